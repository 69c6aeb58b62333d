"""The timing loop: buffers, warm-up, interleaved repetitions of every contender at every size and
mode, the slowest rank's time per call, and the wrong-element count against MPI_Allreduce's
result."""

import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ...algorithms import HOST_ALGORITHMS as ALGORITHMS
from ...core.state import state_of
from ..openmpi_tuned import TUNED_ALLREDUCE_ALGORITHMS
from .contenders import BASELINE, HostMemory
from .contenders import contenders as make_contenders
from .limits import bound_pass, link_pass, link_peer

__all__ = ["Measurement", "compare", "count_wrong"]

SECONDS_PER_REPETITION = 0.02
MAX_ITERATIONS = 200
#: a contender's repetitions have settled when the middle half of them (first to third quartile)
#: spans at most this share of their median; until then it is repeated again, up to the cap
SETTLED_SPREAD = 0.10
#: the cap on repetitions, as a multiple of the minimum asked for (--repetitions)
REPETITION_CAP = 3
#: the default ``memory`` (HostMemory keeps no state: one instance serves every call)
_HOST_MEMORY = HostMemory()


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
    #: the fastest and slowest repetition (each the slowest rank's time per call)
    time_us_low: float | None = None
    time_us_high: float | None = None
    #: the least time any allreduce of this size can take here (limits.py), same run
    bound_us: float | None = None
    #: the first and third quartiles of the repetitions: the middle half, the range that tells a
    #: gain from noise (report.within_noise); one stalled repetition moves neither
    time_us_q1: float | None = None
    time_us_q3: float | None = None


def _input(count, dtype, rank):
    """Small integers that depend on rank and index: every reduction order gives the same bits."""
    values = (np.arange(count, dtype=np.int64) * 7 + rank * 3) % 11 - 5
    return values.astype(dtype)


def count_wrong(result, expected):
    """How many elements of ``result`` are not bitwise equal to ``expected``'s."""
    itemsize = result.dtype.itemsize
    differing_bytes = result.view(np.uint8).reshape(-1, itemsize) != expected.view(
        np.uint8
    ).reshape(-1, itemsize)
    return int(np.count_nonzero(differing_bytes.any(axis=1)))


def settled(seconds):
    """Whether repetitions ``seconds`` have settled: the middle half of them (first to third
    quartile) spans at most SETTLED_SPREAD of their median."""
    if len(seconds) < 2:
        return False
    q1, median, q3 = np.percentile(seconds, [25, 50, 75])
    return bool(q3 - q1 <= SETTLED_SPREAD * median)


def _iterations(probe_seconds):
    return int(min(MAX_ITERATIONS, max(1, SECONDS_PER_REPETITION / max(probe_seconds, 1e-7))))


def _time_calls(call, iterations, comm, prepare=None, memory=_HOST_MEMORY):
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


#: calls of the baseline timed one by one to size a repetition: the fastest of them, so that one
#: stalled call does not shrink every contender's repetitions to a single call
PROBES = 3


def _probe_seconds(comm, call, buffers, reset, memory):
    """The baseline's time per call, as the fastest of PROBES calls (the slowest rank's each)."""
    return min(
        _time_calls(lambda: call(*buffers, comm), 1, comm, reset, memory) for _ in range(PROBES)
    )


#: how long a rank whose contender raised waits for the others to agree on it: a contender that
#: raised on one rank alone, inside a collective, leaves the others there, and then the job is
#: aborted
AGREE_SECONDS = 60


