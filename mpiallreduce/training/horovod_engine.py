"""How the Horovod facade runs its collectives: negotiated, in order, in the background.

    hvd.allreduce_async(t, name=...)      (and every other collective of mpiallreduce.torch)
      submit ──> a queue ──> one thread per communicator (an Engine), in submission order:
        negotiate   every rank's Descriptor (kind, dtype, shape, root, op...), gathered, bounded
                    by the timeout (core.gather.gather_from_ranks on the engine's own duplicate)
          agree     ──> the op moves its data (the library's allreduce, or MPI's allgatherv,
                        bcast, alltoallv, reduce_scatter on a second duplicate, waited for with
                        the deadline)
          differ    ──> the same HorovodMismatchError on every rank, naming each rank's call;
                        no data moves, and the next op pairs up on every rank
          joined    ──> ranks that called join() answer every negotiation as joined: an
                        allreduce counts them as zeros, any other collective is an error
      handle.wait() (hvd.synchronize): the op's result, or its error

So an async op never blocks its caller (Horovod's semantics: a rank may submit, then wait in a
barrier its peers reach before they submit theirs), and ops match by their order on each rank (not
by name, as in Horovod: docs/training.md). ``name=`` is checked at submission: a name still in
flight on this rank is a ValueError there, as in Horovod.
"""

import itertools
import queue
import threading
from dataclasses import dataclass, field

from mpi4py import MPI

from ..core.consistency import SignatureMismatch
from ..core.gather import gather_from_ranks
from ..core.settings import settings

__all__ = [
    "HorovodInternalError",
    "HorovodMismatchError",
    "HorovodArgumentError",
    "REFUSED",
    "joined_runner",
    "Descriptor",
    "Engine",
    "Handle",
    "JOINED",
    "engine_for",
    "forget_engine",
    "observe",
    "forget",
    "wait_for",
]


class HorovodInternalError(RuntimeError):
    """Horovod's error of a collective that could not run (Horovod raises RuntimeError)."""


class HorovodMismatchError(HorovodInternalError, SignatureMismatch):
    """The ranks' collectives differ: a RuntimeError, as Horovod raises, and this project's
    SignatureMismatch (a ValueError); raised on every rank, before any data moved."""


class HorovodArgumentError(HorovodInternalError, ValueError):
    """A rank could not make the collective (bad splits, a root out of range): raised on every
    rank, naming it (Horovod raises ValueError or RuntimeError for these)."""


#: a rank that has called join(): what its descriptor says in every negotiation
JOINED = "joined"
#: a rank that cannot make its call: its descriptor's kind, its matched (the call, the reason)
REFUSED = "refused"


@dataclass(frozen=True)
class Descriptor:
    """What must match across the ranks (``matched``), and what each rank may give its own
    (``own``: allgather's first dimension, alltoall's splits)."""

    kind: str
    matched: tuple = ()
    own: tuple = ()

    def describe(self):
        return self.kind if not self.matched else f"{self.kind} {' '.join(map(str, self.matched))}"


