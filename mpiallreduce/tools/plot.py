"""``mpiallreduce plot RESULTS``: PNG figures of a bench run (matplotlib, no display needed).

busbw_<mode>.png: bus bandwidth against message size, one line per contender (ours solid, each
Open MPI algorithm dashed with a dash pattern and marker of its own, its default black), and one
core's memory copy bandwidth measured in the same run: a reference line, not a limit (below a few
MiB the data sits in caches, which go faster); and the bound measured in the run, where it has one
(the least time an allreduce of that size can take: mpiallreduce.tools.bench.limits), as busbw.
gain_<mode>.png: Open MPI default time / our time against message size, one line per algorithm
of ours; above 1 ours is faster; a hollow circle marks a gain within the noise (the repetitions of
the two overlap: mpiallreduce.tools.bench.report.within_noise).
"""

import os

from .arguments import ArgumentParser
from .results import ResultsError, load_results

__all__ = ["plot_results", "main"]


def _size_label(nbytes, _position=None):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def plot_results(results, output_dir):
    """Write the figures; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(output_dir, exist_ok=True)
    meta = results["metadata"]
    title = (
        f"{meta['ranks']} ranks, {meta['mpi_library'].split(',')[0]}, {', '.join(meta['hosts'])}"
    )
    written = []
    for mode, rows in results["gains"].items():
        in_place = mode == "in_place"
        measured = [m for m in results["measurements"] if m["in_place"] == in_place]
        names = list(dict.fromkeys(m["algorithm"] for m in measured))

        fig, ax = plt.subplots(figsize=(9, 5.5))
        for name, colour, style, marker in _line_styles(plt, names):
            points = sorted(
                (m["nbytes"], m["busbw_gbs"]) for m in measured if m["algorithm"] == name
            )
            ax.plot(
                *zip(*points, strict=True),
                linestyle=style,
                marker=marker,
                color=colour,
                linewidth=2.5 if name == "openmpi" else 1.2,
                label=name,
            )
        bound = sorted(
            {
                (m["nbytes"], m["nbytes"] / m["bound_us"] / 1e3 * 2 * (m["ranks"] - 1) / m["ranks"])
                for m in measured
                if m.get("bound_us")
            }
        )
        if (
            bound
        ):  # (the least time an allreduce can take here, as busbw: mpiallreduce.tools.bench.limits)
            ax.plot(
                *zip(*bound, strict=True),
                color="black",
                linewidth=1.8,
                label="the bound, this run (no allreduce is faster)",
            )
        ax.axhline(
            results["memcpy_gbs"],
            color="black",
            linestyle=":",
            linewidth=0.8,
            label="one core's memcpy, this run (a reference: caches beat it)",
        )
        written.append(
            _finish(
                plt,
                fig,
                ax,
                "busbw (GB/s) = bytes/time x 2(p-1)/p",
                f"allreduce bus bandwidth, {mode.replace('_', ' ')}: {title}",
                os.path.join(output_dir, f"busbw_{mode}.png"),
                columns=2,
            )
        )

        fig, ax = plt.subplots(figsize=(9, 5.5))
        ours = list(rows[0]["gain_by_algorithm"]) if rows else []
        for name, colour, style, marker in _line_styles(plt, ours):
            ax.plot(
                [r["nbytes"] for r in rows],
                [r["gain_by_algorithm"][name] for r in rows],
                linestyle=style,
                marker=marker,
                color=colour,
                label=name,
            )
            noisy = [r for r in rows if r.get("noise_by_algorithm", {}).get(name)]
            ax.plot(
                [r["nbytes"] for r in noisy],
                [r["gain_by_algorithm"][name] for r in noisy],
                "o",
                markersize=8,
                markerfacecolor="none",
                color=colour,
            )
        if any(any(r.get("noise_by_algorithm", {}).values()) for r in rows):
            ax.plot(
                [],
                [],
                "o",
                markersize=8,
                markerfacecolor="none",
                color="black",
                label="within the noise",
            )
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_yscale("log", base=2)
        written.append(
            _finish(
                plt,
                fig,
                ax,
                "gain = Open MPI default time / our time",
                f"gain over Open MPI's default, {mode.replace('_', ' ')}: {title}",
                os.path.join(output_dir, f"gain_{mode}.png"),
                columns=1,
            )
        )
    return written


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
MARKERS = ["v", "^", "s", "D", "P", "X", "<", ">"]


def _line_styles(plt, names):
    """(name, colour, line style, marker) for each contender: ours solid with dots, each in a colour
    of its own (tab10, then tab20's light shades, no grey); Open MPI's forced algorithms grey, each
    with a dash pattern and a hollow-able marker of its own; its default black, dashed, with
    crosses."""
    ours = [n for n in names if not n.startswith("openmpi")]
    theirs = [n for n in names if n.startswith("openmpi") and n != "openmpi"]
    palette = (
        [plt.get_cmap("tab10")(i) for i in range(10) if i != 7]  # (7 is grey: Open MPI's)
        + [plt.get_cmap("tab20")(2 * i + 1) for i in range(10) if i != 7]
    )
    styles = {n: (palette[i % len(palette)], "-", ".") for i, n in enumerate(ours)}
    styles.update(
        {
            n: ("0.45", DASHES[i % len(DASHES)], MARKERS[i % len(MARKERS)])
            for i, n in enumerate(theirs)
        }
    )
    styles["openmpi"] = ("black", "--", "x")
    return [(n, *styles[n]) for n in names]


def _finish(plt, fig, ax, ylabel, title, path, columns):
    """Axes, labels and legend shared by every figure; save and close; return the path."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(_size_label))
    ax.set_xlabel("message size")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=columns)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    parser = ArgumentParser(
        prog="mpiallreduce plot",
        description=__doc__.split("\n")[0],
        examples=("mpiallreduce plot results/bench-2ranks",),
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
