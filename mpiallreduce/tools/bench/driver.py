"""The command: its arguments checked, the algorithms that can run here, the run (timing.py, against
the limits of limits.py) and its header, tables and files."""

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from ... import __version__
from ...algorithms import HOST_ALGORITHMS as ALGORITHMS
from ...algorithms import REGISTRY, SYMMETRIC_ALGORITHMS
from ...core.ops import OPS, get_op
from ...core.state import state_of
from ...device.arrays import cuda_aware
from ..arguments import ArgumentParser, size_list, unknown
from ..openmpi_tuned import TUNED_ALLREDUCE_ALGORITHMS, default_allreduce_component
from .contenders import (
    AUTO_PLAIN,
    DEVICE_ALGORITHMS,
    REPRODUCIBLE,
    REPRODUCIBLE_SYMMETRIC,
    device_memory,
)

# the timing loop and the reference bandwidths: their names stay importable from here
from .limits import MEMCPY_BYTES, device_copy_bandwidth, link_bandwidth, memory_copy_bandwidth  # noqa: F401
from .metadata import machine_load, run_metadata
from .report import format_field_table, format_gain_table, gain_rows, write_results
from .reproducible_table import format_reproducible_table, reproducible_rows
from .timing import REPETITION_CAP, SETTLED_SPREAD, Measurement, compare, count_wrong  # noqa: F401

__all__ = [
    "Measurement",
    "compare",
    "count_wrong",
    "memory_copy_bandwidth",
    "device_copy_bandwidth",
    "main",
    "DEFAULT_SIZES",
    "QUICK_SIZES",
    "FULL_SIZES",
]

#: the quick sweep, the default (make bench): 11 sizes from 4 B to 64 MiB, under 2 minutes on a
#: quiet machine of 2 cores; 4 KiB and 1 MiB among them, where auto has been weakest
QUICK_SIZES = (4, 64, *(1 << k for k in range(10, 21, 2)), 4 << 20, 16 << 20, 64 << 20)
#: the full sweep (make bench-full): every power of two from 4 B to 256 MiB
FULL_SIZES = tuple(1 << k for k in range(2, 29))
DEFAULT_SIZES = QUICK_SIZES
SWEEPS = {"quick": QUICK_SIZES, "full": FULL_SIZES}


def sizes_argument(text):
    """An argparse type: 'quick', 'full' (SWEEPS), or sizes such as '4,4K,1M'."""
    return list(SWEEPS[text]) if text in SWEEPS else size_list(text)


def runnable_here(comm, names):
    """(the algorithms of ``names`` that can run on ``comm``, a line for each one left out): across
    nodes, those that need every rank on one node, or (on unequal nodes) equal nodes."""
    state = state_of(comm).make_ready()
    if state.node_count == 1:
        return names, []
    kept, skipped = [], []
    where = f"these {comm.Get_size()} ranks are on {state.node_count} nodes"
    for name in names:
        algorithm = REGISTRY.get(name)
        if algorithm is not None and algorithm.needs_one_node:
            skipped.append(
                f"{name} (needs every rank on one node; {where}: use "
                f"{algorithm.across_nodes or 'hierarchical'})"
            )
        elif algorithm is not None and algorithm.needs_equal_nodes and not state.equal_nodes:
            skipped.append(f"{name} (needs the same rank count on every node; {where}, unequal)")
        else:
            kept.append(name)
    return kept, skipped


