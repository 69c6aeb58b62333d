"""What the Python wrapper, a prepared call, the signature check and a timeout cost per call,
against mpi4py's raw MPI_Allreduce, measured side by side in one run.

    mpiallreduce launch -n 2 -- python benchmarks/call_overhead.py

Median over interleaved repetitions of the slowest rank's time per call (microseconds), and the
ratio to raw ``comm.Allreduce`` on the same buffers:
- 4 B: raw comm.Allreduce, persistent MPI_Allreduce_init (Start + Wait), mar.prepare(...)() and
  its Python path, mar.allreduce(algorithm="mpi"), mar.allreduce (auto), its mean (MPI's sum,
  then divided); auto on a duplicate communicator through the compiled short path and through the
  Python one (mpiallreduce/core/compiled.py: the same call, side by side); where auto's time goes:
  the same MPI_Allreduce on the library's duplicate, and auto's short path called without the entry
  point; a call that cannot take the short path (a strided x: the general path); entering
  np.errstate (what the reductions no longer do per call);
- 64 KiB: raw, a prepared call (agreed once, no per-call check), allreduce(algorithm="mpi") with the
  signature check that every call makes by default, and that check alone; then auto
  (shared_memory here, which waits for the codes in place of its first barrier) and mpi, each with
  and without the check (the checked call's ratio to the unchecked one is the check's price);
- 4 KiB and 1 MiB: ring without and with timeout=60 (the rendezvous of mpiallreduce.faults);
- the flight recorder (mpiallreduce.faults.recorder) on and off: two communicators, the recorder
  taken from one before its first call, at 4 B (auto, and a prepared call) and at 64 KiB (auto).
"""

import dataclasses
import statistics

import numpy as np
from call_price import per_call  # (the slowest rank's seconds per call: benchmarks/call_price.py)
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.core import compiled
from mpiallreduce.core import settings as settings_module
from mpiallreduce.core.consistency import compare as compare_signature
from mpiallreduce.core.state import state_of
from mpiallreduce.faults.watch import PeerWatch

COMM = MPI.COMM_WORLD
REPETITIONS = 7


