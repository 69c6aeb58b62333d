"""Where the time of a reproducible sum goes, against the ordinary sum, side by side in one run.

    mpiallreduce launch -n 2 -- python benchmarks/reproducible_cost.py [--mib 64]
    mpiallreduce launch -n 2 -- python benchmarks/reproducible_cost.py
        --direct-sizes 4K,64K,1M,4M,16M

For a float32 sum of --mib MiB (default 64), each a median over 5 interleaved repetitions of the
slowest rank's time:
- the ordinary sum: auto, and pairwise_exchange (the messages of the direct route);
- the reproducible sum: auto (the direct route: pairwise_exchange, each rank summing its slice
  exactly from the p floats), and the words route (ring_pipelined reducing exponent bytes, then
  int64 words);
- the direct route's exact sums alone: each rank's exact_sum_into on p slices of n/p elements
  (compiled where numba is installed, else numpy passes), against numpy adding the same slices:
  what the direct route costs beyond the ordinary sum's messages.

With --direct-sizes: the two algorithms of the direct route, shared_memory and pairwise_exchange,
for reproducible sums of each size (medians of 15 interleaved repetitions, 101 up to 1 MiB): where
mpiallreduce.core.overrides' REPRODUCIBLE_SHARED_MEMORY_BELOW comes from.
"""

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.reproducible import routes
from mpiallreduce.tools.arguments import size_list

COMM = MPI.COMM_WORLD
REPETITIONS = 5


def timed(call):
    COMM.Barrier()
    start = time.perf_counter()
    call()
    return COMM.allreduce(time.perf_counter() - start, op=MPI.MAX)


def print_medians(header, times):
    """Print ``header`` and each contender's median time in ms (``times``: name -> seconds); returns
    the medians, in ms."""
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(header)
    for name, ms in median.items():
        print(f"{name:>12} {ms:9.3f}")
    return median


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=64)
    parser.add_argument(
        "--direct-sizes",
        type=size_list,
        help="compare the direct route's algorithms at these sizes (4K,1M,...)",
    )
    args = parser.parse_args()
    if args.direct_sizes:
        compare_direct_route(args.direct_sizes)
        return
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
        "ordinary sum (pairwise_exchange)": lambda: mar.allreduce(
            x, out=out, algorithm="pairwise_exchange"
        ),
        "reproducible sum (auto: direct route)": lambda: mar.allreduce(
            x, out=out, reproducible=True
        ),
        "reproducible sum (words route)": lambda: mar.allreduce(
            x, out=out, reproducible=True, algorithm="ring_pipelined"
        ),
        "  exact sums of a rank's slice alone": lambda: routes.exact_sum_into(slices, slice_out),
        "  numpy adding the same slices": numpy_adds,
    }
    times = {name: [] for name in contenders}
    for _ in range(REPETITIONS):
        for name, call in contenders.items():
            times[name].append(timed(call))
    if COMM.Get_rank() == 0:
        base = statistics.median(times["ordinary sum (auto)"])
        from mpiallreduce.reproducible import kernels as reproducible_kernels

        print(
            f"# {size} ranks, float32 sum of {args.mib:g} MiB; median of {REPETITIONS} interleaved "
            "repetitions, slowest rank; exact sums "
            + (
                "compiled (numba)"
                if reproducible_kernels.available()
                else "in numpy passes (no numba)"
            )
        )
        for name, seconds in times.items():
            median = statistics.median(seconds)
            print(f"{name:<40} {median * 1e3:9.1f} ms  {median / base:6.2f}x")


def compare_direct_route(sizes):
    for nbytes in sizes:
        x = (
            np.random.default_rng([COMM.Get_rank(), nbytes])
            .standard_normal(nbytes // 4)
            .astype(np.float32)
        )
        out = np.empty_like(x)
        names = ("shared_memory", "pairwise_exchange")
        times = {name: [] for name in names}
        for _ in range(101 if nbytes <= 1 << 20 else 15):
            for name in names:
                times[name].append(
                    timed(
                        lambda x=x, out=out, name=name: mar.allreduce(
                            x, out=out, algorithm=name, reproducible=True
                        )
                    )
                )
        if COMM.Get_rank() == 0:
            medians = {name: statistics.median(seconds) * 1e3 for name, seconds in times.items()}
            print(
                f"{nbytes:>10} B  "
                + "  ".join(f"{name} {ms:8.3f} ms" for name, ms in medians.items())
                + "  shared_memory / pairwise_exchange "
                f"{medians['shared_memory'] / medians['pairwise_exchange']:.2f}"
            )


if __name__ == "__main__":
    main()
