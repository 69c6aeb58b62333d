"""``mpiallreduce tune``: measure every host algorithm here and write the table ``auto`` reads.

    mpiallreduce launch -n 4 -- python -m mpiallreduce tune --output my-table.json
    mpiallreduce launch -n 4 --nodes 2 -- python -m mpiallreduce tune --output my-table.json
    MPIALLREDUCE_TUNING=my-table.json python my_training.py

On ranks that span nodes it measures what runs across nodes and writes the table's ``by_nodes``
section (for that node and rank count), which ``auto`` reads on such communicators.

The table's format and how it is read: mpiallreduce.tuning.
"""
import json
import os

from .arguments import ArgumentParser, size_list
from .tuning import TUNING_ENV, rules_from_measurements

__all__ = ["main"]


def main(argv=None):
    from mpi4py import MPI

    from .algorithms import HOST_ALGORITHMS as ALGORITHMS
    from .bench import compare, run_metadata
    from .bench.driver import runnable_here
    from .state import state_of

    parser = ArgumentParser(prog="mpiallreduce tune", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=size_list, default=[4 ** k for k in range(1, 14)],
                        help="comma-separated sizes in bytes (K, M, G suffixes); default 4 B..64 MiB by 4x")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--output", default=os.environ.get(TUNING_ENV) or "tuning.json",
                        help="table to write or update (default: $MPIALLREDUCE_TUNING or ./tuning.json)")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    sizes = args.sizes
    state = state_of(comm).make_ready()
    algorithms, skipped = runnable_here(comm, list(ALGORITHMS))
    results = compare(comm, sizes, algorithms, repetitions=args.repetitions, modes=(False,), forced=())
    metadata = run_metadata(comm, vars(args))
    if comm.Get_rank() != 0:
        return 0
    rules = rules_from_measurements([(m.nbytes, m.algorithm, m.time_us) for m in results
                                     if m.algorithm in algorithms])
    table = {"metadata": {}, "by_ranks": {}}
    if os.path.exists(args.output):
        with open(args.output) as f:
            table = json.load(f)
    ranks = str(comm.Get_size())
    if state.spans_nodes:  # a section of its own: auto reads it on communicators that span nodes
        nodes = str(state.node_count)
        table.setdefault("by_nodes", {}).setdefault(nodes, {})[ranks] = rules
        table.setdefault("metadata", {})[f"{nodes} nodes, {ranks} ranks"] = metadata
        where = f"{ranks} ranks on {nodes} nodes"
    else:
        table.setdefault("by_ranks", {})[ranks] = rules
        table.setdefault("metadata", {})[ranks] = metadata
        where = f"{ranks} ranks"
    with open(args.output, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    for line in skipped:
        print(f"# skipped: {line}")
    print(f"# {where}: auto will use")
    low = 0
    for rule in rules:
        high = rule["up_to_bytes"]
        print(f"  {low:>10} .. {'' if high is None else high:<10} bytes: {rule['algorithm']}")
        low = (high or 0) + 1
    print(f"# written to {args.output}")
    return 0
