"""``mpiallreduce tune``: measure every host algorithm here and write the table ``auto`` reads.

    mpiallreduce launch -n 4 -- python -m mpiallreduce tune --output my-table.json
    mpiallreduce launch -n 4 --nodes 2 -- python -m mpiallreduce tune --output my-table.json
    MPIALLREDUCE_TUNING=my-table.json python my_training.py
    mpiallreduce tune --from-bench results/gpu/bench-gpu.json --output my-table.json

On ranks that span nodes it measures what runs across nodes and writes the table's ``by_nodes``
section (for that node and rank count), which ``auto`` reads on such communicators. Out of place
and in place (``out=x``) each get rules of their own (``by_ranks_in_place``, ``by_nodes_in_place``).

``--from-bench`` measures nothing: it reads a ``bench --device gpu`` run's bench.json (the GPU
check's bench-gpu.json) and writes the table's ``device`` section from it (one node: the fastest
of Open MPI's path, which becomes ``mpi``, and ours at each size; ``"measured": true``), keeping
the section's rules across nodes, which one node cannot measure.

It also prices a plain call of each algorithm against a prepared one, less the same for MPI's own
(whose plain call takes the compiled short path; mpiallreduce.tools.plain_price): MPI's own is kept
wherever another algorithm gains less than its price (``plain_call_prices_us`` in the table's
metadata, with the lowest and highest of the runs' prices), so that a plain call does not lose
where a prepared one gains a little.

It measures, at every size, a prepared call of MPI's own bound as a persistent request
(MPI_Allreduce_init) against the same as the blocking call, and writes the table's
``persistent_by_ranks`` rules (across nodes ``persistent_by_nodes``): persistent where it is faster
by more than 5% (mpiallreduce.tools.persistent_rules; the times in the metadata, ``persistent_us``),
first: the algorithms are then timed against MPI's own as those rules will run it. Not under ULFM,
where prepared calls are never persistent requests.

The table's format and how it is read: mpiallreduce.tuning.
"""

import copy
import json
import os
import statistics

from ..core.tuning import (
    TUNING_ENV,
    rules_from_measurements,
    rules_kept_outside,
    set_tuning_table,
    shipped_device_section,
    tuning_table,
)
from .arguments import ArgumentParser, size_list

__all__ = ["main"]


def device_section_from_bench(bench, previous=None):
    """The tuning table's ``device`` section from a ``bench --device gpu`` run (bench.json,
    loaded)."""
    if bench.get("metadata", {}).get("device") not in ("gpu", "fake-gpu"):
        raise ValueError("not a bench run on device arrays (bench --device gpu)")
    from .bench import BASELINE

    measured = [
        (m["nbytes"], "mpi" if m["algorithm"] == BASELINE else m["algorithm"], m["time_us"])
        for m in bench["measurements"]
        if not m["in_place"]
        and m["algorithm"] != "auto"
        and ":" not in m["algorithm"]
        and not m["wrong"]
    ]
    if not measured:
        raise ValueError("the run has no out-of-place measurements without wrong elements")
    section = dict(previous or shipped_device_section())
    section.pop("note", None)  # (a guess's note: these rules are measured, and say where from)
    section.update(
        measured=bench["metadata"].get("device") == "gpu",
        one_node=rules_from_measurements(measured),
        source={
            key: bench["metadata"].get(key)
            for key in ("date_utc", "git_commit", "hosts", "ranks", "mpi_library", "cuda_aware")
        },
    )
    return section


