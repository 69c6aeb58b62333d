"""Single copy, one node, symmetric buffers: every rank reduces its own slice straight from its
peers' inputs and writes it straight into every rank's output.

The call's input and output are symmetric arrays (``mpiallreduce.empty``: one shared window per
allocation, every rank's array at the same offset of its segment, mpiallreduce.core.symmetric), so
every rank can load from and store into its peers' arrays. p = 3, slices s0 s1 s2:

    --- arrival: every rank's input is ready, every output free to write ---
                  (the signature codes in the shared slots, compared: always, a prepared or
                  unchecked call too, since the code names the allocations and offsets)
    step 1   rank r, chunk by chunk of its slice, in rank order:
             rank 0: y0[s0] = x0[s0] + x1[s0] + x2[s0];  y1[s0] = y0[s0];  y2[s0] = y0[s0]
             rank 1: y1[s1] = x0[s1] + x1[s1] + x2[s1];  y0[s1] = y1[s1];  y2[s1] = y1[s1]
             rank 2: ...
    --- barrier: every slice of every output is written ---

No staging: each input byte is read once, each output byte written once (2n of memory traffic per
rank, against about 5n through shared_memory's private window). A chunk of 256 KiB is copied to the
peers while it is still in the cache. In place (``out=x``), ranks 0 and 1 reduce a chunk into their
own array (the first two terms of the sum may be its target), the others into scratch first. Each
slice is reduced once, by one rank, in one order: the same bits everywhere. A reproducible sum
(mpiallreduce.reproducible) sums each chunk exactly, straight from the p floats (the direct route).
The arrival is never a bare barrier: a rank whose call runs on other symmetric arrays (another
prepared call, say) must not meet this one there, or each would read and write arrays the other
never passed; the code compared names the allocation and offsets of both arrays, so such calls
raise SignatureMismatch on every rank before anything is written. A peer writes this rank's output
only after every rank has arrived, so nothing is written before the call is known to run; a rank
that dies during step 1 leaves the outputs part written (as MPI's shared-memory collectives do).
"""

from ..core.plan_cases import Carries
from .base import OneNodeSlicedAlgorithm, reduce_in_rank_order_into

#: elements per chunk: 256 KiB of float32 (reduced, then copied while in the L2 cache)
CHUNK_BYTES = 256 << 10


class SingleCopyAllreduce(OneNodeSlicedAlgorithm):
    name = "single_copy"
    finishes_slices = True
    memory = "host"
    across_nodes = "hierarchical"
    uses_point_to_point = False
    #: it runs on symmetric buffers only: the planner gives it their placement (``peers=``)
    needs_symmetric = True
    #: it writes into the peers' outputs: a timed call runs shared_memory instead
    unbounded_when_timed = True
    #: the signature codes in the shared slots stand for its arrival barrier (as shared_memory's)
    carries_signature = Carries.SHARED_SLOTS
    #: each slice is reduced from every rank's input at once (a reproducible sum's direct route)
    sees_every_contribution = True

    def execute(
        self, plan, comm, send, recv, op, datatype, signature=None, peers=None, finish=None
    ):
        if peers is None:
            raise ValueError(
                "single_copy runs on symmetric buffers only (mpiallreduce.empty/zeros, the same "
                "place on every rank); these arrays are not"
            )
        inputs, outputs = peers.sends, peers.recvs
        rank = comm.Get_rank()
        if signature is None:  # (the executor always gives one: Execution._reduce)
            raise ValueError(
                "single_copy compares where the arrays lie on arrival; it was given nothing to "
                "compare"
            )
        peers.sync()
        if signature.shared():
            signature.publish()
            signature.compare()  # (raises on every rank, before any rank writes anything)
        else:  # (no shared slots: under ULFM) in messages, which every rank awaits: a barrier too
            signature.agree()
        peers.sync()

        a, b = plan.slices[rank]
        step = max(1, CHUNK_BYTES // max(1, recv.itemsize))
        mine = outputs[rank]
        # in place, ranks 0 and 1 reduce into their own array (the first two pieces may be the
        # output: reduce_in_rank_order_into), the others into scratch first
        through_scratch = send is None and rank > 1
        if through_scratch:
            from ..core.buffers import scratch

            chunk_buffer = scratch("single_copy", min(step, b - a), recv.dtype)
        others = [out for q, out in enumerate(outputs) if q != rank]
        for start in range(a, b, step):
            stop = min(b, start + step)
            target = chunk_buffer[: stop - start] if through_scratch else mine[start:stop]
            reduce_in_rank_order_into(op, [x[start:stop] for x in inputs], out=target)
            if finish is not None:  # (a mean's division, before the copies)
                finish(target)
            if through_scratch:
                mine[start:stop] = target
            for out in others:
                out[start:stop] = target
        peers.sync()
        comm.Barrier()
        peers.sync()


ALGORITHM = SingleCopyAllreduce()
