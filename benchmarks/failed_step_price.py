"""What "a failed step changes no gradient" costs GradientSync, side by side in one run.

    mpiallreduce launch -n 2 -- python benchmarks/failed_step_price.py [--mib 16] [--small 20]
        [--timeout S]

One step of --small small gradients (10,000 float32 each) and one large gradient of --mib MiB, the
median over 9 interleaved repetitions of the slowest rank's time (after a warm-up step each):

- gradsync: GradientSync(parameters=..., timeout=--timeout), as training uses it: the small
  gradients fused in a bucket; the large one, where no rank overlaps and without a timeout, reduced
  in place once the ranks agreed on the step, else copied into a buffer of its own, reduced there
  and copied back at wait(), once every rank's step is known to have succeeded;
- in place: what a step that may change gradients before it fails would cost: the same fused bucket
  (a prepared call on a buffer filled from the gradients and copied back) and the large gradient
  reduced in place, straight into the gradient (mar.allreduce(g, op="mean", out=g));
- the copy alone: np.copyto of the large gradient, what the guarantee adds to it.

Prints each time in ms and gradsync / in place.
"""

import argparse

import numpy as np
from reproducible_cost import (
    COMM,
    print_medians,
    timed,
)  # (the slowest rank's seconds: benchmarks/reproducible_cost.py)

import mpiallreduce as mar

REPETITIONS = 9


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=16.0)
    parser.add_argument("--small", type=int, default=20)
    parser.add_argument(
        "--timeout", type=float, default=None, help="GradientSync's (with one: the buffer's copies)"
    )
    args = parser.parse_args()
    rank = COMM.Get_rank()
    rng = np.random.default_rng(rank)
    large = rng.standard_normal(int(args.mib * 2**20) // 4).astype(np.float32)
    small = [rng.standard_normal(10_000).astype(np.float32) for _ in range(args.small)]
    names = [f"s{i}" for i in range(args.small)] + ["large"]
    grads = small + [large]
    sync = mar.GradientSync(
        parameters=dict(zip(names, grads, strict=True)), bucket_bytes=25 << 20, timeout=args.timeout
    )
    fused = np.empty(sum(g.size for g in small), np.float32)
    prepared = mar.prepare(fused, op="mean", out=fused)

    def gradsync():
        for name, grad in zip(reversed(names), reversed(grads), strict=True):
            sync.ready(grad, name=name)
        sync.wait()

    def in_place():
        np.concatenate(small, out=fused)
        prepared()
        mar.allreduce(large, op="mean", out=large)
        offset = 0
        for g in small:
            g[:] = fused[offset : offset + g.size]
            offset += g.size

    copy_target = np.empty_like(large)
    contenders = {
        "gradsync": gradsync,
        "in place": in_place,
        "copy alone": lambda: np.copyto(copy_target, large),
    }
    times = {name: [] for name in contenders}
    for call in contenders.values():
        call()  # (warm-up: plans, buffers, prepared calls)
    for _ in range(REPETITIONS):
        for name, call in contenders.items():
            times[name].append(timed(call))
    if rank == 0:
        median = print_medians(
            f"# {COMM.Get_size()} ranks, {args.small} x 10,000 float32 + {args.mib:g} MiB float32, "
            f"timeout {args.timeout}; median of {REPETITIONS} interleaved repetitions, "
            "slowest rank, ms",
            times,
        )
        print(
            f"gradsync / in place: {median['gradsync'] / median['in place']:.2f}x "
            f"({median['gradsync'] - median['in place']:+.3f} ms; "
            f"the copy alone {median['copy alone']:.3f} ms)"
        )


if __name__ == "__main__":
    main()
