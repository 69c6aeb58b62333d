"""What a reproducible sum costs: its time against our fastest ordinary sum of the same run, on the
same kind of buffers (#28 item 6).

    numpy arrays        "reproducible" (auto: the direct route) against the fastest of our other
                        contenders on numpy arrays (prepared calls, as it is)
    symmetric buffers   "reproducible:symmetric" (single_copy on one node) against the fastest on
                        symmetric buffers (single_copy)

A ratio of times, theirs over the ordinary sum's: 1.25x is a reproducible sum 25% slower.
"""

from ...algorithms import SYMMETRIC_ALGORITHMS
from .contenders import AUTO_PLAIN, BASELINE, FORCED_PREFIX, REPRODUCIBLE, REPRODUCIBLE_SYMMETRIC

__all__ = ["EXACT_CONTENDERS", "reproducible_rows", "format_reproducible_table"]

EXACT_CONTENDERS = (REPRODUCIBLE, REPRODUCIBLE_SYMMETRIC)


def _ordinary(m):
    return not (
        m.algorithm in (BASELINE, AUTO_PLAIN) + EXACT_CONTENDERS
        or m.algorithm.startswith(FORCED_PREFIX)
    )


def reproducible_rows(results, in_place=False):
    """Per (ranks, bytes) that timed a reproducible contender: for numpy arrays and for symmetric
    buffers, the fastest ordinary sum (algorithm, us), the reproducible sum's us and the ratio."""
    rows = []
    here_mode = [m for m in results if m.in_place == in_place]
    for ranks, nbytes in sorted(
        {(m.ranks, m.nbytes) for m in here_mode if m.algorithm in EXACT_CONTENDERS}
    ):
        here = [m for m in here_mode if (m.ranks, m.nbytes) == (ranks, nbytes)]
        row = {"ranks": ranks, "nbytes": nbytes, "in_place": in_place}
        for kind, exact_name, symmetric in (
            ("numpy", REPRODUCIBLE, False),
            ("symmetric", REPRODUCIBLE_SYMMETRIC, True),
        ):
            exact = next((m for m in here if m.algorithm == exact_name), None)
            ordinary = [
                m
                for m in here
                if _ordinary(m) and (m.algorithm in SYMMETRIC_ALGORITHMS) == symmetric
            ]
            if exact is None or not ordinary:
                continue
            best = min(ordinary, key=lambda m: m.time_us)
            row[kind] = {
                "ordinary": best.algorithm,
                "ordinary_us": best.time_us,
                "reproducible_us": exact.time_us,
                "ratio": exact.time_us / best.time_us,
            }
        rows.append(row)
    return rows


def format_reproducible_table(rows):
    """One line per (ranks, bytes), under 120 characters."""
    lines = [
        f"{'ranks':>5} {'bytes':>10} | {'their arrays: fastest':>21} {'(us)':>9} {'exact(us)':>9} "
        f"{'ratio':>6} | {'symmetric: fastest':>18} {'(us)':>9} {'exact(us)':>9} {'ratio':>6}"
    ]
    for r in rows:
        cells = []
        for kind, width in (("numpy", 21), ("symmetric", 18)):
            c = r.get(kind)
            cells.append(
                f"{c['ordinary']:>{width}} {c['ordinary_us']:>9.1f} {c['reproducible_us']:>9.1f} "
                f"{c['ratio']:>5.2f}x"
                if c
                else f"{'-':>{width}} {'-':>9} {'-':>9} {'-':>6}"
            )
        lines.append(f"{r['ranks']:>5} {r['nbytes']:>10} | {cells[0]} | {cells[1]}")
    return "\n".join(lines)
