"""``mpiallreduce report RESULTS...``: many bench runs merged into one Deep Speech 2 table and \
a scaling plot.

The runs of a job array (``results/slurm-<job>/ranks-<n>/``), or of ``make bench`` and ``make
bench-nodes`` on 1, 2 and 3 emulated nodes, each measured one layout (nodes x ranks). The report
puts them in one table ordered by nodes, ranks and size: Open MPI's default time and the component
that ran it (tuned on one node, han across nodes), our best algorithm and the gain, ``auto``'s
gain, Open MPI's best forced algorithm (han switched off counts among them) and the gain over it,
and both bus bandwidths. Gains are within one run: each run times Open MPI and ours side by side,
so runs on different days can be merged without comparing one day's Open MPI with another's.

scaling.png: time against layout for each size, our best (solid) against Open MPI's default
(dashed), one colour per size, without the oversubscribed layouts (more ranks than cores: the
scheduler's times, not the hardware's; the title names them). report.txt and report.csv hold the
table, whose notes name the oversubscribed runs.
"""

import csv
import os
from types import SimpleNamespace

from .arguments import ArgumentParser, size_list
from .bench.report import format_gain_table, gain_rows
from .results import ResultsError, find_runs, run_nodes, run_oversubscribed

__all__ = ["merged_rows", "plot_scaling", "main"]

#: sizes drawn when none are given: at most this many, spread over the sizes every layout measured
PLOTTED_SIZES = 6
COLUMNS = (
    "nodes",
    "ranks",
    "nbytes",
    "openmpi_default",
    "openmpi_us",
    "ours_us",
    "ours_algorithm",
    "gain",
    "auto_gain",
    "openmpi_best_forced",
    "openmpi_best_forced_us",
    "gain_over_best_forced",
    "ours_busbw_gbs",
    "openmpi_busbw_gbs",
    "date_utc",
    "source",
)


def merged_rows(runs, in_place=False):
    """(rows by nodes, ranks and size; notes on what was left out). Where two runs measured the same
    layout and size, the later run's row is kept."""
    chosen, notes = {}, []
    for path, results in runs:
        meta = results.get("metadata", {})
        measurements = [SimpleNamespace(**m) for m in results["measurements"]]
        if not any(m.algorithm == "openmpi" and m.in_place == in_place for m in measurements):
            notes.append(
                f"{path}: no {'in-place' if in_place else 'out-of-place'} Open MPI default rows, "
                "left out"
            )
            continue
        crowded = run_oversubscribed(results)
        if crowded:
            notes.append(
                f"{path}: {crowded[0]} ranks ran on {crowded[1]} cores (oversubscribed): its times "
                "are not the hardware's; compare its results for correctness"
            )
        for row in gain_rows(measurements, in_place):
            row.update(
                nodes=run_nodes(results),
                openmpi_default=meta.get("openmpi_default"),
                oversubscribed=bool(crowded),
                date_utc=meta.get("date_utc", ""),
                source=path,
            )
            key = (row["nodes"], row["ranks"], row["nbytes"])
            if key in chosen:
                older, newer = sorted((chosen[key], row), key=lambda r: r["date_utc"])
                notes.append(
                    f"{key[0]} nodes x {key[1]} ranks at {key[2]} B measured by {older['source']} "
                    f"and {newer['source']}: the later kept"
                )
                row = newer
            chosen[key] = row
    return [chosen[k] for k in sorted(chosen)], notes


def _layout(row):
    return row["nodes"], row["ranks"]


def _plotted_sizes(rows, sizes=None):
    layouts = {_layout(r) for r in rows}
    common = sorted(
        n
        for n in {r["nbytes"] for r in rows}
        if all(any(_layout(r) == layout and r["nbytes"] == n for r in rows) for layout in layouts)
    )
    if sizes:
        return [n for n in sizes if n in {r["nbytes"] for r in rows}]
    if len(common) <= PLOTTED_SIZES:
        return common
    step = (len(common) - 1) / (PLOTTED_SIZES - 1)
    return sorted({common[round(i * step)] for i in range(PLOTTED_SIZES)})


