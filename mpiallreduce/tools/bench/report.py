"""The tables: nccl-tests' columns, Deep Speech 2's gains, and the CSV and JSON files."""

import csv
import json
import os
from dataclasses import asdict, fields

from .contenders import AUTO_PLAIN, BASELINE, FORCED_PREFIX, REPRODUCIBLE, REPRODUCIBLE_SYMMETRIC

__all__ = [
    "format_field_table",
    "gain_rows",
    "format_gain_table",
    "write_results",
    "within_noise",
    "of_bound",
]


def format_field_table(results, memcpy_gbs=None, wide=False, failed=()):
    """nccl-tests' columns, one row per (size, mode, algorithm), under 120 characters; ``wide``: and
    busbw as a share of the one-core memory copy bandwidth ``memcpy_gbs``; each of ``failed`` (a
    contender that raised at a size: mpiallreduce.tools.bench.timing.compare) a FAILED row."""
    share = wide and memcpy_gbs is not None
    lines = [
        f"{'size(B)':>10} {'count':>10} {'type':>8} {'op':>5} {'place':>6} {'algorithm':>26} "
        f"{'time(us)':>11} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7} {'bound':>5}"
        + (f" {'busbw/memcpy':>12}" if share else "")
    ]
    for m in results:
        lines.append(
            f"{m.nbytes:>10} {m.count:>10} {m.dtype:>8} {m.op:>5} "
            f"{'in' if m.in_place else 'out':>6} {m.algorithm:>26} {m.time_us:>11.1f} "
            f"{m.algbw_gbs:>11.3f} {m.busbw_gbs:>11.3f} {m.wrong:>7} "
            f"{of_bound(m.bound_us, m.time_us)}"
            + (f" {m.busbw_gbs / memcpy_gbs:>11.0%}" if share else "")
        )
    for f in failed:
        lines.append(
            f"{f['nbytes']:>10} {'':>10} {'':>8} {'':>5} {'in' if f['in_place'] else 'out':>6} "
            f"{f['algorithm']:>26} FAILED: {f['error'][:200]}"
        )
    return "\n".join(lines)


def of_bound(bound_us, time_us):
    """The bound's time as a share of ``time_us`` (100%: at the bound), 5 characters; "-" without
    one."""
    return f"{bound_us / time_us:>5.0%}" if bound_us else f"{'-':>5}"


def noise_range(m):
    """(low, high) of a measurement's time: the middle half of its repetitions (first and third
    quartile), or in results from before those were kept the fastest and slowest repetition; None
    without either."""
    for low, high in (("time_us_q1", "time_us_q3"), ("time_us_low", "time_us_high")):
        spread = getattr(m, low, None), getattr(m, high, None)
        if None not in spread:
            return spread
    return None


def within_noise(a, b):
    """Whether two measurements' ranges (noise_range) overlap: then the gain between them is
    smaller than the spread it was measured with and says nothing ("same within the noise"). None
    when a measurement has no range."""
    ranges = noise_range(a), noise_range(b)
    if None in ranges:
        return None
    (low_a, high_a), (low_b, high_b) = ranges
    return low_a <= high_b and low_b <= high_a


#: ours, but not counted as "ours" for the best: "mpi" is Open MPI's allreduce behind our wrapper,
#: "auto" picks one of the others; reproducible sums have a table of their own
NOT_HAND_WRITTEN = ("mpi", "auto", AUTO_PLAIN, REPRODUCIBLE, REPRODUCIBLE_SYMMETRIC)


def gain_rows(results, in_place=False):
    """Deep Speech 2's table: per (ranks, bytes) Open MPI's default time, our best algorithm's, the
    gain; and Open MPI's best forced algorithm, so a gain over the default is not mistaken for one
    over Open MPI. ``results``: Measurements, or anything with their attributes."""
    rows = []
    here_mode = [m for m in results if m.in_place == in_place]
    for ranks, nbytes in sorted({(m.ranks, m.nbytes) for m in here_mode}):
        here = [m for m in here_mode if (m.ranks, m.nbytes) == (ranks, nbytes)]
        baseline = next(m for m in here if m.algorithm == BASELINE)
        forced = [m for m in here if m.algorithm.startswith(FORCED_PREFIX)]
        ours = [
            m for m in here if m.algorithm != BASELINE and not m.algorithm.startswith(FORCED_PREFIX)
        ]
        if not ours:  # (Open MPI's alone: nothing to compare)
            continue
        hand_written = [
            m for m in ours if m.algorithm not in NOT_HAND_WRITTEN
        ] or ours  # (where only those ran, the best of them: the table's header says so)
        best = min(hand_written, key=lambda m: m.time_us)
        best_forced = min(forced, key=lambda m: m.time_us) if forced else None
        auto = next((m for m in ours if m.algorithm == "auto"), None)
        rows.append(
            {
                "ranks": ranks,
                "nbytes": nbytes,
                "in_place": in_place,
                "openmpi_us": baseline.time_us,
                "ours_us": best.time_us,
                "ours_algorithm": best.algorithm,
                "gain": baseline.time_us / best.time_us,
                "auto_gain": baseline.time_us / auto.time_us if auto else None,
                "openmpi_best_forced_us": best_forced.time_us if best_forced else None,
                "openmpi_best_forced": best_forced.algorithm[len(FORCED_PREFIX) :]
                if best_forced
                else None,
                "gain_over_best_forced": best_forced.time_us / best.time_us
                if best_forced
                else None,
                "openmpi_busbw_gbs": baseline.busbw_gbs,
                "ours_busbw_gbs": best.busbw_gbs,
                "bound_us": getattr(baseline, "bound_us", None),
                "gain_by_algorithm": {m.algorithm: baseline.time_us / m.time_us for m in ours},
                # (gains within the repetitions' spread: "same" in the tables, hollow in the plots)
                "noise_by_algorithm": {m.algorithm: within_noise(baseline, m) for m in ours},
                "forced_noise": within_noise(best_forced, best) if best_forced else None,
            }
        )
    return rows


