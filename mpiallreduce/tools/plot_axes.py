"""What every figure of a bench run shares: the size axis, lines broken where the sweep has no
measurement between two sizes, the spread of the repetitions as a band, and a legend outside the
axes."""

import math

__all__ = [
    "size_label",
    "segments",
    "spread",
    "plot_series",
    "plot_line",
    "size_axis",
    "ratio_axis",
    "legend_outside",
    "save",
]


def size_label(nbytes, _position=None):
    """4 B, 64 KiB, 16 MiB: a tick label of the size axis."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def segments(points, sweep):
    """``points`` ((size, ...) tuples) cut into runs of sizes that lie next to each other in
    ``sweep`` (every size the run measured, sorted): a line joins two points only where no size
    of the sweep lies between them unmeasured (a contender that failed there, or was left out)."""
    where = {size: i for i, size in enumerate(sweep)}
    runs, last = [], None
    for point in sorted(points):
        index = where[point[0]]
        if last is None or index != last + 1:
            runs.append([])
        runs[-1].append(point)
        last = index
    return runs


def spread(m):
    """(low, high) of a measurement's time in µs: the middle half of its repetitions, or the
    fastest and slowest in results from before the quartiles were kept; its median twice without
    either."""
    for low, high in (("time_us_q1", "time_us_q3"), ("time_us_low", "time_us_high")):
        if m.get(low) is not None and m.get(high) is not None:
            return m[low], m[high]
    return m["time_us"], m["time_us"]


def plot_series(ax, points, sweep, band=True, **style):
    """One contender's line: ``points`` (size, value, low, high), a segment per run of neighbouring
    sizes (``segments``), each with a marker per measurement and the band low..high; the label
    once."""
    label = style.pop("label", None)
    for run in segments(points, sweep):
        sizes = [p[0] for p in run]
        (line,) = ax.plot(sizes, [p[1] for p in run], label=label, **style)
        label = None
        if band:
            ax.fill_between(
                sizes,
                [p[2] for p in run],
                [p[3] for p in run],
                color=line.get_color(),
                alpha=0.18,
                linewidth=0,
            )


def plot_line(ax, points, sweep, **style):
    """A line without a band: ``points`` (size, value), broken as plot_series breaks it."""
    plot_series(ax, [(size, value, value, value) for size, value in points], sweep, False, **style)


def size_axis(ax, sweep, label=True):
    """A log-2 size axis labelled in B, KiB, MiB, ticks at most 12, the grid; ``label``: and its
    name (not on a panel above another that shares it)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter

    ax.set_xscale("log", base=2)
    step = max(1, math.ceil(len(sweep) / 12))
    ax.xaxis.set_major_locator(FixedLocator(list(sweep)[::step]))
    ax.xaxis.set_major_formatter(FuncFormatter(size_label))
    ax.xaxis.set_minor_locator(FixedLocator([]))
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    if label:
        ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.3)


def ratio_axis(ax):
    """A log-2 axis of ratios, labelled 0.5x, 1x, 2x, with the line at 1x."""
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _position: f"{value:g}x"))
    ax.axhline(1.0, color="black", linewidth=0.8)


def legend_outside(ax, **kwargs):
    """The legend to the right of the axes, where it covers no line."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, borderaxespad=0, **kwargs)


def save(plt, fig, path):
    """Save (the legends outside the axes included) and close; return the path."""
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
