"""Ring allreduce: a reduce-scatter around the ring, then an allgather around it.

The buffer is cut into p chunks c0..c(p-1) (sizes differ by at most one element). Every rank
sends only to its right neighbour (r+1) and receives only from its left one (r-1), so each link
carries 2(p-1)/p of the buffer: the bandwidth lower bound for any allreduce (Patarasuk & Yuan 2009).

    rank 0 --> rank 1 --> rank 2 --> rank 3 --+
      ^                                        |
      +----------------------------------------+

Reduce-scatter, step s = 0..p-2: rank r sends chunk (r - s) % p and receives chunk (r - s - 1) % p,
which it reduces into its own copy. Example p = 4 (send / receive+reduce):

    step   rank 0    rank 1    rank 2    rank 3
     0     c0 / c3   c1 / c0   c2 / c1   c3 / c2
     1     c3 / c2   c0 / c3   c1 / c0   c2 / c1
     2     c2 / c1   c3 / c2   c0 / c3   c1 / c0
    -> rank r now holds chunk (r + 1) % p reduced over all ranks.

Allgather, step s = 0..p-2: rank r sends chunk (r + 1 - s) % p and receives chunk (r - s) % p,
which it copies over its own:

    step   rank 0    rank 1    rank 2    rank 3
     0     c1 / c0   c2 / c1   c3 / c2   c0 / c3
     1     c0 / c3   c1 / c0   c2 / c1   c3 / c2
     2     c3 / c2   c0 / c3   c1 / c0   c2 / c1

Every chunk is reduced once, by one chain of ranks, and then copied: all ranks end with the same
bits whatever the op or dtype.
"""

from dataclasses import dataclass

from ..core.buffers import scratch
from .base import Algorithm, ring_neighbours, split_evenly

# Tags of this algorithm's messages (it runs on a private duplicate communicator; distinct tags
# still make a mix-up between its two phases impossible).
REDUCE_SCATTER_TAG = 101
ALLGATHER_TAG = 102


@dataclass(frozen=True)
class RingPlan:
    left: int
    right: int
    chunk_offsets: tuple[int, ...]
    chunk_counts: tuple[int, ...]
    #: (chunk sent, chunk received and reduced) per step
    reduce_scatter_steps: tuple[tuple[int, int], ...]
    #: (chunk sent, chunk received and copied) per step
    allgather_steps: tuple[tuple[int, int], ...]


class RingAllreduce(Algorithm):
    name = "ring"
    finishes_slices = True
    blocking_messages_only = True
    messages_only = True

    def plan(self, size, rank, count):
        left, right = ring_neighbours(size, rank)
        offsets, counts = split_evenly(count, size)
        return RingPlan(
            left=left,
            right=right,
            chunk_offsets=offsets,
            chunk_counts=counts,
            reduce_scatter_steps=tuple(
                ((rank - s) % size, (rank - s - 1) % size) for s in range(size - 1)
            ),
            allgather_steps=tuple(
                ((rank + 1 - s) % size, (rank - s) % size) for s in range(size - 1)
            ),
        )

    def execute(self, plan, comm, send, recv, op, datatype, finish=None):
        # No copy of the input into recv first: step 0 sends from the input and every reduction
        # writes input (op) incoming into recv; chunks this rank never reduces arrive in the
        # allgather.
        source = recv if send is None else send
        bounds = chunk_bounds(plan)
        incoming = scratch("ring.incoming", max(plan.chunk_counts), recv.dtype, like=recv)

        # Reduce-scatter
        for step, (send_chunk, reduce_chunk) in enumerate(plan.reduce_scatter_steps):
            s0, s1 = bounds[send_chunk]
            r0, r1 = bounds[reduce_chunk]
            outgoing = source[s0:s1] if step == 0 else recv[s0:s1]
            comm.Sendrecv(
                [outgoing, datatype],
                plan.right,
                REDUCE_SCATTER_TAG,
                [incoming[: r1 - r0], datatype],
                plan.left,
                REDUCE_SCATTER_TAG,
            )
            op.reduce_local(source[r0:r1], incoming[: r1 - r0], out=recv[r0:r1])
        if (
            finish is not None and plan.reduce_scatter_steps
        ):  # (a mean's division, on this rank's chunk)
            finish(recv[r0:r1])

        ring_allgather(plan, comm, recv, datatype)


def chunk_bounds(plan):
    """[(start, stop)] of every chunk, in elements."""
    return [(o, o + n) for o, n in zip(plan.chunk_offsets, plan.chunk_counts, strict=False)]


def ring_allgather(plan, comm, recv, datatype, received=None):
    """The allgather half: pass the reduced chunks around the ring, copying each over the old one.

    ``received(start, stop)``, if given, is called as each chunk arrives.
    """
    bounds = chunk_bounds(plan)
    for send_chunk, copy_chunk in plan.allgather_steps:
        s0, s1 = bounds[send_chunk]
        c0, c1 = bounds[copy_chunk]
        comm.Sendrecv(
            [recv[s0:s1], datatype],
            plan.right,
            ALLGATHER_TAG,
            [recv[c0:c1], datatype],
            plan.left,
            ALLGATHER_TAG,
        )
        if received is not None:
            received(c0, c1)


ALGORITHM = RingAllreduce()
