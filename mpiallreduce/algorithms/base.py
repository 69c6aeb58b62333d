"""What every allreduce algorithm is: a plan (who sends what to whom, no communication) and a run.

An algorithm module defines one subclass of :class:`Algorithm` and sets ``ALGORITHM`` to an
instance; :mod:`mpiallreduce.algorithms` finds it there. ``plan`` is a pure function of the rank
count, this rank and the element count, so plans are cached and can be checked without MPI.
``run`` executes a plan on flat contiguous buffers.
"""

import functools
import itertools
from dataclasses import dataclass

from ..core.plan_cases import Carries

__all__ = [
    "Algorithm",
    "CallTags",
    "OneNodeSlicedAlgorithm",
    "SlicesPlan",
    "slices_plan",
    "ring_neighbours",
    "split_evenly",
    "reduce_in_rank_order_into",
    "wait_all",
    "within",
]


class Algorithm:
    """Base class: subclasses set ``name`` and implement ``plan`` and ``execute``."""

    name: str | None = None
    #: True when the algorithm moves data with its own point-to-point messages, which must not
    #: meet the user's messages: it then runs on a private duplicate of the user's communicator.
    uses_point_to_point = True
    #: True when every rank of the communicator must be on one node (shared memory); the planner
    #: (mpiallreduce.planner) then refuses, on every rank, a communicator that spans several,
    #: suggesting ``across_nodes``
    needs_one_node = False
    across_nodes: str | None = None
    #: True when it needs the same rank count on every node
    needs_equal_nodes = False
    #: which arrays it runs on: "any" (numpy, and device arrays through mpiallreduce.transports),
    #: "host" (device arrays make a round trip through host memory), "device" (device arrays only)
    memory = "any"
    #: True when its only MPI calls are blocking Send/Recv/Sendrecv, which the staged path can
    #: carry through pinned host buffers message by message (reductions staying on the GPU)
    blocking_messages_only = False
    #: for memory == "device": the name of the path it is (see mpiallreduce.transports)
    device_path: str | None = None
    #: True when it maps the peers' device memory (CUDA IPC): the planner runs it only where the
    #: communicator's probe found that works (CallFacts.cuda_ipc)
    needs_cuda_ipc = False
    #: True when it talks only with Send/Recv/Sendrecv/Isend/Irecv: its tags are then offset by
    #: the call's number (CallTags), so that a message left behind by a call that failed midway
    #: can never be taken for the next call's
    messages_only = False
    #: where ``execute`` takes ``signature=`` (mpiallreduce.core.consistency.CarriedSignature), the
    #: call's comparison across the ranks, made in place of a step of its own (no extra collective):
    #: a Carries (mpiallreduce.core.plan_cases): SHARED_SLOTS (on one node, in place of a barrier)
    #: or MESSAGES (across nodes, in its rounds' messages); None where it carries none (the registry
    #: refuses any other value)
    carries_signature: Carries | None = None
    #: True when one rank reduces each element from every rank's contribution at once (through
    #: ``reduce_in_rank_order_into``), never from partial results: a reproducible sum then runs
    #: straight on the floats (mpiallreduce.reproducible's direct route), not on fixed-point words
    sees_every_contribution = False
    #: True when ``execute`` takes ``inner=``: the planner's plan for the ranks it runs across nodes
    #: with (one per node: hierarchical's leaders, two_level's rails)
    takes_inner_plan = False
    #: True when ``execute`` takes ``finish=``: what remains of the op once a slice holds its full
    #: reduction (a mean's division), applied by the one rank that reduced the slice, before the
    #: slice is sent on or copied out: each element once, 1/p of the buffer per rank instead of all
    #: of it, the same bits (the executor passes it only where there is something to finish; a
    #: subclass whose ``execute`` takes no ``finish=`` sets it False again, as staged_ring does)
    finishes_slices = False
    #: True when it runs only on symmetric buffers (mpiallreduce.core.symmetric): ``execute`` takes
    #: ``peers=``, the call's Placement, and the planner picks it only where the arrays are
    #: symmetric
    needs_symmetric = False
    #: True when its MPI calls are MPI's own collectives (on the call's communicator, or on the
    #: node, leaders' or rails' communicators of it, found through ``within``): a timed call then
    #: runs them on a communicator of its own, each wait bounded (mpiallreduce.faults.bounded)
    bounded_collectives = False
    #: True when ``execute`` takes ``sequence=``, the call's number (the same on every rank)
    takes_call_number = False
    #: True when a timed call cannot run it: it touches the peers' memory (writes their outputs,
    #: maps their buffers) before the ranks agree on how the call ends, which a rank that gave up
    #: would see after it raised; the planner runs another instead (planner.timed_instead)
    unbounded_when_timed = False

    def bind_runs(self, execution):
        """``run(send, recv, sequence, watch)``: the repeated untimed runs of Execution
        ``execution`` on host arrays, bound once (the executor's, in place of planning and executing
        each time), or None (the default) where the algorithm has no such path."""
        return None

    def can_carry(self, size, nbytes):
        """Whether a run over ``nbytes`` bytes on ``size`` ranks can carry the call's signature."""
        return self.carries_signature is not None

    def needs_set_up(self, comm, nbytes):
        """Whether a run over ``nbytes`` bytes (of the dtype it reduces) on ``comm`` must first make
        something that is collective to make (shared_memory: a larger window). Such a run is made on
        the caller's thread (mpiallreduce.core.call), never on the asynchronous worker: Open MPI
        gives communicators and windows their ids in one order across threads, so one made on the
        worker while the caller's thread (the user's code, or the library) makes another can
        hang."""
        return False

    def set_up(self, comm, nbytes):
        """Make what ``needs_set_up`` says is missing (collective over ``comm``)."""

    def plan(self, size, rank, count):
        """Return a plan for ``count`` elements on rank ``rank`` of ``size`` ranks; no
        communication."""
        raise NotImplementedError

    def execute(self, plan, comm, send, recv, op, datatype):
        """Run ``plan``: afterwards ``recv`` holds the reduction of every rank's input.

        Args:
            plan: what ``plan(comm.size, comm.rank, recv.size)`` returned.
            comm: the communicator to talk on.
            send: 1-D contiguous input, or None when ``recv`` already holds this rank's input.
            recv: 1-D contiguous array for the result.
            op: a :class:`mpiallreduce.ops.ReduceOp`.
            datatype: the MPI datatype of one element.
        """
        raise NotImplementedError

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - REGISTRY's instances live as long anyway
    def cached_plan(self, size, rank, count):
        return self.plan(size, rank, count)

    def run(self, comm, send, recv, op, datatype, **options):
        """Plan (cached) and execute on ``comm``. ``options``: what the call plan gives this
        algorithm besides its own plan (``inner``: the node leaders' plan, for hierarchical)."""
        plan = self.cached_plan(comm.Get_size(), comm.Get_rank(), recv.size)
        self.execute(plan, comm, send, recv, op, datatype, **options)

    def __repr__(self):
        return f"<allreduce algorithm {self.name!r}>"


