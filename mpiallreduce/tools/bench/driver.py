"""The driver: sizes, buffers, warm-up, interleaved timing, the wrong-element count, and the command."""
import argparse
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ... import __version__
from ...algorithms import HOST_ALGORITHMS as ALGORITHMS
from ...algorithms import REGISTRY
from ..arguments import ArgumentParser, size_list, unknown
from ...core.buffers import aligned_empty
from ...device.arrays import cuda_aware
from ..openmpi_tuned import TUNED_ALLREDUCE_ALGORITHMS, default_allreduce_component
from ...core.ops import OPS, get_op
from ...core.state import state_of
from ...core.topology import node_communicator
from .contenders import (BASELINE, DEVICE_ALGORITHMS, REPRODUCIBLE, HostMemory, contenders as make_contenders,
                         device_memory)
from .metadata import run_metadata
from .report import format_field_table, format_gain_table, gain_rows, write_results

__all__ = ["Measurement", "compare", "count_wrong", "memory_copy_bandwidth", "device_copy_bandwidth",
           "main", "DEFAULT_SIZES"]

DEFAULT_SIZES = tuple(1 << k for k in range(2, 29))  # 4 B .. 256 MiB, powers of two
SECONDS_PER_REPETITION = 0.02
MAX_ITERATIONS = 200
MEMCPY_BYTES = 64 << 20


@dataclass
class Measurement:
    ranks: int
    nbytes: int
    count: int
    dtype: str
    op: str
    algorithm: str
    in_place: bool
    iterations: int
    repetitions: int
    time_us: float  # median over repetitions of the slowest rank's time per call
    algbw_gbs: float  # bytes / time
    busbw_gbs: float  # algbw * 2(p-1)/p
    wrong: int  # elements differing from MPI_Allreduce's result, summed over ranks


def _input(count, dtype, rank):
    """Small integers that depend on rank and index: every reduction order gives the same bits."""
    values = (np.arange(count, dtype=np.int64) * 7 + rank * 3) % 11 - 5
    return values.astype(dtype)


def count_wrong(result, expected):
    """How many elements of ``result`` are not bitwise equal to ``expected``'s."""
    itemsize = result.dtype.itemsize
    differing_bytes = result.view(np.uint8).reshape(-1, itemsize) != expected.view(np.uint8).reshape(-1, itemsize)
    return int(np.count_nonzero(differing_bytes.any(axis=1)))


def _iterations(probe_seconds):
    return int(min(MAX_ITERATIONS, max(1, SECONDS_PER_REPETITION / max(probe_seconds, 1e-7))))


def _time_calls(call, iterations, comm, prepare=None, memory=HostMemory()):
    if prepare is not None:
        prepare()
    memory.finish()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    memory.finish()
    elapsed = (time.perf_counter() - start) / iterations
    return comm.allreduce(elapsed, op=MPI.MAX)


