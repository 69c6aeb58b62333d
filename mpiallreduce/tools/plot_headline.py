"""headline.png: the answer to the Deep Speech 2 question, whether ours beats Open MPI here.

One column per mode (out of place, in place), two panels each:

    time (µs, log)           Open MPI's default ─ black      auto ─ blue, thick
       against size          Open MPI's best forced, per size ─ grey, dashed
                             our best hand-written, per size ─ orange   the bound ┄ thin
    speed against Open MPI's default (its time / the contender's, log): above 1 faster

Each line carries the middle half of its repetitions as a band; a line breaks where the sweep has
a size it did not measure. "Per size" lines take, at each size, whichever algorithm was fastest
there (the table names it: mpiallreduce.tools.bench.report.gain_rows); "hand-written" leaves out
auto and mpi (Open MPI's own behind our call), as the table's "best of ours" does.
"""

from types import SimpleNamespace

from .bench.contenders import BASELINE, FORCED_PREFIX
from .bench.report import NOT_HAND_WRITTEN, gain_rows
from .plot_axes import (
    legend_outside,
    plot_line,
    plot_series,
    ratio_axis,
    save,
    size_axis,
    spread,
)

__all__ = ["plot_headline", "run_title"]

#: (label, colour, line style, line width) of the headline's four contenders
SERIES = {
    "default": ("Open MPI's default", "black", "-", 2.0),
    "forced": ("Open MPI's best forced algorithm or persistent call, per size", "0.5", "--", 1.5),
    "auto": ("auto (ours, the default)", "tab:blue", "-", 2.6),
    "best": ("our best hand-written algorithm, per size", "tab:orange", "-", 1.5),
}


def run_title(meta):
    """'2 ranks, Open MPI v5.0.9, host; load 0.4 on 2 cores' (what the figure was measured on)."""
    title = (
        f"{meta.get('ranks', '?')} ranks, {str(meta.get('mpi_library', '?')).split(',')[0]}, "
        f"{', '.join(meta.get('hosts', []))}"
    )
    load, cores = meta.get("load_at_start"), meta.get("cores")
    if load and cores:
        title += f"; load {load[0]:.1f} on {cores} cores at the start"
    if meta.get("oversubscribed"):
        title += " (oversubscribed: the scheduler's times)"
    return title


def _picks(measured, in_place):
    """{series: [measurement dict per size]} of one mode, from gain_rows' choices."""
    rows = gain_rows([SimpleNamespace(**m) for m in measured], in_place)
    by_key = {(m["nbytes"], m["algorithm"]): m for m in measured}
    picks = {name: [] for name in SERIES}
    for row in rows:
        size = row["nbytes"]
        chosen = {
            "default": BASELINE,
            "forced": FORCED_PREFIX + row["openmpi_best_forced"]
            if row["openmpi_best_forced"]
            else None,
            "auto": "auto",
            # (none where no hand-written algorithm ran: gain_rows falls back on auto or mpi)
            "best": None if row["ours_algorithm"] in NOT_HAND_WRITTEN else row["ours_algorithm"],
        }
        for name, algorithm in chosen.items():
            if (size, algorithm) in by_key:
                picks[name].append(by_key[(size, algorithm)])
    return picks


def plot_headline(results, path):
    """Write headline.png to ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measurements = results["measurements"]
    modes = sorted({m["in_place"] for m in measurements})
    fig, axes = plt.subplots(
        2, len(modes), figsize=(5.2 * len(modes) + 2.6, 7.5), squeeze=False, sharex="col"
    )
    for column, in_place in enumerate(modes):
        measured = [m for m in measurements if m["in_place"] == in_place]
        sweep = sorted({m["nbytes"] for m in measured})
        picks = _picks(measured, in_place)
        baseline = {m["nbytes"]: m["time_us"] for m in picks["default"]}
        time_ax, speed_ax = axes[0][column], axes[1][column]
        for name, (label, colour, style, width) in SERIES.items():
            chosen = picks[name]
            look = dict(color=colour, linestyle=style, linewidth=width, marker="o", markersize=3)
            plot_series(
                time_ax,
                [(m["nbytes"], m["time_us"], *spread(m)) for m in chosen],
                sweep,
                label=label,
                **look,
            )
            plot_series(
                speed_ax,
                [
                    (
                        m["nbytes"],
                        baseline[m["nbytes"]] / m["time_us"],
                        baseline[m["nbytes"]] / spread(m)[1],
                        baseline[m["nbytes"]] / spread(m)[0],
                    )
                    for m in chosen
                    if m["nbytes"] in baseline
                ],
                sweep,
                band=name != "default",
                label=label,
                **look,
            )
        bound = [(m["nbytes"], m["bound_us"]) for m in picks["default"] if m.get("bound_us")]
        if bound:
            plot_line(
                time_ax,
                bound,
                sweep,
                color="black",
                linestyle=":",
                linewidth=0.9,
                label="the bound: no allreduce of that size is faster here",
            )
        mode = "in place" if in_place else "out of place"
        time_ax.set_yscale("log")
        time_ax.set_ylabel("time per call (µs, log)")
        time_ax.set_title(f"{mode}: time (lower is better)", fontsize=9)
        ratio_axis(speed_ax)
        speed_ax.set_ylabel("Open MPI default's time / this time (log)")
        speed_ax.set_title(f"{mode}: against Open MPI's default (above 1: faster)", fontsize=9)
        size_axis(time_ax, sweep, label=False)
        size_axis(speed_ax, sweep)
    legend_outside(axes[0][-1])
    quartiles = all(m.get("time_us_q1") is not None for m in measurements)
    bands = "the middle half" if quartiles else "the fastest to the slowest"
    fig.suptitle(
        f"Allreduce here, ours against Open MPI's (bands: {bands} of the repetitions)\n"
        + run_title(results.get("metadata", {})),
        fontsize=10,
    )
    fig.tight_layout()
    return save(plt, fig, path)
