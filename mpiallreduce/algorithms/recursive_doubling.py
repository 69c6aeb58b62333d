"""Recursive doubling: log2(p) rounds in which partners at distance 1, 2, 4, ... swap whole buffers.

For p a power of two, in round k rank r swaps its partial result with rank r XOR 2^k and both
reduce; after log2(p) rounds every rank holds the full reduction. p = 4:

    round 0 (distance 1):   0 <-> 1     2 <-> 3
    round 1 (distance 2):   0 <-> 2     1 <-> 3

Other rank counts fold the extra ranks in before and out after (power_of_two.py). p = 6:

    fold in:    0 -> 1      2 -> 3
    round 0:    1 <-> 3     4 <-> 5        (new ranks 0 <-> 1, 2 <-> 3)
    round 1:    1 <-> 4     3 <-> 5        (new ranks 0 <-> 2, 1 <-> 3)
    fold out:   1 -> 0      3 -> 2

Same bits everywhere: each reduction applies the op to the lower rank's data first, so two
partners compute the identical expression even where the result depends on operand order (NaN
payloads); folded-out ranks get a copy. Cost lg p (alpha + n beta + n gamma): for small messages.
"""

from dataclasses import dataclass

from ..core.buffers import copy_into, scratch
from .base import Algorithm
from .power_of_two import Fold, fold_in, fold_out, fold_plan, reduce_in_rank_order

EXCHANGE_TAG = 202


@dataclass(frozen=True)
class RecursiveDoublingPlan:
    fold: Fold
    #: the partner's rank, in this communicator, for each exchange round (empty for folded ranks)
    exchange_partners: tuple[int, ...]


class RecursiveDoublingAllreduce(Algorithm):
    name = "recursive_doubling"
    blocking_messages_only = True
    messages_only = True

    def plan(self, size, rank, count):
        fold = fold_plan(size, rank)
        partners = []
        if fold.new_rank is not None:
            distance = 1
            while distance < fold.pof2:
                partners.append(fold.old_rank(fold.new_rank ^ distance))
                distance <<= 1
        return RecursiveDoublingPlan(fold=fold, exchange_partners=tuple(partners))

    def execute(self, plan, comm, send, recv, op, datatype):
        folds = plan.fold.fold_into is not None or plan.fold.fold_from is not None
        mine = recv  # (what this rank sends and reduces in each round)
        if send is not None:
            if folds or not plan.exchange_partners:
                copy_into(recv, send)
            else:
                # the first round sends the input where it lies and writes its reduction into recv:
                # no copy
                mine = send
        incoming = scratch("recursive_doubling.incoming", recv.size, recv.dtype, like=recv)
        if fold_in(plan.fold, comm, recv, incoming, op, datatype):
            return
        rank = comm.Get_rank()
        for partner in plan.exchange_partners:
            comm.Sendrecv(
                [mine, datatype], partner, EXCHANGE_TAG, [incoming, datatype], partner, EXCHANGE_TAG
            )
            reduce_in_rank_order(op, rank, mine, partner, incoming, out=recv)
            mine = recv
        fold_out(plan.fold, comm, recv, datatype)


ALGORITHM = RecursiveDoublingAllreduce()
