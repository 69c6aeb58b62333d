"""The references a bench run is read against, measured in the same run: the memory copy
bandwidth of one core or of the GPU, and the link's own speed between nodes. One core's memcpy is
a reference, not a limit: below a few MiB the data sits in caches, which go faster (issue #28
asks for a measured bound)."""
import statistics
import time

import numpy as np

from ...core.buffers import aligned_empty
from ...core.topology import node_communicator

__all__ = ["MEMCPY_BYTES", "memory_copy_bandwidth", "link_bandwidth", "device_copy_bandwidth"]

MEMCPY_BYTES = 64 << 20


def memory_copy_bandwidth(comm, nbytes=MEMCPY_BYTES, repetitions=5):
    """One core's memory copy bandwidth (GB/s, bytes copied per second), measured on rank 0 alone.

    A reference for an allreduce on one node (every byte is copied at least once), not a limit:
    cached sizes beat it, and several cores copy at once.
    """
    result = 0.0
    if comm.Get_rank() == 0:
        a = aligned_empty(nbytes, np.uint8)
        a[:] = 1
        b = aligned_empty(nbytes, np.uint8)
        np.copyto(b, a)
        seconds = []
        for _ in range(repetitions):
            start = time.perf_counter()
            np.copyto(b, a)
            seconds.append(time.perf_counter() - start)
        result = nbytes / statistics.median(seconds) / 1e9
    return comm.bcast(result, root=0)


def link_bandwidth(comm, nbytes=MEMCPY_BYTES, repetitions=5):
    """(GB/s each way, peer) of a plain MPI_Sendrecv of ``nbytes`` between rank 0 and the first rank
    on another node, both ways at once (what a ring step between nodes asks of the link); None where
    every rank is on one node. Collective; the other ranks wait."""
    leaders = comm.allgather(node_communicator(comm).Get_rank() == 0)
    peer = next((r for r in range(1, comm.Get_size()) if leaders[r]), None)
    if peer is None:
        return None
    result = 0.0
    if comm.Get_rank() in (0, peer):
        other = peer if comm.Get_rank() == 0 else 0
        send, receive = aligned_empty(nbytes, np.uint8), aligned_empty(nbytes, np.uint8)
        send[:] = 1
        seconds = []
        for _ in range(repetitions + 1):  # (the first one warms the connection up)
            start = time.perf_counter()
            comm.Sendrecv(send, other, 0, receive, other, 0)
            seconds.append(time.perf_counter() - start)
        result = nbytes / statistics.median(seconds[1:]) / 1e9
    comm.Barrier()
    return comm.bcast(result, root=0), peer


def device_copy_bandwidth(comm, memory, nbytes=MEMCPY_BYTES, repetitions=5):
    """The GPU's device-to-device copy bandwidth (GB/s, bytes copied per second), rank 0 alone."""
    result = 0.0
    if comm.Get_rank() == 0:
        a = memory.array(np.ones(nbytes, np.uint8))
        b = memory.empty(nbytes, np.uint8)
        seconds = []
        for _ in range(repetitions + 1):
            memory.finish()
            start = time.perf_counter()
            memory.copy(b, a)
            memory.finish()
            seconds.append(time.perf_counter() - start)
        result = nbytes / statistics.median(seconds[1:]) / 1e9
    return comm.bcast(result, root=0)