def _write_device_section(path, output):
    with open(path) as f:
        bench = json.load(f)
    table = {"metadata": {}, "by_ranks": {}}
    if os.path.exists(output):
        with open(output) as f:
            table = json.load(f)
    table["device"] = device_section_from_bench(bench, table.get("device"))
    with open(output, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    print(
        "# device arrays on one node: auto will use "
        f"({'measured' if table['device']['measured'] else 'stand-in'})"
    )
    _print_rules(table["device"]["one_node"])
    print(f"# written to {output}")
    return 0


def _print_rules(rules):
    low = 0
    for rule in rules:
        high = rule["up_to_bytes"]
        print(f"  {low:>10} .. {'' if high is None else high:<10} bytes: {rule['algorithm']}")
        low = (high or 0) + 1


def _put(table, args, section, ranks, key, rules, written):
    """``section[ranks] = rules`` and the table's metadata ``key`` = ``written``; with
    ``--keep-above`` the new rules below the cut, the section's earlier ones above it, and below the
    smallest size measured (if above 4 B) the section's earlier ones too (the metadata says so). The
    rules put."""
    low = (
        min(args.sizes) if min(args.sizes) > 4 else 0
    )  # (below the smallest size measured: the table's, kept)
    if (args.keep_above or low) and ranks in section:
        high = args.keep_above[0] if args.keep_above else None
        rules = rules_kept_outside(rules, section[ranks], low, high)
        written.update(
            kept_above_bytes=high,
            kept_below_bytes=low or None,
            kept_from=table.get("metadata", {}).get(key),
        )
    section[ranks] = rules
    table.setdefault("metadata", {})[key] = written
    return rules


def _section(table, state, ranks, suffix, prefix=""):
    """(the table's section for these ranks' rules, their metadata key, where, in words): by_ranks,
    or on ranks that span nodes by_nodes (auto reads it on such communicators), each ``suffix``
    "_in_place" or not; ``prefix`` "persistent_": the persistent rules' sections."""
    key = ranks + suffix.replace("_", " ")
    if state.spans_nodes:
        nodes = str(state.node_count)
        section = table.setdefault(prefix + "by_nodes" + suffix, {}).setdefault(nodes, {})
        key, where = (
            f"{nodes} nodes, {ranks} ranks" + suffix.replace("_", " "),
            f"{ranks} ranks on {nodes} nodes",
        )
    else:
        section, where = table.setdefault(prefix + "by_ranks" + suffix, {}), f"{ranks} ranks"
    return (
        section,
        key + (" persistent" if prefix else ""),
        where + suffix.replace("_", ", ", 1).replace("_", " "),
    )


def _write_rules(table, args, metadata, state, ranks, suffix, rules, prices):
    """Put one mode's algorithm rules (and their metadata, with the plain calls' ``prices``) into
    ``table``: by_ranks, or by_nodes where the ranks span nodes; print them."""
    section, key, where = _section(table, state, ranks, suffix)
    rules = _put(
        table, args, section, ranks, key, rules, dict(metadata, plain_call_prices_us=prices)
    )
    print(
        f"# {where}: auto will use (MPI's own unless another gains more than 5% "
        "and more than its plain call's price: "
        + ", ".join(f"{name} {price[0]:.1f}" for name, price in prices.items())
        + " us)"
    )
    _print_rules(rules)


def main(argv=None):
    from ..algorithms import HOST_ALGORITHMS as ALGORITHMS
    from ..core.state import state_of
    from .bench import compare, run_metadata
    from .bench.driver import runnable_here
    from .persistent_rules import persistent_rules
    from .plain_price import plain_call_prices_us

    parser = ArgumentParser(
        prog="mpiallreduce tune",
        description=__doc__.split("\n")[0],
        examples=("mpiallreduce launch -n 2 -- mpiallreduce tune",),
    )
    parser.add_argument(
        "--sizes",
        type=size_list,
        default=[4**k for k in range(1, 14)],
        help="comma-separated sizes in bytes (K, M, G suffixes); default 4 B..64 MiB by 4x",
    )
    parser.add_argument(
        "--repetitions", type=int, default=5, help="interleaved repetitions in each run"
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=3,
        help="whole runs; each algorithm's time at a size is the median of its runs' medians "
        "(one noisy run cannot flip a choice); default 3",
    )
    parser.add_argument(
        "--mode",
        choices=["both", "out-of-place", "in-place"],
        default="both",
        help="which rules to measure and write (out-of-place: by_ranks/by_nodes; in-place: "
        "their _in_place sections); default both",
    )
    parser.add_argument(
        "--output",
        default=os.environ.get(TUNING_ENV) or "tuning.json",
        help="table to write or update (default: $MPIALLREDUCE_TUNING or ./tuning.json)",
    )
    parser.add_argument(
        "--keep-above",
        type=size_list,
        metavar="BYTES",
        help="write the new rules up to BYTES only and keep the table's rules above it (its "
        "metadata says so): where runs differ by more than the algorithms do",
    )
    parser.add_argument(
        "--persistent-only",
        action="store_true",
        help="measure and write only where a prepared call of MPI's own is a persistent request "
        "(persistent_by_ranks, or persistent_by_nodes), keeping the table's algorithm rules (a new "
        "file: the table in use, with its rules)",
    )
    parser.add_argument(
        "--from-bench",
        metavar="BENCH_JSON",
        help="write the device section from a bench --device gpu run's bench.json; measure nothing",
    )
    args = parser.parse_args(argv)
    if args.from_bench:
        try:
            return _write_device_section(args.from_bench, args.output)
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"--from-bench {args.from_bench}: {error}")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    sizes = args.sizes
    state = state_of(comm).make_ready()
    ranks = str(comm.Get_size())
    algorithms, skipped = runnable_here(comm, list(ALGORITHMS))
    modes = {"both": (False, True), "out-of-place": (False,), "in-place": (True,)}[args.mode]
    in_use = copy.deepcopy(tuning_table())
    persistent, persistent_us = {}, {}
    if (
        hasattr(comm, "Allreduce_init") and state.facts.persistent_collectives
    ):  # (not under ULFM: never persistent)
        persistent, persistent_us = persistent_rules(
            comm, sizes, modes, args.repetitions, args.runs
        )
        measured_with = copy.deepcopy(
            in_use
        )  # (the algorithms are timed against MPI's own as it will run)
        for (
            in_place,
            rules,
        ) in persistent.items():  # (as they will be written: --keep-above's cut too)
            section, key, _ = _section(
                measured_with, state, ranks, "_in_place" if in_place else "", "persistent_"
            )
            _put(measured_with, args, section, ranks, key, rules, {})
        set_tuning_table(measured_with)
    elif args.persistent_only:
        parser.error(
            "--persistent-only: no persistent collectives here (MPI_Allreduce_init; not under ULFM)"
        )
    runs, prices, spreads = [], {}, {}
    if not args.persistent_only:
        runs = [
            compare(comm, sizes, algorithms, repetitions=args.repetitions, modes=modes, forced=())
            for _ in range(max(1, args.runs))
        ]
        prices, spreads = plain_call_prices_us(comm, algorithms, modes, args.repetitions, args.runs)
    metadata = run_metadata(comm, vars(args))
    if comm.Get_rank() != 0:
        return 0
    table = (
        in_use if args.persistent_only else {"metadata": {}, "by_ranks": {}}
    )  # (--persistent-only, a new
    if os.path.exists(args.output):  # file: the table in use, its algorithm rules kept)
        with open(args.output) as f:
            table = json.load(f)
    for line in [] if args.persistent_only else skipped:
        print(f"# skipped: {line}")
    times = {}
    for results in runs:
        for m in results:
            if m.algorithm in algorithms:
                times.setdefault((m.in_place, m.nbytes, m.algorithm), []).append(m.time_us)
    for in_place, suffix in (
        (False, ""),
        (True, "_in_place"),
    ):  # (in-place calls: rules of their own)
        if in_place not in modes:
            continue
        if not args.persistent_only:
            rules = rules_from_measurements(
                [
                    (nbytes, algorithm, statistics.median(t))
                    for (mode_, nbytes, algorithm), t in times.items()
                    if mode_ == in_place
                ],
                {name: price for (mode_, name), price in prices.items() if mode_ == in_place},
            )
            _write_rules(
                table,
                args,
                metadata,
                state,
                ranks,
                suffix,
                rules,
                {
                    name: [round(price, 2), *(round(bound, 2) for bound in spreads[mode_, name])]
                    for (mode_, name), price in sorted(prices.items())
                    if mode_ == in_place
                },
            )
        if in_place in persistent:  # (prepared calls of MPI's own, persistent or blocking, by size)
            section, key, where = _section(table, state, ranks, suffix, "persistent_")
            rules = _put(
                table,
                args,
                section,
                ranks,
                key,
                persistent[in_place],
                dict(
                    metadata,
                    persistent_us={
                        str(nbytes): [round(t, 2) for t in pair]
                        for nbytes, pair in sorted(persistent_us[in_place].items())
                    },
                ),
            )
            print(
                f"# {where}: a prepared call of MPI's own runs (mpi:persistent where it beats the "
                "blocking call, mpi, by more than 5%)"
            )
            _print_rules(rules)
    with open(args.output, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    print(f"# written to {args.output}")
    return 0