def _measure_size(comm, contenders, nbytes, dtype, op, repetitions, in_place, memory=HostMemory()):
    size = comm.Get_size()
    count = max(1, nbytes // dtype.itemsize)
    source = memory.array(_input(count, dtype, comm.Get_rank()))
    expected = memory.empty(count, dtype)
    contenders[BASELINE](source, expected, comm)
    expected = memory.to_host(expected)
    out = memory.empty(count, dtype)
    send = out if in_place else source

    def reset():
        if in_place:  # in place, the input is the output: put it back (outside the timed calls)
            memory.copy(out, source)

    # Warm up every contender and count its wrong elements; size the repetitions from the baseline.
    # In the timed calls in place, each call reduces the previous result again, as nccl-tests does.
    wrong, probe = {}, {}
    for name, contender in contenders.items():
        probe[name] = _time_calls(lambda c=contender: c(send, out, comm), 1, comm, reset, memory)
        wrong[name] = comm.allreduce(count_wrong(memory.to_host(out), expected), op=MPI.SUM)
    iterations = _iterations(probe[BASELINE])
    times = {name: [] for name in contenders}
    with np.errstate(over="ignore"):  # in place, repeated sums of the result may overflow to inf
        for _ in range(repetitions):
            for name, contender in contenders.items():
                times[name].append(_time_calls(lambda c=contender: c(send, out, comm), iterations, comm, reset,
                                               memory))
    results = []
    for name in contenders:
        seconds = statistics.median(times[name])
        algbw = count * dtype.itemsize / seconds / 1e9
        results.append(Measurement(
            ranks=size, nbytes=count * dtype.itemsize, count=count, dtype=str(dtype), op=op,
            algorithm=name, in_place=in_place, iterations=iterations, repetitions=repetitions,
            time_us=seconds * 1e6, algbw_gbs=algbw, busbw_gbs=algbw * 2 * (size - 1) / size,
            wrong=wrong[name]))
    return results


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
            skipped.append(f"{name} (needs every rank on one node; {where}: use "
                           f"{algorithm.across_nodes or 'hierarchical'})")
        elif algorithm is not None and algorithm.needs_equal_nodes and not state.equal_nodes:
            skipped.append(f"{name} (needs the same rank count on every node; {where}, unequal)")
        else:
            kept.append(name)
    return kept, skipped


def compare(comm, sizes, algorithms=ALGORITHMS, dtype="float32", op="sum", repetitions=5,
            modes=(False, True), forced=tuple(TUNED_ALLREDUCE_ALGORITHMS), plant_wrong=None, memory=HostMemory(),
            progress=None):
    """Measure every contender at every size and mode (in_place False/True); collective.

    Returns a list of Measurements (complete on every rank). ``progress(measurements)``, if given,
    is called with each size and mode's measurements as soon as they are taken.
    """
    dtype = np.dtype(dtype)
    contenders, made = make_contenders(comm, algorithms, op, forced, plant_wrong, memory)
    try:
        results = []
        for nbytes in sizes:
            for in_place in modes:
                measured = _measure_size(comm, contenders, nbytes, dtype, op, repetitions, in_place, memory)
                if progress is not None:
                    progress(measured)
                results.extend(measured)
        return results
    finally:
        for c in made:
            c.Free()


def memory_copy_bandwidth(comm, nbytes=MEMCPY_BYTES, repetitions=5):
    """One core's memory copy bandwidth (GB/s, bytes copied per second), measured on rank 0 alone.

    The physical limit for an allreduce on one node: every byte must at least be copied once.
    """
    result = 0.0
    if comm.Get_rank() == 0:
        a = aligned_empty(nbytes, np.uint8)
        a[:] = 1
        b = aligned_empty(nbytes, np.uint8)
        np.copyto(b, a)
        seconds = []
        for _ in range(repetitions):
            start = time.perf_counter()
            np.copyto(b, a)
            seconds.append(time.perf_counter() - start)
        result = nbytes / statistics.median(seconds) / 1e9
    return comm.bcast(result, root=0)


def link_bandwidth(comm, nbytes=MEMCPY_BYTES, repetitions=5):
    """(GB/s each way, peer) of a plain MPI_Sendrecv of ``nbytes`` between rank 0 and the first rank
    on another node, both ways at once (what a ring step between nodes asks of the link); None where
    every rank is on one node. Collective; the other ranks wait."""
    leaders = comm.allgather(node_communicator(comm).Get_rank() == 0)
    peer = next((r for r in range(1, comm.Get_size()) if leaders[r]), None)
    if peer is None:
        return None
    result = 0.0
    if comm.Get_rank() in (0, peer):
        other = peer if comm.Get_rank() == 0 else 0
        send, receive = aligned_empty(nbytes, np.uint8), aligned_empty(nbytes, np.uint8)
        send[:] = 1
        seconds = []
        for _ in range(repetitions + 1):  # (the first one warms the connection up)
            start = time.perf_counter()
            comm.Sendrecv(send, other, 0, receive, other, 0)
            seconds.append(time.perf_counter() - start)
        result = nbytes / statistics.median(seconds[1:]) / 1e9
    comm.Barrier()
    return comm.bcast(result, root=0), peer


def device_copy_bandwidth(comm, memory, nbytes=MEMCPY_BYTES, repetitions=5):
    """The GPU's device-to-device copy bandwidth (GB/s, bytes copied per second), rank 0 alone."""
    result = 0.0
    if comm.Get_rank() == 0:
        a = memory.array(np.ones(nbytes, np.uint8))
        b = memory.empty(nbytes, np.uint8)
        seconds = []
        for _ in range(repetitions + 1):
            memory.finish()
            start = time.perf_counter()
            memory.copy(b, a)
            memory.finish()
            seconds.append(time.perf_counter() - start)
        result = nbytes / statistics.median(seconds[1:]) / 1e9
    return comm.bcast(result, root=0)


def _checked_arguments(parser, args):
    """(sizes, algorithm names, forced Open MPI algorithm numbers), or parser.error with what is wrong
    (before any communication: every rank parses the same argv)."""
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
            parser.error(f"--sizes: {size} bytes is not a positive whole number of {dtype} elements "
                         f"({dtype.itemsize} bytes each)")
    known = list(ALGORITHMS) + ["auto"] if args.device == "cpu" else list(DEVICE_ALGORITHMS)
    if args.algorithms is None:
        algorithms = list(known)  # (the reproducible sum only when asked for)
    else:
        known.append(REPRODUCIBLE)
        algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
        for name in algorithms:
            if name not in known:
                parser.error("--algorithms: " + unknown("algorithm", name, known))
    if args.repetitions < 1:
        parser.error("--repetitions must be at least 1")
    if args.openmpi_forced in ("all", "none"):
        forced = tuple(TUNED_ALLREDUCE_ALGORITHMS) if args.openmpi_forced == "all" else ()
    else:
        numbers = [n.strip() for n in args.openmpi_forced.split(",") if n.strip()]
        if not numbers or not all(n.isdigit() and int(n) in TUNED_ALLREDUCE_ALGORITHMS for n in numbers):
            parser.error(f"--openmpi-forced {args.openmpi_forced!r}: give 'all', 'none' or numbers from "
                         + ", ".join(f"{k} ({v})" for k, v in TUNED_ALLREDUCE_ALGORITHMS.items()))
        forced = tuple(int(n) for n in numbers)
    return args.sizes, algorithms, forced


def print_progress(measurements):
    """One line per size and mode: each contender's time and wrong elements (rank 0)."""
    first = measurements[0]
    times = ", ".join(f"{m.algorithm} {m.time_us:.1f} us" + (f" ({m.wrong} wrong)" if m.wrong else "")
                      for m in measurements)
    print(f"# measured {first.nbytes} B {'in place' if first.in_place else 'out of place'}: {times}", flush=True)


def main(argv=None):
    parser = ArgumentParser(prog="mpiallreduce bench", description="our algorithms against Open MPI's MPI_Allreduce, side by side, in one run")
    parser.add_argument("--sizes", type=size_list, default=list(DEFAULT_SIZES),
                        help="comma-separated message sizes in bytes (K, M, G suffixes); default 4 B..256 MiB")
    parser.add_argument("--algorithms",
                        help=f"comma-separated, from {', '.join(ALGORITHMS)}, auto, {REPRODUCIBLE} (Open MPI's "
                             f"default always runs); default: all of them but {REPRODUCIBLE}, or with --device gpu "
                             f"{','.join(DEVICE_ALGORITHMS)}")
    parser.add_argument("--device", choices=["cpu", "gpu", "fake-gpu"], default="cpu",
                        help="where the buffers live: numpy (cpu) or CuPy arrays on each rank's GPU")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--op", default="sum")
    parser.add_argument("--repetitions", type=int, default=5, help="interleaved repetitions; the median is reported")
    parser.add_argument("--mode", choices=["both", "out-of-place", "in-place"], default="both")
    parser.add_argument("--openmpi-forced", default="all",
                        help="Open MPI tuned algorithms to force in turn: 'all', 'none' or numbers like 2,4,6")
    parser.add_argument("--output", metavar="DIR", help="write bench.csv and bench.json there")
    parser.add_argument("--wide", action="store_true",
                        help="tables with every column (busbw as a share of memcpy, both busbw), over 120 characters")
    parser.add_argument("--progress", action="store_true",
                        help="print each size's times as soon as they are measured (the tables come at the end)")
    parser.add_argument("--plant-wrong", metavar="ALGORITHM", help=argparse.SUPPRESS)  # tests of #wrong
    args = parser.parse_args(argv)
    sizes, algorithms, forced = _checked_arguments(parser, args)
    comm = MPI.COMM_WORLD
    algorithms, skipped = runnable_here(comm, algorithms)
    memory = device_memory(args.device)
    modes = {"both": (False, True), "out-of-place": (False,), "in-place": (True,)}[args.mode]
    if args.device == "cpu":
        memcpy_gbs = memory_copy_bandwidth(comm)
        limit = f"one core copies memory at {{:.2f}} GB/s (np.copyto, {MEMCPY_BYTES >> 20} MiB, rank 0 alone)"
    else:
        memcpy_gbs = device_copy_bandwidth(comm, memory, max(MEMCPY_BYTES, max(sizes)))
        limit = ("the GPU copies device memory at {:.2f} GB/s (device to device, "
                 f"{max(MEMCPY_BYTES, max(sizes)) >> 20} MiB, rank 0 alone)")
    link = link_bandwidth(comm)  # across nodes: the link's own speed, in the same run
    results = compare(comm, sizes, algorithms, args.dtype, args.op, args.repetitions, modes, forced,
                      args.plant_wrong, memory, progress=print_progress if args.progress and comm.Get_rank() == 0 else None)
    metadata = run_metadata(comm, vars(args))
    metadata["device"] = args.device
    metadata["skipped"] = skipped
    metadata["openmpi_default"] = default_allreduce_component(comm, state_of(comm).make_ready().spans_nodes)
    if link is not None:
        metadata["link_between_nodes_gbs"] = link[0]
    if args.device != "cpu":
        metadata["cuda_aware"] = cuda_aware()[0]
    if comm.Get_rank() == 0:
        print(f"# mpiallreduce bench: {comm.Get_size()} ranks on {', '.join(metadata['hosts'])}, "
              f"{metadata['mpi_library']}")
        print(f"# mpiallreduce {__version__} ({metadata['git_commit']}), {metadata['date_utc']}")
        print(f"# {args.dtype} {args.op}; time = median of {args.repetitions} interleaved repetitions of the "
              f"slowest rank's time per call")
        print("# physical limit: " + limit.format(memcpy_gbs))
        if link is not None:
            print(f"# link between nodes: {link[0]:.3f} GB/s each way (MPI_Sendrecv of {MEMCPY_BYTES >> 20} MiB, "
                  f"ranks 0 and {link[1]}, median of 5)")
        for line in skipped:
            print(f"# skipped: {line}")
        if metadata["openmpi_default"]:
            print(f"# Open MPI's default allreduce here: coll/{metadata['openmpi_default']} (by the components' "
                  "priorities" + ("; openmpi:han_off is that default with han switched off)"
                                  if metadata["openmpi_default"] == "han" else ")"))
        if args.device != "cpu":
            print(f"# device buffers; MPI CUDA-aware: {metadata['cuda_aware']} ({cuda_aware()[1]})")
        print(format_field_table(results, memcpy_gbs, args.wide))
        for mode in modes:
            print()
            print(f"# Deep Speech 2 table, {'in place' if mode else 'out of place'}: "
                  "gain = Open MPI default time / our time (>1: ours is faster)")
            print(format_gain_table(gain_rows(results, mode), args.wide))
        if args.output:
            write_results(args.output, results, metadata, memcpy_gbs)
            print(f"# written: {os.path.join(args.output, 'bench.csv')}, {os.path.join(args.output, 'bench.json')}")
    wrong = sum(m.wrong for m in results)
    if wrong and comm.Get_rank() == 0:
        print(f"# {wrong} wrong elements in all: see the #wrong column")
    return 1 if wrong else 0
