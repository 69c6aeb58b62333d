"""Two or more configurations of the package measured side by side: their launches interleaved
(A B A B ...), each launch's times taken as ratios to raw MPI_Allreduce in that same launch, and
the median ratio over the launches compared.

    python benchmarks/side_by_side.py --rounds 5 [--nodes 2] \\
        --config old:PYTHONPATH=/path/to/old/checkout --config new: \\
        --config unchecked:MPIALLREDUCE_SIGNATURE_MIN_BYTES=off

A configuration is NAME:VAR=VALUE,VAR=VALUE (environment given to its launches; PYTHONPATH picks a
checkout of another commit). Each launch runs benchmarks/call_price.py on --ranks ranks. Prints a
table per size: each contender's median us per call and ratio to raw MPI, per configuration, and
each configuration's ratio to the first.

With ``--bench "ARGS"`` each launch is ``mpiallreduce bench ARGS`` instead, and the table is each
contender's gain (Open MPI's default time / its time, in that launch: make bench's gain column).
``--output FILE`` also writes the table there, and every launch's measurements to FILE.json;
``--from FILE.json`` prints the table again from those (no launch).
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from mpiallreduce.tools.launch import run

HERE = Path(__file__).resolve().parent


def parse_config(text):
    name, _, assignments = text.partition(":")
    env = {}
    for item in filter(None, assignments.split(",")):
        key, _, value = item.partition("=")
        env[key] = value
    return name, env


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", required=True, type=parse_config)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--program", default=str(HERE / "call_price.py"))
    parser.add_argument(
        "--bench", default=None, help="arguments of mpiallreduce bench (gains instead of us)"
    )
    parser.add_argument(
        "--output", default=None, help="also write the table to this file (and FILE.json)"
    )
    parser.add_argument(
        "--from", dest="source", default=None, help="the table of a FILE.json written before"
    )
    if "--from" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(config=[])
        for action in parser._actions:
            action.required = False
    args = parser.parse_args(argv)
    if args.source is not None:
        saved = json.loads(Path(args.source).read_text())
        args.config = [(name, {}) for name in saved["configurations"]]
        args.ranks, args.nodes, args.rounds, args.bench = (
            saved["ranks"],
            saved["nodes"],
            saved["rounds"],
            saved["bench"],
        )
        micros = saved["launches"]
    else:
        micros = {name: [] for name, _ in args.config}
        for _ in range(args.rounds):
            for name, extra in args.config:
                env = dict(os.environ, **extra)
                micros[name].append(
                    _bench(args, env, name)
                    if args.bench is not None
                    else _call_price(args, env, name)
                )
        if args.output:
            Path(args.output + ".json").write_text(
                json.dumps(
                    {
                        "configurations": {name: extra for name, extra in args.config},
                        "ranks": args.ranks,
                        "nodes": args.nodes,
                        "rounds": args.rounds,
                        "bench": args.bench,
                        "launches": micros,
                    },
                    indent=1,
                )
            )
    ratios = {
        name: [
            {size: {c: us / row["raw"] for c, us in row.items()} for size, row in measured.items()}
            for measured in launches
        ]
        for name, launches in micros.items()
    }
    lines = []
    print = lines.append  # noqa: A001 - the table goes to stdout and to --output
    first = args.config[0][0]
    where = f"{args.ranks} ranks" + (
        f", {args.nodes} emulated nodes" if args.nodes else ", one node"
    )
    what = (
        f"mpiallreduce bench {args.bench}: each contender's time over Open MPI's default's "
        "('raw'), so below 1 is a gain"
        if args.bench is not None
        else "median over launches of each launch's median us per call, and of its ratio to raw "
        "MPI_Allreduce in the same launch"
    )
    print(f"# {where}; {args.rounds} interleaved launches per configuration; {what}")
    for size in micros[first][0]:
        print(f"\n{size}")
        contenders = list(micros[first][0][size])
        print("  " + "configuration".ljust(14) + "".join(c.rjust(22) for c in contenders))
        medians = {}
        for name, _ in args.config:
            medians[name] = {
                c: statistics.median(r[size][c] for r in ratios[name]) for c in contenders
            }
            cells = [
                f"{statistics.median(m[size][c] for m in micros[name]):8.2f} "
                f"({medians[name][c]:.2f}x)"
                for c in contenders
            ]
            print("  " + name.ljust(14) + "".join(cell.rjust(22) for cell in cells))
        for name, _ in args.config[1:]:
            cells = [f"{medians[name][c] / medians[first][c]:.2f}x" for c in contenders]
            print("  " + f"{name}/{first}".ljust(14) + "".join(cell.rjust(22) for cell in cells))
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.output and args.source is None:
        Path(args.output).write_text(text)


def _call_price(args, env, name):
    result = run(args.ranks, [sys.executable, args.program], timeout=600, env=env, nodes=args.nodes)
    line = next((ln for ln in result.output.splitlines() if ln.startswith("RESULT ")), None)
    if result.returncode != 0 or line is None:
        sys.exit(f"{name}: launch failed (rc {result.returncode}):\n{result.output[-3000:]}")
    return json.loads(line[len("RESULT ") :])["us"]


def _bench(args, env, name):
    """One ``mpiallreduce bench`` launch: {size: {"raw": Open MPI's default us, contender: us}}."""
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable,
            "-m",
            "mpiallreduce",
            "bench",
            *shlex.split(args.bench),
            "--output",
            folder,
        ]
        result = run(args.ranks, command, timeout=600, env=env, nodes=args.nodes)
        if result.returncode != 0:
            sys.exit(f"{name}: bench failed (rc {result.returncode}):\n{result.output[-3000:]}")
        measurements = json.loads(Path(folder, "bench.json").read_text())["measurements"]
    table = {}
    for m in measurements:
        if m["in_place"] or m["wrong"]:
            continue
        row = table.setdefault(f"{m['nbytes']} B", {})
        row["raw" if m["algorithm"] == "openmpi" else m["algorithm"]] = m["time_us"]
    return table


if __name__ == "__main__":
    main()