class CallTags:
    """A communicator whose point-to-point tags are offset by the call's number (other calls pass
    through): calls a few apart use disjoint tags, so a stray message of a failed call waits
    unmatched instead of corrupting a later call. ``slot`` tags of room per call.

    With a ``watch`` (mpiallreduce.faults.watch.PeerWatch) its blocking calls post non-blocking
    requests and wait through the watch: a peer that fails midway, or the call's timeout, ends the
    wait with an exception instead of a hang. Algorithms that post requests themselves wait with
    ``wait_all(comm, requests)``."""

    slot = 1024
    calls_apart = (
        None  # (MPI_TAG_UB + 1) // slot - 1: 2**21 - 1 calls with Open MPI's TAG_UB of 2**31 - 1
    )
    # (the last slot is left out: its top tag, MPI_TAG_UB, carries the control messages)

    #: where in a call's slot the signature comparison's messages go
    #: (mpiallreduce.core.consistency), above every algorithm's tags (all below 512)
    SIGNATURE_BASE = 512

    def __init__(self, comm, sequence, watch=None, base=0, collectives=None):
        """``collectives``: where MPI's collectives of the call go (a timed call's communicator of
        its own, mpiallreduce.faults.bounded), each waited for through ``watch``; None: ``comm``'s
        own, blocking, as without CallTags."""
        if CallTags.calls_apart is None:
            from mpi4py import MPI

            CallTags.calls_apart = max(
                1, (MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) + 1) // self.slot - 1
            )
        self.comm = comm
        self.offset = (sequence % CallTags.calls_apart) * self.slot + base
        self.watch = watch
        self.collectives = collectives

    def within(self, derive):
        """``derive(c)`` (the node's, the leaders' or a rail's communicator of ``c``) of the call's
        collectives' communicator, talked on as this one is: its collectives bounded too."""
        if self.collectives is None:
            return derive(self.comm)
        from mpi4py import MPI

        sub = derive(self.collectives)
        if sub == MPI.COMM_NULL:
            return sub
        derived = CallTags.__new__(
            CallTags
        )  # (the same tags and watch; not copy.copy: __getattr__)
        derived.__dict__.update(vars(self), comm=sub, collectives=sub)
        return derived

    # MPI's collectives, with ``collectives``: their nonblocking forms, waited for through the watch
    def Allreduce(self, *args, **kwargs):
        self._collective("Allreduce", args, kwargs)

    def Reduce(self, *args, **kwargs):
        self._collective("Reduce", args, kwargs)

    def Bcast(self, *args, **kwargs):
        self._collective("Bcast", args, kwargs)

    def Reduce_scatter(self, *args, **kwargs):
        self._collective("Reduce_scatter", args, kwargs)

    def Allgatherv(self, *args, **kwargs):
        self._collective("Allgatherv", args, kwargs)

    def Barrier(self):
        self._collective("Barrier", (), {})

    def _collective(self, name, args, kwargs):
        comm = self.comm if self.collectives is None else self.collectives
        if self.collectives is None or self.watch is None:
            getattr(comm, name)(*args, **kwargs)
        else:
            start = getattr(comm, "I" + name[0].lower() + name[1:])
            self.watch.wait_collective(start(*args, **kwargs), (args, kwargs))

    def Send(self, buf, dest, tag=0):
        if self.watch is None:
            self.comm.Send(buf, dest, tag + self.offset)
        else:
            self.watch.wait([self.comm.Isend(buf, dest, tag + self.offset)])

    def Recv(self, buf, source, tag=0, status=None):
        if self.watch is None:
            self.comm.Recv(buf, source, tag + self.offset, status)
        else:
            self.watch.wait([self.comm.Irecv(buf, source, tag + self.offset)])

    def Sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag, status=None):
        if self.watch is None:
            self.comm.Sendrecv(
                sendbuf, dest, sendtag + self.offset, recvbuf, source, recvtag + self.offset, status
            )
        else:
            self.watch.wait(
                [
                    self.comm.Irecv(recvbuf, source, recvtag + self.offset),
                    self.comm.Isend(sendbuf, dest, sendtag + self.offset),
                ]
            )

    def Isend(self, buf, dest, tag=0):
        return self._posted(self.comm.Isend(buf, dest, tag + self.offset))

    def Irecv(self, buf, source, tag=0):
        return self._posted(self.comm.Irecv(buf, source, tag + self.offset))

    def _posted(self, request):
        """A request the algorithm waits for later (posted ahead, say): its watch keeps it, so that
        a call given up leaves it behind too, not only the requests of the wait that ended."""
        if self.watch is not None:
            self.watch.posted.append(request)
        return request

    def __getattr__(self, name):
        return getattr(self.comm, name)


