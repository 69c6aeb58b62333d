"""Where a 2-rank exchange across nodes spends its time: MPI's own allreduce against the same
exchange built up layer by layer, up to the library's prepared and plain recursive doubling.

    mpiallreduce launch -n 2 --nodes 2 -- python benchmarks/exchange_across_nodes.py
        [--sizes 128K,512K,1M] [--rounds 11] [--forced] [--output FILE]

On 2 ranks, recursive doubling is one exchange: each rank sends its whole input to the other and
adds what comes, the lower rank's first (the same bits on both). The contenders, interleaved in one
launch, ``--rounds`` times per size, each a batch of calls on the same float32 buffers:

    MPI_Allreduce    comm.Allreduce(x, out): Open MPI's default (coll/han across nodes)
    sendrecv         comm.Sendrecv of x into a buffer, then np.add into out (blocking)
    halves           the ring's 2-rank exchange, bare: comm.Sendrecv of the half the peer sums,
                     np.add of this rank's half, comm.Sendrecv of the summed halves (blocking; n/2
                     each way twice and an addition of n/2, against n and n)
    polled           the same as Irecv + Isend, MPI_Testall polled with sched_yield between tests
                     (how the library waits: mpiallreduce.faults.watch.PeerWatch.wait)
    call tags        the same through the library's CallTags and PeerWatch on its duplicate
    prepared rd      mar.prepare(x, out=out, algorithm="recursive_doubling").run(): no check
    plain rd         mar.allreduce(x, out=out, algorithm="recursive_doubling"): the signature
                     compared first, in 32-byte messages
    auto             mar.allreduce(x, out=out)
    prepared auto    mar.prepare(x, out=out).run()
    openmpi:NAME     with --forced: MPI_Allreduce with Open MPI's tuned algorithm NAME forced
                     (han off)

With --forced, a last summary line per size says whether issue #28's 1.2x of Open MPI's strongest
(the fastest of MPI_Allreduce and the forced ones) is within reach of the bare exchanges, with no
library layer at all: the faster of "sendrecv" and "halves" over the strongest.

Each figure: the mean per call over a batch, the slowest rank's, in microseconds; per size the
medians over the rounds, each as MPI_Allreduce's time over its own (above 1: faster than MPI's).
Then, for the prepared call, where its time goes on rank 0 (perf_counter around each layer,
the layers' own time: the executor, the algorithm's execute less the exchange and the addition).
"""

import collections
import os
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI
from plain_across_nodes import (
    arguments,
    interleaved,
    nbytes_of,
)  # (benchmarks/, the script's folder)
from signature_exchange import write_lines

import mpiallreduce as mar
from mpiallreduce.algorithms import recursive_doubling
from mpiallreduce.algorithms.base import CallTags
from mpiallreduce.core import executor
from mpiallreduce.core.state import state_of
from mpiallreduce.faults.watch import PeerWatch

COMM = MPI.COMM_WORLD
SIZES = "128K,256K,512K,1M"
ROUNDS = 11


def exchanges(x, out, incoming):
    """The hand-built contenders: {name: call}."""
    rank = COMM.Get_rank()
    peer = 1 - rank
    own = COMM.Dup()
    state = state_of(COMM).make_ready()
    numbers = iter(range(1 << 20, 1 << 30))

    def add():
        np.add(x, incoming, out=out) if rank == 0 else np.add(incoming, x, out=out)

    def sendrecv():
        own.Sendrecv(x, peer, 7, incoming, peer, 7)
        add()

    def polled():
        requests = [own.Irecv(incoming, peer, 7), own.Isend(x, peer, 7)]
        while not MPI.Request.Testall(requests):
            os.sched_yield()
        add()

    def call_tags():
        number = next(numbers)
        tags = CallTags(state.library, number, PeerWatch(state, number, None, "exchange"))
        tags.Sendrecv([x, MPI.FLOAT], peer, 202, [incoming, MPI.FLOAT], peer, 202)
        add()

    half = x.size // 2
    mine, theirs = (
        (slice(0, half), slice(half, None)) if rank == 0 else (slice(half, None), slice(0, half))
    )

    def halves():
        received = incoming[mine]
        own.Sendrecv(x[theirs], peer, 8, received, peer, 8)
        np.add(x[mine], received, out=out[mine])
        own.Sendrecv(out[mine], peer, 9, out[theirs], peer, 9)

    return {"sendrecv": sendrecv, "halves": halves, "polled": polled, "call tags": call_tags}


def forced_contenders(x, out):
    """With --forced: {"openmpi:NAME": MPI_Allreduce with Open MPI's tuned algorithm NAME
    forced}."""
    from mpiallreduce.tools.openmpi_tuned import (
        TUNED_ALLREDUCE_ALGORITHMS,
        forced_allreduce_communicator,
    )

    found = {}
    for number, name in TUNED_ALLREDUCE_ALGORITHMS.items():
        comm = forced_allreduce_communicator(COMM, number)
        if comm is not None:
            found["openmpi:" + name] = lambda comm=comm: comm.Allreduce(x, out)
    return found


