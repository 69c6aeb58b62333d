"""``mpiallreduce tune``: measure every host algorithm here and write the table ``auto`` reads.

    mpiallreduce launch -n 4 -- python -m mpiallreduce tune --output my-table.json
    MPIALLREDUCE_TUNING=my-table.json python my_training.py

The table's format and how it is read: mpiallreduce.tuning.
"""
import argparse
import json
import os

from .tuning import TUNING_ENV, rules_from_measurements

__all__ = ["main"]


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
