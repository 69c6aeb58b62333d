"""``mpiallreduce report --markdown PAGE RESULTS...``: the measured results as a page of the docs.

One section per run (a ``bench.json`` of ``mpiallreduce bench --output``): its date, commit,
machine and the command that made it, then its Deep Speech 2 tables, as ``bench`` prints them. The
page says which command wrote it; docs/results.md is written this way from the results folders in
the repository (tests/test_readme.py checks that it is what the command writes now).
"""

import fnmatch
import glob
import os

from .bench.contenders import FORCED_PREFIX
from .bench.report import format_gain_table, gain_rows
from .bench.reproducible_table import format_reproducible_table, reproducible_rows
from .results import run_nodes, run_oversubscribed

__all__ = ["markdown_page", "bench_command", "holds_text_results"]

#: bench's defaults: a run's command names only what differs from them
_DEFAULTS = {
    "device": "cpu",
    "dtype": "float32",
    "op": "sum",
    "repetitions": 5,
    "mode": "both",
    "openmpi_forced": "all",
    "algorithms": None,
}


def bench_command(meta):
    """The command line that made a run, from its metadata (ranks, nodes, bench's arguments)."""
    arguments = meta.get("arguments") or {}
    nodes = int(meta.get("nodes") or 1)
    words = [
        f"mpiallreduce launch -n {meta.get('ranks', '?')}"
        + (f" --nodes {nodes}" if nodes > 1 else ""),
        "-- python -m mpiallreduce bench",
    ]
    sizes = arguments.get("sizes")
    if sizes and sizes != "default":
        words.append(f"--sizes {sizes if isinstance(sizes, str) else ','.join(map(str, sizes))}")
    for key, default in _DEFAULTS.items():
        value = arguments.get(key, default)
        if value is not None and value != default and str(value) != str(default):
            words.append(f"--{key.replace('_', '-')} {value}")
    return " ".join(words)


def _machine(meta, results):
    library = str(meta.get("mpi_library", "?")).split(",")[0]
    text = (
        f"{', '.join(meta.get('hosts', [])) or '?'}: {meta.get('ranks', '?')} ranks on "
        f"{run_nodes(results)} node(s), {library}"
    )
    if meta.get("openmpi_default"):
        text += f", Open MPI's default component {meta['openmpi_default']}"
    if results.get("memcpy_gbs"):
        text += f"; one core's memcpy {results['memcpy_gbs']:.1f} GB/s"
    if meta.get("link_between_nodes_gbs"):
        text += (
            f"; link between nodes {meta['link_between_nodes_gbs']:.2f} GB/s each way "
            "(MPI_Sendrecv of 64 MiB)"
        )
    crowded = run_oversubscribed(results)
    if crowded:
        text += (
            f"; **oversubscribed** ({crowded[0]} ranks on {crowded[1]} cores: "
            "times not the hardware's)"
        )
    return text


def _training_runs(folder):
    return sorted(
        os.path.join(root, "train.txt")
        for root, _dirs, files in os.walk(folder)
        if "train.txt" in files
    )


#: the text results a folder may hold besides bench runs: plain calls against raw MPI_Allreduce
#: (benchmarks/plain_across_nodes.py), and what a guarantee or a path costs (benchmarks/*_price.py)
_PLAIN, _PRICES = "plain-*.txt", "*price*.txt"
#: the bare exchanges across nodes against Open MPI's strongest (benchmarks/exchange_across_nodes.py
#: --forced)
_FLOORS, _FLOORS_FROM = "exchange-*floor*.txt", "# the bare exchanges"


def _text_files(folder, pattern):
    """The non-empty files under ``folder`` (subfolders too) named like ``pattern``, sorted; a
    plain-call file is not a price file as well."""
    found = glob.glob(os.path.join(folder, "**", pattern), recursive=True)
    return sorted(
        path
        for path in found
        if os.path.getsize(path)
        and not (pattern == _PRICES and fnmatch.fnmatch(os.path.basename(path), _PLAIN))
    )


#: make bench-jax's table (benchmarks/jax_bench.py writes it from its jax.json)
_JAX_TABLE = "table.md"


def _jax_tables(folder):
    return sorted(
        os.path.join(root, _JAX_TABLE)
        for root, _dirs, files in os.walk(folder)
        if "jax.json" in files and _JAX_TABLE in files
    )


def holds_text_results(folder):
    """Whether ``folder`` holds text results only (train_bench's train.txt, plain calls, prices,
    bench-jax's table), no bench run."""
    texts = (
        _training_runs(folder)
        or _jax_tables(folder)
        or any(_text_files(folder, pattern) for pattern in (_PLAIN, _PRICES))
    )
    return bool(texts) and not any("bench.json" in files for _root, _dirs, files in os.walk(folder))


