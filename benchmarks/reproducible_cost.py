"""Where the time of a reproducible sum goes, against the ordinary sum, side by side in one run.

    mpiallreduce launch -n 2 -- python benchmarks/reproducible_cost.py [--mib 64]

For a float32 sum of --mib MiB (default 64), each a median over 5 interleaved repetitions of the
slowest rank's time:
- the ordinary sum: auto, and pairwise_exchange (the messages of the direct route);
- the reproducible sum: auto (the direct route: pairwise_exchange, each rank summing its slice
  exactly from the p floats), and the words route (ring_pipelined reducing exponent bytes, then
  int64 words);
- the direct route's exact sums alone: each rank's exact_sum_into on p slices of n/p elements
  (compiled where numba is installed, else numpy passes), against numpy adding the same slices:
  what the direct route costs beyond the ordinary sum's messages.
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
    size = COMM.Get_size()
    rng = np.random.default_rng(COMM.Get_rank())
    x = rng.standard_normal(count).astype(np.float32)
    out = np.empty_like(x)
    slices = [rng.standard_normal(count // size).astype(np.float32) for _ in range(size)]
    slice_out = np.empty(count // size, np.float32)

    def numpy_adds():
        np.add(slices[0], slices[1], out=slice_out)
        for s in slices[2:]:
            np.add(slice_out, s, out=slice_out)

    contenders = {
        "ordinary sum (auto)": lambda: mar.allreduce(x, out=out),
        "ordinary sum (pairwise_exchange)": lambda: mar.allreduce(x, out=out, algorithm="pairwise_exchange"),
        "reproducible sum (auto: direct route)": lambda: mar.allreduce(x, out=out, reproducible=True),
        "reproducible sum (words route)": lambda: mar.allreduce(x, out=out, reproducible=True,
                                                                algorithm="ring_pipelined"),
        "  exact sums of a rank's slice alone": lambda: reproducible.exact_sum_into(slices, slice_out),
        "  numpy adding the same slices": numpy_adds,
    }
    times = {name: [] for name in contenders}
    for _ in range(REPETITIONS):
        for name, call in contenders.items():
            times[name].append(timed(call))
    if COMM.Get_rank() == 0:
        base = statistics.median(times["ordinary sum (auto)"])
        from mpiallreduce import reproducible_kernels
        print(f"# {size} ranks, float32 sum of {args.mib:g} MiB; median of {REPETITIONS} interleaved "
              "repetitions, slowest rank; exact sums "
              + ("compiled (numba)" if reproducible_kernels.available() else "in numpy passes (no numba)"))
        for name, seconds in times.items():
            median = statistics.median(seconds)
            print(f"{name:<40} {median * 1e3:9.1f} ms  {median / base:6.2f}x")


if __name__ == "__main__":
    main()