def _checked_arguments(parser, args):
    """(sizes, algorithm names, forced Open MPI algorithm numbers), or parser.error with what is
    wrong (before any communication: every rank parses the same argv)."""
    try:
        dtype = np.dtype(args.dtype)
    except TypeError:
        parser.error(f"--dtype {args.dtype!r} is not a numpy dtype")
    if args.op not in OPS:
        parser.error("--op: " + unknown("op", args.op, list(OPS)))
    try:
        get_op(args.op).check_dtype(dtype)
    except TypeError as error:
        parser.error(f"--op {args.op} --dtype {args.dtype}: {error}")
    for size in args.sizes:
        if size == 0 or size % dtype.itemsize:
            parser.error(
                f"--sizes: {size} bytes is not a positive whole number of {dtype} elements "
                f"({dtype.itemsize} bytes each)"
            )
    known = (
        list(ALGORITHMS) + list(SYMMETRIC_ALGORITHMS) + ["auto", AUTO_PLAIN]
        if args.device == "cpu"
        else list(DEVICE_ALGORITHMS)
    )
    if args.algorithms is None:
        algorithms = list(known)  # (the reproducible sum only when asked for)
    else:
        known += [REPRODUCIBLE] + (
            [REPRODUCIBLE_SYMMETRIC] if args.device == "cpu" else []
        )  # (symmetric: host memory)
        algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
        for name in algorithms:
            if name not in known:
                parser.error("--algorithms: " + unknown("algorithm", name, known))
    if args.repetitions < 1:
        parser.error("--repetitions must be at least 1")
    if args.max_repetitions is not None and args.max_repetitions < args.repetitions:
        parser.error(
            f"--max-repetitions {args.max_repetitions} is below --repetitions {args.repetitions}"
        )
    if args.openmpi_forced in ("all", "none"):
        forced = tuple(TUNED_ALLREDUCE_ALGORITHMS) if args.openmpi_forced == "all" else ()
    else:
        numbers = [n.strip() for n in args.openmpi_forced.split(",") if n.strip()]
        if not numbers or not all(
            n.isdigit() and int(n) in TUNED_ALLREDUCE_ALGORITHMS for n in numbers
        ):
            parser.error(
                f"--openmpi-forced {args.openmpi_forced!r}: give 'all', 'none' or numbers from "
                + ", ".join(f"{k} ({v})" for k, v in TUNED_ALLREDUCE_ALGORITHMS.items())
            )
        forced = tuple(int(n) for n in numbers)
    return args.sizes, algorithms, forced


def repetitions_said(args):
    """'the median of 7 to 21 interleaved repetitions (...)', or of '5' where the least and the
    most are one number."""
    most = args.max_repetitions or REPETITION_CAP * args.repetitions
    if most == args.repetitions:
        return f"the median of {most} interleaved repetitions"
    return (
        f"the median of {args.repetitions} to {most} interleaved repetitions (more than "
        f"{args.repetitions} until their middle half is within {SETTLED_SPREAD:.0%} of the median)"
    )


def new_run_folder(root, ranks):
    """Make and return a folder of ``root`` that no run has used: bench-<ranks>ranks-<date>-<time>,
    with -2, -3 ... after it when a run of the same second has it."""
    stem = os.path.join(root, f"bench-{ranks}ranks-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(root, exist_ok=True)
    for suffix in ["", *(f"-{n}" for n in range(2, 1000))]:
        try:
            os.mkdir(stem + suffix)
        except FileExistsError:
            continue
        return stem + suffix
    raise FileExistsError(f"{stem}: a thousand runs of this second already")


def point_latest(root, folder):
    """Point ``root``/latest at ``folder`` (a relative symbolic link, replaced in one step);
    returns the link's path."""
    link = os.path.join(root, "latest")
    if os.path.exists(link) and not os.path.islink(link):
        raise FileExistsError(
            f"{link} is not a symbolic link: left as it is, not pointed at {folder}"
        )
    temporary = f"{link}.{os.getpid()}"
    os.symlink(os.path.relpath(folder, root), temporary)
    try:
        os.replace(temporary, link)
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)
    return link


def print_progress(measurements):
    """One line per size and mode: each contender's time and wrong elements (rank 0)."""
    first = measurements[0]
    times = ", ".join(
        f"{m.algorithm} {m.time_us:.1f} us" + (f" ({m.wrong} wrong)" if m.wrong else "")
        for m in measurements
    )
    print(
        f"# measured {first.nbytes} B {'in place' if first.in_place else 'out of place'}: {times}",
        flush=True,
    )


