"""Pairwise exchange: every rank receives its own slice of every rank's input, reduces it from all
p contributions at once, then sends the result to every rank.

The buffer is cut into p slices s0..s(p-1). p = 3 (x_q: rank q's input):

    step 1  reduce-scatter: rank r sends slice q of its input to every rank q != r and receives
            slice r of every other rank's input (all messages posted at once)
              rank 0: x1[s0], x2[s0] in      rank 1: x0[s1], x2[s1] in     rank 2: x0[s2], x1[s2] in
    step 2  rank r reduces slice r from the p contributions in rank order: x0[sr] + x1[sr] + x2[sr]
    step 3  allgather: rank r sends its reduced slice to every rank q != r and receives theirs

Each link carries 2(p-1)/p of the buffer, as the ring's does, in 2 rounds of p-1 concurrent
messages instead of 2(p-1) steps one after the other. Each slice is reduced once, by one rank, in one
order: the same bits everywhere. Because one rank holds every contribution of an element, a
reproducible sum (mpiallreduce.reproducible) sums it exactly straight from the floats (the direct
route), across nodes as well, where pairwise algorithms must reduce fixed-point words instead.
"""
from dataclasses import dataclass
from typing import Tuple

from ..buffers import scratch
from .base import Algorithm, reduce_in_rank_order_into, slices_plan, wait_all

REDUCE_SCATTER_TAG = 301
ALLGATHER_TAG = 302


@dataclass(frozen=True)
class PairwiseExchangePlan:
    rank: int
    #: rank q owns the element range [start, stop) = slices[q]
    slices: Tuple[Tuple[int, int], ...]
    #: the other ranks, in the order their messages are posted (r+1, r+2, ...: each rank starts
    #: with a different peer)
    peers: Tuple[int, ...]


class PairwiseExchangeAllreduce(Algorithm):
    name = "pairwise_exchange"
    memory = "host"
    messages_only = True
    sees_every_contribution = True

    def plan(self, size, rank, count):
        return PairwiseExchangePlan(rank=rank, slices=slices_plan(size, count).slices,
                                    peers=tuple((rank + k) % size for k in range(1, size)))

    def execute(self, plan, comm, send, recv, op, datatype):
        source = recv if send is None else send
        a, b = plan.slices[plan.rank]
        slots = scratch("pairwise_exchange.incoming", len(plan.slices) * (b - a), recv.dtype)
        pieces = [slots[q * (b - a):(q + 1) * (b - a)] for q in range(len(plan.slices))]
        if send is None and not op.exact and plan.rank >= 2:
            pieces[plan.rank][...] = source[a:b]  # (out may be only the first or second piece of a pairwise reduction)
        else:
            pieces[plan.rank] = source[a:b]

        # Step 1: slice q of this rank's input to rank q, slice `rank` of every input here
        requests = [comm.Irecv([pieces[q], datatype], q, REDUCE_SCATTER_TAG) for q in plan.peers]
        requests += [comm.Isend([source[c:d], datatype], q, REDUCE_SCATTER_TAG)
                     for q, (c, d) in ((q, plan.slices[q]) for q in plan.peers)]
        wait_all(comm, requests)

        # Step 2: this rank's slice from every contribution, in rank order
        reduce_in_rank_order_into(op, pieces, out=recv[a:b])

        # Step 3: every reduced slice to every rank
        requests = [comm.Irecv([recv[c:d], datatype], q, ALLGATHER_TAG)
                    for q, (c, d) in ((q, plan.slices[q]) for q in plan.peers)]
        requests += [comm.Isend([recv[a:b], datatype], q, ALLGATHER_TAG) for q in plan.peers]
        wait_all(comm, requests)


ALGORITHM = PairwiseExchangeAllreduce()
