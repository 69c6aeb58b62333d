"""Reading what ``mpiallreduce bench --output`` wrote, for ``plot``, ``model`` and ``report``.

A run is a folder holding bench.json (metadata, measurements, gain tables) and bench.csv (the
measurements alone). Several runs are folders of such folders too: a job array's
``results/slurm-<job>/ranks-<n>/``, or ``results/`` after runs on 1, 2 and 3 emulated nodes.
"""

import csv
import json
import os
import sys

__all__ = ["load_results", "find_runs", "run_nodes", "run_oversubscribed", "ResultsError"]

_NUMBERS = {
    "ranks": int,
    "nbytes": int,
    "count": int,
    "iterations": int,
    "repetitions": int,
    "wrong": int,
    "time_us": float,
    "algbw_gbs": float,
    "busbw_gbs": float,
    "busbw_share_of_memcpy": float,
    "time_us_low": float,
    "time_us_high": float,
    "time_us_q1": float,
    "time_us_q3": float,
    "bound_us": float,
}


class ResultsError(ValueError):
    """A path that holds no bench results, or results this version cannot read."""


def _read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "algorithm" not in rows[0]:
        raise ResultsError(f"{path}: not a bench.csv of `mpiallreduce bench` (no algorithm column)")
    for row in rows:
        for key, kind in _NUMBERS.items():
            if row.get(key) in ("", "None"):  # (what csv writes for a measurement's None)
                row[key] = None
            elif row.get(key) is not None:
                row[key] = kind(row[key])
        row["in_place"] = row.get("in_place") == "True"
    print(
        f"{path}: read without its bench.json, so without the run's metadata: taken as one node",
        file=sys.stderr,
    )
    return {"metadata": {"ranks": rows[0]["ranks"]}, "measurements": rows}


def load_results(path):
    """One run: a results folder, its bench.json, or its bench.csv (then without the metadata)."""
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "bench.json")):
            raise ResultsError(
                f"{path}: no bench.json here (give a folder written by `mpiallreduce bench "
                "--output`)"
            )
        path = os.path.join(path, "bench.json")
    if not os.path.exists(path):
        raise ResultsError(f"{path}: no such file or folder")
    if path.endswith(".csv"):
        sibling = os.path.join(os.path.dirname(path), "bench.json")
        return load_results(sibling) if os.path.exists(sibling) else _read_csv(path)
    try:
        with open(path) as f:
            results = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultsError(f"{path}: not a bench.json of `mpiallreduce bench` ({e})") from None
    if not isinstance(results, dict) or "measurements" not in results:
        raise ResultsError(f"{path}: not a bench.json of `mpiallreduce bench` (no measurements)")
    results.setdefault("metadata", {})
    return results


def find_runs(paths):
    """Every run under ``paths`` (results folders, bench.json/csv files, or folders of them), in
    order."""
    found = []
    for path in paths:
        if os.path.isdir(path) and not os.path.exists(os.path.join(path, "bench.json")):
            below = sorted(
                os.path.join(root, "bench.json")
                for root, _dirs, files in os.walk(path)
                if "bench.json" in files
            )
            if not below:
                raise ResultsError(f"{path}: no bench.json in it or below it")
            found.extend(below)
        else:
            found.append(path)
    return [(path, load_results(path)) for path in found]


def run_nodes(results):
    """The node count a run's metadata records (1 for runs from before it was recorded)."""
    return int(results.get("metadata", {}).get("nodes") or 1)


def run_oversubscribed(results):
    """[ranks, cores] when the run had more ranks than cores on a machine, else None."""
    return results.get("metadata", {}).get("oversubscribed")
