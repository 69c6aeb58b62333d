"""How the Horovod facade runs its collectives: matched by name, negotiated in rounds, run in the
background, as Horovod's own background thread does.

    hvd.allreduce_async(t, name=...)          (every collective of mpiallreduce.torch)
      submit (the caller's thread): the op's key, (kind, name), or ("noname", n) for the n-th
      unnamed op of this rank; a key still in flight here is a ValueError, at once
        └─> the engine's thread (one per communicator) rings every peer's doorbell

    a round (every rank's engine thread, when any rank rang for it; idle otherwise):
        rank 0: [allreduce.grad_a, noname.7]  ┐
        rank 1: [noname.7]                    ├─ gathered by every rank (bounded by the timeout)
        rank 2: [noname.7, allreduce.grad_a]  ┘
      ready: the keys every rank that has not joined holds (noname.7), in the order of the
      lowest such rank's list; for each, from every rank's descriptor, the same decision on every
      rank:
        refused (a rank could not make it)  ──> HorovodArgumentError on every rank holding it
        differ (kind, dtype, shape, root)   ──> HorovodMismatchError on every rank holding it
        joined ranks, not an allreduce      ──> HorovodInternalError
        agree                               ──> the op moves its data (horovod_collectives; a
                                                joined rank gives an allreduce zeros)
      expired: a key some rank has held longer than the timeout setting fails there, naming the
      ranks that never submitted it; those fail it when they do, so the ranks stay in step
      every rank joined ──> join() returns the rank that joined last, on every rank
      (a joined rank counts the unnamed ops it took part in as its own: the numbers stay alike)

So an async op never blocks its caller, and a rank may submit an op, wait in a barrier its peers
reach first, and have its op met after it (Horovod's semantics; its test_torch.py relies on them).
"""

import atexit
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from ..core.consistency import SignatureMismatch
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
    "forget_engines",
    "observe",
    "forget",
]


class HorovodInternalError(RuntimeError):
    """Horovod's error of a collective that could not run (Horovod raises RuntimeError)."""


class HorovodMismatchError(HorovodInternalError, SignatureMismatch):
    """The ranks' collectives of one name differ: a RuntimeError, as Horovod raises, and this
    project's SignatureMismatch (a ValueError); raised on every rank, before any data moved."""


class HorovodArgumentError(HorovodInternalError, ValueError):
    """A rank could not make the collective (bad splits, a root out of range): raised on every
    rank, naming it (Horovod raises ValueError or RuntimeError for these)."""


#: a rank that has joined and does not hold the op: its place among the descriptors
JOINED = "joined"
#: a rank that cannot make its call: its descriptor's kind, its matched (the call, the reason)
REFUSED = "refused"
#: how often an idle engine looks for a peer's doorbell (seconds), by how long it has been idle:
#: (idle up to, poll every); the last, beyond. A rank's own submission wakes it at once.
POLLS = ((0.01, 0.0002), (1.0, 0.001), (None, 0.01))
#: how long a wait for a request only yields between its tests (seconds), before it sleeps
SPIN = 0.001


@dataclass(frozen=True)
class Descriptor:
    """What must match across the ranks (``matched``), and what each rank may give its own
    (``own``: allgather's first dimension, alltoall's splits)."""

    kind: str
    matched: tuple = ()
    own: tuple = ()

    def describe(self):
        return self.kind if not self.matched else f"{self.kind} {' '.join(map(str, self.matched))}"


_JOINED = Descriptor(JOINED)