def _warm_up(comm, contender, send, out, reset, expected, memory):
    """(seconds of one call, wrong elements over all ranks, None) or (None, None, the error): each
    contender on its own, so that one that raises is recorded as failed and the others go on. The
    ranks agree on it in one Iallgather, waited for at most AGREE_SECONDS (the library raises its
    errors on every rank; one rank's own error inside a collective ends the job, saying so)."""
    reset()
    memory.finish()
    comm.Barrier()
    error = None
    mine = np.zeros(3)  # raised, seconds, wrong elements
    start = time.perf_counter()
    try:
        contender(send, out, comm)
        memory.finish()
        mine[1] = time.perf_counter() - start
        mine[2] = count_wrong(memory.to_host(out), expected)
    except Exception as failure:  # noqa: BLE001 - recorded with its rank, on every rank
        error, mine[0] = (
            " ".join(f"{type(failure).__name__}: {failure}".split()),
            1,
        )  # (one line: a table cell)
    everyone = np.empty((comm.Get_size(), 3))
    request = comm.Iallgather(mine, everyone)
    deadline = time.monotonic() + AGREE_SECONDS
    while not request.Test():
        if time.monotonic() > deadline:
            print(
                f"mpiallreduce bench: rank {comm.Get_rank()}: {error}; the other ranks did not "
                f"come to agree on it within {AGREE_SECONDS} s (raised here alone, inside a "
                "collective?): aborting the job",
                file=sys.stderr,
                flush=True,
            )
            comm.Abort(1)
        time.sleep(0.001)
    if everyone[:, 0].any():
        errors = [
            (rank, text) for rank, text in enumerate(comm.allgather(error)) if text is not None
        ]
        return None, None, "; ".join(f"rank {rank}: {text}" for rank, text in errors[:2])
    return float(everyone[:, 1].max()), int(everyone[:, 2].sum()), None


