"""The table that ``algorithm="auto"`` reads: which algorithm for which rank count and message size.

``mpiallreduce tune`` (under mpiexec/srun) measures every algorithm on the current machine and rank
count, and writes or updates the table. The table used is, in order: the one given to
``set_tuning_table(path)``, the file named by ``MPIALLREDUCE_TUNING`` (read at first use), or the
one shipped with the package (measured on this project's 2-core machines).

Format (JSON)::

    {"metadata": {...},
     "by_ranks": {"2": [{"up_to_bytes": 65536, "algorithm": "mpi"},
                        {"up_to_bytes": null, "algorithm": "ring_pipelined"}], ...}}

For a rank count not in the table, the nearest smaller one is used (else the smallest).
"""
import argparse
import json
import math
import os

__all__ = ["TUNING_ENV", "DEFAULT_TABLE", "set_tuning_table", "tuning_table", "choose_name",
           "rules_from_measurements", "main"]

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


def tuning_table():
    if _table is None:
        set_tuning_table(os.environ.get(TUNING_ENV) or DEFAULT_TABLE)
    return _table


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


def main(argv=None):
    from mpi4py import MPI

    from .algorithms import HOST_ALGORITHMS as ALGORITHMS
    from .bench import compare, parse_size, run_metadata

    parser = argparse.ArgumentParser(prog="mpiallreduce tune", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(str(4 ** k) for k in range(1, 14)),
                        help="comma-separated sizes in bytes (K, M, G suffixes); default 4 B..64 MiB by 4x")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--output", default=os.environ.get(TUNING_ENV) or "tuning.json",
                        help="table to write or update (default: $MPIALLREDUCE_TUNING or ./tuning.json)")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    results = compare(comm, sizes, ALGORITHMS, repetitions=args.repetitions, modes=(False,), forced=())
    metadata = run_metadata(comm, vars(args))
    if comm.Get_rank() != 0:
        return 0
    rules = rules_from_measurements([(m.nbytes, m.algorithm, m.time_us) for m in results
                                     if m.algorithm in ALGORITHMS])
    table = {"metadata": {}, "by_ranks": {}}
    if os.path.exists(args.output):
        with open(args.output) as f:
            table = json.load(f)
    table.setdefault("by_ranks", {})[str(comm.Get_size())] = rules
    table.setdefault("metadata", {})[str(comm.Get_size())] = metadata
    with open(args.output, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    print(f"# {comm.Get_size()} ranks: auto will use")
    low = 0
    for rule in rules:
        high = rule["up_to_bytes"]
        print(f"  {low:>10} .. {'' if high is None else high:<10} bytes: {rule['algorithm']}")
        low = (high or 0) + 1
    print(f"# written to {args.output}")
    return 0