def main(argv=None):
    parser = ArgumentParser(
        prog="mpiallreduce bench",
        description="our algorithms against Open MPI's MPI_Allreduce, side by side, in one run",
        examples=(
            "mpiallreduce launch -n 2 -- mpiallreduce bench --summary --runs-in results",
            "mpiallreduce launch -n 2 -- mpiallreduce bench --sizes full --output results/full",
            "mpiallreduce launch -n 2 -- mpiallreduce bench --sizes 4,64K,16M --algorithms "
            "auto,ring",
            "mpiallreduce launch -n 2 -- mpiallreduce bench --device gpu --sizes 1M,64M",
        ),
    )
    parser.add_argument(
        "--sizes",
        type=sizes_argument,
        default=list(DEFAULT_SIZES),
        help="comma-separated message sizes in bytes (K, M, G suffixes), or 'quick' (the default: "
        "11 sizes from 4 B to 64 MiB) or 'full' (every power of two from 4 B to 256 MiB)",
    )
    parser.add_argument(
        "--algorithms",
        help=f"comma-separated, from {', '.join(ALGORITHMS + SYMMETRIC_ALGORITHMS)}, auto, "
        f"{AUTO_PLAIN} (a plain call; the others are prepared), {REPRODUCIBLE} and "
        f"{REPRODUCIBLE_SYMMETRIC} (reproducible sums on numpy arrays, on symmetric buffers; Open "
        f"MPI's default always runs); default: all of them but those two, or with --device gpu "
        f"{','.join(DEVICE_ALGORITHMS)}",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "gpu", "fake-gpu"],
        metavar="{cpu,gpu}",  # (fake-gpu: the tests' stand-in, not for users)
        default="cpu",
        help="where the buffers live: numpy (cpu) or CuPy arrays on each rank's GPU",
    )
    parser.add_argument(
        "--dtype", default="float32", help="the arrays' numpy dtype (default float32)"
    )
    parser.add_argument(
        "--op", default="sum", help="the reduction: sum, mean, max, min or prod (default sum)"
    )
    parser.add_argument(
        "--repetitions",
        type=int,
        default=7,
        help="the least number of interleaved repetitions (default 7); the median is reported",
    )
    parser.add_argument(
        "--max-repetitions",
        type=int,
        help="a contender whose repetitions have not settled (their middle half wider than "
        f"{SETTLED_SPREAD * 100:.0f}%% of the median) is repeated again, up to this many "
        f"(default {REPETITION_CAP} x --repetitions)",
    )
    parser.add_argument(
        "--mode",
        choices=["both", "out-of-place", "in-place"],
        default="both",
        help="out-of-place (a result array of its own), in-place (out=x), or both (default)",
    )
    parser.add_argument(
        "--openmpi-forced",
        default="all",
        help="Open MPI tuned algorithms to force in turn: 'all', 'none' or numbers like 2,4,6",
    )
    parser.add_argument("--output", metavar="DIR", help="write bench.csv and bench.json there")
    parser.add_argument(
        "--runs-in",
        metavar="DIR",
        help="write them into a new folder of DIR named by the run's ranks, date and time "
        "(bench-2ranks-20261208-014500), and point DIR/latest at it when the run is done (make "
        "bench): no run overwrites another",
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        help="tables with every column (busbw as a share of memcpy, both busbw), over 120 "
        "characters",
    )
    parser.add_argument(
        "--progress",
        action="store_true",
        help="print each size's times as soon as they are measured (the tables come at the end)",
    )
    parser.add_argument(
        "--summary",
        action="store_true",
        help="print the Deep Speech 2 tables only: the row per size, mode and contender (about "
        "500 rows at the quick sweep) goes to OUTPUT/table.txt instead (make bench)",
    )
    parser.add_argument(
        "--plant-wrong", metavar="ALGORITHM", help=argparse.SUPPRESS
    )  # tests of #wrong
    args = parser.parse_args(argv)
    sizes, algorithms, forced = _checked_arguments(parser, args)
    if args.output and args.runs_in:
        parser.error("give --output or --runs-in, not both")
    comm = MPI.COMM_WORLD
    if args.runs_in:  # (rank 0 makes the folder; every rank learns it, or why it could not)
        made = None
        if comm.Get_rank() == 0:
            try:
                made = ("folder", new_run_folder(args.runs_in, comm.Get_size()))
            except OSError as error:
                made = ("error", f"--runs-in {args.runs_in}: {error.strerror or error}")
        kind, said = comm.bcast(made)
        if kind == "error":
            parser.error(said)
        args.output = said
    algorithms, skipped = runnable_here(comm, algorithms)
    memory = device_memory(args.device)
    modes = {"both": (False, True), "out-of-place": (False,), "in-place": (True,)}[args.mode]
    load, load_lines = machine_load(comm)  # (said at the start: issue 58)
    if comm.Get_rank() == 0:
        print("\n".join(load_lines), flush=True)
    if args.device == "cpu":
        memcpy_gbs = memory_copy_bandwidth(comm)
        limit = (
            "one core copies memory at {:.2f} GB/s "
            f"(np.copyto, {MEMCPY_BYTES >> 20} MiB, rank 0 alone)"
        )
    else:
        memcpy_gbs = device_copy_bandwidth(comm, memory, max(MEMCPY_BYTES, max(sizes)))
        limit = (
            "the GPU copies device memory at {:.2f} GB/s (device to device, "
            f"{max(MEMCPY_BYTES, max(sizes)) >> 20} MiB, rank 0 alone)"
        )
    link = link_bandwidth(comm)  # across nodes: the link's own speed, in the same run
    failed, measured = [], []

    def progress(measurements):
        measured.extend(measurements)
        if args.progress and comm.Get_rank() == 0:
            print_progress(measurements)

    try:
        results = compare(
            comm,
            sizes,
            algorithms,
            args.dtype,
            args.op,
            args.repetitions,
            modes,
            forced,
            args.plant_wrong,
            memory,
            progress=progress,
            failed=failed,
            max_repetitions=args.max_repetitions or REPETITION_CAP * args.repetitions,
        )
    except (
        Exception
    ) as error:  # (after the warm-up, or Open MPI's own default): what was measured is kept
        if args.output and comm.Get_rank() == 0:
            write_results(
                args.output,
                measured,
                {"error": f"{type(error).__name__}: {error}", "partial": True},
                memcpy_gbs,
                failed,
            )
        raise
    metadata = run_metadata(comm, vars(args))
    metadata.update(load)
    metadata["device"] = args.device
    metadata["skipped"] = skipped
    metadata["openmpi_default"] = default_allreduce_component(
        comm, state_of(comm).make_ready().spans_nodes
    )
    if link is not None:
        metadata["link_between_nodes_gbs"] = link[0]
    if args.device != "cpu":
        metadata["cuda_aware"] = cuda_aware()[0]
    if comm.Get_rank() == 0:
        print(
            f"# mpiallreduce bench: {comm.Get_size()} ranks on {', '.join(metadata['hosts'])}, "
            f"{metadata['mpi_library']}"
        )
        print(f"# mpiallreduce {__version__} ({metadata['git_commit']}), {metadata['date_utc']}")
        print(
            f"# {args.dtype} {args.op}; time = {repetitions_said(args)} of the slowest rank's "
            "time per call"
        )
        print("# reference (not a limit: cached sizes beat it): " + limit.format(memcpy_gbs))
        if link is not None:
            print(
                f"# link between nodes: {link[0]:.3f} GB/s each way (MPI_Sendrecv of "
                f"{MEMCPY_BYTES >> 20} MiB, ranks 0 and {link[1]}, median of 5)"
            )
        for line in skipped:
            print(f"# skipped: {line}")
        if metadata["openmpi_default"]:
            print(
                f"# Open MPI's default allreduce here: coll/{metadata['openmpi_default']} (by the "
                "components' priorities"
                + (
                    "; openmpi:han_off is that default with han switched off)"
                    if metadata["openmpi_default"] == "han"
                    else ")"
                )
            )
        if args.device != "cpu":
            print(f"# device buffers; MPI CUDA-aware: {metadata['cuda_aware']} ({cuda_aware()[1]})")
        table = format_field_table(results, memcpy_gbs, args.wide, failed)
        if args.summary and args.output:
            os.makedirs(args.output, exist_ok=True)
            with open(os.path.join(args.output, "table.txt"), "w") as f:
                f.write(table + "\n")
            print(
                "# every row (size, mode, contender; #wrong): "
                f"{os.path.join(args.output, 'table.txt')}"
            )
        else:
            print(table)
        for mode in modes:
            print()
            print(
                f"# Deep Speech 2 table, {'in place' if mode else 'out of place'}: "
                "gain = Open MPI default time / our time (>1: ours is faster)"
            )
            print(format_gain_table(gain_rows(results, mode), args.wide))
            exact_rows = reproducible_rows(results, mode)
            if exact_rows:
                print(
                    f"# reproducible sums, {'in place' if mode else 'out of place'}: time against "
                    "our fastest ordinary sum on the same kind of buffers"
                )
                print(format_reproducible_table(exact_rows))
        if args.output:
            write_results(args.output, results, metadata, memcpy_gbs, failed)
            print(
                f"# written: {os.path.join(args.output, 'bench.csv')}, "
                f"{os.path.join(args.output, 'bench.json')}"
            )
        if args.runs_in:
            try:
                print(f"# {point_latest(args.runs_in, args.output)} -> {args.output}")
            except OSError as error:
                print(f"# warning: {error}")
    wrong = sum(m.wrong for m in results)
    if wrong and comm.Get_rank() == 0:
        print(f"# {wrong} wrong elements in all: see the #wrong column")
    if failed and comm.Get_rank() == 0:
        print(f"# {len(failed)} contender(s) failed at a size: see the FAILED rows")
    return 1 if wrong or failed else 0
