"""``mpiallreduce model RESULTS...``: fit a two-level cost model to bench runs and project it to many ranks.

Each algorithm's time is modelled as (docs/field-notes.md; Thakur, Rabenseifner & Gropp 2005, with the
network split from the node as in Hockney's model applied per level)

    T = a_node*alpha_node + b_node*beta_node + a_net*alpha_net + b_net*beta_net + c*gamma

alpha: the latency of one message, beta: the time per byte on one link, each within a node
(shared memory) and between nodes (the network); gamma: the time per byte reduced. The counts
(a, b, c) come from the algorithm's steps for p ranks on N nodes of p/N ranks each, placed by block
(``cost_terms``). A step whose pairs all stay within a node costs node terms; a step in which some
pair crosses costs network terms, with the bytes of every rank of a node that crosses at once
(they share the node's link: recursive doubling across nodes sends p/N copies of the buffer over
it, the ring one, ``two_level`` p/N shards). Node leaders (``hierarchical``) and rails
(``two_level``) are modelled running recursive doubling below 64 KiB and Rabenseifner above, the
tuning table's usual choice.

The fit finds the non-negative constants that best explain the measured times of our algorithms
(least squares on relative error), from runs on one node and across nodes together; a constant
no run shows is reported as not resolved. Runs with more ranks than cores on a machine (their
metadata says so) are left out of the fit, and their rows still compared with it. It then says how far it is off, per layout, and for
each cross-node row. The projection keeps this machine's node constants and gamma and replaces
the network by the one the user names (--latency-us, --bandwidth-gbs): how every algorithm would
fare on 64 to 4096 ranks of --ranks-per-node each, as a table and a figure (model.png).
"""
import functools
import itertools
import math
import os
from typing import NamedTuple, Optional, Tuple

import numpy as np

from .arguments import ArgumentParser, size_list

__all__ = ["CONSTANTS", "MODELLED", "cost_terms", "fit", "project", "main"]

MODELLED = ("ring", "ring_pipelined", "rabenseifner", "recursive_doubling", "reduce_bcast", "hierarchical",
            "two_level")
FLAT = MODELLED[:5]
CONSTANTS = ("alpha_node", "beta_node", "alpha_net", "beta_net", "gamma")
#: leaders and rails: recursive doubling below this many bytes, Rabenseifner from it
INNER_SWITCH_BYTES = 64 << 10


def _log2(p):
    return math.log2(p) if p > 1 else 0.0


