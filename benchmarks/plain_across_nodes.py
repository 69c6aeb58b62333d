"""A plain call where the signature goes in messages (across nodes, under ULFM): what ``auto`` runs,
against the check and then the tuning table's choice (what ``auto`` ran before dissemination carried
the check on 2 ranks past 16 KiB), the check and then MPI's own, and raw ``comm.Allreduce``:

    mpiallreduce launch -n 2 --nodes 2 -- python benchmarks/plain_across_nodes.py
        [--sizes 4,64K,1M] [--rounds 15] [--in-place] [--output FILE]

Interleaved in one launch, ``--rounds`` times per size: a batch of plain calls of each contender on
the same float32 buffers (``mar.allreduce(x, out=out)``, ``mar.allreduce(x, out=out,
algorithm=...)``), then raw ``comm.Allreduce``; with ``--in-place`` each contender on a buffer of
its own, ``out=x`` and ``MPI_IN_PLACE``. Each figure: the mean time per call over a batch, the
slowest rank's, in microseconds; then per size the medians over the rounds and ``auto`` against raw
(raw's time over auto's: 1.0 is as fast as MPI's own call, which compares nothing).
"""

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI
from signature_exchange import per_call, write_lines  # (benchmarks/, the script's folder)

import mpiallreduce as mar
from mpiallreduce.core.planner import plan_call
from mpiallreduce.core.state import state_of

ROUNDS = 15
COMM = MPI.COMM_WORLD
SIZES = "4,8K,32K,64K,128K,256K,512K,1M,4M"


def nbytes_of(text):
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def table_choice(x, in_place=False):
    """What ``auto`` runs where the dissemination rule does not apply: the table's choice."""
    facts = dataclasses.replace(state_of(COMM).make_ready().facts, compiled=False)
    return plan_call(facts, False, x.dtype, x.nbytes, "sum", "auto", in_place=in_place).name


def arguments(description, sizes=SIZES, rounds=ROUNDS, in_place=False, forced=False):
    """--sizes, --rounds and --output (and ``in_place``: --in-place; ``forced``: --forced), parsed
    (this script's, and exchange_across_nodes.py's)."""
    parser = argparse.ArgumentParser(description=description)
    if in_place:
        parser.add_argument(
            "--in-place", action="store_true", help="out=x and MPI_IN_PLACE (default: out of place)"
        )
    if forced:
        parser.add_argument(
            "--forced", action="store_true", help="also time Open MPI's six tuned algorithms forced"
        )
    parser.add_argument(
        "--sizes", default=sizes, help=f"comma-separated bytes (K, M suffixes); default {sizes}"
    )
    parser.add_argument(
        "--rounds", type=int, default=rounds, help=f"interleaved rounds per size (default {rounds})"
    )
    parser.add_argument("--output", help="also write the lines to this file (rank 0)")
    return parser.parse_args()


def interleaved(contenders, calls, rounds, nbytes, lines):
    """``rounds`` rounds of a batch of ``calls`` of each contender in turn, a line for each round
    appended to ``lines``: {name: the median over the rounds of the us per call}."""
    times = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, call in contenders.items():
            times[name].append(per_call(call, calls))
        lines.append(
            f"{nbytes:>8} B  " + "  ".join(f"{name} {times[name][-1]:8.1f}" for name in contenders)
        )
    return {name: statistics.median(values) for name, values in times.items()}


def plain(x, out, algorithm, in_place):
    """A plain call of ``algorithm`` on ``x`` into ``out``; in place on a copy of ``x`` of its
    own."""
    if in_place:
        y = x.copy()
        return lambda: mar.allreduce(y, out=y, algorithm=algorithm)
    return lambda: mar.allreduce(x, out=out, algorithm=algorithm)


def main():
    args = arguments(__doc__.splitlines()[0], in_place=True)
    lines = [
        f"# plain calls{', in place' if args.in_place else ''}, the signature in messages: "
        f"{COMM.Get_size()} ranks, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, "
        f"load {' '.join(Path('/proc/loadavg').read_text().split()[:3])}, "
        "us per call, slowest rank, "
        f"{args.rounds} interleaved rounds"
    ]
    summary = []
    for nbytes in (nbytes_of(s) for s in args.sizes.split(",")):
        x = np.arange(max(nbytes // 4, 1), dtype=np.float32) + COMM.Get_rank()
        out = np.empty_like(x)
        assert (
            "32-byte messages" in mar.describe_call(x, out=out, algorithm="mpi")
            or COMM.Get_size() == 1
        ), "the check does not go in messages here: launch with --nodes 2"
        auto = mar.describe_call(x, out=x if args.in_place else out).split(" ")[0]
        table = table_choice(x, args.in_place)
        contenders = {
            f"auto ({auto})": plain(x, out, "auto", args.in_place),
            f"check + {table}": plain(x, out, table, args.in_place),
        }
        if table != "mpi":
            contenders["check + mpi"] = plain(x, out, "mpi", args.in_place)
        contenders["MPI_Allreduce"] = (
            # (y: a copy of this size's x, made once, here, for the in-place calls)
            (lambda y=x.copy(): COMM.Allreduce(MPI.IN_PLACE, y))  # noqa: B008
            if args.in_place
            else (lambda x=x, out=out: COMM.Allreduce(x, out))
        )
        calls = max(20, min(1000, int(4e7 / max(nbytes, 40000))))
        for call in contenders.values():
            for _ in range(10):
                call()
        medians = interleaved(contenders, calls, args.rounds, x.nbytes, lines)
        summary.append(
            f"{x.nbytes:>8} B  medians: "
            + "  ".join(f"{name} {m:.1f}" for name, m in medians.items())
            + "  |  auto against MPI_Allreduce "
            f"{medians['MPI_Allreduce'] / medians[f'auto ({auto})']:.2f}x"
        )
    write_lines(lines + ["# medians over the rounds"] + summary, args.output)


if __name__ == "__main__":
    main()
