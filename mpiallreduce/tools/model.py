"""``mpiallreduce model RESULTS...``: fit a two-level cost model to bench runs and project it \
to many ranks.

Each algorithm's time is modelled as (docs/field-notes.md; Thakur, Rabenseifner & Gropp 2005, with
the network split from the node as in Hockney's model applied per level)

    T = a_node*alpha_node + b_node*beta_node + a_net*alpha_net + b_net*beta_net + c*gamma

alpha: the latency of one message, beta: the time per byte on one link, each within a node
(shared memory) and between nodes (the network); gamma: the time per byte reduced. The counts
(a, b, c) come from the algorithm's steps for p ranks on N nodes of p/N ranks each, placed by block
(``cost_terms``). A step whose pairs all stay within a node costs node terms; a step in which some
pair crosses costs network terms, with the bytes of every rank of a node that crosses at once
(they share the node's link: recursive doubling across nodes sends p/N copies of the buffer over
it, the ring one, ``two_level`` p/N shards). Node leaders (``hierarchical``) and rails
(``two_level``) are modelled running recursive doubling below 64 KiB and Rabenseifner above, the
tuning table's usual choice.

The fit finds the non-negative constants that best explain the measured times of our algorithms
(least squares on relative error), from runs on one node and across nodes together; a constant
no run shows is reported as not resolved. Runs with more ranks than cores on a machine (their
metadata says so) are left out of the fit, and their rows still compared with it. It then says how
far it is off, per layout, and for each cross-node row. The projection keeps this machine's node
constants and gamma and replaces the network by the one the user names (--latency-us,
--bandwidth-gbs): how every algorithm would fare on 64 to 4096 ranks of --ranks-per-node each, as a
table and a figure (model.png).
"""

import os

from .arguments import ArgumentParser, size_list

# the counts and the fit (model_fit.py), the tables and the figure (model_report.py); their names
# stay importable from here
from .model_fit import (
    CONSTANTS,
    FLAT,
    INNER_SWITCH_BYTES,
    MODELLED,
    Row,
    _rows,
    cost_terms,
    fit,  # noqa: F401
    fitted_rows,
    project,
)
from .model_report import plot_projection, projection_table, report_fit  # noqa: F401

__all__ = ["CONSTANTS", "MODELLED", "cost_terms", "fit", "project", "main"]


def main(argv=None):
    from .results import ResultsError, find_runs

    parser = ArgumentParser(
        prog="mpiallreduce model",
        description=__doc__.split("\n")[0],
        examples=("mpiallreduce model results/latest results/nodes/2nodes-2ranks",),
    )
    parser.add_argument(
        "results",
        nargs="+",
        help="results folders of `mpiallreduce bench --output` (or folders of them, or bench.json "
        "files): runs on one node and across nodes are fitted together",
    )
    parser.add_argument(
        "--latency-us", type=float, default=2.0, help="network latency per message (default 2 us)"
    )
    parser.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=12.5,
        help="bandwidth of one node's network link (default 12.5 GB/s)",
    )
    parser.add_argument(
        "--ranks-per-node", type=int, default=8, help="ranks per node of the projection (default 8)"
    )
    parser.add_argument(
        "--ranks", type=size_list, default=[64, 512, 4096], help="rank counts to project to"
    )
    parser.add_argument("--sizes", type=size_list, default=[4 << 10, 1 << 20, 64 << 20, 1 << 30])
    parser.add_argument(
        "--output", metavar="DIR", help="folder for model.png (default: the first results folder)"
    )
    args = parser.parse_args(argv)
    if not args.latency_us > 0 or not args.bandwidth_gbs > 0 or args.ranks_per_node < 1:
        parser.error(
            "--latency-us and --bandwidth-gbs must be positive, --ranks-per-node at least 1"
        )
    try:
        runs = find_runs(args.results)
        rows = _rows(runs)
        constants, error = fit(fitted_rows(rows))
    except (ResultsError, ValueError) as e:
        parser.error(str(e))
    print(report_fit(rows, constants, error))
    projected = constants.copy()
    projected[2:4] = (args.latency_us * 1e-6, 1 / (args.bandwidth_gbs * 1e9))
    network = f"a network of {args.latency_us:g} us and {args.bandwidth_gbs:g} GB/s per node"
    print(
        f"# projected to {network}, {args.ranks_per_node} ranks per node; within a node and gamma "
        "as fitted"
    )
    print(projection_table(projected, args.ranks, args.sizes, args.ranks_per_node))
    first = args.results[0]
    output = args.output or (first if os.path.isdir(first) else os.path.dirname(first) or ".")
    os.makedirs(output, exist_ok=True)
    print(
        plot_projection(
            projected,
            args.ranks,
            args.sizes,
            args.ranks_per_node,
            network,
            os.path.join(output, "model.png"),
        )
    )
    return 0