def _gain(value, noise=None):
    """A gain cell: the number, or "same" where the two are the same within the noise."""
    if value is None:
        return f"{'-':>6} "
    return f"{'same':>6} " if noise else f"{value:>5.2f}x "


def _noise(row, algorithm):
    return row.get("noise_by_algorithm", {}).get(algorithm)


#: the table's first line: what each column holds (issue 58: "best of ours" left out auto and mpi
#: without saying so)
COLUMNS_SAID = (
    "gain: Open MPI's default time / the column's; \"same\": the same within the noise (the\n"
    "middle halves of the two's repetitions overlap). best of ours: the fastest hand-written\n"
    "algorithm (not auto, not mpi, unless only those ran). auto: auto's gain. OMPI best forced:\n"
    "Open MPI's fastest algorithm forced (or its persistent allreduce), and ours against it.\n"
    "bound: the memory bound's time / ours."
)


def format_gain_table(rows, wide=False):
    """One line per (ranks, bytes), at most 120 characters; ``wide``: and both busbw. With the nodes
    and Open MPI's default component ("coll": tuned, han) when the rows carry them (mpiallreduce
    report). Each algorithm's gain is in the JSON and the gain figure. A gain within the noise
    (within_noise) says "same"."""
    nodes = any("nodes" in r for r in rows)
    lines = [
        COLUMNS_SAID,
        (f"{'nodes':>5} {'ranks':>5} {'coll':>5} " if nodes else f"{'ranks':>5} ")
        + f"{'bytes':>10} {'Open MPI(us)':>12} {'ours(us)':>9} {'best of ours':>17} {'gain':>6}  "
        f"{'auto':>6}   {'OMPI best forced':>18} {'(us)':>8} {'gain':>6} {'bound':>5}"
        + (f" | {'busbw ours/OMPI (GB/s)':>22}" if wide else ""),
    ]
    for r in rows:
        forced = (
            f"{r['openmpi_best_forced']:>18} {r['openmpi_best_forced_us']:>8.1f} "
            f"{_gain(r['gain_over_best_forced'], r.get('forced_noise'))}"
            if r["openmpi_best_forced"]
            else f"{'-':>18} {'-':>8} {'-':>6} "
        )
        layout = (
            f"{r['nodes']:>5} {r['ranks']:>5} {r.get('openmpi_default') or '?':>5} "
            if nodes
            else f"{r['ranks']:>5} "
        )
        lines.append(
            layout + f"{r['nbytes']:>10} {r['openmpi_us']:>12.1f} {r['ours_us']:>9.1f} "
            f"{r['ours_algorithm']:>17} {_gain(r['gain'], _noise(r, r['ours_algorithm']))} "
            f"{_gain(r.get('auto_gain'), _noise(r, 'auto'))}  "
            f"{forced}{of_bound(r.get('bound_us'), r['ours_us'])}"
            + (f" | {r['ours_busbw_gbs']:>10.3f} / {r['openmpi_busbw_gbs']:<9.3f}" if wide else "")
        )
    return "\n".join(lines)


def write_results(directory, results, metadata, memcpy_gbs, failed=()):
    """bench.csv (a header row, then one row per measurement: what csv.DictReader and pandas read)
    and bench.json (metadata, measurements, gain tables, and "failed": the contenders that raised,
    with their errors, at the sizes where they did)."""
    os.makedirs(directory, exist_ok=True)
    columns = [f.name for f in (fields(results[0]) if results else ())] + ["busbw_share_of_memcpy"]
    with open(os.path.join(directory, "bench.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for m in results:
            writer.writerow([getattr(m, c) for c in columns[:-1]] + [m.busbw_gbs / memcpy_gbs])
    modes = sorted({m.in_place for m in results})
    with open(os.path.join(directory, "bench.json"), "w") as f:
        json.dump(
            {
                "metadata": metadata,
                "memcpy_gbs": memcpy_gbs,
                "measurements": [asdict(m) for m in results],
                "failed": list(failed),
                "gains": {
                    ("in_place" if mode else "out_of_place"): gain_rows(results, mode)
                    for mode in modes
                },
            },
            f,
            indent=1,
        )
