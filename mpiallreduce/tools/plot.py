"""``mpiallreduce plot RESULTS``: PNG figures of a bench run (matplotlib, no display needed).

headline.png, first: ours against Open MPI's default, its best forced algorithm, auto and the best
of ours, time and speed against size (plot_headline.py).

busbw_<mode>.png: bus bandwidth (log) against message size, one line per contender: ours solid,
each in a colour and marker of its own, auto thick; each Open MPI algorithm grey and dashed with a
dash pattern and marker of its own, its default black. Below, on a panel of its own: the bound
measured in the run (the least time an allreduce of that size can take here:
mpiallreduce.tools.bench.limits) and one core's memory copy bandwidth, a reference, not a limit
(below a few MiB the data sits in caches, which go faster).

gain_<mode>.png: Open MPI default time / our time against message size, one line per algorithm of
ours, auto thick; above 1 ours is faster; a hollow marker is a gain within the noise (the middle
halves of the two's repetitions overlap: mpiallreduce.tools.bench.report.within_noise).

Every legend sits outside the axes, and no line joins two sizes the run measured another size
between (plot_axes.segments).
"""

import os
from types import SimpleNamespace

from .arguments import ArgumentParser
from .bench.report import gain_rows
from .plot_axes import legend_outside, plot_line, ratio_axis, save, size_axis
from .plot_headline import plot_headline, run_title
from .results import ResultsError, load_results

__all__ = ["plot_results", "main"]

#: Open MPI's forced algorithms: told apart by dash pattern and marker, not by shades of grey
DASHES = [
    (0, (6, 2)),
    (0, (2, 2)),
    (0, (6, 2, 2, 2)),
    (0, (10, 3)),
    (0, (1, 1)),
    (0, (6, 2, 2, 2, 2, 2)),
    (0, (4, 4)),
    (0, (3, 1, 1, 1, 1, 1)),
]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p"]


def _line_styles(plt, names):
    """{name: plot keywords} for each contender: ours solid, each a colour of tab20 (its greys and
    auto's blue left out) and a marker of its own, so that 15 lines are told apart by both; auto
    blue and thick; Open MPI's forced algorithms grey, each with a dash pattern and marker of its
    own; its default black, dashed, with crosses."""
    palette = [plt.get_cmap("tab20")(i) for i in range(20) if i not in (0, 14, 15)]
    ours = [n for n in names if not n.startswith("openmpi") and n != "auto"]
    theirs = [n for n in names if n.startswith("openmpi") and n != "openmpi"]
    styles = {
        n: dict(
            color=palette[i % len(palette)],
            linestyle="-",
            marker=MARKERS[i % len(MARKERS)],
            markersize=4,
            linewidth=1.2,
        )
        for i, n in enumerate(ours)
    }
    styles.update(
        {
            n: dict(
                color="0.45",
                linestyle=DASHES[i % len(DASHES)],
                marker=MARKERS[i % len(MARKERS)],
                markersize=4,
                linewidth=1.0,
            )
            for i, n in enumerate(theirs)
        }
    )
    styles["auto"] = dict(color="tab:blue", linestyle="-", marker="o", markersize=5, linewidth=3.0)
    styles["openmpi"] = dict(color="black", linestyle="--", marker="x", markersize=5, linewidth=2.2)
    return {n: styles[n] for n in names}


