"""Fault injection: one program, one fault per run, under mpiexec; tests/test_faults.py reads what
it prints.

    python inject.py SCENARIO ALGORITHM

Every rank prints lines "RESULT rank=R key=value ..." that the test parses. Data depend on rank and
index; expected values come from numpy on every rank's data (recomputed here from the formula,
independently of mpiallreduce).
"""

import os
import signal
import sys
import threading
import time
import warnings

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
COUNT = 100_003
TIMEOUT = 1.5
LATE = SIZE - 2  # the rank that misbehaves (not 0, not the last)


def data(rank, call=0):
    return ((np.arange(COUNT) * 7 + rank * 13 + call) % 11 - 5).astype(np.float64)


def expected(call=0):
    return np.sum([data(r, call) for r in range(SIZE)], axis=0)


def report(**fields):
    print(f"RESULT rank={RANK} " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def timed_call(algorithm, call, timeout=TIMEOUT):
    """One allreduce with a timeout: reports its outcome and how long it took; returns the error."""
    started = time.monotonic()
    try:
        result = mar.allreduce(data(RANK, call), algorithm=algorithm, timeout=timeout)
        report(
            call=call,
            outcome="ok",
            right=np.array_equal(result, expected(call)),
            seconds=f"{time.monotonic() - started:.2f}",
        )
    except mar.AllreduceTimeout as error:
        report(
            call=call,
            outcome="AllreduceTimeout",
            missing=",".join(map(str, error.missing_ranks)) or "-",
            sequence=error.sequence,
            seconds=f"{time.monotonic() - started:.2f}",
        )
        print(f"rank {RANK} message: {error}", flush=True)
        return error


def sleep_past_timeout(algorithm):
    timed_call(algorithm, 0)  # everyone present: sets up the control channel
    if RANK == LATE:
        time.sleep(TIMEOUT * 2)
    timed_call(algorithm, 1)
    WORLD.Barrier()
    timed_call(algorithm, 2)  # the communicator is still usable


def sleep_less_than_timeout(algorithm):
    timed_call(algorithm, 0)
    if RANK == LATE:
        time.sleep(TIMEOUT * 0.6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        timed_call(algorithm, 1)
    stalls = [str(w.message) for w in caught if issubclass(w.category, mar.AllreduceStallWarning)]
    named = sorted(
        {
            s.split(" for ")[1].split(";")[0].replace("rank ", "").replace("ranks ", "")
            for s in stalls
        }
    )
    report(warnings=len(stalls), warned_of=",".join(named) or "-")


def skip_a_call(algorithm):
    """The misbehaving rank skips the second of three calls in a loop (same line, same shapes)."""
    for call in range(3):
        if RANK == LATE and call == 1:
            continue
        if timed_call(algorithm, call) is not None:
            break
    WORLD.Barrier()


def skip_a_call_checked(algorithm):
    """The misbehaving rank skips a call made from one line and meets the others' with one from
    another line: check=True names the call sites on every rank."""
    try:
        if RANK != LATE:
            mar.allreduce(data(RANK), algorithm=algorithm, check=True)  # the call LATE skips
        mar.allreduce(data(RANK), algorithm=algorithm, check=True)
        report(outcome="ok")
    except ValueError as error:
        report(outcome="ValueError")
        print(f"rank {RANK} message: {' | '.join(str(error).splitlines())}", flush=True)


def mismatch(algorithm):
    """The misbehaving rank calls with another length, then another dtype, then another op."""
    for what in ("length", "dtype", "op"):
        x = data(RANK)
        op = "sum"
        if RANK == LATE:
            if what == "length":
                x = x[:-1]
            elif what == "dtype":
                x = x.astype(np.float32)
            else:
                op = "max"
        try:
            mar.allreduce(x, op=op, algorithm=algorithm, check=True)
            report(mismatch=what, outcome="ok")
        except ValueError as error:
            report(mismatch=what, outcome="ValueError")
            print(f"rank {RANK} message: {' | '.join(str(error).splitlines())}", flush=True)
        result = mar.allreduce(data(RANK), algorithm=algorithm)  # and the next call works
        report(mismatch=what, after="ok" if np.array_equal(result, expected()) else "wrong")


def raise_on_one_rank(algorithm):
    mar.abort_on_exception()
    mar.allreduce(data(RANK), algorithm=algorithm)
    report(started=f"{time.time():.3f}")
    if (
        RANK == LATE
    ):  # (after the others are in call #2: else a slow one is ended before it, and named)
        time.sleep(0.5)
        raise RuntimeError(f"injected failure on rank {RANK}")
    mar.allreduce(
        data(RANK), algorithm=algorithm
    )  # the others wait here, until the abort ends them
    report(outcome="not aborted")


def mismatch_then_dump(algorithm):
    """The misbehaving rank's second call reduces the same bytes as int64 (compared:
    SignatureMismatch on every rank; below MPIALLREDUCE_SIGNATURE_MIN_BYTES: wrong values, no error,
    as MPI_Allreduce cannot know); every rank catches what it raises, then writes its flight
    recorder's dump on demand."""
    mar.allreduce(data(RANK), algorithm=algorithm)
    x = data(RANK).view(np.int64) if RANK == LATE else data(RANK)
    try:
        mar.allreduce(x, algorithm=algorithm)
        report(outcome="ok")
    except (ValueError, RuntimeError) as error:
        report(outcome=type(error).__name__)
    report(dumped=mar.dump_trace("after the mismatch"))


def hang_until_stopped(algorithm):
    """The misbehaving rank stops calling after two calls (it sleeps); the others wait in the third
    until the launcher is sent SIGTERM."""
    for _ in range(2):
        mar.allreduce(data(RANK), algorithm=algorithm)
    report(waiting=True)
    if RANK == LATE:
        time.sleep(600)
    mar.allreduce(data(RANK), algorithm=algorithm)
    report(outcome="not stopped")


def prepared_apart_until_stopped(algorithm):
    """Every rank prepares two untimed calls, of 4 and of 8 float64s, and runs each once; then the
    misbehaving rank runs the second where the others run the first, until the launcher is sent
    SIGTERM (untimed prepared calls compare nothing: docs/call.md says what happens)."""
    small, large = data(RANK)[:4].copy(), data(RANK)[:8].copy()
    first = mar.prepare(small, out=small)
    second = mar.prepare(large, out=large)
    report(persistent=f"{first!r} {second!r}".count("persistent"))
    small[...], large[...] = data(RANK)[:4], data(RANK)[:8]
    first()
    second()
    report(
        right=bool(np.array_equal(small, expected()[:4]) and np.array_equal(large, expected()[:8]))
    )
    report(waiting=True)
    try:
        (second if RANK == LATE else first)()
        report(outcome="returned", small=small.tolist(), large=large.tolist())
    except (
        Exception
    ) as error:  # (what Open MPI, or the library, raised: said, then the job goes on)
        report(outcome=type(error).__name__)
        print(f"rank {RANK} message: {error}", flush=True)
    time.sleep(600)  # (until the launcher's SIGTERM: every rank's dump)


def killed(algorithm):
    """SIGKILL of one rank in the middle of a stream of large allreduces (no ULFM: the job ends)."""
    mar.allreduce(data(RANK), algorithm=algorithm)
    report(started=f"{time.time():.3f}")
    if RANK == LATE:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    big = np.ones(1 << 22)
    for _ in range(100000):
        mar.allreduce(big, algorithm=algorithm, out=big)
        big[:] = 1
    report(outcome="not ended")


def killed_under_ulfm(algorithm):
    """As killed, under mpiexec --with-ft ulfm: survivors get RankFailure naming the lost rank, then
    reduce on mar.survivors(comm)."""
    comm = WORLD.Dup()
    mar.allreduce(data(RANK), algorithm=algorithm, comm=comm)
    if RANK == LATE:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    big = np.ones(1 << 22)
    started = None
    try:
        for _ in range(100000):
            started = time.monotonic()
            mar.allreduce(big, algorithm=algorithm, out=big, comm=comm)
            big[:] = 1
    except mar.RankFailure as failure:
        report(
            outcome="RankFailure",
            failed=",".join(map(str, failure.failed_ranks)) or "-",
            seconds=f"{time.monotonic() - started:.2f}",
        )
        print(f"rank {RANK} message: {failure}", flush=True)
    survivors = mar.survivors(comm)
    alive = [r for r in range(SIZE) if r != LATE]
    result = mar.allreduce(data(RANK), algorithm=algorithm, comm=survivors)
    right = np.array_equal(result, np.sum([data(r) for r in alive], axis=0))
    report(survivors=survivors.Get_size(), right=right)


def killed_before_a_timed_call_under_ulfm(algorithm):
    """Under ULFM, with a timeout: a rank killed before a timed call is a RankFailure naming it on
    every survivor (not a bare MPI error from the rendezvous), and the survivors go on."""
    killed_before(
        algorithm,
        lambda comm, fresh: mar.allreduce(data(RANK), algorithm=algorithm, comm=comm, timeout=30),
    )


def killed_before_a_prepare_under_ulfm(algorithm):
    """Under ULFM: a rank killed before ``prepare`` is a RankFailure naming it on every survivor
    (not a bare MPI error from the allgather that agrees on the prepared call)."""
    killed_before(
        algorithm, lambda comm, fresh: mar.prepare(data(RANK), algorithm=algorithm, comm=comm)()
    )


def killed_before_a_first_call_under_ulfm(algorithm):
    """Under ULFM: a rank killed before the first call on a communicator, whose set-up (the
    library's duplicate) meets the dead rank, is a RankFailure naming it on every survivor (it was
    a bare MPI_ERR_INTERN; timed, a crash in MPI_Comm_revoke of the unfinished duplicate)."""
    killed_before(
        algorithm, lambda comm, fresh: mar.allreduce(data(RANK), algorithm=algorithm, comm=fresh)
    )


def killed_before_a_first_timed_call_under_ulfm(algorithm):
    """The same for a timed first call (its duplicate is waited for in the rendezvous)."""
    killed_before(
        algorithm,
        lambda comm, fresh: mar.allreduce(data(RANK), algorithm=algorithm, comm=fresh, timeout=30),
    )


def killed_before(algorithm, call):
    comm, fresh = WORLD.Dup(), WORLD.Dup()  # (fresh: no call on it before the death)
    mar.allreduce(
        data(RANK), algorithm=algorithm, comm=comm, timeout=30
    )  # the control channel is set up
    WORLD.Barrier()
    if RANK == LATE:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    started = time.monotonic()
    try:
        call(comm, fresh)
        report(outcome="ok")
    except mar.RankFailure as failure:
        report(
            outcome="RankFailure",
            failed=",".join(map(str, failure.failed_ranks)) or "-",
            seconds=f"{time.monotonic() - started:.2f}",
        )
        print(f"rank {RANK} message: {failure}", flush=True)
    except Exception as error:  # noqa: BLE001 - what the test must not see
        report(outcome=type(error).__name__)
        print(f"rank {RANK} message: {error}", flush=True)
    survivors = mar.survivors(comm)
    alive = [r for r in range(SIZE) if r != LATE]
    result = mar.allreduce(data(RANK), algorithm=algorithm, comm=survivors, timeout=30)
    report(
        survivors=survivors.Get_size(),
        right=np.array_equal(result, np.sum([data(r) for r in alive], axis=0)),
    )


def peers_die_mid_call(algorithm):
    """Every rank makes timed 64-byte calls in a row; after 1 s ranks 0 and SIZE - 1 end at once
    (os._exit from a thread, as the flight recorder's SIGTERM does), inside a call. A survivor's
    call must end in an error (RankFailure; AllreduceTimeout where the failure is slow to show) or
    give the right sum, never another: each reports its count."""
    comm = WORLD.Dup()
    mar.allreduce(np.ones(1), comm=comm)
    if RANK in (0, SIZE - 1):
        threading.Timer(1.0, lambda: os._exit(0)).start()
    right = wrong = 0
    for call in range(1, 1_000_000):
        x = data(RANK, call)[:8]
        try:
            result = mar.allreduce(x, algorithm=algorithm, comm=comm, timeout=TIMEOUT)
        except (
            mar.RankFailure,
            mar.AllreduceTimeout,
        ) as error:  # (a timeout, on a machine slow to tell)
            report(outcome=type(error).__name__, right=right, wrong=wrong)
            return
        if np.array_equal(result, expected(call)[:8]):
            right += 1
        else:
            wrong += 1
            print(
                f"rank {RANK}: call {call} returned {result.tolist()}, "
                f"not {expected(call)[:8].tolist()}",
                flush=True,
            )


if __name__ == "__main__":
    scenario, algorithm = sys.argv[1], sys.argv[2]
    globals()[scenario](algorithm)
    mar.exit_after_rank_failures(0)
