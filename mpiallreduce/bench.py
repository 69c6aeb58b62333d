"""``mpiallreduce bench``: our algorithms against Open MPI's MPI_Allreduce, side by side, in one run.

One driver owns sizes, buffers, warm-up, timing, correctness and the tables; each contender is a
small adapter (a function that performs one allreduce of ``send`` into ``out``), as in nccl-tests.

Contenders: ``openmpi`` (a direct mpi4py ``comm.Allreduce``: Open MPI's default choice), each of
Open MPI's six tuned algorithms forced in turn (``openmpi:ring`` ...; see openmpi_tuned.py), and our
algorithms through ``mpiallreduce.allreduce``.

``--device gpu``: the buffers are CuPy arrays on each rank's GPU (``select_gpu``). ``openmpi`` is then
MPI_Allreduce on the device pointers where the MPI is CUDA-aware, else a host round trip (device to
pinned host buffers allocated once, MPI_Allreduce, back: what Open MPI's coll/cuda does, minus its
per-call malloc). The physical limit reported is the GPU's device-to-device copy bandwidth.
``--device fake-gpu`` runs the same code on mpiallreduce.testing.fake_cupy (for tests).

Timing: for each size and mode (out of place, in place), repetitions of the contenders are
interleaved (A B C A B C ...) so that a drift in the machine's speed hits all of them alike. One
repetition is ``iterations`` back-to-back calls between barriers; its time per call is the slowest
rank's. The figure reported is the median over repetitions. Every contender's result is compared
bitwise with MPI_Allreduce's and the wrong elements counted (the data are small integers, so every
summation order gives the same bits).
"""
import argparse
import csv
import datetime
import json
import os
import socket
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
from mpi4py import MPI

from . import __version__, allreduce
from .algorithms import HOST_ALGORITHMS as ALGORITHMS
from .buffers import aligned_empty, mpi_datatype
from .device import cuda_aware, select_gpu, synchronize
from .mpilib import library_version
from .openmpi_tuned import TUNED_ALLREDUCE_ALGORITHMS, forced_allreduce_communicator
from .ops import get_op

__all__ = ["Measurement", "compare", "main", "parse_size", "DEFAULT_SIZES", "BASELINE",
           "gain_rows", "memory_copy_bandwidth", "run_metadata"]

#: the baseline's name in tables: a direct mpi4py ``comm.Allreduce`` with Open MPI's default choices
BASELINE = "openmpi"
FORCED_PREFIX = "openmpi:"
DEFAULT_SIZES = tuple(1 << k for k in range(2, 29))  # 4 B .. 256 MiB, powers of two
SECONDS_PER_REPETITION = 0.02
MAX_ITERATIONS = 200
MEMCPY_BYTES = 64 << 20
#: what --device gpu compares by default (besides Open MPI's path for device memory)
DEVICE_ALGORITHMS = ("staged_ring", "device_to_device", "ring", "auto")


class HostMemory:
    """Where the benchmark's buffers live: numpy arrays (page-aligned)."""

    name = "cpu"

    def array(self, values):
        data = aligned_empty(values.size, values.dtype)
        data[:] = values
        return data

    def empty(self, count, dtype):
        return aligned_empty(count, dtype)

    def copy(self, destination, source):
        destination[:] = source

    def to_host(self, a):
        return a

    def finish(self):
        """Wait until every call made so far has finished (device work is asynchronous)."""


class DeviceMemory(HostMemory):
    """CuPy arrays (or the test stand-in's) on this rank's GPU."""

    name = "gpu"

    def __init__(self, xp):
        self.xp = xp

    def array(self, values):
        return self.xp.asarray(values)

    def empty(self, count, dtype):
        return self.xp.empty(count, dtype)

    def copy(self, destination, source):
        self.xp.copyto(destination, source)

    def to_host(self, a):
        return self.xp.asnumpy(a)

    def finish(self):
        synchronize(self.xp)


def device_memory(kind):
    """HostMemory() for "cpu"; DeviceMemory for "gpu" (CuPy, this rank's GPU selected) or "fake-gpu"."""
    if kind == "cpu":
        return HostMemory()
    if kind == "fake-gpu":
        from .testing import fake_cupy
        return DeviceMemory(fake_cupy)
    import cupy
    select_gpu(xp=cupy)
    return DeviceMemory(cupy)


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


