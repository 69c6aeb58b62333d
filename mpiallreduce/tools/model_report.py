"""What ``mpiallreduce model`` prints and draws: the fitted constants and how far they are off, the
projection table to many ranks, and its figure (model.png)."""

import math

import numpy as np

from .model_fit import MODELLED, _log2, fitted_rows, project

__all__ = ["report_fit", "projection_table", "plot_projection"]


def _duration(seconds):
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e6:.3g} us"


def _describe(constants, level):
    alpha, beta = (constants[0], constants[1]) if level == "node" else (constants[2], constants[3])
    latency = (
        f"alpha = {alpha * 1e6:.2f} us per message" if alpha else "alpha not resolved (fitted to 0)"
    )
    bandwidth = f"beta = {1 / beta / 1e9:.2f} GB/s" if beta else "beta not resolved (fitted to 0)"
    return f"{latency}, {bandwidth}"


def _layout_name(layout):
    nodes, ranks = layout
    per = ranks // nodes if ranks % nodes == 0 else f"{ranks / nodes:.1f}"
    return f"{nodes} node{'s' if nodes > 1 else ''} x {per} rank{'s' if per != 1 else ''}"


def _off(row, constants):
    return float(row.terms @ constants / row.seconds - 1)


def report_fit(rows, constants, error):
    """The fitted constants and how far the model is off, per layout and for each cross-node row."""
    fitted = fitted_rows(rows)
    layouts = sorted({r.layout for r in rows})
    lines = [
        f"# fitted to {len(fitted)} measurements of "
        f"{', '.join(_layout_name(layout) for layout in sorted({r.layout for r in fitted}))}; "
        f"median relative error {error:.0%}"
    ]
    lines.append(f"# within a node:  {_describe(constants, 'node')}")
    if any(nodes > 1 for nodes, _ in layouts):
        lines.append(f"# between nodes:  {_describe(constants, 'net')}")
    else:
        lines.append(
            "# between nodes:  not measured (no run spans nodes: run `mpiallreduce launch --nodes "
            "2 ...`)"
        )
    lines.append(
        f"# reduction:      gamma = {1 / constants[4] / 1e9:.2f} GB/s reduced"
        if constants[4]
        else "# reduction:      gamma not resolved (fitted to 0)"
    )
    for layout in layouts:
        here = [r for r in rows if r.layout == layout]
        off = [_off(r, constants) for r in here]
        worst = int(np.argmax(np.abs(off)))
        crowded = here[0].oversubscribed
        left_out = crowded and len(fitted) < len(
            rows
        )  # (fitted_rows keeps every row when all are crowded)
        lines.append(
            f"#   {_layout_name(layout)}: the model is off by {np.median(np.abs(off)):.0%} "
            f"(median), worst {off[worst]:+.0%} ({here[worst].algorithm} at {here[worst].nbytes} B)"
            + (f"; not fitted: {crowded[0]} ranks ran on {crowded[1]} cores" if left_out else "")
        )
    for layout in (lay for lay in layouts if lay[0] > 1):
        here = [r for r in rows if r.layout == layout]
        names = [a for a in MODELLED if any(r.algorithm == a for r in here)]
        lines.append(f"# {_layout_name(layout)}, predicted/measured - 1 per row:")
        lines.append(f"{'bytes':>11} " + " ".join(f"{a:>18}" for a in names))
        for nbytes in sorted({r.nbytes for r in here}):
            cells = {r.algorithm: f"{_off(r, constants):+.0%}" for r in here if r.nbytes == nbytes}
            lines.append(f"{nbytes:>11} " + " ".join(f"{cells.get(a, '-'):>18}" for a in names))
    return "\n".join(lines)


def projection_table(constants, ranks, sizes, ranks_per_node):
    lines = [
        f"{'ranks':>6} {'nodes':>6} {'bytes':>11} "
        + " ".join(f"{a:>18}" for a in MODELLED)
        + f" {'fastest':>18}"
    ]
    for p in ranks:
        nodes = max(1, p // ranks_per_node)
        for n in sizes:
            times = {a: project(a, p, n, constants, nodes) for a in MODELLED}
            lines.append(
                f"{p:>6} {nodes:>6} {n:>11} "
                + " ".join(f"{_duration(times[a]):>18}" for a in MODELLED)
                + f" {min(times, key=times.get):>18}"
            )
    return "\n".join(lines)


def plot_projection(constants, ranks, sizes, ranks_per_node, network, path):
    """Time against ranks for every algorithm, one panel per size (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plot_axes import size_label as _size_label

    counts = sorted(
        {
            ranks_per_node << k
            for k in range(1, max(2, math.ceil(_log2(max(ranks) / ranks_per_node))) + 1)
        }
        | set(ranks)
    )
    columns = 2 if len(sizes) > 1 else 1
    fig, axes = plt.subplots(
        math.ceil(len(sizes) / columns),
        columns,
        figsize=(10, 3.6 * math.ceil(len(sizes) / columns)),
        squeeze=False,
    )
    for ax, n in zip(axes.flat, sizes, strict=False):
        for algorithm in MODELLED:
            ax.plot(
                counts,
                [project(algorithm, p, n, constants, max(1, p // ranks_per_node)) for p in counts],
                marker=".",
                linestyle="--" if algorithm in ("hierarchical", "two_level") else "-",
                label=algorithm,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{_size_label(n)}", fontsize=9)
        ax.set_xlabel("ranks")
        ax.set_ylabel("modelled time (s)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(sizes) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"allreduce projected to {network}, {ranks_per_node} ranks per node", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
