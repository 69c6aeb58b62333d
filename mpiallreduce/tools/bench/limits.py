"""The references a bench run is read against, measured in the same run: the memory copy
bandwidth of one core or of the GPU, the link's own speed between nodes, and the bound (the least
time any allreduce of n bytes can take here; docs/benchmarks.md, "The bound"):

    one node, out of place   every rank at once copies n bytes into a buffer of its own
                             (np.copyto): each rank reads n and writes n, the traffic of reading
                             each input once and writing each output once (p.n + p.n on the node)
    one node, in place       every rank at once rewrites n bytes where they lie (np.negative,
                             out=a): read n, write n to lines just read, as an in-place allreduce
    across nodes             2(N-1)/N.n bytes each way between two of the N nodes, as the
                             faster of one MPI_Sendrecv and MPI_Sendrecvs of segments one
                             after the other (the ring's traffic over the nodes: the least any
                             allreduce sends out of a node)

One core's memcpy is a reference, not a limit: below a few MiB the data sits in caches, which go
faster; the bound is measured at each size, with the caches as the contenders find them."""

import statistics
import time

import numpy as np

from ...core.buffers import aligned_empty
from ...core.topology import node_communicator

__all__ = [
    "MEMCPY_BYTES",
    "memory_copy_bandwidth",
    "link_bandwidth",
    "device_copy_bandwidth",
    "bound_pass",
    "link_pass",
    "link_peer",
]

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
    peer = link_peer(comm)
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


def bound_pass(count, dtype, in_place):
    """A callable that makes, on this rank, the least memory traffic an allreduce of ``count``
    elements must make on each rank of one node (see the module's docstring): timed with every rank
    at once, interleaved with the contenders, its fastest repetition is the bound."""
    a = aligned_empty(count, dtype)
    a[...] = 1
    if in_place:
        return lambda: np.negative(a, out=a)
    b = aligned_empty(count, dtype)
    b[...] = 0
    return lambda: np.copyto(b, a)


#: the segments of link_pass's second way: below the TCP eager size up to 1 MiB, 1 MiB above
SMALL_SEGMENT_BYTES, LARGE_SEGMENT_BYTES = 32 << 10, 1 << 20


def link_pass(comm, peer, nodes, nbytes):
    """Across nodes: callables that send the least any allreduce of ``nbytes`` must send between
    nodes, 2(N-1)/N.n bytes each way for N nodes (the ring's, over the nodes), between rank 0 and
    ``peer`` (the first rank of another node); the other ranks do nothing. Timed interleaved with
    the contenders at each size, as the bound on one node is: a message of that size runs as fast
    as the link does at that size (caches, socket buffers), which one 64 MiB measurement does not
    say. Two ways, both timed, the faster counts: one MPI_Sendrecv, and MPI_Sendrecvs of segments
    one after the other. Over loopback TCP, 64 KiB went 1.6x faster in 32 KiB segments (eager
    messages; Open MPI's allreduce beat the single message there) and 16 MiB 1.6x faster in 1 MiB
    segments (a pipelined algorithm beat the single message). Returns the list of callables."""
    volume = max(1, -(-nbytes * 2 * (nodes - 1) // nodes))
    segment = SMALL_SEGMENT_BYTES if volume <= LARGE_SEGMENT_BYTES else LARGE_SEGMENT_BYTES
    ways = [[(0, volume)]] + (
        [[(a, min(a + segment, volume)) for a in range(0, volume, segment)]]
        if volume > segment
        else []
    )
    rank = comm.Get_rank()
    if rank not in (0, peer):
        return [
            lambda: None for _ in ways
        ]  # (as many as the others: each is timed between barriers)
    other = peer if rank == 0 else 0
    send, receive = aligned_empty(volume, np.uint8), aligned_empty(volume, np.uint8)
    send[:] = 1

    def sendrecv(pieces):
        for a, b in pieces:
            comm.Sendrecv(send[a:b], other, 0, receive[a:b], other, 0)

    return [lambda pieces=pieces: sendrecv(pieces) for pieces in ways]


def link_peer(comm):
    """The first rank on another node than rank 0's, or None (every rank on one node);
    collective."""
    leaders = comm.allgather(node_communicator(comm).Get_rank() == 0)
    return next((r for r in range(1, comm.Get_size()) if leaders[r]), None)
