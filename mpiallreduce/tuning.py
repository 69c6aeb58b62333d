"""The table that ``algorithm="auto"`` reads: which algorithm for which rank count and message size.

``mpiallreduce tune`` (mpiallreduce/tune.py, under mpiexec/srun) measures every algorithm on the current
machine and rank count, and writes or updates the table. The table used is, in order: the one given
to ``set_tuning_table(path)``, the file named by ``MPIALLREDUCE_TUNING`` (mpiallreduce.settings), or
the one shipped with the package (measured on this project's 2-core machines). This module only
reads the table; what a call runs is decided in mpiallreduce.planner.

Format (JSON)::

    {"metadata": {...},
     "by_ranks": {"2": [{"up_to_bytes": 65536, "algorithm": "mpi"},
                        {"up_to_bytes": null, "algorithm": "ring_pipelined"}], ...}}

For a rank count not in the table, the nearest smaller one is used (else the smallest).
"""
import hashlib
import json
import math
import os

__all__ = ["TUNING_ENV", "DEFAULT_TABLE", "set_tuning_table", "tuning_table", "choose_name",
           "rules_from_measurements", "table_digest"]

TUNING_ENV = "MPIALLREDUCE_TUNING"
DEFAULT_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tuning.json")
#: tune prefers MPI_Allreduce (the reference) unless another algorithm is faster by more than this
PREFER_MPI_WITHIN = 0.05

_table = None
_choices = {}


def set_tuning_table(path_or_table):
    """Use this table (a path, or a dict in the JSON format) for "auto" from now on."""
    global _table
    if isinstance(path_or_table, dict):
        _table = path_or_table
    else:
        with open(path_or_table) as f:
            _table = json.load(f)
    _choices.clear()
    import sys
    planner, state = sys.modules.get("mpiallreduce.planner"), sys.modules.get("mpiallreduce.state")
    if planner is not None:  # what was planned with the old table is forgotten
        planner.plan_call.cache_clear()
    if state is not None:
        state.forget_plans()


def tuning_table():
    if _table is None:
        from .settings import settings
        set_tuning_table(settings().tuning_path or DEFAULT_TABLE)
    return _table


def table_digest():
    """A short digest of the table in use: ranks must agree on it (see mpiallreduce.settings)."""
    text = json.dumps(tuning_table().get("by_ranks", {}), sort_keys=True).encode()
    return hashlib.blake2b(text, digest_size=8).hexdigest()


def _rules_for(size):
    by_ranks = {int(k): v for k, v in tuning_table().get("by_ranks", {}).items()}
    if not by_ranks:
        return []
    if size in by_ranks:
        return by_ranks[size]
    smaller = [k for k in by_ranks if k <= size]
    return by_ranks[max(smaller) if smaller else min(by_ranks)]


def choose_name(nbytes, size, known):
    """The algorithm name the table gives for ``nbytes`` on ``size`` ranks ("mpi" if none applies)."""
    key = (nbytes, size)
    choice = _choices.get(key)
    if choice is None:
        choice = "mpi"
        for rule in _rules_for(size):
            if rule.get("up_to_bytes") is None or nbytes <= rule["up_to_bytes"]:
                choice = rule["algorithm"] if rule["algorithm"] in known else "mpi"
                break
        if len(_choices) < 4096:
            _choices[key] = choice
    return choice


def rules_from_measurements(measurements):
    """Rules for one rank count from (nbytes, algorithm, time) triples: the fastest per size (MPI's
    own unless beaten by more than PREFER_MPI_WITHIN), sizes with one winner merged, boundaries
    halfway (geometrically) between measured sizes."""
    by_size = {}
    for nbytes, algorithm, seconds in measurements:
        by_size.setdefault(nbytes, {})[algorithm] = seconds
    winners = []
    for nbytes in sorted(by_size):
        times = by_size[nbytes]
        best = min(times, key=times.get)
        if "mpi" in times and times["mpi"] <= times[best] * (1 + PREFER_MPI_WITHIN):
            best = "mpi"
        winners.append((nbytes, best))
    rules = []
    for i, (nbytes, best) in enumerate(winners):
        if rules and rules[-1]["algorithm"] == best:
            continue
        if rules:
            previous = winners[i - 1][0]
            rules[-1]["up_to_bytes"] = int(math.sqrt(previous * nbytes))
        rules.append({"up_to_bytes": None, "algorithm": best})
    return rules
