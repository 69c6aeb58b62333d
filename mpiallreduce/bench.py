"""``mpiallreduce bench``: every algorithm against Open MPI's default MPI_Allreduce, side by side.

One driver owns sizes, buffers, warm-up, timing, correctness and the tables; each contender is a
small adapter (a function that performs one allreduce of ``send`` into ``out``), as in nccl-tests.

Timing: for each size, repetitions of the contenders are interleaved (A B C A B C ...) so that a
drift in the machine's speed hits all of them alike. One repetition is ``iterations`` back-to-back
calls between barriers; its time per call is the slowest rank's. The figure reported is the median
over repetitions. Every contender's result is compared bitwise with MPI_Allreduce's and the wrong
elements counted (the data are small integers, so every summation order gives the same bits).
"""
import argparse
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
from mpi4py import MPI

from . import allreduce
from .algorithms import ALGORITHMS
from .buffers import aligned_empty, mpi_datatype
from .ops import get_op

__all__ = ["Measurement", "compare", "main", "parse_size", "DEFAULT_SIZES"]

#: the baseline's name in tables: a direct mpi4py ``comm.Allreduce`` with Open MPI's default choices
BASELINE = "openmpi"
DEFAULT_SIZES = tuple(4 ** k for k in range(1, 14))  # 4 B .. 64 MiB
SECONDS_PER_REPETITION = 0.02
MAX_ITERATIONS = 200


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


def _contenders(names, op):
    """name -> function(send, out, comm) that allreduces ``send`` into ``out``."""
    mpi_op = get_op(op)

    def baseline(send, out, comm):
        datatype = mpi_datatype(send.dtype)
        sendbuf = MPI.IN_PLACE if send is out else [send, datatype]
        comm.Allreduce(sendbuf, [out, datatype], op=mpi_op.mpi_op(send.dtype))
        mpi_op.finish(out, comm.Get_size())

    def ours(algorithm):
        return lambda send, out, comm: allreduce(send, op=op, algorithm=algorithm, comm=comm, out=out)

    found = {BASELINE: baseline}
    for name in names:
        found[name] = ours(name)
    return found


def _input(count, dtype, rank):
    """Small integers that depend on rank and index: every reduction order gives the same bits."""
    values = (np.arange(count, dtype=np.int64) * 7 + rank * 3) % 11 - 5
    data = aligned_empty(count, dtype)
    data[:] = values.astype(dtype)
    return data


def count_wrong(result, expected):
    """How many elements of ``result`` are not bitwise equal to ``expected``'s."""
    itemsize = result.dtype.itemsize
    differing_bytes = result.view(np.uint8).reshape(-1, itemsize) != expected.view(np.uint8).reshape(-1, itemsize)
    return int(np.count_nonzero(differing_bytes.any(axis=1)))


def _iterations(probe_seconds):
    return int(min(MAX_ITERATIONS, max(1, SECONDS_PER_REPETITION / max(probe_seconds, 1e-7))))


def _time_calls(call, iterations, comm):
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    elapsed = (time.perf_counter() - start) / iterations
    return comm.allreduce(elapsed, op=MPI.MAX)