def _busbw_figure(plt, measured, memcpy_gbs, mode, title, path):
    """busbw_<mode>.png: every contender's busbw (log) above; the bound and memcpy below."""
    sweep = sorted({m["nbytes"] for m in measured})
    names = list(dict.fromkeys(m["algorithm"] for m in measured))
    fig, (ax, below) = plt.subplots(
        2, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    for name, look in _line_styles(plt, names).items():
        mine = [m for m in measured if m["algorithm"] == name]
        plot_line(ax, [(m["nbytes"], m["busbw_gbs"]) for m in mine], sweep, label=name, **look)
    ax.set_yscale("log")
    ax.set_ylabel("busbw (GB/s, log) = bytes/time x 2(p-1)/p")
    ax.set_title(f"allreduce bus bandwidth, {mode}: {title}", fontsize=9)
    legend_outside(ax, ncol=1 if len(names) <= 26 else 2)
    bound = sorted(
        {
            (m["nbytes"], m["nbytes"] / m["bound_us"] / 1e3 * 2 * (m["ranks"] - 1) / m["ranks"])
            for m in measured
            if m.get("bound_us")
        }
    )
    if bound:  # (the least time an allreduce can take here, as busbw)
        plot_line(
            below,
            bound,
            sweep,
            color="black",
            linewidth=1.2,
            marker=".",
            label="the bound, this run: no allreduce is faster",
        )
    if memcpy_gbs:
        below.axhline(
            memcpy_gbs,
            color="black",
            linestyle=":",
            linewidth=0.8,
            label="one core's memcpy, this run (a reference: caches beat it)",
        )
    below.set_yscale("log")
    below.set_ylabel("GB/s (log)")
    below.set_title("references: the bound measured in the run, memcpy", fontsize=8)
    legend_outside(below)
    size_axis(ax, sweep, label=False)
    size_axis(below, sweep)
    fig.tight_layout()
    return save(plt, fig, path)


def _gain_figure(plt, rows, mode, title, path):
    """gain_<mode>.png: each algorithm of ours against Open MPI's default, hollow within the
    noise."""
    sweep = sorted({r["nbytes"] for r in rows})
    ours = list(dict.fromkeys(name for r in rows for name in r["gain_by_algorithm"]))
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for name, look in _line_styles(plt, ours).items():
        measured = [r for r in rows if name in r["gain_by_algorithm"]]
        gains = [(r["nbytes"], r["gain_by_algorithm"][name]) for r in measured]
        plot_line(ax, gains, sweep, label=name, **look)
        noisy = [
            (r["nbytes"], r["gain_by_algorithm"][name])
            for r in measured
            if r.get("noise_by_algorithm", {}).get(name)
        ]
        if noisy:  # within the noise: a white marker over the line's own
            ax.plot(
                *zip(*noisy, strict=True),
                linestyle="none",
                marker=look["marker"],
                markersize=look["markersize"] + 1,
                markerfacecolor="white",
                markeredgecolor=look["color"],
            )
    if any(any(r.get("noise_by_algorithm", {}).values()) for r in rows):
        ax.plot(
            [],
            [],
            "o",
            markerfacecolor="white",
            markeredgecolor="black",
            label="hollow: the same within the noise",
        )
    ratio_axis(ax)
    ax.set_ylabel("gain = Open MPI default time / our time (log)")
    ax.set_title(
        f"gain over Open MPI's default, {mode} (above 1: ours faster): {title}", fontsize=9
    )
    size_axis(ax, sweep)
    legend_outside(ax)
    fig.tight_layout()
    return save(plt, fig, path)


def plot_results(results, output_dir):
    """Write the figures (headline.png first); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(output_dir, exist_ok=True)
    title = run_title(results.get("metadata", {}))
    written = [plot_headline(results, os.path.join(output_dir, "headline.png"))]
    measurements = results["measurements"]
    for in_place in sorted({m["in_place"] for m in measurements}):
        mode = "in_place" if in_place else "out_of_place"
        measured = [m for m in measurements if m["in_place"] == in_place]
        rows = gain_rows([SimpleNamespace(**m) for m in measured], in_place)
        said = mode.replace("_", " ")
        written.append(
            _busbw_figure(
                plt,
                measured,
                results.get("memcpy_gbs"),
                said,
                title,
                os.path.join(output_dir, f"busbw_{mode}.png"),
            )
        )
        written.append(
            _gain_figure(plt, rows, said, title, os.path.join(output_dir, f"gain_{mode}.png"))
        )
    return written


def main(argv=None):
    parser = ArgumentParser(
        prog="mpiallreduce plot",
        description=__doc__.split("\n")[0],
        examples=("mpiallreduce plot results/latest",),
    )
    parser.add_argument(
        "results",
        help="a results folder written by `mpiallreduce bench --output` (or its bench.json)",
    )
    parser.add_argument("--output", help="folder for the PNG files (default: the results folder)")
    args = parser.parse_args(argv)
    try:
        results = load_results(args.results)
    except ResultsError as e:
        parser.error(str(e))
    output = args.output or (
        args.results if os.path.isdir(args.results) else os.path.dirname(args.results)
    )
    for path in plot_results(results, output):
        print(path)
    return 0
