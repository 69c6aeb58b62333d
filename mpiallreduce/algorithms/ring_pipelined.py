"""Pipelined ring: the ring's schedule, with each reduce-scatter chunk sent in segments, two in
flight.

The chunks and steps are the ring's (ring.py). Within one reduce-scatter step, the chunk is cut into
segments of SEGMENT_BYTES; while segment k is reduced, segment k+1 is already posted (Isend to the
right, Irecv from the left into the other of two segment buffers):

    time ->   post s0 | post s1, wait s0, reduce s0 | post s2, wait s1, reduce s1
              | ... | wait sN, reduce sN

On one node the win is less overlap than locality: a segment arrives into a small buffer that is
still in cache when it is reduced, instead of a chunk-sized buffer that went out to memory. The
allgather passes the chunks in the same segments, one at a time: across nodes (TCP) a 16 MiB
allreduce of 2 ranks ran about 25% faster than with whole chunks, the sender's and the receiver's
copies of a segment staying in cache. Bits as the ring's: every chunk reduced once along one chain
of ranks, then copied.
"""

from ..core.buffers import scratch
from ..core.settings import settings
from .base import wait_all
from .ring import ALLGATHER_TAG, REDUCE_SCATTER_TAG, RingAllreduce, chunk_bounds

#: segment size: `mpiallreduce bench --algorithms ring,ring_pipelined --sizes 1M,4M,16M,64M` with
#: MPIALLREDUCE_RING_SEGMENT_BYTES (mpiallreduce.settings; the ranks must agree on it) at 64 KiB,
#: 256 KiB, 1 MiB and 4 MiB, 2 ranks here: 1 MiB was best or within noise of best at 4-64 MiB in
#: three runs of four (64 KiB was worst)


class PipelinedRingAllreduce(RingAllreduce):
    name = "ring_pipelined"
    blocking_messages_only = (
        False  # Isend/Irecv: device arrays take the host round trip when staged
    )

    @property
    def segment_bytes(self):
        return settings().ring_segment_bytes

    def execute(self, plan, comm, send, recv, op, datatype, finish=None):
        source = recv if send is None else send
        bounds = chunk_bounds(plan)
        segment = max(1, self.segment_bytes // recv.dtype.itemsize)
        buffers = (
            scratch("ring_pipelined.a", segment, recv.dtype, like=recv),
            scratch("ring_pipelined.b", segment, recv.dtype, like=recv),
        )

        # Reduce-scatter, segment by segment, the next segment in flight while one is reduced
        last = len(plan.reduce_scatter_steps) - 1  # (the step that completes this rank's chunk)
        for step, (send_chunk, reduce_chunk) in enumerate(plan.reduce_scatter_steps):
            s0, s1 = bounds[send_chunk]
            r0, r1 = bounds[reduce_chunk]
            outgoing = source if step == 0 else recv
            send_segments = [(a, min(a + segment, s1)) for a in range(s0, s1, segment)]
            recv_segments = [(a, min(a + segment, r1)) for a in range(r0, r1, segment)]
            # The chunk sent to the right is the one the right neighbour reduces at this step and
            # cuts the same way; the two lists here may differ by one segment (chunk sizes differ by
            # up to one element), so sends and receives are posted by index, each while it lasts.

            def post(k):
                requests = []
                if k < len(recv_segments):  # noqa: B023 (called in this iteration only)
                    c, d = recv_segments[k]  # noqa: B023 (called in this iteration only)
                    requests.append(
                        comm.Irecv(
                            [buffers[k % 2][: d - c], datatype], plan.left, REDUCE_SCATTER_TAG
                        )
                    )
                if k < len(send_segments):  # noqa: B023 (called in this iteration only)
                    a, b = send_segments[k]  # noqa: B023 (called in this iteration only)
                    requests.append(
                        comm.Isend([outgoing[a:b], datatype], plan.right, REDUCE_SCATTER_TAG)  # noqa: B023 (called in this iteration only)
                    )
                return requests

            rounds = max(len(send_segments), len(recv_segments))
            in_flight = post(0)
            for k in range(rounds):
                following = post(k + 1) if k + 1 < rounds else []
                wait_all(comm, in_flight)
                if k < len(recv_segments):
                    c, d = recv_segments[k]
                    op.reduce_local(source[c:d], buffers[k % 2][: d - c], out=recv[c:d])
                    if (
                        finish is not None and step == last
                    ):  # (a mean's division, on a segment of this rank's chunk)
                        finish(recv[c:d])
                in_flight = following

        # Allgather, segment by segment (a segment a step: nothing to overlap)
        for send_chunk, copy_chunk in plan.allgather_steps:
            s0, s1 = bounds[send_chunk]
            c0, c1 = bounds[copy_chunk]
            for k in range(max(-(-(s1 - s0) // segment), -(-(c1 - c0) // segment))):
                a, b = s0 + k * segment, min(s0 + (k + 1) * segment, s1)
                c, d = c0 + k * segment, min(c0 + (k + 1) * segment, c1)
                requests = (
                    [comm.Irecv([recv[c:d], datatype], plan.left, ALLGATHER_TAG)] if c < d else []
                )
                if a < b:
                    requests.append(comm.Isend([recv[a:b], datatype], plan.right, ALLGATHER_TAG))
                wait_all(comm, requests)


ALGORITHM = PipelinedRingAllreduce()
