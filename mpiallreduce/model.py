"""``mpiallreduce model RESULTS``: fit the cost model to a bench run and project to many ranks.

Each algorithm's time is modelled as  T = a*alpha + b*beta + c*gamma  (FIELD.md; Thakur,
Rabenseifner & Gropp 2005), with alpha the latency of one message, beta the time per byte moved
and gamma the time per byte reduced, and (a, b, c) counted from the algorithm for p ranks and n
bytes (``cost_terms``). The fit finds the non-negative alpha, beta, gamma that best explain the
measured times of our algorithms (least squares on relative error). The projection then replaces
alpha and beta by the network the user describes (--latency-us, --bandwidth-gbs) and keeps the
measured gamma (this machine's reduction speed): how each algorithm would fare on thousands of ranks.
"""
import itertools
import math

import numpy as np

from .arguments import ArgumentParser, size_list

__all__ = ["cost_terms", "fit", "project", "main"]

MODELLED = ("ring", "ring_pipelined", "rabenseifner", "recursive_doubling", "reduce_bcast")


def _log2(p):
    return math.log2(p) if p > 1 else 0.0


def _fold_terms(p, n):
    """Extra cost of folding a non-power-of-two rank count in and out (power_of_two.py)."""
    if p & (p - 1) == 0:
        return 0.0, 0.0, 0.0
    return 2.0, 2.0 * n, 1.0 * n


def cost_terms(algorithm, p, n, segment_bytes=1 << 20):
    """(messages, bytes moved, bytes reduced) on the critical path for ``n`` bytes on ``p`` ranks."""
    if p <= 1:
        return 0.0, 0.0, 0.0
    if algorithm == "ring":
        return 2.0 * (p - 1), 2.0 * n * (p - 1) / p, n * (p - 1) / p
    if algorithm == "ring_pipelined":
        segments = max(1, math.ceil(n / p / segment_bytes))
        return (p - 1) * (segments + 1.0), 2.0 * n * (p - 1) / p, n * (p - 1) / p
    pof2 = 1 << (p.bit_length() - 1)
    fa, fb, fc = _fold_terms(p, n)
    if algorithm == "rabenseifner":
        return 2 * _log2(pof2) + fa, 2.0 * n * (pof2 - 1) / pof2 + fb, n * (pof2 - 1) / pof2 + fc
    if algorithm == "recursive_doubling":
        return _log2(pof2) + fa, n * _log2(pof2) + fb, n * _log2(pof2) + fc
    if algorithm == "reduce_bcast":
        steps = math.ceil(_log2(p))
        return 2.0 * steps, 2.0 * n * steps, 1.0 * n * steps
    raise ValueError(f"no cost model for {algorithm!r}")


def fit(measurements):
    """(alpha s, beta s/B, gamma s/B, median relative error) from dicts with ranks, nbytes, algorithm, time_us."""
    rows, times = [], []
    for m in measurements:
        if m["algorithm"] in MODELLED and not m["in_place"] and m["ranks"] > 1:
            rows.append(cost_terms(m["algorithm"], m["ranks"], m["nbytes"]))
            times.append(m["time_us"] * 1e-6)
    if not rows:
        raise ValueError("no measurements of modelled algorithms (out of place, 2 or more ranks)")
    terms, times = np.array(rows), np.array(times)
    weighted = terms / times[:, None]  # relative error: every size counts alike
    best = None
    for active in itertools.chain.from_iterable(itertools.combinations(range(3), k) for k in (3, 2, 1)):
        coefficients = np.zeros(3)
        solution, *_ = np.linalg.lstsq(weighted[:, active], np.ones(len(times)), rcond=None)
        if np.any(solution < 0):
            continue
        coefficients[list(active)] = solution
        error = float(np.median(np.abs(terms @ coefficients / times - 1)))
        if best is None or error < best[3]:
            best = (*coefficients, error)
    return best


def project(algorithm, p, n, alpha, beta, gamma):
    a, b, c = cost_terms(algorithm, p, n)
    return a * alpha + b * beta + c * gamma


def main(argv=None):
    from .plot import load_results

    parser = ArgumentParser(prog="mpiallreduce model", description=__doc__.split("\n")[0])
    parser.add_argument("results", help="a results folder of `mpiallreduce bench --output` (or its bench.json)")
    parser.add_argument("--latency-us", type=float, default=2.0, help="network latency per message (default 2 us)")
    parser.add_argument("--bandwidth-gbs", type=float, default=12.5, help="per-link bandwidth (default 12.5 GB/s)")
    parser.add_argument("--ranks", default="8,64,512,4096")
    parser.add_argument("--sizes", type=size_list, default=[4 << 10, 1 << 20, 64 << 20, 1 << 30])
    args = parser.parse_args(argv)
    alpha, beta, gamma, error = fit(load_results(args.results)["measurements"])
    print(f"# fitted on this machine: alpha = {alpha * 1e6:.2f} us per message, beta = "
          f"{1 / beta / 1e9 if beta else float('inf'):.2f} GB/s, gamma = {1 / gamma / 1e9 if gamma else float('inf'):.2f} "
          f"GB/s reduced; median relative error {error:.0%}")
    net_alpha, net_beta = args.latency_us * 1e-6, 1 / (args.bandwidth_gbs * 1e9)
    print(f"# projected: alpha = {args.latency_us} us, {args.bandwidth_gbs} GB/s per link, gamma as measured")
    ranks = [int(r) for r in args.ranks.split(",")]
    sizes = args.sizes
    print(f"{'ranks':>6} {'bytes':>11} " + " ".join(f"{a:>19}" for a in MODELLED) + f" {'fastest':>19}")
    for p in ranks:
        for n in sizes:
            times = {a: project(a, p, n, net_alpha, net_beta, gamma) for a in MODELLED}
            print(f"{p:>6} {n:>11} " + " ".join(f"{times[a] * 1e6:>16.1f} us" for a in MODELLED)
                  + f" {min(times, key=times.get):>19}")
    return 0