class Handle:
    """An op in flight: ``wait()`` gives its result or raises its error (the same on every rank
    for a negotiation's)."""

    def __init__(self, name=None):
        self.name, self._done, self._result, self._error = name, threading.Event(), None, None

    def done(self):
        return self._done.is_set()

    def finish(self, result=None, error=None):
        self._result, self._error = result, error
        self._done.set()

    def wait(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


@dataclass
class Op:
    """A collective: its descriptor, ``run(descriptors, engine)`` (every rank's descriptor, in rank
    order: the data's move; joined ranks' are JOINED), and whether joined ranks may take part."""

    descriptor: Descriptor
    run: object
    joined_may_take_part: bool = False
    handle: Handle = field(default_factory=Handle)


def _mismatch(descriptors, rank):
    """The error of differing descriptors (None where they agree), the same text on every rank."""
    present = [d for d in descriptors if d.kind != JOINED]
    if len({(d.kind, d.matched) for d in present}) <= 1:
        return None
    lines = "\n".join(f"  rank {r}: {d.describe()}" for r, d in enumerate(descriptors))
    return HorovodMismatchError(
        f"rank {rank}: the ranks' collectives differ (mpiallreduce.torch matches them by their "
        f"order on each rank); nothing was moved:\n{lines}"
    )


class Engine:
    """One communicator's ops, in order, on one background thread."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        # (made here, in program order on every rank: the facade's first call, or init)
        self.negotiation, self.data = comm.Dup(), comm.Dup()
        self._queue = queue.Queue()
        self._names = {}  # name -> Handle in flight
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="mpiallreduce.torch", daemon=True)
        self._thread.start()

    def submit(self, op, name=None):
        """Queue ``op``; its Handle. A ``name`` still in flight here: ValueError, at once."""
        if name is not None:
            key = (op.descriptor.kind, name)
            with self._lock:
                earlier = self._names.get(key)
                if earlier is not None and not earlier.done():
                    raise ValueError(
                        f"rank {self.rank}: a {op.descriptor.kind} named {name!r} is still in "
                        "flight on this rank (Horovod's rule: one at a time per name)"
                    )
                self._names[key] = op.handle
        op.handle.name = name
        self._queue.put(op)
        return op.handle

    def negotiate(self, descriptor):
        """Every rank's descriptor, in rank order (bounded by the timeout setting)."""
        return gather_from_ranks(self.negotiation, descriptor, timeout=settings().timeout)

    def _serve(self):
        while True:
            op = self._queue.get()
            try:
                op.handle.finish(result=self._run(op))
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                op.handle.finish(error=error)

    def _run(self, op):
        if op.descriptor.kind == "join":
            return self._join()
        kind, label = op.descriptor.kind, f"{op.descriptor.kind}.{op.handle.name or 'noname'}"
        observed = list(_observers)
        for observer in observed:
            observer("CYCLE_START", label, "i")
            observer(f"NEGOTIATE_{kind.upper()}", label, "B")
        try:
            descriptors = self.negotiate(op.descriptor)
        finally:
            for observer in observed:
                observer(f"NEGOTIATE_{kind.upper()}", label, "E")
        for observer in observed:
            observer(kind.upper(), label, "B")
        try:
            return self._moved(op, descriptors)
        finally:
            for observer in observed:
                observer(kind.upper(), label, "E")

    def _moved(self, op, descriptors):
        refused = [(r, d.matched) for r, d in enumerate(descriptors) if d.kind == REFUSED]
        if refused:
            raise HorovodArgumentError(
                f"rank {self.rank}: "
                + "; ".join(f"rank {r} cannot make its {kind}: {why}" for r, (kind, why) in refused)
            )
        error = _mismatch(descriptors, self.rank)
        if error is not None:
            raise error
        if any(d.kind == JOINED for d in descriptors) and not op.joined_may_take_part:
            joined = [r for r, d in enumerate(descriptors) if d.kind == JOINED]
            raise HorovodInternalError(
                f"rank {self.rank}: a {op.descriptor.kind} while rank(s) {joined} have joined: "
                "only allreduce takes part in join (Horovod's rule)"
            )
        return op.run(descriptors, self)

    def _join(self):
        """Answer every negotiation as joined (zeros to the allreduces of the others) until every
        rank has joined; the rank that joined last (the same on every rank)."""
        for round_number in itertools.count():
            descriptors = self.negotiate(Descriptor(JOINED, (), (round_number,)))
            present = [(r, d) for r, d in enumerate(descriptors) if d.kind != JOINED]
            if any(d.kind == REFUSED for _, d in present):
                continue
            if not present:
                # (each joined rank's own: the round it joined in; the last to join is the
                # highest round, the highest rank among equals)
                return max(range(self.size), key=lambda r: (-descriptors[r].own[0], r))
            error = _mismatch(descriptors, self.rank)
            if error is not None:  # (the others' ops differ: they raise it; this rank goes on)
                continue
            runner = _joined_runners.get(present[0][1].kind)
            if runner is not None:
                runner(descriptors, self)


#: what a joined rank does in another rank's collective, by kind (allreduce: zeros)
_joined_runners = {}
#: functions told of each op's phases (the timeline: horovod_timeline): (event, op label, "B"
#: for its beginning, "E" for its end, "i" for an instant)
_observers = []


def observe(observer):
    _observers.append(observer)


def forget(observer):
    if observer in _observers:
        _observers.remove(observer)


def joined_runner(kind):
    def register(function):
        _joined_runners[kind] = function
        return function

    return register


_engines = {}
_engines_lock = threading.Lock()


def forget_engine(comm):
    """Drop ``comm``'s Engine (its communicator is being freed: a later one may get its handle)."""
    with _engines_lock:
        _engines.pop(comm.handle, None)


def engine_for(comm):
    """The Engine of ``comm`` (made on first use: collective over ``comm``, in program order)."""
    with _engines_lock:
        engine = _engines.get(comm.handle)
        if engine is None:
            engine = _engines[comm.handle] = Engine(comm)
        return engine


def wait_for(request, what, rank):
    """Wait for an MPI ``request`` of the data's move, at most the timeout setting."""
    timeout = settings().timeout
    if timeout is None:
        request.Wait()
        return
    import time

    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            raise HorovodInternalError(
                f"rank {rank}: the {what} did not finish within {timeout} s after every rank "
                "agreed on it (a peer stopped in it)"
            )
        time.sleep(0.0002)


def world():
    return MPI.COMM_WORLD