def markdown_page(runs, command, folders=(), page_folder="docs"):
    """The page, from ``runs`` ((path, results) pairs: mpiallreduce.tools.results.find_runs); and,
    whole, each of ``folders``' training runs (train.txt) and model.txt (``mpiallreduce model``).
    A run whose folder holds its headline figure (``mpiallreduce plot``) shows it, linked from
    ``page_folder``, where the page is written."""
    lines = [
        "# Measured results",
        "",
        f"Written by `{command}` from the results folders in the repository. "
        "Do not edit it: run the",
        "command again. Gain = Open MPI's default time / our time, both measured in the same run",
        "(interleaved repetitions, the median); above 1, ours is faster. "
        "`auto` is what the library",
        "runs by default. A gain that says `same` is the same within the noise: the middle",
        "halves of the two's repetitions overlap (in runs before 2026-12-08, their whole ranges).",
        "How to read them: [benchmarks.md](benchmarks.md).",
        "",
    ]
    for path, results in runs:
        meta = results.get("metadata", {})
        measurements = results["measurements"]
        forced_measured = any(m["algorithm"].startswith(FORCED_PREFIX) for m in measurements)
        lines += [
            f"## {path}",
            "",
            f"- date: {meta.get('date_utc', '?')}",
            f"- commit: {str(meta.get('git_commit', '?'))[:12]}",
            f"- machine: {_machine(meta, results)}",
            f"- command: `{bench_command(meta)}`",
            f"- Open MPI's forced algorithms measured: {'yes' if forced_measured else 'no'}",
            "",
        ]
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        headline = os.path.join(folder, "headline.png")
        if os.path.isfile(headline):
            link = os.path.relpath(headline, page_folder).replace(os.sep, "/")
            lines += [
                f"![ours against Open MPI's, time and speed against size: {path}]({link})",
                "",
            ]
        for in_place in sorted({m["in_place"] for m in measurements}):
            from types import SimpleNamespace

            rows = gain_rows([SimpleNamespace(**m) for m in measurements], in_place)
            lines += [
                f"{'In place' if in_place else 'Out of place'}:",
                "",
                "```text",
                format_gain_table(rows),
                "```",
                "",
            ]
            exact_rows = reproducible_rows([SimpleNamespace(**m) for m in measurements], in_place)
            if exact_rows:
                lines += [
                    "Reproducible sums against our fastest ordinary sum on the same kind of "
                    "buffers (docs/reproducible.md):",
                    "",
                    "```text",
                    format_reproducible_table(exact_rows),
                    "```",
                    "",
                ]
    for folder in folders:
        for train in _training_runs(folder):
            with open(train) as f:
                text = f.read().rstrip("\n")
            lines += [
                f"## {train}",
                "",
                "Training end to end (`python -m mpiallreduce.tools.train_bench`, make "
                "bench-train; how to read it: training.md). comm ms/step is the step's time minus "
                "that of `none`, no synchronization.",
                "",
                "```text",
                text,
                "```",
                "",
            ]
        for trace in sorted(glob.glob(os.path.join(folder, "trace-*.txt"))):
            with open(trace) as f:
                text = f.read().rstrip("\n")
            lines += [
                f"## {trace}",
                "",
                "Where a training step's time goes, phase by phase "
                "(`benchmarks/train_trace.py`, its command in training.md).",
                "",
                "```text",
                text,
                "```",
                "",
            ]
        for plain in _text_files(folder, _PLAIN):
            with open(plain) as f:
                text = f.read().splitlines()
            start = next((i for i, line in enumerate(text) if line.startswith("# medians")), None)
            medians = (
                text[start:] if start is not None else ["(no medians: the run did not finish)"]
            )
            lines += [
                f"## {plain}",
                "",
                "Plain calls whose signature goes in messages against raw `MPI_Allreduce`, "
                "the rounds' medians (`benchmarks/plain_across_nodes.py`, its command in "
                "benchmarks.md); the ratio is raw's time over auto's.",
                "",
                "```text",
                text[0],
                *medians,
                "```",
                "",
            ]
        for floor in _text_files(folder, _FLOORS):
            with open(floor) as f:
                text = f.read().splitlines()
            start = next(
                (i for i, line in enumerate(text) if line.startswith(_FLOORS_FROM)), len(text)
            )
            lines += [
                f"## {floor}",
                "",
                "Across nodes, two exchanges with no library layer (a `Sendrecv` and an "
                "addition) against Open MPI's strongest (`benchmarks/exchange_across_nodes.py "
                "--forced`, its command in benchmarks.md); the ratio is the strongest's time over "
                "theirs.",
                "",
                "```text",
                text[0],
                *(text[start:] or ["(no summary: the run did not finish)"]),
                "```",
                "",
            ]
        for price in _text_files(folder, _PRICES):
            with open(price) as f:
                text = f.read().rstrip("\n")
            lines += [
                f"## {price}",
                "",
                "Side by side in one run, as the file's first line says (the script's "
                "docstring says what each line is).",
                "",
                "```text",
                text,
                "```",
                "",
            ]
        for table in _jax_tables(folder):
            with open(table) as f:
                text = f.read().rstrip("\n")
            lines += [
                f"## {table}",
                "",
                "Allreduce inside `jax.jit` (`make bench-jax`: `benchmarks/jax_bench.py`, its "
                "docstring says what each contender runs; jax.md); the table as the script wrote "
                "it from the jax.json beside it.",
                "",
                text,
                "",
            ]
        model = os.path.join(folder, "model.txt")
        if os.path.isfile(model):
            with open(model) as f:
                text = f.read().rstrip("\n")
            lines += [
                f"## {model}",
                "",
                "The cost model fitted to the runs above and projected to larger jobs, as "
                "`mpiallreduce model` printed it (its command is in benchmarks.md).",
                "",
                "```text",
                text,
                "```",
                "",
            ]
    return "\n".join(lines)