@functools.lru_cache(maxsize=4096)
def _link_load(pairs, ranks_per_node):
    """How many of one node's ranks send across its link at once in a step of (sender, receiver)
    pairs (the busiest node's count; 0: the step stays within nodes)."""
    if not pairs:
        return 0
    senders, receivers = np.array(pairs).T
    crossing = senders // ranks_per_node != receivers // ranks_per_node
    return int(np.bincount(senders[crossing] // ranks_per_node).max()) if crossing.any() else 0


@functools.lru_cache(maxsize=256)
def _exchange_pairs(pof2, distance):
    return tuple((r, r ^ distance) for r in range(pof2))


@functools.lru_cache(maxsize=256)
def _binomial_pairs(p, distance):
    return tuple((r, r - distance) for r in range(p) if r % (2 * distance) == distance)


class _Terms:
    """Accumulates the five counts, step by step."""

    def __init__(self, ranks_per_node):
        self.rpn = ranks_per_node
        self.counts = np.zeros(5)

    def step(self, pairs, nbytes, messages=1.0, times=1):
        load = _link_load(pairs, self.rpn)
        if load:
            self.counts[2:4] += (times * messages, times * nbytes * load)
        else:
            self.counts[0:2] += (times * messages, times * nbytes)

    def reduce(self, nbytes):
        self.counts[4] += nbytes


def _fold(terms, p, pof2, n):
    """Folding the ranks beyond a power of two in and out (power_of_two.py): pairs (2i, 2i+1)."""
    if p == pof2:
        return
    pairs = tuple((2 * i + 1, 2 * i) for i in range(p - pof2))
    terms.step(pairs, n)
    terms.reduce(n)
    terms.step(tuple((b, a) for a, b in pairs), n)


def _flat_terms(algorithm, p, n, rpn, segment_bytes):
    terms = _Terms(rpn)
    pof2 = 1 << (p.bit_length() - 1)
    if algorithm in ("ring", "ring_pipelined"):
        neighbours = tuple((r, (r + 1) % p) for r in range(p))
        messages = 1.0  # per step; the pipelined ring's segments add (segments + 1)/2 on average
        if algorithm == "ring_pipelined":
            messages = (max(1, math.ceil(n / p / segment_bytes)) + 1) / 2.0
        terms.step(neighbours, n / p, messages, times=2 * (p - 1))
        terms.reduce(n * (p - 1) / p)
    elif algorithm == "recursive_doubling":
        _fold(terms, p, pof2, n)
        for k in range(int(_log2(pof2))):
            terms.step(_exchange_pairs(pof2, 1 << k), n)
            terms.reduce(n)
    elif algorithm == "rabenseifner":
        _fold(terms, p, pof2, n)
        distances = [pof2 >> j for j in range(1, int(_log2(pof2)) + 1)]
        for j, d in enumerate(distances, start=1):  # reduce-scatter: halves, quarters, ...
            terms.step(_exchange_pairs(pof2, d), n / 2 ** j)
        for j, d in reversed(list(enumerate(distances, start=1))):  # allgather: the same in reverse
            terms.step(_exchange_pairs(pof2, d), n / 2 ** j)
        terms.reduce(n * (pof2 - 1) / pof2)
    elif algorithm == "reduce_bcast":
        for k in range(math.ceil(_log2(p))):  # binomial reduce, then the same tree down
            terms.step(_binomial_pairs(p, 1 << k), n)
            terms.reduce(n)
        for k in range(math.ceil(_log2(p))):
            terms.step(_binomial_pairs(p, 1 << k), n)
    else:
        raise ValueError(f"no cost model for {algorithm!r}")
    return terms.counts


def _inner(nodes, n, segment_bytes):
    """Terms of the allreduce among one rank per node (leaders, or one rail)."""
    algorithm = "recursive_doubling" if n < INNER_SWITCH_BYTES else "rabenseifner"
    return _flat_terms(algorithm, nodes, n, 1, segment_bytes) if nodes > 1 else np.zeros(5)


def cost_terms(algorithm, p, n, nodes=1, segment_bytes=1 << 20):
    """(messages and bytes within a node, messages and bytes over the network, bytes reduced) on the
    critical path of ``algorithm`` for ``n`` bytes on ``p`` ranks over ``nodes`` nodes (by block)."""
    if p <= 1:
        return np.zeros(5)
    rpn = math.ceil(p / nodes)
    if algorithm in FLAT:
        return _flat_terms(algorithm, p, n, rpn, segment_bytes)
    local = np.zeros(5)
    if algorithm == "hierarchical":  # binomial reduce to the leader, leaders' allreduce, binomial bcast
        steps = math.ceil(_log2(rpn))
        local[[0, 1, 4]] = (2.0 * steps, 2.0 * n * steps, 1.0 * n * steps)
        return local + _inner(nodes, n, segment_bytes)
    if algorithm == "two_level":  # reduce-scatter in the node, rpn rails at once, allgather in the node
        local[[0, 1, 4]] = (2.0 * (rpn - 1), 2.0 * n * (rpn - 1) / rpn, 1.0 * n * (rpn - 1) / rpn)
        rails = _inner(nodes, n / rpn, segment_bytes)
        rails[3] *= rpn  # the node's rpn rails share its link
        return local + rails
    raise ValueError(f"no cost model for {algorithm!r}")


class Row(NamedTuple):
    """One measured time and what the model counts for it."""
    layout: Tuple[int, int]  # (nodes, ranks)
    algorithm: str
    nbytes: int
    terms: np.ndarray
    seconds: float
    #: (ranks, cores) of a machine that ran more ranks than cores, else None
    oversubscribed: Optional[Tuple[int, int]] = None


def _rows(runs):
    """A Row for every modelled measurement (out of place, 2 or more ranks) of ``runs``."""
    from .results import run_nodes, run_oversubscribed
    rows = []
    for _path, results in runs:
        nodes, crowded = run_nodes(results), run_oversubscribed(results)
        for m in results["measurements"]:
            if m["algorithm"] in MODELLED and not m["in_place"] and m["ranks"] > 1:
                rows.append(Row((nodes, m["ranks"]), m["algorithm"], m["nbytes"],
                                cost_terms(m["algorithm"], m["ranks"], m["nbytes"], nodes), m["time_us"] * 1e-6,
                                tuple(crowded) if crowded else None))
    return rows


def fit(rows):
    """(the five constants in seconds and seconds per byte, median relative error) that explain the
    Rows best; a constant no row depends on is 0."""
    if not rows:
        raise ValueError("no measurements of modelled algorithms (out of place, 2 or more ranks)")
    terms = np.array([r.terms for r in rows])
    times = np.array([r.seconds for r in rows])
    weighted = terms / times[:, None]  # relative error: every size counts alike
    shown = [i for i in range(5) if terms[:, i].any()]
    best = None
    for k in range(len(shown), 0, -1):
        for active in itertools.combinations(shown, k):
            solution, *_ = np.linalg.lstsq(weighted[:, active], np.ones(len(times)), rcond=None)
            if np.any(solution < 0):
                continue
            constants = np.zeros(5)
            constants[list(active)] = solution
            error = float(np.median(np.abs(terms @ constants / times - 1)))
            if best is None or error < best[1]:
                best = (constants, error)
    return best


def project(algorithm, p, n, constants, nodes=1):
    return float(cost_terms(algorithm, p, n, nodes) @ constants)


def _duration(seconds):
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e6:.3g} us"


def _describe(constants, level):
    alpha, beta = (constants[0], constants[1]) if level == "node" else (constants[2], constants[3])
    latency = f"alpha = {alpha * 1e6:.2f} us per message" if alpha else "alpha not resolved (fitted to 0)"
    bandwidth = f"beta = {1 / beta / 1e9:.2f} GB/s" if beta else "beta not resolved (fitted to 0)"
    return f"{latency}, {bandwidth}"


def _layout_name(layout):
    nodes, ranks = layout
    per = ranks // nodes if ranks % nodes == 0 else f"{ranks / nodes:.1f}"
    return f"{nodes} node{'s' if nodes > 1 else ''} x {per} rank{'s' if per != 1 else ''}"


def _off(row, constants):
    return float(row.terms @ constants / row.seconds - 1)


def fitted_rows(rows):
    """The rows to fit: those of runs that had a core per rank (all rows if no run had)."""
    return [r for r in rows if not r.oversubscribed] or rows


def report_fit(rows, constants, error):
    """The fitted constants and how far the model is off, per layout and for each cross-node row."""
    fitted = fitted_rows(rows)
    layouts = sorted({r.layout for r in rows})
    lines = [f"# fitted to {len(fitted)} measurements of {', '.join(_layout_name(l) for l in sorted({r.layout for r in fitted}))}; "
             f"median relative error {error:.0%}"]
    lines.append(f"# within a node:  {_describe(constants, 'node')}")
    if any(nodes > 1 for nodes, _ in layouts):
        lines.append(f"# between nodes:  {_describe(constants, 'net')}")
    else:
        lines.append("# between nodes:  not measured (no run spans nodes: run `mpiallreduce launch --nodes 2 ...`)")
    lines.append(f"# reduction:      gamma = {1 / constants[4] / 1e9:.2f} GB/s reduced" if constants[4]
                 else "# reduction:      gamma not resolved (fitted to 0)")
    for layout in layouts:
        here = [r for r in rows if r.layout == layout]
        off = [_off(r, constants) for r in here]
        worst = int(np.argmax(np.abs(off)))
        crowded = here[0].oversubscribed
        left_out = crowded and len(fitted) < len(rows)  # (fitted_rows keeps every row when all are crowded)
        lines.append(f"#   {_layout_name(layout)}: the model is off by {np.median(np.abs(off)):.0%} (median), worst "
                     f"{off[worst]:+.0%} ({here[worst].algorithm} at {here[worst].nbytes} B)"
                     + (f"; not fitted: {crowded[0]} ranks ran on {crowded[1]} cores" if left_out else ""))
    for layout in (l for l in layouts if l[0] > 1):
        here = [r for r in rows if r.layout == layout]
        names = [a for a in MODELLED if any(r.algorithm == a for r in here)]
        lines.append(f"# {_layout_name(layout)}, predicted/measured - 1 per row:")
        lines.append(f"{'bytes':>11} " + " ".join(f"{a:>18}" for a in names))
        for nbytes in sorted({r.nbytes for r in here}):
            cells = {r.algorithm: f"{_off(r, constants):+.0%}" for r in here if r.nbytes == nbytes}
            lines.append(f"{nbytes:>11} " + " ".join(f"{cells.get(a, '-'):>18}" for a in names))
    return "\n".join(lines)


def projection_table(constants, ranks, sizes, ranks_per_node):
    lines = [f"{'ranks':>6} {'nodes':>6} {'bytes':>11} " + " ".join(f"{a:>18}" for a in MODELLED) + f" {'fastest':>18}"]
    for p in ranks:
        nodes = max(1, p // ranks_per_node)
        for n in sizes:
            times = {a: project(a, p, n, constants, nodes) for a in MODELLED}
            lines.append(f"{p:>6} {nodes:>6} {n:>11} " + " ".join(f"{_duration(times[a]):>18}" for a in MODELLED)
                         + f" {min(times, key=times.get):>18}")
    return "\n".join(lines)


def plot_projection(constants, ranks, sizes, ranks_per_node, network, path):
    """Time against ranks for every algorithm, one panel per size (matplotlib, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plot import _size_label
    counts = sorted({ranks_per_node << k for k in range(1, max(2, math.ceil(_log2(max(ranks) / ranks_per_node))) + 1)}
                    | set(ranks))
    columns = 2 if len(sizes) > 1 else 1
    fig, axes = plt.subplots(math.ceil(len(sizes) / columns), columns, figsize=(10, 3.6 * math.ceil(len(sizes) / columns)),
                             squeeze=False)
    for ax, n in zip(axes.flat, sizes):
        for algorithm in MODELLED:
            ax.plot(counts, [project(algorithm, p, n, constants, max(1, p // ranks_per_node)) for p in counts],
                    marker=".", linestyle="--" if algorithm in ("hierarchical", "two_level") else "-", label=algorithm)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{_size_label(n)}", fontsize=9)
        ax.set_xlabel("ranks")
        ax.set_ylabel("modelled time (s)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(sizes):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"allreduce projected to {network}, {ranks_per_node} ranks per node", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    from .results import ResultsError, find_runs

    parser = ArgumentParser(prog="mpiallreduce model", description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+",
                        help="results folders of `mpiallreduce bench --output` (or folders of them, or bench.json "
                             "files): runs on one node and across nodes are fitted together")
    parser.add_argument("--latency-us", type=float, default=2.0, help="network latency per message (default 2 us)")
    parser.add_argument("--bandwidth-gbs", type=float, default=12.5,
                        help="bandwidth of one node's network link (default 12.5 GB/s)")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node of the projection (default 8)")
    parser.add_argument("--ranks", type=size_list, default=[64, 512, 4096], help="rank counts to project to")
    parser.add_argument("--sizes", type=size_list, default=[4 << 10, 1 << 20, 64 << 20, 1 << 30])
    parser.add_argument("--output", metavar="DIR", help="folder for model.png (default: the first results folder)")
    args = parser.parse_args(argv)
    if not args.latency_us > 0 or not args.bandwidth_gbs > 0 or args.ranks_per_node < 1:
        parser.error("--latency-us and --bandwidth-gbs must be positive, --ranks-per-node at least 1")
    try:
        runs = find_runs(args.results)
        rows = _rows(runs)
        constants, error = fit(fitted_rows(rows))
    except (ResultsError, ValueError) as e:
        parser.error(str(e))
    print(report_fit(rows, constants, error))
    projected = constants.copy()
    projected[2:4] = (args.latency_us * 1e-6, 1 / (args.bandwidth_gbs * 1e9))
    network = f"a network of {args.latency_us:g} us and {args.bandwidth_gbs:g} GB/s per node"
    print(f"# projected to {network}, {args.ranks_per_node} ranks per node; within a node and gamma as fitted")
    print(projection_table(projected, args.ranks, args.sizes, args.ranks_per_node))
    first = args.results[0]
    output = args.output or (first if os.path.isdir(first) else os.path.dirname(first) or ".")
    os.makedirs(output, exist_ok=True)
    print(plot_projection(projected, args.ranks, args.sizes, args.ranks_per_node, network,
                          os.path.join(output, "model.png")))
    return 0
