"""Shared memory, one node: every rank reduces its own slice straight from its peers' memory.

The ranks (all on one node) share an MPI-3 window (``Win.Allocate_shared``) with one segment per
rank. The buffer is cut into p slices s0..s(p-1). p = 3:

    step 1   rank q copies its input into segment q              seg0 = x0, seg1 = x1, seg2 = x2
             (and its call's signature code, mpiallreduce.core.slots)
    --- barrier ---                                              (or: wait for the p codes, compare)
    step 2   rank r reduces slice r over all segments, in rank order, and publishes it in its
             segment
             rank 0: s0 = seg0[s0] + seg1[s0] + seg2[s0]   rank 1: s1 = ...   rank 2: s2 = ...
    --- barrier ---
    step 3   rank r copies slice q out of segment q, for every q

No messages: each byte is copied in once, read once by the rank that reduces it and copied out by
every rank. Each slice is reduced once, by one rank, in one order: the same bits everywhere. Two
halves of the window are used in turn, so the next call can start writing while a slow rank still
copies out of the previous one (two barriers per call, not three). All ranks of the communicator
must share a node; otherwise every rank raises ValueError (use "hierarchical").
"""

import numpy as np
from mpi4py import MPI

from ..core.comms import cached, replace_cached
from ..core.plan_cases import Carries
from .base import CallTags, OneNodeSlicedAlgorithm, reduce_in_rank_order_into

MIN_WINDOW_BYTES = 1 << 16


class SharedWindow:
    """A shared window with two halves per rank, each ``half_bytes`` long, and numpy views of
    all."""

    def __init__(self, node, half_bytes):
        self.half_bytes = half_bytes
        self.window = MPI.Win.Allocate_shared(2 * half_bytes, 1, comm=node)
        self.segments = []
        for rank in range(node.Get_size()):
            buffer, _ = self.window.Shared_query(rank)
            self.segments.append(np.frombuffer(buffer, dtype=np.uint8))
        self.window.Lock_all(MPI.MODE_NOCHECK)
        self.calls = 0

    def halves(self, nbytes, dtype, sequence=None):
        """Call #``sequence``'s half of every rank's segment, as arrays of ``dtype``: by the call's
        number, the same on every rank whatever calls some rank left before taking a half (a count
        of its own, outside the executor's calls)."""
        if sequence is None:
            sequence = self.calls
            self.calls += 1
        start = (sequence % 2) * self.half_bytes
        return [s[start : start + nbytes].view(dtype) for s in self.segments]

    def fence(self, comm):
        """All ranks' stores before it are visible to all ranks' loads after it."""
        self.window.Sync()
        comm.Barrier()
        self.window.Sync()

    def free(self):
        self.window.Unlock_all()
        self.window.Free()


def shared_window(comm, nbytes):
    """A SharedWindow over ``comm`` with halves of at least ``nbytes`` (collective when it
    grows)."""
    if isinstance(comm, CallTags):  # (a timed call's: the window is its communicator's)
        comm = comm.comm
    current = cached(comm, "shared_window", lambda: None)
    if current is None or current.half_bytes < nbytes:
        half = max(MIN_WINDOW_BYTES, 1 << max(0, nbytes - 1).bit_length())
        current = replace_cached(comm, "shared_window", SharedWindow(comm, half))
    return current


class SharedMemoryAllreduce(OneNodeSlicedAlgorithm):
    name = "shared_memory"
    finishes_slices = True
    memory = "host"
    across_nodes = "hierarchical"
    #: its barriers (a timed call's: bounded, faults.bounded)
    bounded_collectives = True
    #: the call's number picks the half of the window (every rank alike)
    takes_call_number = True

    #: the ranks' signature codes, published in shared memory, can be waited for in place of the
    #: first barrier (the planner says when: one node, the call compared)
    carries_signature = Carries.SHARED_SLOTS
    #: each slice is reduced from every rank's segment at once (a reproducible sum's direct route)
    sees_every_contribution = True

    def needs_set_up(self, comm, nbytes):
        window = cached(comm, "shared_window", lambda: None)
        return window is None or window.half_bytes < nbytes

    def set_up(self, comm, nbytes):
        shared_window(comm, nbytes)

    def execute(
        self, plan, comm, send, recv, op, datatype, signature=None, finish=None, sequence=None
    ):
        """``signature``: the call's signature comparison when the plan says this algorithm carries
        it (mpiallreduce.core.executor: published with the input, compared in place of the barrier).
        ``sequence``: the call's number, which picks the half of the window it writes."""
        window = cached(comm, "shared_window", lambda: None)
        if signature is not None and (window is None or window.half_bytes < recv.nbytes):
            signature.agree()  # making or growing the window is collective: compare first
            signature = None
        window = shared_window(comm, recv.nbytes)
        segments = window.halves(recv.nbytes, recv.dtype, sequence)
        rank = comm.Get_rank()

        # Step 1: publish this rank's input (and its signature code, which then stands for the
        # barrier)
        np.copyto(segments[rank], recv if send is None else send)
        if signature is None:
            window.fence(comm)
        else:
            window.window.Sync()
            signature.publish()
            try:
                signature.compare()
            except ValueError:
                if sequence is None:  # this call did not happen: the count stays in step
                    window.calls -= 1
                raise
            window.window.Sync()

        # Step 2: reduce this rank's slice over every segment, in rank order, and publish it
        a, b = plan.slices[rank]
        mine = recv[a:b]
        reduce_in_rank_order_into(op, [segment[a:b] for segment in segments], out=mine)
        if finish is not None:  # (a mean's division, before it is published)
            finish(mine)
        segments[rank][a:b] = mine
        window.fence(comm)

        # Step 3: copy every other slice out of its owner's segment
        for q, (c, d) in enumerate(plan.slices):
            if q != rank:
                recv[c:d] = segments[q][c:d]


ALGORITHM = SharedMemoryAllreduce()
