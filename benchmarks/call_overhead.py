"""What the Python wrapper and a timeout cost per call, against mpi4py's raw MPI_Allreduce.

    mpiallreduce launch -n 2 -- python benchmarks/call_overhead.py

Median over interleaved repetitions of the slowest rank's time per call (microseconds):
- 4 B: raw comm.Allreduce, mar.allreduce(algorithm="mpi"), mar.allreduce (auto);
- 4 KiB and 1 MiB: ring without and with timeout=60 (the rendezvous of mpiallreduce.faults).
"""
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

COMM = MPI.COMM_WORLD
REPETITIONS = 7


def per_call(call, iterations):
    COMM.Barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    return COMM.allreduce((time.perf_counter() - start) / iterations, op=MPI.MAX)


def compare(contenders, iterations):
    """{name: median microseconds}, the contenders interleaved in every repetition."""
    times = {name: [] for name in contenders}
    for _ in range(REPETITIONS):
        for name, call in contenders.items():
            times[name].append(per_call(call, iterations))
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main():
    x = np.ones(1, np.float32)
    out = np.empty_like(x)
    rows = [("4 B", compare({
        "MPI_Allreduce (mpi4py)": lambda: COMM.Allreduce(x, out),
        "allreduce(algorithm='mpi')": lambda: mar.allreduce(x, out=out, algorithm="mpi"),
        "allreduce (auto)": lambda: mar.allreduce(x, out=out),
    }, 2000))]
    for nbytes, iterations in ((4096, 200), (1 << 20, 20)):
        y = np.ones(nbytes // 4, np.float32)
        result = np.empty_like(y)
        rows.append((f"{nbytes} B", compare({
            "ring": lambda: mar.allreduce(y, out=result, algorithm="ring"),
            "ring, timeout=60": lambda: mar.allreduce(y, out=result, algorithm="ring", timeout=60),
        }, iterations)))
    if COMM.Get_rank() == 0:
        print(f"# {COMM.Get_size()} ranks; median of {REPETITIONS} interleaved repetitions, slowest rank, us per call")
        for size, measured in rows:
            print(size + ": " + ", ".join(f"{name} {us:.1f}" for name, us in measured.items()))


if __name__ == "__main__":
    main()
