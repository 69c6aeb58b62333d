"""What the signature check costs a plain call where it goes in messages (across nodes, under ULFM),
with today's exchange and the two before it, side by side:

    mpiallreduce launch -n 2 --nodes 2 -- python benchmarks/signature_exchange.py [--output FILE]

- today's: dissemination in bare Isend/Irecv pairs, its codes (and the call's number) packed with
  struct (mpiallreduce.core.consistency, since the evening of 2026-12-03);
- "numpy": the same rounds with numpy arrays for the codes (2026-12-03, until that evening);
- "recursive doubling": the recursive_doubling algorithm run on the call's tags (before 2026-12-03).

Interleaved in one launch, ROUNDS times: 1000 plain calls of MPI's own allreduce
(``mar.allreduce(x, out=out, algorithm="mpi")``, the check first) with each exchange in turn, then
1000 plain calls of what ``auto`` runs there (dissemination, carrying the check in its rounds, up to
overrides.DISSEMINATION_UP_TO), then raw ``comm.Allreduce`` on the same buffers, at 4 B, 8 KiB and
64 KiB; then, at 64 KiB, one ``Sendrecv`` of the whole buffer (what a check carried in an
algorithm's own first message would start from) against Open MPI's allreduce. Each figure: the mean
time per call over a round, the slowest rank's, in microseconds.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.core import consistency

ROUNDS, CALLS = 4, 1000
COMM = MPI.COMM_WORLD


def recursive_doubling(state, code, sequence, watch):
    """The exchange before 2026-12-03: the recursive_doubling algorithm on the call's tags."""
    from mpiallreduce.algorithms import REGISTRY
    from mpiallreduce.algorithms.base import CallTags
    from mpiallreduce.core.ops import OPS

    extremes = np.array([code, -code], dtype=np.int64)
    REGISTRY["recursive_doubling"].run(
        CallTags(state.library, sequence, watch, CallTags.SIGNATURE_BASE),
        None,
        extremes,
        OPS["max"],
        MPI.INT64_T,
    )
    return extremes[0] == -extremes[1]


def numpy_dissemination(state, code, sequence, watch):
    """The exchange of 2026-12-03: today's rounds, the codes in numpy arrays."""
    from mpiallreduce.algorithms.base import CallTags

    tags = CallTags(state.library, sequence, None, CallTags.SIGNATURE_BASE)
    rank, size = state.rank, state.size
    mine, distance, step = np.array((code, -code), dtype=np.int64), 1, 0
    while distance < size:
        theirs = np.empty(2, dtype=np.int64)
        watch.wait(
            [
                tags.Irecv(theirs, (rank - distance) % size, step),
                tags.Isend(mine, (rank + distance) % size, step),
            ]
        )
        mine = np.maximum(mine, theirs)
        distance, step = distance * 2, step + 1
    return mine[0] == -mine[1]


def per_call(call, calls=CALLS):
    COMM.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return COMM.allreduce((time.perf_counter() - start) / calls * 1e6, op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="also write the lines to this file (rank 0)")
    args = parser.parse_args()
    today = consistency._codes_agree_by_messages
    lines = [
        f"# signature exchange in messages: {COMM.Get_size()} ranks, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, "
        f"us per call, slowest rank, {ROUNDS} interleaved rounds of {CALLS} calls"
    ]
    for nbytes in (4, 8 * 1024, 64 * 1024):
        x = np.arange(nbytes // 4, dtype=np.float32) + COMM.Get_rank()
        out = np.empty_like(x)
        assert (
            "32-byte messages" in mar.describe_call(x, out=out, algorithm="mpi")
            or COMM.Get_size() == 1
        ), "the check does not go in messages here: launch with --nodes 2"
        auto = mar.describe_call(x, out=out).split(" ")[0]
        for _ in range(20):
            mar.allreduce(x, out=out)
            mar.allreduce(x, out=out, algorithm="mpi")
        rows = []
        for _ in range(ROUNDS):
            row = []
            for exchange in (today, numpy_dissemination, recursive_doubling):
                consistency._codes_agree_by_messages = exchange
                row.append(
                    per_call(lambda x=x, out=out: mar.allreduce(x, out=out, algorithm="mpi"))
                )
            consistency._codes_agree_by_messages = today
            rows.append(
                (
                    *row,
                    per_call(lambda x=x, out=out: mar.allreduce(x, out=out)),
                    per_call(lambda x=x, out=out: COMM.Allreduce(x, out)),
                )
            )
        for now, numpy_rounds, doubling, plain, raw in rows:
            lines.append(
                f"{nbytes:>6} B  check, then MPI's own: today's exchange {now:7.1f}  "
                f"numpy {numpy_rounds:7.1f}  "
                f"recursive doubling {doubling:7.1f}  |  auto ({auto}) {plain:7.1f}  "
                f"|  MPI_Allreduce {raw:7.1f}"
            )
    x = np.arange(16384, dtype=np.float32) + COMM.Get_rank()
    out, incoming, peer = (
        np.empty_like(x),
        np.empty_like(x),
        (COMM.Get_rank() + 1) % COMM.Get_size(),
    )
    source = (COMM.Get_rank() - 1) % COMM.Get_size()
    for _ in range(ROUNDS):
        sendrecv = per_call(lambda: COMM.Sendrecv(x, peer, 7, incoming, source, 7), CALLS // 4)
        allreduce = per_call(lambda: COMM.Allreduce(x, out), CALLS // 4)
        lines.append(
            f" 65536 B  one Sendrecv of the buffer {sendrecv:7.1f}  "
            f"Open MPI's MPI_Allreduce {allreduce:7.1f}"
        )
    write_lines(lines, args.output)


def write_lines(lines, output):
    """Print ``lines`` on rank 0, and write them to ``output`` where given."""
    if COMM.Get_rank() == 0:
        print("\n".join(lines), flush=True)
        if output:
            with open(output, "w") as f:
                f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
