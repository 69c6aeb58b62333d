"""What a call costs through the public API, against mpi4py's raw MPI_Allreduce in the same run: the
program each launch of benchmarks/side_by_side.py runs (it uses nothing but the public API, so the
same file measures an older commit of the package too).

    mpiallreduce launch -n 2 [--nodes 2] -- python benchmarks/call_price.py

Prints one JSON line (rank 0): for 4 B, 4 KiB and 64 KiB of float32, the median over interleaved
repetitions of the slowest rank's microseconds per call of: raw ``comm.Allreduce``,
``mar.allreduce(x, out=out)`` (auto, repeated: the short path), ``mar.allreduce(...,
algorithm="mpi")`` and a prepared call ``mar.prepare(x, out=out)()``.
"""

import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

COMM = MPI.COMM_WORLD
REPETITIONS = 7
SIZES = {"4 B": (1, 3000), "4 KiB": (1024, 2000), "64 KiB": (16384, 400)}


def per_call(call, iterations):
    COMM.Barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    return COMM.allreduce((time.perf_counter() - start) / iterations, op=MPI.MAX)


def main():
    results = {}
    for label, (count, iterations) in SIZES.items():
        x = np.arange(count, dtype=np.float32) + COMM.Get_rank()
        out = np.empty_like(x)
        prepared = mar.prepare(x, out=out)
        contenders = {
            "raw": lambda x=x, out=out: COMM.Allreduce(x, out),
            "auto": lambda x=x, out=out: mar.allreduce(x, out=out),
            "mpi": lambda x=x, out=out: mar.allreduce(x, out=out, algorithm="mpi"),
            "prepared": prepared,
        }
        for call in contenders.values():  # warm up: states, plans, short paths, windows
            for _ in range(20):
                call()
        times = {name: [] for name in contenders}
        for _ in range(REPETITIONS):
            for name, call in contenders.items():
                times[name].append(per_call(call, iterations))
        results[label] = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        expected = np.arange(count, dtype=np.float32) * COMM.Get_size() + sum(
            range(COMM.Get_size())
        )
        assert np.array_equal(mar.allreduce(x), expected), "wrong values"
    if COMM.Get_rank() == 0:
        print("RESULT " + json.dumps({"ranks": COMM.Get_size(), "us": results}))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