def _measure_size(
    comm,
    contenders,
    nbytes,
    dtype,
    op,
    repetitions,
    in_place,
    memory=_HOST_MEMORY,
    failed=None,
    link=None,
    max_repetitions=None,
):
    """Every contender at one size and mode (see ``compare``); ``link``: across nodes, (the peer of
    rank 0 on another node, the node count): the bound there is a message over the link."""
    size = comm.Get_size()
    count = max(1, nbytes // dtype.itemsize)
    source = memory.array(_input(count, dtype, comm.Get_rank()))
    expected = memory.empty(count, dtype)
    contenders[BASELINE](source, expected, comm)
    expected = memory.to_host(expected)
    out = memory.empty(count, dtype)
    shared = (out if in_place else source, out)
    buffers = {}  # name -> (send, out): the shared pair, or a contender's own (symmetric buffers)

    def buffers_of(contender):
        own = getattr(contender, "buffers", None)
        if own is None:
            return shared
        mine = own(count, dtype, in_place, comm)
        memory.copy(mine[0], source)
        return mine

    def reset(name):
        if in_place:  # in place, the input is the output: put it back (outside the timed calls)
            memory.copy(buffers[name][1], source)

    # Warm up every contender and count its wrong elements; size the repetitions from the baseline.
    # In the timed calls in place, each call reduces the previous result again, as nccl-tests does.
    wrong, probe = {}, {}
    for name, contender in list(contenders.items()):
        buffers[name] = buffers_of(contender)
        probe[name], wrong[name], error = _warm_up(
            comm, contender, *buffers[name], lambda n=name: reset(n), expected, memory
        )
        if error is not None:
            if failed is None or name == BASELINE:
                raise RuntimeError(
                    f"{name} failed at {nbytes} bytes ({'in' if in_place else 'out of'} place): "
                    f"{error}"
                )
            failed.append(
                {
                    "ranks": size,
                    "nbytes": count * dtype.itemsize,
                    "in_place": in_place,
                    "algorithm": name,
                    "error": error,
                }
            )
    contenders = {name: c for name, c in contenders.items() if probe[name] is not None}
    iterations = _iterations(
        _probe_seconds(
            comm, contenders[BASELINE], buffers[BASELINE], lambda: reset(BASELINE), memory
        )
    )
    times = {name: [] for name in contenders}
    # the bound (limits.py): on one node, a pass of the least traffic, timed among the contenders
    on_host = type(memory) is HostMemory  # (no bound for device memory yet)
    bounds = (
        []
        if not on_host
        else [bound_pass(count, dtype, in_place)]
        if link is None
        else link_pass(comm, *link, count * dtype.itemsize)
    )
    bound_times = []
    # Rounds of interleaved repetitions (A B C, A B C, ...): at least ``repetitions``, then again
    # for the contenders whose spread has not settled, the baseline with them every round, until
    # none is left or ``max_repetitions`` is reached. Every rank holds the same times (each is the
    # slowest rank's), so every rank makes the same choice.
    timed = dict(contenders)
    if max_repetitions is None:  # (tune and the prices: as many as asked for, no more)
        max_repetitions = repetitions
    with np.errstate(over="ignore"):  # in place, repeated sums of the result may overflow to inf
        for done in range(max(repetitions, max_repetitions)):
            if done >= repetitions:
                timed = {
                    name: c
                    for name, c in contenders.items()
                    if name == BASELINE or not settled(times[name])
                }
                if len(timed) == 1 and settled(times[BASELINE]):
                    break
            for name, contender in timed.items():
                times[name].append(
                    _time_calls(
                        lambda c=contender, b=buffers[name]: c(*b, comm),
                        iterations,
                        comm,
                        lambda n=name: reset(n),
                        memory,
                    )
                )
            for bound in bounds:  # (as many on every rank)
                bound_times.append(_time_calls(bound, iterations, comm))
    bound_us = min(bound_times) * 1e6 if bound_times else None
    results = []
    for name in contenders:
        seconds = statistics.median(times[name])
        quartiles = np.percentile(times[name], [25, 75]).tolist()
        algbw = count * dtype.itemsize / seconds / 1e9
        results.append(
            Measurement(
                ranks=size,
                nbytes=count * dtype.itemsize,
                count=count,
                dtype=str(dtype),
                op=op,
                algorithm=name,
                in_place=in_place,
                iterations=iterations,
                repetitions=len(times[name]),
                time_us=seconds * 1e6,
                algbw_gbs=algbw,
                busbw_gbs=algbw * 2 * (size - 1) / size,
                wrong=wrong[name],
                time_us_low=min(times[name]) * 1e6,
                time_us_high=max(times[name]) * 1e6,
                bound_us=bound_us,
                time_us_q1=quartiles[0] * 1e6,
                time_us_q3=quartiles[1] * 1e6,
            )
        )
    return results


def compare(
    comm,
    sizes,
    algorithms=ALGORITHMS,
    dtype="float32",
    op="sum",
    repetitions=5,
    modes=(False, True),
    forced=tuple(TUNED_ALLREDUCE_ALGORITHMS),
    plant_wrong=None,
    memory=_HOST_MEMORY,
    progress=None,
    failed=None,
    max_repetitions=None,
):
    """Measure every contender at every size and mode (in_place False/True); collective.

    Returns a list of Measurements (complete on every rank). ``progress(measurements)``, if given,
    is called with each size and mode's measurements as soon as they are taken. ``failed``: a list
    that gets a dict (ranks, nbytes, in_place, algorithm, error) for each contender that raised at
    a size, the others going on; without it, such an error is raised (Open MPI's default's always).
    ``repetitions`` is the least number of interleaved repetitions; a contender whose repetitions
    have not settled (``settled``) is repeated again, up to ``max_repetitions`` (default
    ``repetitions``: no more; bench asks for REPETITION_CAP times as many). Each size and mode has
    its bound, measured among the contenders (limits.bound_pass on one node, limits.link_pass
    across nodes).
    """
    dtype = np.dtype(dtype)
    contenders, made = make_contenders(
        comm, algorithms, op, forced, plant_wrong, memory, largest=max(sizes, default=0)
    )
    peer = link_peer(comm)
    link = None if peer is None else (peer, state_of(comm).make_ready().node_count)
    try:
        results = []
        for nbytes in sizes:
            for in_place in modes:
                measured = _measure_size(
                    comm,
                    contenders,
                    nbytes,
                    dtype,
                    op,
                    repetitions,
                    in_place,
                    memory,
                    failed,
                    link,
                    max_repetitions,
                )
                if progress is not None:
                    progress(measured)
                results.extend(measured)
        return results
    finally:
        for c in made:
            c.Free()