def compare(contenders, iterations):
    """{name: median microseconds}, the contenders interleaved in every repetition."""
    times = {name: [] for name in contenders}
    for _ in range(REPETITIONS):
        for name, call in contenders.items():
            times[name].append(per_call(call, iterations))
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main():
    x = np.ones(1, np.float32)
    out = np.empty_like(x)
    persistent = COMM.Allreduce_init(x, out)
    prepared = mar.prepare(x, out=out)

    def start_wait():
        persistent.Start()
        persistent.Wait()

    # where auto's microseconds go: the same MPI_Allreduce on the library's duplicate, then the
    # short path (bound once per shape, dtype, op, algorithm) called directly, then the entry point
    mar.allreduce(x, out=out)
    world = state_of(COMM)
    execution = world.fast_calls[
        (x.shape, x.dtype, "sum", "auto", False)
    ]  # (numpy, not in place: the short path's key)
    library = world.library

    strided = np.ones(8, np.int8)[::2]  # 4 bytes, every other one: the general path
    # two duplicates: one's short path compiled (where built), the other's the Python closure
    compiled_comm, python_comm = COMM.Dup(), COMM.Dup()
    for c in (compiled_comm, python_comm):
        mar.allreduce(x, out=out, comm=c)
    python_execution = state_of(python_comm).fast_calls[(x.shape, x.dtype, "sum", "auto", False)]
    python_execution.short = python_execution._short_path()

    def enter_errstate():
        with np.errstate(all="ignore"):
            pass

    rows = [
        (
            "4 B",
            compare(
                {
                    "MPI_Allreduce (mpi4py)": lambda: COMM.Allreduce(x, out),
                    "MPI_Allreduce_init Start+Wait": start_wait,
                    "prepare(x, out=out)()": prepared,
                    "prepared, its Python path": prepared._call,
                    "allreduce(algorithm='mpi')": lambda: mar.allreduce(
                        x, out=out, algorithm="mpi"
                    ),
                    "allreduce (auto)": lambda: mar.allreduce(x, out=out),
                    "allreduce(op='mean') (auto)": lambda: mar.allreduce(x, out=out, op="mean"),
                    "auto on a duplicate, compiled short path": lambda: mar.allreduce(
                        x, out=out, comm=compiled_comm
                    ),
                    "auto on a duplicate, Python short path": lambda: mar.allreduce(
                        x, out=out, comm=python_comm
                    ),
                    "its MPI_Allreduce on the library's duplicate": lambda: library.Allreduce(
                        x, out, MPI.SUM
                    ),
                    "its short path alone": lambda: execution.short(x, out),
                    "allreduce of a strided x (4 int8: the general path)": lambda: mar.allreduce(
                        strided
                    ),
                    "entering np.errstate (no MPI)": enter_errstate,
                },
                4000,
            ),
        )
    ]

    y = np.ones(16384, np.float32)
    result = np.empty_like(y)
    prepared_64k = mar.prepare(y, out=result, algorithm="mpi")  # agreed once: no per-call check
    state = state_of(COMM)
    code = 12345

    def signature_alone():
        number = state.number()
        compare_signature(state, code, lambda: {}, lambda: PeerWatch(state, number), number)

    rows.append(
        (
            "64 KiB",
            compare(
                {
                    "MPI_Allreduce (mpi4py)": lambda: COMM.Allreduce(y, result),
                    "prepare(..., algorithm='mpi')()": prepared_64k,
                    "allreduce(algorithm='mpi') (signature checked)": lambda: mar.allreduce(
                        y, out=result, algorithm="mpi"
                    ),
                    "its mean (op='mean')": lambda: mar.allreduce(
                        y, out=result, algorithm="mpi", op="mean"
                    ),
                    "the signature check alone": signature_alone,
                },
                400,
            ),
        )
    )

    # the check against no check, for auto at 64 KiB (shared_memory on one node, which waits for the
    # ranks' codes in place of its first barrier) and for mpi: one communicator made while the check
    # is on, one while it is off. Each keeps what its first call bound, so both run side by side.
    checked, unchecked = COMM.Dup(), COMM.Dup()
    current = settings_module.settings()
    for algorithm in ("auto", "mpi"):
        mar.allreduce(y, out=result, comm=checked, algorithm=algorithm)
        settings_module.reset_settings(dataclasses.replace(current, signature_min_bytes=-1))
        mar.allreduce(y, out=result, comm=unchecked, algorithm=algorithm)
        settings_module.reset_settings(current)
    rows.append(
        (
            "64 KiB, check or not",
            compare(
                {
                    "MPI_Allreduce (mpi4py)": lambda: COMM.Allreduce(y, result),
                    "auto, signature not checked": lambda: mar.allreduce(
                        y, out=result, comm=unchecked
                    ),
                    "auto, signature checked": lambda: mar.allreduce(y, out=result, comm=checked),
                    "mpi, signature not checked": lambda: mar.allreduce(
                        y, out=result, comm=unchecked, algorithm="mpi"
                    ),
                    "mpi, signature checked": lambda: mar.allreduce(
                        y, out=result, comm=checked, algorithm="mpi"
                    ),
                },
                400,
            ),
        )
    )
    plan = mar.describe_call(y, comm=checked)

    for nbytes, iterations in ((4096, 200), (1 << 20, 20)):
        z = np.ones(nbytes // 4, np.float32)
        zout = np.empty_like(z)
        rows.append(
            (
                f"{nbytes} B",
                compare(
                    {
                        "ring": lambda z=z, zout=zout: mar.allreduce(z, out=zout, algorithm="ring"),
                        "ring, timeout=60": lambda z=z, zout=zout: mar.allreduce(
                            z, out=zout, algorithm="ring", timeout=60
                        ),
                    },
                    iterations,
                ),
            )
        )
    from mpiallreduce.faults.recorder import Recorder

    traced, untraced = COMM.Dup(), COMM.Dup()
    # (before any call, so that their short paths are made with and without one; the recorder is off
    # by default, MPIALLREDUCE_TRACE_ENTRIES: one of 512 entries here whatever the environment says)
    state_of(traced).recorder, state_of(untraced).recorder = Recorder(512), None
    for size, values, iterations in (("4 B", x, 4000), ("64 KiB", y, 400)):
        sink = np.empty_like(values)
        prepared_on, prepared_off = (
            mar.prepare(values, out=sink, comm=c) for c in (traced, untraced)
        )
        rows.append(
            (
                f"{size}, recorder on or off",
                compare(
                    {
                        "MPI_Allreduce (mpi4py)": lambda v=values, o=sink: COMM.Allreduce(v, o),
                        "auto, recorder off": lambda v=values, o=sink: mar.allreduce(
                            v, out=o, comm=untraced
                        ),
                        "auto, recorder on": lambda v=values, o=sink: mar.allreduce(
                            v, out=o, comm=traced
                        ),
                        "prepared, recorder off": prepared_off,
                        "prepared, recorder on": prepared_on,
                    },
                    iterations,
                ),
            )
        )
    persistent.Free()
    for c in (compiled_comm, python_comm):
        c.Free()
    if COMM.Get_rank() == 0:
        print(
            f"# compiled paths: {'built' if compiled.built() else 'not built'}"
            f"{'' if compiled.used() else ', not used (MPIALLREDUCE_COMPILED=0)'}"
        )
        print(f"# auto at 64 KiB runs: {plan}")
        print(
            f"# {COMM.Get_size()} ranks; median of {REPETITIONS} interleaved repetitions, "
            "slowest rank, us per call"
        )
        for size, measured in rows:
            raw = measured.get("MPI_Allreduce (mpi4py)")
            print(
                size
                + ": "
                + ", ".join(
                    f"{name} {us:.2f}"
                    + (f" ({us / raw:.2f}x)" if raw and name != "MPI_Allreduce (mpi4py)" else "")
                    for name, us in measured.items()
                )
            )
            for name, us in measured.items():
                if name.endswith(", signature checked"):
                    unchecked_us = measured[name.replace("checked", "not checked")]
                    print(
                        f"  the check's price, {name.split(',')[0]}: "
                        f"{100 * (us / unchecked_us - 1):+.1f}%"
                    )
                if name.endswith(", recorder on"):
                    off_us = measured[name.replace(" on", " off")]
                    print(
                        f"  the recorder's price, {name.split(',')[0]}: "
                        f"{100 * (us / off_us - 1):+.1f}%"
                    )


if __name__ == "__main__":
    main()