def plot_scaling(rows, path, sizes=None):
    """Time against layout (ranks, then nodes) for each size: our best against Open MPI's default.
    Oversubscribed layouts (more ranks than cores) are left out, and the title says which: their
    times are the scheduler's, not the hardware's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plot_axes import size_label as _size_label

    crowded = sorted(
        {_layout(r) for r in rows if r.get("oversubscribed")},
        key=lambda layout: (layout[1], layout[0]),
    )
    rows = [r for r in rows if not r.get("oversubscribed")]
    layouts = sorted({_layout(r) for r in rows}, key=lambda layout: (layout[1], layout[0]))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colours = plt.get_cmap("tab10")
    for i, nbytes in enumerate(_plotted_sizes(rows, sizes)):
        here = {_layout(r): r for r in rows if r["nbytes"] == nbytes}
        xs = [x for x, layout in enumerate(layouts) if layout in here]
        ax.plot(
            xs,
            [here[layouts[x]]["ours_us"] for x in xs],
            "-",
            marker="o",
            color=colours(i % 10),
            label=f"{_size_label(nbytes)}: ours (best)",
        )
        ax.plot(
            xs,
            [here[layouts[x]]["openmpi_us"] for x in xs],
            "--",
            marker="x",
            color=colours(i % 10),
            label=f"{_size_label(nbytes)}: Open MPI default",
        )
    ax.set_xticks(range(len(layouts)))
    ax.set_xticklabels(
        [f"{p} ranks\n{n} node{'s' if n > 1 else ''}" for n, p in layouts], fontsize=8
    )
    ax.set_yscale("log")
    ax.set_ylabel("time per allreduce (us)")
    left_out = ", ".join(f"{n}x{p // n}" for n, p in crowded)
    ax.set_title(
        "allreduce time against ranks and nodes: ours (solid) and Open MPI's default (dashed)"
        + (
            f"\noversubscribed layouts left out (nodes x ranks per node): {left_out}"
            if crowded
            else ""
        ),
        fontsize=9,
    )
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _write_csv(rows, path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def main(argv=None):
    parser = ArgumentParser(
        prog="mpiallreduce report",
        description=__doc__.split("\n")[0],
        examples=("mpiallreduce report results/nodes results/latest --output results/nodes",),
    )
    parser.add_argument(
        "results",
        nargs="+",
        help="results folders of `mpiallreduce bench --output`, or folders holding them",
    )
    parser.add_argument("--mode", choices=("out-of-place", "in-place"), default="out-of-place")
    parser.add_argument(
        "--sizes",
        type=size_list,
        help="sizes to draw in scaling.png (default: up to 6 every layout measured)",
    )
    parser.add_argument(
        "--wide", action="store_true", help="with both busbw columns (over 120 characters)"
    )
    parser.add_argument(
        "--markdown",
        metavar="PAGE",
        help="write the runs, each with its date, commit, machine and command, and its tables, "
        "as a Markdown page (docs/results.md) instead",
    )
    parser.add_argument(
        "--output",
        metavar="DIR",
        help="write report.txt, report.csv and scaling.png there (default: print the table only)",
    )
    args = parser.parse_args(argv)
    if args.markdown:
        from .results_page import holds_text_results, markdown_page

        # (a folder of text results, train_bench's train.txt, plain calls, prices, holds no
        # bench.json)
        try:
            runs = find_runs([path for path in args.results if not holds_text_results(path)])
        except ResultsError as e:
            parser.error(str(e))
        with open(args.markdown, "w") as f:
            f.write(
                markdown_page(
                    runs,
                    "mpiallreduce report --markdown " + " ".join([args.markdown, *args.results]),
                    folders=args.results,
                    page_folder=os.path.dirname(os.path.abspath(args.markdown)),
                )
            )
        print(f"written: {args.markdown} ({len(runs)} runs)")
        return 0
    try:
        rows, notes = merged_rows(find_runs(args.results), in_place=args.mode == "in-place")
    except ResultsError as e:
        parser.error(str(e))
    if not rows:
        parser.error(
            f"no {args.mode} measurements with Open MPI's default in " + ", ".join(args.results)
        )
    layouts = sorted({_layout(r) for r in rows})
    text = "\n".join(
        [
            f"# {len(rows)} rows from {len(layouts)} layouts ("
            + ", ".join(
                f"{p} rank{'s' if p > 1 else ''} on {n} node{'s' if n > 1 else ''}"
                for n, p in layouts
            )
            + f"), {args.mode}; gains within each run",
            *(f"# note: {n}" for n in notes),
            format_gain_table(rows, args.wide),
        ]
    )
    print(text)
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "report.txt"), "w") as f:
            f.write(text + "\n")
        print(_write_csv(rows, os.path.join(args.output, "report.csv")))
        print(plot_scaling(rows, os.path.join(args.output, "scaling.png"), args.sizes))
    return 0
