"""Symmetric buffers: arrays that live in a window shared by the ranks of one node.

    mar.empty(shape, dtype, comm)     collective, made like a call (mpiallreduce.core.call): the
                                      ranks compare its shape and dtype (SignatureMismatch on every
                                      rank where they differ), then allocate together here
                                      (MPI_Win_allocate_shared over the node)
    rank 0's segment  [ a0 | b0 ... ]    the k-th allocation of every rank is one window; an array
    rank 1's segment  [ a1 | b1 ... ]    at byte offset o of rank r's segment has its twins at
                                         offset o of every other rank's segment, which every rank
                                         can read and write (a load or a store: no message, no copy)

An allreduce whose input and output are symmetric (``placement_of`` finds them) can read each
peer's input where it lies and write each result into every rank's output once: the single_copy
algorithm (mpiallreduce.algorithms.single_copy). The ranks compare the placement (allocation and
offsets) with the call's signature, so arrays at different places raise SignatureMismatch on every
rank. Ordinary numpy arrays keep every other path.

A symmetric array is valid until its communicator is freed (COMM_WORLD's: at MPI_Finalize, at the
latest at exit). Its windows are freed then, with every rank: an array used after that is freed
memory.
"""

import bisect
import operator
import threading

import numpy as np
from mpi4py import MPI

from .topology import node_communicator

__all__ = [
    "Allocation",
    "checked",
    "allocate",
    "free_array",
    "placement_of",
    "placement_of_call",
    "Placement",
    "touches",
]

#: every segment starts on a page (MPI's alloc_shared_noncontig: each rank's segment on its own
#: pages)
_INFO = None
#: this rank's live symmetric allocations (on every communicator), sorted by their start address,
#: and those addresses: what ``touches`` bisects
_MADE: list["Allocation"] = []
_STARTS: list[int] = []
_MADE_LOCK = threading.Lock()


def touches(a):
    """Whether numpy ``a`` starts in this rank's segment of a symmetric allocation (the short path
    asks, and leaves such arrays to the general path, which may run single_copy on them). An array
    that owns its memory (``base`` None), or a view of one (numpy's ``base`` is then that array,
    which owns its data), is in none: free; any other view costs its address (1.7 us here:
    ``__array_interface__``) and a bisection."""
    if not _MADE:
        return False
    base = a.base
    if base is None or (
        type(base) is np.ndarray and base.flags.owndata
    ):  # (numpy's own memory: in no window)
        return False
    address = a.__array_interface__["data"][0]
    at = bisect.bisect_right(_STARTS, address) - 1
    return at >= 0 and address < _STARTS[at] + _MADE[at].nbytes


class Allocation:
    """One window over the ranks of a node: every node rank's segment as bytes (numpy uint8)."""

    def __init__(self, node, nbytes, number):
        global _INFO
        if _INFO is None:
            _INFO = MPI.Info.Create()
            _INFO.Set("alloc_shared_noncontig", "true")
        self.number, self.nbytes, self.node = number, nbytes, node
        self.window = MPI.Win.Allocate_shared(max(nbytes, 1), 1, _INFO, comm=node)
        self.segments = [
            np.frombuffer(self.window.Shared_query(r)[0], dtype=np.uint8)[:nbytes]
            for r in range(node.Get_size())
        ]
        self.window.Lock_all(MPI.MODE_NOCHECK)
        self.mine = self.segments[node.Get_rank()]
        self.start = self.mine.__array_interface__["data"][0] if nbytes else 0

    def sync(self):
        """This rank's stores before it are visible to its peers' loads after their next sync
        (with a barrier between)."""
        self.window.Sync()

    def free(self):
        if self.window is None:
            return
        try:
            self.window.Unlock_all()
            self.window.Free()
        except MPI.Exception:  # (a revoked communicator after a rank died: MPI_Finalize takes it)
            pass
        self.window = None
        with _MADE_LOCK:  # (communicators made by several threads are freed side by side at exit)
            if self in _MADE:
                del _STARTS[_MADE.index(self)]
                _MADE.remove(self)