def within(comm, derive):
    """``derive(comm)``: the node's, the leaders' or a rail's communicator of the call's; of a
    timed call's collectives' communicator where it has one (CallTags.within), bounded alike."""
    return comm.within(derive) if isinstance(comm, CallTags) else derive(comm)


def wait_all(comm, requests):
    """Wait for ``requests`` posted on ``comm``: through its PeerWatch when it has one
    (CallTags)."""
    watch = getattr(comm, "watch", None)
    if watch is None:
        from mpi4py import MPI

        MPI.Request.Waitall(requests)
    else:
        watch.wait(requests)


class OneNodeSlicedAlgorithm(Algorithm):
    """Base for algorithms in which every rank of one node reduces its own slice by reading its
    peers' memory (a shared window, or GPU memory through CUDA IPC), then copies the others'
    slices."""

    needs_one_node = True

    def plan(self, size, rank, count):
        return slices_plan(size, count)


def split_evenly(count, parts):
    """Offsets and counts of ``parts`` contiguous chunks covering ``count`` elements, sizes
    differing by <= 1.

    The first ``count % parts`` chunks get one element more, as ``numpy.array_split`` does.
    """
    base, extra = divmod(count, parts)
    counts = tuple(base + (1 if i < extra else 0) for i in range(parts))
    offsets = (0,) + tuple(itertools.accumulate(counts))[:-1]
    return offsets, counts


@dataclass(frozen=True)
class SlicesPlan:
    """Rank r owns the element range [start, stop) = ``slices[r]`` of the buffer."""

    slices: tuple[tuple[int, int], ...]


def slices_plan(size, count):
    """A SlicesPlan cutting ``count`` elements into ``size`` contiguous slices (split_evenly's)."""
    offsets, counts = split_evenly(count, size)
    return SlicesPlan(tuple((o, o + n) for o, n in zip(offsets, counts, strict=False)))


def ring_neighbours(size, rank):
    """(left, right): the ranks this rank receives from and sends to around a ring."""
    return (rank - 1) % size, (rank + 1) % size


def reduce_in_rank_order_into(op, pieces, out):
    """out = pieces[0] (op) pieces[1] (op) ... left to right: one fixed order, the same bits
    wherever it runs. ``out`` may be one of the pieces only if it is ``pieces[0]`` or ``pieces[1]``.
    An exact op (a reproducible sum) sums every piece at once instead."""
    if op.exact:
        op.reduce_all_into(pieces, out)
        return
    op.reduce_local(pieces[0], pieces[1], out=out)
    for piece in pieces[2:]:
        op.reduce_local(out, piece, out=out)