def parse_size(text):
    """'64' -> 64, '4K' -> 4096, '16M' -> 16 MiB, '1G' -> 1 GiB (bytes)."""
    text = text.strip().upper().rstrip("B").rstrip("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    return int(float(number) * scale)


def _mpi_allreduce(op, comm_to_use=None):
    """Adapter: plain MPI_Allreduce (on ``comm_to_use`` if given: a forced-algorithm communicator)."""
    reduce_op = get_op(op)

    def call(send, out, comm):
        c = comm_to_use or comm
        datatype = mpi_datatype(send.dtype)
        sendbuf = MPI.IN_PLACE if send is out else [send, datatype]
        c.Allreduce(sendbuf, [out, datatype], op=reduce_op.mpi_op(send.dtype))
        reduce_op.finish(out, c.Get_size())

    return call


def _mpi_allreduce_of_device_memory(op, xp):
    """Adapter: Open MPI's path for device buffers: the pointers themselves to a CUDA-aware MPI,
    else a round trip through pinned host buffers (allocated once) around MPI_Allreduce."""
    from .transports import pinned
    reduce_op = get_op(op)
    aware = cuda_aware()[0]

    def call(send, out, comm):
        datatype = mpi_datatype(send.dtype)
        if aware:
            synchronize(xp)
            comm.Allreduce(MPI.IN_PLACE if send is out else [send, datatype], [out, datatype],
                           op=reduce_op.mpi_op(send.dtype))
        else:
            host = pinned(xp, "bench.openmpi", out.size, out.dtype)
            xp.asnumpy(send, out=host)
            comm.Allreduce(MPI.IN_PLACE, [host, datatype], op=reduce_op.mpi_op(send.dtype))
            out.set(host, stream=xp.cuda.get_current_stream())
        reduce_op.finish(out, comm.Get_size())

    return call


def _ours(algorithm, op):
    return lambda send, out, comm: allreduce(send, op=op, algorithm=algorithm, comm=comm, out=out)


def _planted_wrong(call):
    """For tests of the checker: the contender's result with one element changed on rank 0."""
    def wrong(send, out, comm):
        call(send, out, comm)
        if comm.Get_rank() == 0 and out.size:
            out[0] += 1
    return wrong


def _contenders(comm, names, op, forced, plant_wrong=None, memory=None):
    """(name -> adapter, communicators to free)."""
    if isinstance(memory, DeviceMemory):
        found = {BASELINE: _mpi_allreduce_of_device_memory(op, memory.xp)}
        forced = ()  # Open MPI's forced algorithms would all take the same host round trip
    else:
        found = {BASELINE: _mpi_allreduce(op)}
    made = []
    for number in forced:
        forced_comm = forced_allreduce_communicator(comm, number)
        if forced_comm is not None:
            made.append(forced_comm)
            found[FORCED_PREFIX + TUNED_ALLREDUCE_ALGORITHMS[number]] = _mpi_allreduce(op, forced_comm)
    for name in names:
        found[name] = _ours(name, op)
    if plant_wrong:
        found[plant_wrong] = _planted_wrong(found[plant_wrong])
    return found, made


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


def compare(comm, sizes, algorithms=ALGORITHMS, dtype="float32", op="sum", repetitions=5,
            modes=(False, True), forced=tuple(TUNED_ALLREDUCE_ALGORITHMS), plant_wrong=None, memory=HostMemory()):
    """Measure every contender at every size and mode (in_place False/True); collective.

    Returns a list of Measurements (complete on every rank).
    """
    dtype = np.dtype(dtype)
    contenders, made = _contenders(comm, algorithms, op, forced, plant_wrong, memory)
    try:
        results = []
        for nbytes in sizes:
            for in_place in modes:
                results.extend(_measure_size(comm, contenders, nbytes, dtype, op, repetitions, in_place, memory))
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


def _git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def run_metadata(comm, args=None):
    """What a result file needs to be read later: library, ranks, host, date, versions, commit."""
    import mpi4py
    hosts = sorted(set(comm.allgather(socket.gethostname())))
    return {
        "mpi_library": library_version(),
        "mpi_standard": "%d.%d" % MPI.Get_version(),
        "ranks": comm.Get_size(),
        "hosts": hosts,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mpiallreduce": __version__,
        "git_commit": _git_commit() if comm.Get_rank() == 0 else None,
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "arguments": args,
    }


def format_field_table(results, memcpy_gbs=None):
    """nccl-tests' columns, one row per (size, mode, algorithm); busbw as a share of memcpy if given."""
    share = memcpy_gbs is not None
    lines = [f"{'size(B)':>10} {'count':>10} {'type':>8} {'op':>5} {'place':>6} {'algorithm':>26} "
             f"{'time(us)':>11} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7}"
             + (f" {'busbw/memcpy':>12}" if share else "")]
    for m in results:
        lines.append(f"{m.nbytes:>10} {m.count:>10} {m.dtype:>8} {m.op:>5} {'in' if m.in_place else 'out':>6} "
                     f"{m.algorithm:>26} {m.time_us:>11.1f} {m.algbw_gbs:>11.3f} {m.busbw_gbs:>11.3f} {m.wrong:>7}"
                     + (f" {m.busbw_gbs / memcpy_gbs:>11.0%}" if share else ""))
    return "\n".join(lines)


def gain_rows(results, in_place=False):
    """Deep Speech 2's table: per (ranks, bytes) Open MPI's default time, our best algorithm's, the gain;
    and Open MPI's best forced algorithm, so a gain over the default is not mistaken for one over Open MPI."""
    rows = []
    here_mode = [m for m in results if m.in_place == in_place]
    for ranks, nbytes in sorted({(m.ranks, m.nbytes) for m in here_mode}):
        here = [m for m in here_mode if (m.ranks, m.nbytes) == (ranks, nbytes)]
        baseline = next(m for m in here if m.algorithm == BASELINE)
        forced = [m for m in here if m.algorithm.startswith(FORCED_PREFIX)]
        ours = [m for m in here if m.algorithm != BASELINE and not m.algorithm.startswith(FORCED_PREFIX)]
        # "mpi" is Open MPI's allreduce behind our wrapper and "auto" picks one of the others:
        # shown, but not counted as "ours" for the best.
        hand_written = [m for m in ours if m.algorithm not in ("mpi", "auto")] or ours
        best = min(hand_written, key=lambda m: m.time_us)
        best_forced = min(forced, key=lambda m: m.time_us) if forced else None
        rows.append({
            "ranks": ranks, "nbytes": nbytes, "in_place": in_place,
            "openmpi_us": baseline.time_us, "ours_us": best.time_us, "ours_algorithm": best.algorithm,
            "gain": baseline.time_us / best.time_us,
            "openmpi_best_forced_us": best_forced.time_us if best_forced else None,
            "openmpi_best_forced": best_forced.algorithm[len(FORCED_PREFIX):] if best_forced else None,
            "gain_over_best_forced": best_forced.time_us / best.time_us if best_forced else None,
            "gain_by_algorithm": {m.algorithm: baseline.time_us / m.time_us for m in ours},
        })
    return rows


def format_gain_table(rows):
    names = list(rows[0]["gain_by_algorithm"]) if rows else []
    header = (f"{'ranks':>5} {'bytes':>10} {'Open MPI(us)':>12} {'ours(us)':>10} {'best of ours':>19} "
              f"{'gain':>6} | {'OMPI best forced':>26} {'gain':>6} | " + " ".join(f"{n:>18}" for n in names))
    lines = [header]
    for r in rows:
        forced = (f"{r['openmpi_best_forced']:>15} {r['openmpi_best_forced_us']:>10.1f} {r['gain_over_best_forced']:>5.2f}x"
                  if r["openmpi_best_forced"] else f"{'-':>26} {'-':>6}")
        lines.append(f"{r['ranks']:>5} {r['nbytes']:>10} {r['openmpi_us']:>12.1f} {r['ours_us']:>10.1f} "
                     f"{r['ours_algorithm']:>19} {r['gain']:>5.2f}x | {forced} | "
                     + " ".join(f"{r['gain_by_algorithm'][n]:>17.2f}x" for n in names))
    return "\n".join(lines)


def write_results(directory, results, metadata, memcpy_gbs):
    """bench.csv (one row per measurement) and bench.json (metadata, measurements, gain tables)."""
    os.makedirs(directory, exist_ok=True)
    columns = [f.name for f in fields(Measurement)] + ["busbw_share_of_memcpy"]
    with open(os.path.join(directory, "bench.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["# " + json.dumps(metadata, sort_keys=True)])
        writer.writerow(columns)
        for m in results:
            writer.writerow([getattr(m, c) for c in columns[:-1]] + [m.busbw_gbs / memcpy_gbs])
    modes = sorted({m.in_place for m in results})
    with open(os.path.join(directory, "bench.json"), "w") as f:
        json.dump({"metadata": metadata, "memcpy_gbs": memcpy_gbs,
                   "measurements": [asdict(m) for m in results],
                   "gains": {("in_place" if mode else "out_of_place"): gain_rows(results, mode) for mode in modes}},
                  f, indent=1)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mpiallreduce bench", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                        help="comma-separated message sizes in bytes (K, M, G suffixes); default 4 B..256 MiB")
    parser.add_argument("--algorithms",
                        help=f"comma-separated, from {', '.join(ALGORITHMS)}, auto (Open MPI's default always "
                             f"runs); default: all of them, or with --device gpu {','.join(DEVICE_ALGORITHMS)}")
    parser.add_argument("--device", choices=["cpu", "gpu", "fake-gpu"], default="cpu",
                        help="where the buffers live: numpy (cpu) or CuPy arrays on each rank's GPU")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--op", default="sum")
    parser.add_argument("--repetitions", type=int, default=5, help="interleaved repetitions; the median is reported")
    parser.add_argument("--mode", choices=["both", "out-of-place", "in-place"], default="both")
    parser.add_argument("--openmpi-forced", default="all",
                        help="Open MPI tuned algorithms to force in turn: 'all', 'none' or numbers like 2,4,6")
    parser.add_argument("--output", metavar="DIR", help="write bench.csv and bench.json there")
    parser.add_argument("--plant-wrong", metavar="ALGORITHM", help=argparse.SUPPRESS)  # tests of #wrong
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.algorithms is None:
        args.algorithms = ",".join(ALGORITHMS + ("auto",) if args.device == "cpu" else DEVICE_ALGORITHMS)
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    memory = device_memory(args.device)
    modes = {"both": (False, True), "out-of-place": (False,), "in-place": (True,)}[args.mode]
    forced = (tuple(TUNED_ALLREDUCE_ALGORITHMS) if args.openmpi_forced == "all" else
              () if args.openmpi_forced == "none" else tuple(int(n) for n in args.openmpi_forced.split(",")))
    if args.device == "cpu":
        memcpy_gbs = memory_copy_bandwidth(comm)
        limit = f"one core copies memory at {{:.2f}} GB/s (np.copyto, {MEMCPY_BYTES >> 20} MiB, rank 0 alone)"
    else:
        memcpy_gbs = device_copy_bandwidth(comm, memory, max(MEMCPY_BYTES, max(sizes)))
        limit = ("the GPU copies device memory at {:.2f} GB/s (device to device, "
                 f"{max(MEMCPY_BYTES, max(sizes)) >> 20} MiB, rank 0 alone)")
    results = compare(comm, sizes, algorithms, args.dtype, args.op, args.repetitions, modes, forced,
                      args.plant_wrong, memory)
    metadata = run_metadata(comm, vars(args))
    metadata["device"] = args.device
    if args.device != "cpu":
        metadata["cuda_aware"] = cuda_aware()[0]
    if comm.Get_rank() == 0:
        print(f"# mpiallreduce bench: {comm.Get_size()} ranks on {', '.join(metadata['hosts'])}, "
              f"{metadata['mpi_library']}")
        print(f"# mpiallreduce {__version__} ({metadata['git_commit']}), {metadata['date_utc']}")
        print(f"# {args.dtype} {args.op}; time = median of {args.repetitions} interleaved repetitions of the "
              f"slowest rank's time per call")
        print("# physical limit: " + limit.format(memcpy_gbs))
        if args.device != "cpu":
            print(f"# device buffers; MPI CUDA-aware: {metadata['cuda_aware']} ({cuda_aware()[1]})")
        print(format_field_table(results, memcpy_gbs))
        for mode in modes:
            print()
            print(f"# Deep Speech 2 table, {'in place' if mode else 'out of place'}: "
                  "gain = Open MPI default time / our time (>1: ours is faster)")
            print(format_gain_table(gain_rows(results, mode)))
        if args.output:
            write_results(args.output, results, metadata, memcpy_gbs)
            print(f"# written: {os.path.join(args.output, 'bench.csv')}, {os.path.join(args.output, 'bench.json')}")
    wrong = sum(m.wrong for m in results)
    if wrong and comm.Get_rank() == 0:
        print(f"# {wrong} wrong elements in all: see the #wrong column")
    return 1 if wrong else 0
