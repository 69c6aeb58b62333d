"""Rabenseifner: a recursive-halving reduce-scatter, then a recursive-doubling allgather.

On pof2 = 2^k ranks the buffer is cut into pof2 chunks c0..c(pof2-1). Reduce-scatter: at distance
pof2/2, pof2/4, ..., 1 a rank and its partner (new rank XOR distance) split the chunks they both
still hold; the lower rank keeps the lower half, sends the upper half and reduces the partner's
copy of its half in. Allgather: the same pairs in reverse order swap what they hold. pof2 = 4:

    reduce-scatter          rank 0         rank 1         rank 2         rank 3
    distance 2 (0<->2,1<->3) keep c0 c1     keep c0 c1     keep c2 c3     keep c2 c3
    distance 1 (0<->1,2<->3) keep c0        keep c1        keep c2        keep c3
    allgather
    distance 1              get c1         get c0         get c3         get c2
    distance 2              get c2 c3      get c2 c3      get c0 c1      get c0 c1

Each rank sends and receives 2n(pof2-1)/pof2 bytes in 2 lg(pof2) messages: the ring's bandwidth with
recursive doubling's latency (Open MPI's and MPICH's choice for long messages). Other rank counts
fold the extra ranks in before and out after (power_of_two.py). Every chunk is reduced once, by
one chain of pairwise reductions, then copied: the same bits on every rank.
"""

from dataclasses import dataclass

from ..core.buffers import copy_into, scratch
from .base import Algorithm, split_evenly
from .power_of_two import Fold, fold_in, fold_out, fold_plan

REDUCE_SCATTER_TAG = 301
ALLGATHER_TAG = 302


@dataclass(frozen=True)
class RabenseifnerPlan:
    fold: Fold
    #: (partner rank, elements sent [start, stop), elements kept and reduced [start, stop)) per step
    reduce_scatter_steps: tuple[tuple[int, tuple[int, int], tuple[int, int]], ...]
    #: (partner rank, elements sent [start, stop), elements received [start, stop)) per step
    allgather_steps: tuple[tuple[int, tuple[int, int], tuple[int, int]], ...]
    largest_piece: int


class RabenseifnerAllreduce(Algorithm):
    name = "rabenseifner"
    finishes_slices = True
    blocking_messages_only = True
    messages_only = True

    def plan(self, size, rank, count):
        fold = fold_plan(size, rank)
        if fold.new_rank is None:
            return RabenseifnerPlan(fold, (), (), 0)
        offsets, _ = split_evenly(count, fold.pof2)
        bounds = offsets + (count,)  # chunk i is [bounds[i], bounds[i + 1])

        def elements(first_chunk, stop_chunk):
            return bounds[first_chunk], bounds[stop_chunk]

        me = fold.new_rank
        window = (0, fold.pof2)  # chunks [lo, hi) this rank still reduces
        reduce_scatter, windows = [], []
        distance = fold.pof2 // 2
        while distance >= 1:
            lo, hi = window
            middle = (lo + hi) // 2
            lower_half, upper_half = (lo, middle), (middle, hi)
            keep, give = (
                (lower_half, upper_half) if me & distance == 0 else (upper_half, lower_half)
            )
            reduce_scatter.append((fold.old_rank(me ^ distance), elements(*give), elements(*keep)))
            windows.append((give, keep))
            window = keep
            distance //= 2
        allgather = []
        for (partner, _, _), (give, keep) in zip(
            reversed(reduce_scatter), reversed(windows), strict=True
        ):
            # what this rank kept it now sends; what it gave away comes back reduced
            allgather.append((partner, elements(*keep), elements(*give)))
        largest = max((stop - start for _, _, (start, stop) in reduce_scatter), default=0)
        return RabenseifnerPlan(fold, tuple(reduce_scatter), tuple(allgather), largest)

    def execute(self, plan, comm, send, recv, op, datatype, finish=None):
        folding = plan.fold.fold_from is not None or plan.fold.fold_into is not None
        if send is not None and folding:
            copy_into(recv, send)
        # Otherwise no copy first: step 0 sends from the input and reduces input (op) incoming into
        # recv; what this rank gives away arrives, reduced, in the allgather.
        source = recv if send is None or folding else send
        incoming = scratch(
            "rabenseifner.incoming",
            recv.size if plan.fold.fold_from is not None else plan.largest_piece,
            recv.dtype,
            like=recv,
        )
        if fold_in(plan.fold, comm, recv, incoming, op, datatype):
            return
        rank = comm.Get_rank()

        # Reduce-scatter (recursive halving)
        for partner, (s0, s1), (k0, k1) in plan.reduce_scatter_steps:
            comm.Sendrecv(
                [source[s0:s1], datatype],
                partner,
                REDUCE_SCATTER_TAG,
                [incoming[: k1 - k0], datatype],
                partner,
                REDUCE_SCATTER_TAG,
            )
            if partner < rank:
                op.reduce_local(incoming[: k1 - k0], source[k0:k1], out=recv[k0:k1])
            else:
                op.reduce_local(source[k0:k1], incoming[: k1 - k0], out=recv[k0:k1])
            source = recv
        if (
            finish is not None and plan.reduce_scatter_steps
        ):  # (a mean's division, on the block it kept last)
            finish(recv[k0:k1])

        # Allgather (recursive doubling)
        for partner, (s0, s1), (r0, r1) in plan.allgather_steps:
            comm.Sendrecv(
                [recv[s0:s1], datatype],
                partner,
                ALLGATHER_TAG,
                [recv[r0:r1], datatype],
                partner,
                ALLGATHER_TAG,
            )

        fold_out(plan.fold, comm, recv, datatype)


ALGORITHM = RabenseifnerAllreduce()
