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
"""
import argparse
import json
import os
import statistics
import sys
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
    args = parser.parse_args(argv)
    ratios = {name: [] for name, _ in args.config}
    micros = {name: [] for name, _ in args.config}
    for _ in range(args.rounds):
        for name, extra in args.config:
            env = dict(os.environ, **extra)
            result = run(args.ranks, [sys.executable, args.program], timeout=600, env=env, nodes=args.nodes)
            line = next((ln for ln in result.output.splitlines() if ln.startswith("RESULT ")), None)
            if result.returncode != 0 or line is None:
                sys.exit(f"{name}: launch failed (rc {result.returncode}):\n{result.output[-3000:]}")
            measured = json.loads(line[len("RESULT "):])["us"]
            micros[name].append(measured)
            ratios[name].append({size: {c: us / row["raw"] for c, us in row.items()} for size, row in measured.items()})
    first = args.config[0][0]
    where = f"{args.ranks} ranks" + (f", {args.nodes} emulated nodes" if args.nodes else ", one node")
    print(f"# {where}; {args.rounds} interleaved launches per configuration; median over launches of each "
          "launch's median us per call, and of its ratio to raw MPI_Allreduce in the same launch")
    for size in micros[first][0]:
        print(f"\n{size}")
        contenders = list(micros[first][0][size])
        print("  " + "configuration".ljust(14) + "".join(c.rjust(22) for c in contenders))
        medians = {}
        for name, _ in args.config:
            medians[name] = {c: statistics.median(r[size][c] for r in ratios[name]) for c in contenders}
            cells = [f"{statistics.median(m[size][c] for m in micros[name]):8.2f} ({medians[name][c]:.2f}x)"
                     for c in contenders]
            print("  " + name.ljust(14) + "".join(cell.rjust(22) for cell in cells))
        for name, _ in args.config[1:]:
            cells = [f"{medians[name][c] / medians[first][c]:.2f}x" for c in contenders]
            print("  " + f"{name}/{first}".ljust(14) + "".join(cell.rjust(22) for cell in cells))


if __name__ == "__main__":
    main()