class Handle:
    """An op in flight: ``wait()`` gives its result or raises its error (the same on every rank
    for a negotiation's)."""

    def __init__(self, name=None):
        self.name, self._done, self._result, self._error = name, threading.Event(), None, None

    def done(self):
        return self._done.is_set()

    def finish(self, result=None, error=None):
        if self._done.is_set():  # (the first word stands: a stop() may fail an op in its move)
            return
        self._result, self._error = result, error
        self._done.set()

    def wait(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


@dataclass
class Op:
    """A collective: its descriptor and ``run(descriptors, engine)`` (every rank's descriptor, in
    rank order, JOINED for a joined rank: the data's move)."""

    descriptor: Descriptor
    run: object
    handle: Handle = field(default_factory=Handle)
    key: tuple = ()
    submitted: float = 0.0


def intended_kind(descriptor):
    """The collective a descriptor is of (a refused one's too: its key must meet the others')."""
    return descriptor.matched[0] if descriptor.kind == REFUSED else descriptor.kind


def _key_text(key):
    return ".".join(map(str, key))


def decide(key, descriptors, rank):
    """The error of op ``key`` from every rank's descriptor (None: it runs): the same on every
    rank, before any data moves."""
    refused = [(r, d.matched) for r, d in enumerate(descriptors) if d.kind == REFUSED]
    if refused:
        return HorovodArgumentError(
            f"rank {rank}: "
            + "; ".join(f"rank {r} cannot make its {kind}: {why}" for r, (kind, why) in refused)
        )
    present = [d for d in descriptors if d.kind != JOINED]
    if len({(d.kind, d.matched) for d in present}) > 1:
        lines = "\n".join(f"  rank {r}: {d.describe()}" for r, d in enumerate(descriptors))
        return HorovodMismatchError(
            f"rank {rank}: the ranks' collectives named {_key_text(key)} differ; nothing was "
            f"moved:\n{lines}"
        )
    joined = [r for r, d in enumerate(descriptors) if d.kind == JOINED]
    if joined and present[0].kind not in _joined_runners:
        return HorovodInternalError(
            f"rank {rank}: a {present[0].kind} while rank(s) {joined} have joined: only "
            "allreduce takes part in join (Horovod's rule)"
        )
    return None


class Engine:
    """One communicator's ops, negotiated in rounds and run on one background thread."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        # (made here, in program order on every rank: the facade's first call, or init)
        self.doorbells, self.negotiation, self.data = comm.Dup(), comm.Dup(), comm.Dup()
        self._lock = threading.Lock()
        self._news = threading.Event()
        self._submitted = []  # ops not yet in a round
        self._pending = {}  # key -> Op, in a round, not yet run
        self._unnamed = 0  # the next unnamed op's number
        self._failed = {}  # key -> the error of a key that expired before this rank held it
        self._join = None  # (join's Handle, the round this rank joined in, when it was called)
        self._round = 0
        self._broken = None
        self._stopping = False
        self._rung = []
        self._bell = np.zeros(1, dtype=np.int64)
        self._bell_request = self.doorbells.Irecv([self._bell, MPI.INT64_T], MPI.ANY_SOURCE)
        self._thread = threading.Thread(target=self._serve, name="mpiallreduce.torch", daemon=True)
        self._thread.start()

    # ---- the caller's side ----
    def submit(self, op, name=None):
        """Queue ``op``; its Handle. A ``name`` of this kind still in flight here: ValueError."""
        with self._lock:
            if op.descriptor.kind == "join":
                op.key = ("join",)
            elif name is None:
                op.key, self._unnamed = ("noname", self._unnamed), self._unnamed + 1
            else:
                kind = intended_kind(op.descriptor)
                op.key = (kind, str(name))
                if self._holds(op.key):
                    raise ValueError(
                        f"rank {self.rank}: a {kind} named {name!r} is still in flight on this "
                        "rank (Horovod's rule: one at a time per name)"
                    )
            op.handle.name, op.submitted = name, time.monotonic()
            if self._broken is not None:
                op.handle.finish(error=self._broken)
                return op.handle
            self._submitted.append(op)
        self._news.set()
        return op.handle

    def _holds(self, key):
        return key in self._pending or any(op.key == key for op in self._submitted)

    # ---- the engine's thread ----
    def stop(self):
        """Stop: every op submitted and not finished fails now, and the thread ends at its next
        step (a round it waits in is given up): its communicator is going (shutdown,
        remove_process_set, the interpreter's exit)."""
        self._stopping = True
        self._break(HorovodInternalError(f"rank {self.rank}: the facade was shut down"))
        self._news.set()

    def _serve(self):
        while True:
            try:
                self._await_round()
                self._run_round()
            except _Stopped:
                self._bell_request.Cancel()
                self._bell_request.Wait()
                self._break(HorovodInternalError(f"rank {self.rank}: the facade was shut down"))
                return
            except BaseException as error:  # noqa: BLE001 - every op in flight is told
                self._break(error)
                return

    def _break(self, error):
        if not isinstance(error, HorovodInternalError):
            wrapped = HorovodInternalError(
                f"rank {self.rank}: the facade's engine stopped: {error}"
            )
            wrapped.__cause__ = error
            error = wrapped
        with self._lock:
            self._broken = error
            ops = [*self._pending.values(), *self._submitted]
            self._pending.clear()
            self._submitted.clear()
            join, self._join = self._join, None
        for op in ops:
            op.handle.finish(error=error)
        if join is not None:
            join[0].finish(error=error)

    def _expiring(self):
        """The time (monotonic) at which this rank's oldest op expires, or None."""
        timeout = settings().timeout
        since = [op.submitted for op in self._pending.values()]
        if self._join is not None:
            since.append(self._join[2])
        if timeout is None or not since:
            return None
        return min(since) + timeout

    def _await_round(self):
        """Return when this rank takes part in the next round: at once where it has news (then it
        rings every peer), else when a peer rings for this round (or this rank's oldest op
        expires: news)."""
        idle_since = time.monotonic()
        while True:
            if self._stopping:
                raise _Stopped
            expiring = self._expiring()
            if self._submitted or (expiring is not None and time.monotonic() >= expiring):
                self._ring()
                return
            while self._bell_request.Test():
                rung_for = int(self._bell[0])
                self._bell_request = self.doorbells.Irecv([self._bell, MPI.INT64_T], MPI.ANY_SOURCE)
                if rung_for >= self._round:
                    return
            idle = time.monotonic() - idle_since
            self._news.wait(next(poll for upto, poll in POLLS if upto is None or idle < upto))
            self._news.clear()

    def _ring(self):
        # (each bell's buffer kept with its send until the send completes)
        self._rung = [(request, bell) for request, bell in self._rung if not request.Test()]
        bell = np.array([self._round], dtype=np.int64)
        for peer in range(self.size):
            if peer != self.rank:
                self._rung.append((self.doorbells.Isend([bell, MPI.INT64_T], peer), bell))

    def _gather(self, value):
        """Every rank's ``value`` (pickled), in rank order, bounded by the timeout setting."""
        if self.size == 1:
            return [value]
        data = np.frombuffer(pickle.dumps(value), dtype=np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        mine = np.array([data.size], dtype=np.int64)
        self.wait(self.negotiation.Iallgather([mine, MPI.INT64_T], [sizes, MPI.INT64_T]))
        displacements = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        received = np.empty(int(sizes.sum()), dtype=np.uint8)
        request = self.negotiation.Iallgatherv(
            [data, MPI.BYTE], [received, sizes.tolist(), displacements.tolist(), MPI.BYTE]
        )
        self.wait(request)
        return [
            pickle.loads(received[start : start + size].tobytes())
            for start, size in zip(displacements.tolist(), sizes.tolist(), strict=True)
        ]

    def wait(self, request, what="negotiation", why="a peer did not come to it"):
        """Wait for an MPI ``request`` of this engine's (a round's, or an op's data move): at most
        the timeout setting; given up on stop(). Polled, as MPI moves a nonblocking collective on
        only inside Test: yielding at first, then sleeping between tests."""
        timeout = settings().timeout
        started = time.monotonic()
        while not request.Test():
            if self._stopping:
                raise _Stopped
            now = time.monotonic()
            if timeout is not None and now > started + timeout:
                raise HorovodInternalError(
                    f"rank {self.rank}: the {what} did not finish within {timeout} s ({why})"
                )
            time.sleep(0 if now - started < SPIN else 0.0002)

    def _run_round(self):
        failed = []
        with self._lock:  # (submit's check of a name in flight sees every op: here or there)
            taken, self._submitted = self._submitted, []
            for op in taken:
                if op.key == ("join",):
                    if ("join",) in self._failed:
                        failed.append((op, self._failed.pop(("join",))))
                    else:
                        self._join = (op.handle, self._round, op.submitted)
                elif op.key in self._failed:
                    failed.append((op, self._failed.pop(op.key)))
                else:
                    self._pending[op.key] = op
        for op, error in failed:
            op.handle.finish(error=error)
        timeout = settings().timeout
        now = time.monotonic()
        late = timeout is not None and self._join is not None and now - self._join[2] >= timeout
        mine = {
            "ops": [(key, op.descriptor) for key, op in self._pending.items()],
            "expired": [
                key
                for key, op in self._pending.items()
                if timeout is not None and now - op.submitted >= timeout
            ]
            + ([("join",)] if late else []),
            "joined": None if self._join is None else self._join[1],
        }
        for op in taken:
            if op.key in self._pending:
                _tell(f"NEGOTIATE_{op.descriptor.kind.upper()}", op, "B")
        for op in self._pending.values():
            _tell("CYCLE_START", op, "i")
        everyone = self._gather(mine)
        self._round += 1
        self._settle(everyone, timeout)

    def _settle(self, everyone, timeout):
        """What the round decided, the same on every rank: the ready ops run, expired ones fail,
        a join every rank made returns."""
        held = [dict(contribution["ops"]) for contribution in everyone]
        joined = [
            r for r, contribution in enumerate(everyone) if contribution["joined"] is not None
        ]
        active = [r for r in range(self.size) if r not in joined]
        # ready: what every rank that has not joined holds (every rank joined: all that is held,
        # ops submitted before a join first), in the order of the lowest such rank's list
        listing = [key for r in (active or range(self.size)) for key, _ in everyone[r]["ops"]]
        ready = [
            key
            for key in dict.fromkeys(listing)
            if all(key in held[r] for r in active)
        ]  # fmt: skip
        for key in ready:
            descriptors = [held[r].get(key, _JOINED) for r in range(self.size)]
            self._run_ready(key, descriptors)
        if ready and self._join is not None:  # (a join waits out the timeout without progress)
            self._join = (*self._join[:2], time.monotonic())
        if not active:
            last = max(joined, key=lambda r: (everyone[r]["joined"], r))
            handle, self._join = self._join[0], None
            handle.finish(result=last)
            return
        expired = {key for contribution in everyone for key in contribution["expired"]}
        for key in sorted(expired - set(ready), key=lambda key: (key == ("join",), _key_text(key))):
            if key == ("join",):
                holding, missing = joined, active
            else:
                holding = [r for r in range(self.size) if key in held[r]]
                missing = [r for r in range(self.size) if key not in held[r]]
            error = HorovodInternalError(
                f"rank {self.rank}: the {_key_text(key)} waited {timeout} s: rank(s) {holding} "
                f"submitted it, rank(s) {missing} did not (it fails on every rank that submits "
                "it, so the ranks stay in step)"
            )
            self._expire(key, error, self.rank in joined)

    def _expire(self, key, error, joined):
        """Fail ``key`` here: the op or join this rank holds, else at its submission, unless
        this rank had joined in the round (it took part: an unnamed key counts as its own)."""
        if key == ("join",):
            if self._join is not None:
                handle, self._join = self._join[0], None
                handle.finish(error=error)
            else:
                self._failed[key] = error
            return
        op = self._pending.pop(key, None)
        if op is not None:
            op.handle.finish(error=error)
        elif joined:
            if key[0] == "noname":
                with self._lock:
                    self._unnamed = max(self._unnamed, key[1] + 1)
        else:
            self._failed[key] = error

    def _run_ready(self, key, descriptors):
        op = self._pending.pop(key, None)
        error = decide(key, descriptors, self.rank)
        if op is None:  # this rank has joined: zeros to an allreduce
            if key[0] == "noname":  # (it took part: its unnamed ops stay numbered as the others')
                with self._lock:
                    self._unnamed = max(self._unnamed, key[1] + 1)
            if error is None:
                kind = next(d.kind for d in descriptors if d.kind != JOINED)
                _joined_runners[kind](descriptors, self)
            return
        kind = op.descriptor.kind.upper()
        _tell(f"NEGOTIATE_{kind}", op, "E")
        if error is not None:
            op.handle.finish(error=error)
            return
        _tell(kind, op, "B")
        try:
            op.handle.finish(result=op.run(descriptors, self))
        except Exception as failure:  # noqa: BLE001 - handed to the waiting thread
            op.handle.finish(error=failure)
        finally:
            _tell(kind, op, "E")


#: what a joined rank does in another rank's collective, by kind (allreduce: zeros)
_joined_runners: dict[str, Callable[..., Any]] = {}
#: functions told of each op's phases (the timeline: horovod_timeline): (event, op label, "B"
#: for its beginning, "E" for its end, "i" for an instant)
_observers: list[Callable[..., Any]] = []


def _tell(event, op, phase):
    if _observers:
        label = f"{op.descriptor.kind}.{op.handle.name or 'noname'}"
        for observer in list(_observers):
            observer(event, label, phase)


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


_engines: dict[int, "Engine"] = {}
_engines_lock = threading.Lock()


class _Stopped(Exception):
    """An engine told to stop (Engine.stop)."""


def forget_engine(comm):
    """Stop and drop ``comm``'s Engine (its communicator is being freed: a later one may get its
    handle)."""
    with _engines_lock:
        engine = _engines.pop(comm.handle, None)
    if engine is not None:
        engine.stop()


def forget_engines():
    """Stop and drop every Engine, and wait (bounded) for their threads to end (hvd.shutdown: a
    later init starts afresh, after a stall too)."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for engine in engines:
        engine.stop()
    for engine in engines:
        engine._thread.join(timeout=2.0)


#: at the interpreter's exit, before MPI_Finalize (which mpi4py registered earlier): a daemon
#: thread still in Python as the interpreter finalizes is ended inside torch's C++ (a tensor's
#: deleter taking the GIL), and the process aborts
atexit.register(forget_engines)


def engine_for(comm):
    """The Engine of ``comm`` (made on first use: collective over ``comm``, in program order)."""
    with _engines_lock:
        engine = _engines.get(comm.handle)
        if engine is None:
            engine = _engines[comm.handle] = Engine(comm)
        return engine
