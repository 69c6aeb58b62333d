"""Staged ring for device arrays on an MPI that is not CUDA-aware: pinned host buffers, three
streams.

The ring of ring.py (reduce-scatter, then allgather; same chunks, same steps), with each chunk cut
into segments whose copies and transfers overlap. Reductions run on the GPU. For one
reduce-scatter step, segments k = 0, 1, 2, ... of the chunk sent and of the chunk received:

  d2h stream     copy seg 0 out | copy seg 1 out | copy seg 2 out |
  MPI (host)                    | send/recv seg 0| send/recv seg 1| send/recv seg 2|
  h2d stream                                     | copy seg 0 in  | copy seg 1 in  | copy seg 2 in
  current stream                                                  | reduce seg 0   | reduce seg 1...

so the device-to-host copy of one segment, the MPI transfer of another and the host-to-device copy
(and reduction) of a third run at once. Pinned buffers and device landing buffers alternate
between even and odd steps, so a step's copies never overwrite what the step before still reads.

Allgather: this rank's reduced chunk is copied to a pinned host buffer once; the chunks then go
round the ring host to host (ring.ring_allgather), and each one is copied to the device on the
h2d stream as it arrives, overlapping the next transfer.
"""

import threading

from ..core.buffers import scratch
from ..core.settings import settings
from ..device.arrays import namespace
from ..device.transports import pinned
from .base import wait_all
from .ring import REDUCE_SCATTER_TAG, RingAllreduce, chunk_bounds, ring_allgather

#: segment size (MPIALLREDUCE_STAGED_SEGMENT_BYTES, mpiallreduce.settings); not yet tuned on a GPU


class _CopyStreams(threading.local):
    def __init__(self):
        self.by_module = {}


_copy_streams = _CopyStreams()


def copy_streams(xp):
    """(device-to-host, host-to-device): two non-blocking streams per thread, made once."""
    streams = _copy_streams.by_module.get(xp.__name__)
    if streams is None:
        streams = (xp.cuda.Stream(non_blocking=True), xp.cuda.Stream(non_blocking=True))
        _copy_streams.by_module[xp.__name__] = streams
    return streams


def event_on(xp, stream):
    event = xp.cuda.Event(disable_timing=True)
    event.record(stream)
    return event


class StagedRingAllreduce(RingAllreduce):
    name = "staged_ring"
    finishes_slices = False  # (its execute on device memory takes no finish)
    memory = "device"
    device_path = "staged pipeline"
    blocking_messages_only = False

    @property
    def segment_bytes(self):
        return settings().staged_segment_bytes

    def execute(self, plan, comm, send, recv, op, datatype):
        xp = namespace(recv)
        compute = xp.cuda.get_current_stream()
        d2h, h2d = copy_streams(xp)
        source = recv if send is None else send
        bounds = chunk_bounds(plan)
        largest = max(plan.chunk_counts)
        segment = max(1, self.segment_bytes // recv.dtype.itemsize)
        sent = [pinned(xp, f"staged_ring.sent{i}", largest, recv.dtype) for i in (0, 1)]
        arrived = [pinned(xp, f"staged_ring.arrived{i}", largest, recv.dtype) for i in (0, 1)]
        landed = [scratch(f"staged_ring.landed{i}", largest, recv.dtype, like=recv) for i in (0, 1)]
        arrived_copied = [None, None]  # per parity: the h2d copies out of arrived[parity] are done
        reduced = event_on(
            xp, compute
        )  # what the copies out must wait for: the input, then each step

        # Reduce-scatter
        for step, (send_chunk, reduce_chunk) in enumerate(plan.reduce_scatter_steps):
            parity = step % 2
            s0, s1 = bounds[send_chunk]
            r0, r1 = bounds[reduce_chunk]
            outgoing = source if step == 0 else recv
            send_segments = [(a, min(a + segment, s1)) for a in range(s0, s1, segment)]
            recv_segments = [(c, min(c + segment, r1)) for c in range(r0, r1, segment)]

            d2h.wait_event(reduced)
            copied_out = []
            for a, b in send_segments:
                xp.asnumpy(
                    outgoing[a:b], stream=d2h, out=sent[parity][a - s0 : b - s0], blocking=False
                )
                copied_out.append(event_on(xp, d2h))
            if arrived_copied[parity] is not None:
                arrived_copied[parity].synchronize()
            receives = [
                comm.Irecv(
                    [arrived[parity][c - r0 : d - r0], datatype], plan.left, REDUCE_SCATTER_TAG
                )
                for c, d in recv_segments
            ]
            sends = []
            for (a, b), copied in zip(send_segments, copied_out, strict=True):
                copied.synchronize()
                sends.append(
                    comm.Isend(
                        [sent[parity][a - s0 : b - s0], datatype], plan.right, REDUCE_SCATTER_TAG
                    )
                )
            h2d.wait_event(reduced)  # landed[parity] was last read by an earlier step's reductions
            for (c, d), request in zip(recv_segments, receives, strict=True):
                wait_all(comm, [request])
                landed[parity][c - r0 : d - r0].set(arrived[parity][c - r0 : d - r0], stream=h2d)
                compute.wait_event(event_on(xp, h2d))
                op.reduce_local(source[c:d], landed[parity][c - r0 : d - r0], out=recv[c:d])
            arrived_copied[parity] = event_on(xp, h2d)
            wait_all(comm, sends)
            reduced = event_on(xp, compute)

        # Allgather, host to host; each chunk copied to the device as it arrives
        result = pinned(xp, "staged_ring.result", recv.size, recv.dtype)
        own0, own1 = bounds[(comm.Get_rank() + 1) % comm.Get_size()]
        xp.asnumpy(
            recv[own0:own1], stream=compute, out=result[own0:own1]
        )  # blocking: after the reductions

        def copy_in(start, stop):
            recv[start:stop].set(result[start:stop], stream=h2d)

        ring_allgather(plan, comm, result, datatype, received=copy_in)
        compute.wait_event(event_on(xp, h2d))
        h2d.synchronize()  # `result` and the pinned buffers are free for the next call


ALGORITHM = StagedRingAllreduce()
