"""Per-call cost of the Horovod facade's negotiated ops: a 4-byte ``hvd.allreduce``, blocking, and
async calls followed by one barrier; the median of 5 runs of 300 calls each, in microseconds.

    mpiallreduce launch -n 2 -- python benchmarks/horovod_latency.py
"""

import statistics
import time

import torch
from mpi4py import MPI

import mpiallreduce.torch as hvd

CALLS, RUNS = 300, 5


def main():
    hvd.init()
    value = torch.ones(1)
    for _ in range(50):  # (warm: the engine, its duplicates, the library's first calls)
        hvd.allreduce(value, op=hvd.Sum)
    blocking, batched = [], []
    for _ in range(RUNS):
        MPI.COMM_WORLD.Barrier()
        started = time.perf_counter()
        for _ in range(CALLS):
            hvd.allreduce(value, op=hvd.Sum)
        blocking.append((time.perf_counter() - started) / CALLS * 1e6)
        MPI.COMM_WORLD.Barrier()
        started = time.perf_counter()
        handles = [hvd.allreduce_async(value, op=hvd.Sum) for _ in range(CALLS)]
        hvd.barrier()
        for handle in handles:
            hvd.synchronize(handle)
        batched.append((time.perf_counter() - started) / CALLS * 1e6)
    if hvd.rank() == 0:
        print(
            f"hvd.allreduce of 4 B on {hvd.size()} ranks: {statistics.median(blocking):.1f} us a "
            f"blocking call, {statistics.median(batched):.1f} us a call when {CALLS} async calls "
            "are followed by one barrier (medians of 5 runs)"
        )


if __name__ == "__main__":
    main()
