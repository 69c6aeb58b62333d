"""A peer that stalls in a timed call, alive (issue 54, item 3): the last rank sleeps past the
call's timeout and its grace, and every rank reports how its call ended and how long it took.

The grace (mpiallreduce.faults.outcome.GRACE_SECONDS, 2 s) is cut to GRACE on every rank for
these tests: its length is not what they test, and each of them sleeps through it."""

import time

from mpi4py import MPI

import mpiallreduce as mar

TIMEOUT = 0.5
GRACE = 0.3
#: what the machine's own delays may add to a rank's bound (timeout + grace)
MARGIN = 1.0
#: how long the stalled rank sleeps: past every other rank's bound
STALL = TIMEOUT + GRACE + MARGIN + 0.3


def shorten_the_grace(monkeypatch):
    import mpiallreduce.faults.outcome as outcome

    monkeypatch.setattr(outcome, "GRACE_SECONDS", GRACE)


def before_the_data_moves(monkeypatch, rank, what):
    """On ``rank``, ``what()`` runs once in the next call, after its signature was compared, before
    its first collective or message (the executor's _reduce: the peers are in theirs by then)."""
    from mpiallreduce.core.executor import Execution

    if MPI.COMM_WORLD.Get_rank() == rank:
        original = Execution._reduce

        def once(self, *args, **kwargs):
            monkeypatch.setattr(Execution, "_reduce", original)
            what()
            return original(self, *args, **kwargs)

        monkeypatch.setattr(Execution, "_reduce", once)


def stall():
    time.sleep(STALL)


def ended_alike_within_the_bound(call, comm=MPI.COMM_WORLD):
    """Run ``call()`` (the one the last rank stalls in) on every rank; assert that no rank returned
    and that every other rank raised within TIMEOUT + GRACE + MARGIN; the ranks' outcomes."""
    started = time.monotonic()
    try:
        call()
        outcome = "returned"
    except (mar.AllreduceTimeout, mar.AllreduceAborted) as error:
        outcome = type(error).__name__
    everyone = comm.allgather((outcome, time.monotonic() - started))
    assert all(o != "returned" for o, _ in everyone), everyone
    assert all(t < TIMEOUT + GRACE + MARGIN for _, t in everyone[:-1]), everyone
    return everyone
