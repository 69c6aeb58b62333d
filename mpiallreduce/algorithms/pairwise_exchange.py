"""Pairwise exchange: every rank receives its own slice of every rank's input, reduces it from all
p contributions at once, then sends the result to every rank.

The buffer is cut into p slices s0..s(p-1). p = 3 (x_q: rank q's input):

    step 1  reduce-scatter: rank r sends slice q of its input to every rank q != r and receives
            slice r of every other rank's input (all messages posted at once)
              rank 0: x1[s0], x2[s0] in      rank 1: x0[s1], x2[s1] in     rank 2: x0[s2], x1[s2] in
    step 2  rank r reduces slice r from the p contributions in rank order: x0[sr] + x1[sr] + x2[sr]
            (a mean: and divides it, by p)
    step 3  allgather: rank r sends its reduced slice to every rank q != r and receives theirs

Steps 1 and 2 go by segments of MPIALLREDUCE_RING_SEGMENT_BYTES (1 MiB) of each slice, two in
flight, as ring_pipelined's: segment k is reduced while segment k+1 travels, from slots still in
cache (one node: less overlap than locality).

Each link carries 2(p-1)/p of the buffer, as the ring's does, in 2 rounds of p-1 concurrent
messages instead of 2(p-1) steps one after the other. Each slice is reduced once, by one rank, in
one order: the same bits everywhere. Because one rank holds every contribution of an element, a
reproducible sum (mpiallreduce.reproducible) sums it exactly straight from the floats (the direct
route), across nodes as well, where pairwise algorithms must reduce fixed-point words instead.
"""

from dataclasses import dataclass

from ..core.buffers import scratch
from ..core.settings import settings
from .base import Algorithm, reduce_in_rank_order_into, slices_plan, wait_all

REDUCE_SCATTER_TAG = 301
ALLGATHER_TAG = 302


@dataclass(frozen=True)
class PairwiseExchangePlan:
    rank: int
    #: rank q owns the element range [start, stop) = slices[q]
    slices: tuple[tuple[int, int], ...]
    #: the other ranks, in the order their messages are posted (r+1, r+2, ...: each rank starts
    #: with a different peer)
    peers: tuple[int, ...]


class PairwiseExchangeAllreduce(Algorithm):
    name = "pairwise_exchange"
    memory = "host"
    messages_only = True
    sees_every_contribution = True
    finishes_slices = True

    def plan(self, size, rank, count):
        return PairwiseExchangePlan(
            rank=rank,
            slices=slices_plan(size, count).slices,
            peers=tuple((rank + k) % size for k in range(1, size)),
        )

    def execute(self, plan, comm, send, recv, op, datatype, finish=None):
        source = recv if send is None else send
        size, rank = len(plan.slices), plan.rank
        a, b = plan.slices[rank]
        segment = max(1, settings().ring_segment_bytes // recv.dtype.itemsize)
        width = min(segment, b - a)
        slots = scratch("pairwise_exchange.incoming", 2 * size * width, recv.dtype)

        def pieces_of(k, length):
            """Segment k's slot of every rank (two sets in turn)."""
            first = (k % 2) * size * width
            return [slots[first + q * width : first + q * width + length] for q in range(size)]

        def segment_of(k, q):
            c, d = plan.slices[q]
            return c + k * segment, min(c + (k + 1) * segment, d)

        def post(
            k,
        ):  # segment k of this rank's slice from every peer; segment k of each peer's slice to it
            lo, hi = segment_of(k, rank)
            incoming = pieces_of(k, hi - lo)
            requests = [
                comm.Irecv([incoming[q], datatype], q, REDUCE_SCATTER_TAG)
                for q in plan.peers
                if lo < hi
            ]
            for q in plan.peers:
                c, d = segment_of(k, q)
                if c < d:
                    requests.append(comm.Isend([source[c:d], datatype], q, REDUCE_SCATTER_TAG))
            return requests

        # Steps 1 and 2, segment by segment: segment k reduced while segment k+1 is in flight
        longest = max(d - c for c, d in plan.slices)
        rounds = -(-longest // segment)
        in_flight = post(0) if rounds else []
        for k in range(rounds):
            following = post(k + 1) if k + 1 < rounds else []
            wait_all(comm, in_flight)
            lo, hi = segment_of(k, rank)
            if lo < hi:
                pieces = pieces_of(k, hi - lo)
                if send is None and not op.exact and rank >= 2:
                    pieces[rank][...] = source[
                        lo:hi
                    ]  # (out may be only the first or second piece of a pairwise reduction)
                else:
                    pieces[rank] = source[lo:hi]
                reduce_in_rank_order_into(op, pieces, out=recv[lo:hi])
                if finish is not None:  # (a mean's division, on the segment just reduced)
                    finish(recv[lo:hi])
            in_flight = following

        # Step 3: every reduced slice to every rank, segment by segment
        for k in range(rounds):
            lo, hi = segment_of(k, rank)
            requests = [
                comm.Irecv([recv[c:d], datatype], q, ALLGATHER_TAG)
                for q, (c, d) in ((q, segment_of(k, q)) for q in plan.peers)
                if c < d
            ]
            if lo < hi:
                requests += [
                    comm.Isend([recv[lo:hi], datatype], q, ALLGATHER_TAG) for q in plan.peers
                ]
            wait_all(comm, requests)


ALGORITHM = PairwiseExchangeAllreduce()
