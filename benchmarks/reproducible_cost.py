"""Where the time of a reproducible sum goes, against the ordinary sum, side by side in one run.

    mpiallreduce launch -n 2 -- python benchmarks/reproducible_cost.py [--mib 64]

For a float32 sum of --mib MiB (default 64): the ordinary sum (auto), the reproducible sum, and its
parts timed alone: the conversions (exponent codes, to fixed point, back to float32; compiled by
numba where it is installed, else numpy passes; on each rank) and the communication (the MAX-allreduce of one exponent byte per element and the
SUM-allreduce of one int64 word per element, with the algorithm auto picks for them). The
communication alone is the floor of this design whatever the conversions cost: on a machine where
allreduce is bound by memory bandwidth, 1 + 8 bytes per element against 4. Median over 5
interleaved repetitions of the slowest rank's time, milliseconds.
"""
import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce import reproducible

COMM = MPI.COMM_WORLD
REPETITIONS = 5


def timed(call):
    COMM.Barrier()
    start = time.perf_counter()
    call()
    return COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=64)
    args = parser.parse_args()
    count = int(args.mib * (1 << 20)) // 4
    rng = np.random.default_rng(COMM.Get_rank())
    x = rng.standard_normal(count).astype(np.float32)
    out = np.empty_like(x)
    fmt = reproducible.FORMATS["float32"]
    codes = reproducible.exponent_codes(x, fmt)
    largest = mar.allreduce(codes, op="max")
    words = reproducible.to_words(x, largest, fmt)
    summed = mar.allreduce(words)

    codes_out, words_out = np.empty_like(codes), np.empty_like(words)

    def conversions():  # (into arrays made once, as the reproducible sum's own work arrays are)
        reproducible.exponent_codes(x, fmt, out=codes_out)
        reproducible.to_words(x, largest, fmt, out=words_out)
        reproducible.from_words(summed, largest, fmt, dtype=np.float32, out=out)

    def communication():
        mar.allreduce(codes, op="max", out=largest)
        mar.allreduce(words, out=summed)

    contenders = {
        "ordinary sum (auto)": lambda: mar.allreduce(x, out=out),
        "reproducible sum": lambda: mar.allreduce(x, out=out, reproducible=True),
        "  its conversions alone": conversions,
        "  its two integer allreduces alone": communication,
    }
    times = {name: [] for name in contenders}
    for _ in range(REPETITIONS):
        for name, call in contenders.items():
            times[name].append(timed(call))
    if COMM.Get_rank() == 0:
        base = statistics.median(times["ordinary sum (auto)"])
        from mpiallreduce import reproducible_kernels
        print(f"# {COMM.Get_size()} ranks, float32 sum of {args.mib:g} MiB; median of {REPETITIONS} interleaved "
              "repetitions, slowest rank; conversions "
              + ("compiled (numba)" if reproducible_kernels.available() else "in numpy passes (no numba)"))
        for name, seconds in times.items():
            median = statistics.median(seconds)
            print(f"{name:<36} {median * 1e3:9.1f} ms  {median / base:6.1f}x")


if __name__ == "__main__":
    main()
