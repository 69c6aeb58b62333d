"""Recursive doubling: log2(p) rounds in which partners at distance 1, 2, 4, ... swap whole buffers.

For p a power of two, in round k rank r swaps its partial result with rank r XOR 2^k and both
reduce; after log2(p) rounds every rank holds the full reduction. p = 4:

    round 0 (distance 1):   0 <-> 1     2 <-> 3
    round 1 (distance 2):   0 <-> 2     1 <-> 3

Other rank counts (MPICH's scheme; Thakur, Rabenseifner & Gropp 2005): with pof2 the largest power
of two <= p and rem = p - pof2, the first 2*rem ranks pair up before and after. p = 6 (rem = 2):

    fold in:    0 -> 1      2 -> 3          (even rank sends its input; odd rank reduces)
    exchange:   1, 3, 4, 5 act as new ranks 0, 1, 2, 3 and do the power-of-two rounds above
    fold out:   1 -> 0      3 -> 2          (odd rank sends the finished result)

Same bits everywhere: each reduction applies the op to the lower rank's data first and the
higher rank's second, so two partners compute the identical expression even where the op's
floating-point result depends on operand order (NaN payloads); folded-out ranks get a copy.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from ..buffers import scratch
from .base import Algorithm

FOLD_TAG = 201
EXCHANGE_TAG = 202


@dataclass(frozen=True)
class RecursiveDoublingPlan:
    #: the rank this one sends its input to before the exchange (it then sits out), or None
    fold_into: Optional[int]
    #: the rank whose input this one reduces in before the exchange, and sends the result to after
    fold_from: Optional[int]
    #: the partner's rank, in this communicator, for each exchange round (empty for folded ranks)
    exchange_partners: Tuple[int, ...]


def largest_power_of_two_at_most(n):
    return 1 << (n.bit_length() - 1)


class RecursiveDoublingAllreduce(Algorithm):
    name = "recursive_doubling"

    def plan(self, size, rank, count):
        pof2 = largest_power_of_two_at_most(size)
        rem = size - pof2
        if rank < 2 * rem and rank % 2 == 0:
            return RecursiveDoublingPlan(fold_into=rank + 1, fold_from=None, exchange_partners=())
        fold_from = rank - 1 if rank < 2 * rem else None
        new_rank = rank // 2 if rank < 2 * rem else rank - rem

        def old_rank(new):
            return 2 * new + 1 if new < rem else new + rem

        partners = []
        distance = 1
        while distance < pof2:
            partners.append(old_rank(new_rank ^ distance))
            distance <<= 1
        return RecursiveDoublingPlan(fold_into=None, fold_from=fold_from, exchange_partners=tuple(partners))

    def execute(self, plan, comm, send, recv, op, datatype):
        if send is not None:
            np.copyto(recv, send)
        rank = comm.Get_rank()
        if plan.fold_into is not None:
            comm.Send([recv, datatype], plan.fold_into, FOLD_TAG)
            comm.Recv([recv, datatype], plan.fold_into, FOLD_TAG)
            return

        incoming = scratch("recursive_doubling.incoming", recv.size, recv.dtype)
        if plan.fold_from is not None:
            comm.Recv([incoming, datatype], plan.fold_from, FOLD_TAG)
            reduce_in_rank_order(op, rank, recv, plan.fold_from, incoming)

        for partner in plan.exchange_partners:
            comm.Sendrecv([recv, datatype], partner, EXCHANGE_TAG,
                          [incoming, datatype], partner, EXCHANGE_TAG)
            reduce_in_rank_order(op, rank, recv, partner, incoming)

        if plan.fold_from is not None:
            comm.Send([recv, datatype], plan.fold_from, FOLD_TAG)


def reduce_in_rank_order(op, rank, mine, partner, theirs):
    """mine = (lower rank's data) op (higher rank's data)."""
    if partner < rank:
        op.reduce_local(theirs, mine, out=mine)
    else:
        op.reduce_local(mine, theirs, out=mine)


ALGORITHM = RecursiveDoublingAllreduce()