def within_reach(nbytes, medians):
    """The summary line of --forced: the bare exchanges against Open MPI's strongest."""
    strongest = min(
        (m, name)
        for name, m in medians.items()
        if name == "MPI_Allreduce" or name.startswith("openmpi:")
    )
    bare = min((medians[name], name) for name in ("sendrecv", "halves"))
    ours = min(
        (m, name) for name, m in medians.items() if name in ("prepared rd", "auto", "prepared auto")
    )
    return (
        f"{nbytes:>8} B  strongest {strongest[1]} {strongest[0]:.1f}; "
        f"1.2x of it: {strongest[0] / 1.2:.1f}; "
        f"bare {bare[1]} {bare[0]:.1f} ({strongest[0] / bare[0]:.2f}x); "
        f"ours {ours[1]} {ours[0]:.1f} "
        f"({strongest[0] / ours[0]:.2f}x)"
    )


def layers(prepared, calls):
    """Rank 0's time per call in each layer of ``prepared.run()``: {layer: us}."""
    spent = collections.Counter()
    patched = [
        (executor.Execution, "run"),
        (recursive_doubling.RecursiveDoublingAllreduce, "execute"),
        (CallTags, "Sendrecv"),
        (recursive_doubling, "reduce_in_rank_order"),
    ]
    originals = [getattr(owner, name) for owner, name in patched]

    def timed(function, key):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        return run

    for (owner, name), function in zip(patched, originals, strict=True):
        setattr(owner, name, timed(function, name))
    try:
        COMM.Barrier()
        start = time.perf_counter()
        for _ in range(calls):
            prepared.run()
        whole = time.perf_counter() - start
    finally:
        for (owner, name), function in zip(patched, originals, strict=True):
            setattr(owner, name, function)
    us = {key: value / calls * 1e6 for key, value in spent.items()}
    return {
        "the whole run()": whole / calls * 1e6,
        "above the executor (prepared call)": whole / calls * 1e6 - us["run"],
        "executor, less execute": us["run"] - us["execute"],
        "execute, less exchange and addition": us["execute"]
        - us["Sendrecv"]
        - us["reduce_in_rank_order"],
        "exchange (CallTags.Sendrecv, watched)": us["Sendrecv"],
        "addition (reduce_in_rank_order)": us["reduce_in_rank_order"],
    }


def main():
    args = arguments(__doc__.splitlines()[0], SIZES, ROUNDS, forced=True)
    if COMM.Get_size() != 2:
        raise SystemExit("run it on 2 ranks (launch -n 2 --nodes 2)")
    lines = [
        f"# a 2-rank exchange across nodes: {time.strftime('%Y-%m-%d %H:%M')}, load "
        f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}, us per call, slowest rank, "
        f"{args.rounds} interleaved rounds; ratio: MPI_Allreduce's time over the contender's"
    ]
    summary, breakdown, reach = [], [], []
    for nbytes in (nbytes_of(s) for s in args.sizes.split(",")):
        x = np.arange(nbytes // 4, dtype=np.float32) + COMM.Get_rank()
        out, incoming = np.empty_like(x), np.empty_like(x)
        prepared = mar.prepare(x, out=out, algorithm="recursive_doubling")
        contenders = {
            "MPI_Allreduce": lambda x=x, out=out: COMM.Allreduce(x, out),
            **exchanges(x, out, incoming),
            "prepared rd": prepared.run,
            "plain rd": lambda x=x, out=out: mar.allreduce(
                x, out=out, algorithm="recursive_doubling"
            ),
            "auto": lambda x=x, out=out: mar.allreduce(x, out=out),
            "prepared auto": mar.prepare(x, out=out).run,
            **(forced_contenders(x, out) if args.forced else {}),
        }
        calls = max(20, min(200, int(2e7 / nbytes)))
        expected = np.arange(x.size, dtype=np.float32) * 2 + 1
        for name, call in contenders.items():
            for _ in range(5):
                call()
            assert np.array_equal(out, expected), name  # (every contender's sum, against numpy's)
        medians = interleaved(contenders, calls, args.rounds, nbytes, lines)
        if args.forced:
            reach.append(within_reach(nbytes, medians))
        summary.append(
            f"{nbytes:>8} B  "
            + "  ".join(
                f"{name} {m:.1f} ({medians['MPI_Allreduce'] / m:.2f}x)"
                for name, m in medians.items()
            )
        )
        spent = layers(prepared, calls)
        breakdown.append(
            f"{nbytes:>8} B  " + "  ".join(f"{layer} {us:.1f}" for layer, us in spent.items())
        )
    write_lines(
        lines
        + ["# medians over the rounds (MPI_Allreduce's time over each)"]
        + summary
        + ["# the prepared call's layers on rank 0, us per call (one batch)"]
        + breakdown
        + (
            ["# the bare exchanges against Open MPI's strongest (ratio: its time over theirs)"]
            + reach
            if reach
            else []
        ),
        args.output,
    )


if __name__ == "__main__":
    main()