def checked(shape, dtype):
    """(shape as a tuple of ints, numpy dtype), or TypeError/ValueError saying what is wrong."""
    dtype = np.dtype(dtype)
    shape = tuple(
        operator.index(n) for n in ((shape,) if np.isscalar(shape) else shape)
    )  # (2.7: TypeError)
    if dtype.kind not in "biufc" and dtype.name != "bfloat16":
        raise TypeError(
            f"a symmetric array holds numbers (bool, integer, float, complex); got dtype {dtype}"
        )
    if any(n < 0 for n in shape) or np.prod(shape, dtype=object) * dtype.itemsize >= 1 << 62:
        raise ValueError(
            f"a symmetric array needs a shape of sizes >= 0 that fits in memory; got {shape}"
        )
    return shape, dtype


def allocate(state, shape, dtype, zero):
    """A symmetric numpy array on ``state``'s communicator (collective over each node: every rank,
    the shape and dtype ``checked`` and compared by the caller, mpiallreduce.core.call)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    node = node_communicator(state.library)
    allocation = Allocation(node, nbytes, len(state.symmetric))
    state.symmetric.append(allocation)
    with _MADE_LOCK:
        at = bisect.bisect_right(_STARTS, allocation.start)
        _STARTS.insert(at, allocation.start)
        _MADE.insert(at, allocation)
    state.on_free.append(allocation.free)
    array = allocation.mine.view(dtype).reshape(shape)
    if zero:
        array[...] = 0
        allocation.sync()
        node.Barrier()  # (no rank reads a peer's zeros before they are there)
        allocation.sync()
    return array


def free_array(state, array):
    """Free the allocation ``array`` lies in (collective over its node: every rank at the same
    point, as GradientSync does when it replans); its arrays are then freed memory."""
    found = _find(state.symmetric, array)
    if found is not None:
        found[0].free()


class Placement:
    """Where a call's input and output lie in symmetric allocations (one each, or the same): the
    twins of this rank's arrays on every node rank (flat arrays of the call's dtype), and what the
    ranks compare."""

    __slots__ = ("allocations", "send_at", "recv_at", "sends", "recvs")

    def __init__(self, send_at, recv_at, count, dtype):
        """``send_at``/``recv_at``: (allocation, byte offset); ``send_at`` None: in place."""
        self.send_at, self.recv_at = send_at, recv_at
        self.allocations = (
            (recv_at[0],)
            if send_at is None or send_at[0] is recv_at[0]
            else (send_at[0], recv_at[0])
        )
        nbytes = count * dtype.itemsize

        def twins(at):
            allocation, offset = at
            return [
                segment[offset : offset + nbytes].view(dtype) for segment in allocation.segments
            ]

        self.recvs = twins(recv_at)
        self.sends = self.recvs if send_at is None else twins(send_at)

    def sync(self):
        for allocation in self.allocations:
            allocation.sync()

    def signature(self):
        """What every rank's must equal: the allocations' numbers and the offsets in them."""
        return tuple(
            None if at is None else (at[0].number, at[1]) for at in (self.send_at, self.recv_at)
        )


def _find(made, a):
    """(allocation, byte offset) of C-contiguous numpy ``a`` in this rank's segment of one of
    ``made``, or None."""
    address = a.__array_interface__["data"][0]
    for allocation in made:
        offset = address - allocation.start
        if offset >= 0 and offset + a.nbytes <= allocation.nbytes and allocation.window is not None:
            return allocation, offset
    return None


def placement_of_call(state, x, out):
    """``placement_of`` for ``allreduce(x, out=out)`` (x and out as the user gave them)."""
    if not _MADE or out is None or type(x) is not np.ndarray:
        return None
    return placement_of(
        state,
        None if out is x else x.reshape(-1) if x.flags.c_contiguous else x,
        out.reshape(-1) if type(out) is np.ndarray and out.flags.c_contiguous else out,
    )


def placement_of(state, send, recv):
    """A Placement when flat ``recv`` (and ``send``, unless None: in place) are C-contiguous numpy
    arrays in symmetric allocations of ``state`` that span the whole communicator (one node), not
    overlapping, else None."""
    made = getattr(state, "symmetric", None)
    if not made or state.spans_nodes or type(recv) is not np.ndarray or not recv.flags.c_contiguous:
        return None
    if send is not None and (
        type(send) is not np.ndarray
        or not send.flags.c_contiguous
        or np.may_share_memory(send, recv)
    ):
        return None
    recv_at = _find(made, recv)
    send_at = None if send is None else _find(made, send)
    if (
        recv_at is None
        or (send is not None and send_at is None)
        or recv_at[0].node.Get_size() != state.size
    ):
        return None
    return Placement(send_at, recv_at, recv.size, recv.dtype)
