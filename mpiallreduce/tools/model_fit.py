"""The cost model's arithmetic: the counts on each algorithm's critical path (messages and bytes
within a node and over the network, bytes reduced) and the fit of their five constants to bench
rows.

The model itself, and why it counts what it counts, is ``mpiallreduce model``'s (model.py).
"""

import functools
import itertools
import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "CONSTANTS",
    "MODELLED",
    "FLAT",
    "INNER_SWITCH_BYTES",
    "cost_terms",
    "project",
    "Row",
    "fit",
    "fitted_rows",
]

MODELLED = (
    "ring",
    "ring_pipelined",
    "rabenseifner",
    "recursive_doubling",
    "reduce_bcast",
    "hierarchical",
    "two_level",
)
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
            terms.step(_exchange_pairs(pof2, d), n / 2**j)
        for j, d in reversed(list(enumerate(distances, start=1))):  # allgather: the same in reverse
            terms.step(_exchange_pairs(pof2, d), n / 2**j)
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
    critical path of ``algorithm`` for ``n`` bytes on ``p`` ranks over ``nodes`` nodes (by
    block)."""
    if p <= 1:
        return np.zeros(5)
    rpn = math.ceil(p / nodes)
    if algorithm in FLAT:
        return _flat_terms(algorithm, p, n, rpn, segment_bytes)
    local = np.zeros(5)
    if (
        algorithm == "hierarchical"
    ):  # binomial reduce to the leader, leaders' allreduce, binomial bcast
        steps = math.ceil(_log2(rpn))
        local[[0, 1, 4]] = (2.0 * steps, 2.0 * n * steps, 1.0 * n * steps)
        return local + _inner(nodes, n, segment_bytes)
    if (
        algorithm == "two_level"
    ):  # reduce-scatter in the node, rpn rails at once, allgather in the node
        local[[0, 1, 4]] = (2.0 * (rpn - 1), 2.0 * n * (rpn - 1) / rpn, 1.0 * n * (rpn - 1) / rpn)
        rails = _inner(nodes, n / rpn, segment_bytes)
        rails[3] *= rpn  # the node's rpn rails share its link
        return local + rails
    raise ValueError(f"no cost model for {algorithm!r}")


class Row(NamedTuple):
    """One measured time and what the model counts for it."""

    layout: tuple[int, int]  # (nodes, ranks)
    algorithm: str
    nbytes: int
    terms: np.ndarray
    seconds: float
    #: (ranks, cores) of a machine that ran more ranks than cores, else None
    oversubscribed: tuple[int, int] | None = None


def _rows(runs):
    """A Row for every modelled measurement (out of place, 2 or more ranks) of ``runs``."""
    from .results import run_nodes, run_oversubscribed

    rows = []
    for _path, results in runs:
        nodes, crowded = run_nodes(results), run_oversubscribed(results)
        for m in results["measurements"]:
            if m["algorithm"] in MODELLED and not m["in_place"] and m["ranks"] > 1:
                rows.append(
                    Row(
                        (nodes, m["ranks"]),
                        m["algorithm"],
                        m["nbytes"],
                        cost_terms(m["algorithm"], m["ranks"], m["nbytes"], nodes),
                        m["time_us"] * 1e-6,
                        tuple(crowded) if crowded else None,
                    )
                )
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


def fitted_rows(rows):
    """The rows to fit: those of runs that had a core per rank (all rows if no run had)."""
    return [r for r in rows if not r.oversubscribed] or rows