def compare(comm, sizes, algorithms=ALGORITHMS, dtype="float32", op="sum", repetitions=5, in_place=False):
    """Measure the baseline and ``algorithms`` at every size; collective; returns Measurements."""
    dtype = np.dtype(dtype)
    size = comm.Get_size()
    contenders = _contenders(algorithms, op)
    results = []
    for nbytes in sizes:
        count = max(1, nbytes // dtype.itemsize)
        source = _input(count, dtype, comm.Get_rank())
        expected = aligned_empty(count, dtype)
        contenders[BASELINE](source, expected, comm)
        out = aligned_empty(count, dtype)
        send = out if in_place else source

        def one_call(contender):
            if in_place:
                out[:] = source
            contender(send, out, comm)

        # Warm up every contender and size the repetitions from the baseline's time.
        probe = {name: _time_calls(lambda c=c: one_call(c), 1, comm) for name, c in contenders.items()}
        iterations = _iterations(probe[BASELINE])
        times = {name: [] for name in contenders}
        for _ in range(repetitions):
            for name, contender in contenders.items():
                times[name].append(_time_calls(lambda c=contender: one_call(c), iterations, comm))
        for name, contender in contenders.items():
            one_call(contender)
            wrong = comm.allreduce(count_wrong(out, expected), op=MPI.SUM)
            seconds = statistics.median(times[name])
            algbw = count * dtype.itemsize / seconds / 1e9
            results.append(Measurement(
                ranks=size, nbytes=count * dtype.itemsize, count=count, dtype=str(dtype), op=op,
                algorithm=name, in_place=in_place, iterations=iterations, repetitions=repetitions,
                time_us=seconds * 1e6, algbw_gbs=algbw, busbw_gbs=algbw * 2 * (size - 1) / size,
                wrong=wrong))
    return results


def format_field_table(results):
    """nccl-tests' columns, one row per (size, algorithm)."""
    lines = [f"{'size(B)':>10} {'count':>10} {'type':>8} {'op':>5} {'algorithm':>19} "
             f"{'time(us)':>11} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7}"]
    for m in results:
        lines.append(f"{m.nbytes:>10} {m.count:>10} {m.dtype:>8} {m.op:>5} {m.algorithm:>19} "
                     f"{m.time_us:>11.1f} {m.algbw_gbs:>11.3f} {m.busbw_gbs:>11.3f} {m.wrong:>7}")
    return "\n".join(lines)


def gain_rows(results):
    """Deep Speech 2's table: per (ranks, bytes) the Open MPI time, our best algorithm's and the gain."""
    rows = []
    keys = sorted({(m.ranks, m.nbytes) for m in results})
    for ranks, nbytes in keys:
        here = [m for m in results if (m.ranks, m.nbytes) == (ranks, nbytes)]
        baseline = next(m for m in here if m.algorithm == BASELINE)
        ours = [m for m in here if m.algorithm != BASELINE]
        # "mpi" is Open MPI's allreduce behind our wrapper: shown, but not "ours" for the best.
        hand_written = [m for m in ours if m.algorithm != "mpi"] or ours
        best = min(hand_written, key=lambda m: m.time_us)
        rows.append({"ranks": ranks, "nbytes": nbytes, "openmpi_us": baseline.time_us,
                     "ours_us": best.time_us, "ours_algorithm": best.algorithm,
                     "gain": baseline.time_us / best.time_us,
                     "gain_by_algorithm": {m.algorithm: baseline.time_us / m.time_us for m in ours}})
    return rows


def format_gain_table(rows):
    names = list(rows[0]["gain_by_algorithm"]) if rows else []
    header = (f"{'ranks':>5} {'bytes':>10} {'Open MPI(us)':>12} {'ours(us)':>10} {'best of ours':>19} "
              f"{'gain':>6} | " + " ".join(f"{n:>18}" for n in names))
    lines = [header]
    for r in rows:
        lines.append(f"{r['ranks']:>5} {r['nbytes']:>10} {r['openmpi_us']:>12.1f} {r['ours_us']:>10.1f} "
                     f"{r['ours_algorithm']:>19} {r['gain']:>5.2f}x | "
                     + " ".join(f"{r['gain_by_algorithm'][n]:>17.2f}x" for n in names))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mpiallreduce bench", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                        help="comma-separated message sizes in bytes (K, M, G suffixes allowed)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS),
                        help=f"comma-separated, from {', '.join(ALGORITHMS)} (the Open MPI baseline always runs)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--op", default="sum")
    parser.add_argument("--repetitions", type=int, default=5, help="interleaved repetitions; the median is reported")
    parser.add_argument("--in-place", action="store_true", help="out=x instead of a separate output")
    parser.add_argument("--json", metavar="PATH", help="also write the measurements as JSON")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    results = compare(comm, sizes, algorithms, args.dtype, args.op, args.repetitions, args.in_place)
    if comm.Get_rank() == 0:
        from .mpilib import library_version
        print(f"# mpiallreduce bench: {comm.Get_size()} ranks, {library_version()}")
        print(f"# {args.dtype} {args.op}, {'in place' if args.in_place else 'out of place'}; time = median of "
              f"{args.repetitions} interleaved repetitions of the slowest rank's time per call")
        print(format_field_table(results))
        print()
        print("# Deep Speech 2 table: gain = Open MPI default time / our time (>1: ours is faster)")
        print(format_gain_table(gain_rows(results)))
        if args.json:
            import json
            with open(args.json, "w") as f:
                json.dump({"library": library_version(), "ranks": comm.Get_size(),
                           "measurements": [asdict(m) for m in results],
                           "gains": gain_rows(results)}, f, indent=1)
    wrong = sum(m.wrong for m in results)
    return 1 if wrong else 0
