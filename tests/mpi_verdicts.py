"""pytest plugin for tests that run on every rank under mpiexec: one verdict per test, on all ranks.

After each test body, the ranks agree (a nonblocking allreduce on a private communicator, waited
for at most AGREE_SECONDS) on whether any rank failed:
    - if one did, the test fails on every rank and rank 0's report carries each failing rank's
      traceback, so the run fails with the reason in front of the reader;
    - if the other ranks never arrive (they are stuck in a collective this rank left when it
      raised), this rank prints its own traceback and aborts the job: bounded time, no hang.
A test in which every rank hangs is ended by pytest-timeout (``--timeout``), which prints the
stacks and exits; mpiexec then ends the other ranks.
"""

import os
import sys
import time
import traceback

import numpy as np
import pytest
from mpi4py import MPI

AGREE_SECONDS = float(os.environ.get("MPIALLREDUCE_TEST_AGREE_SECONDS", "60"))

_verdict_comm = None


def pytest_configure(config):
    global _verdict_comm
    _verdict_comm = MPI.COMM_WORLD.Dup()


def pytest_unconfigure(config):
    if _verdict_comm is not None and not MPI.Is_finalized():
        _verdict_comm.Free()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    rank = _verdict_comm.Get_rank()
    failure = skipped = None
    return_value = None
    try:
        return_value = yield
    except (pytest.skip.Exception, pytest.xfail.Exception) as exc:
        skipped = (
            exc  # a skip on one rank is no failure; the ranks still agree, then it is re-raised
        )
    except BaseException as exc:
        failure = exc
    text = None if failure is None else _format(failure)
    failed_ranks = _agree_on_failures(item, rank, text)
    if not failed_ranks:
        if skipped is not None:
            raise skipped
        return return_value
    reports = _verdict_comm.allgather(text)
    if failure is not None and failed_ranks == [rank]:
        raise failure
    ranks_phrase = ", ".join(str(r) for r in failed_ranks)
    details = "\n".join(f"----- rank {r} -----\n{reports[r]}" for r in failed_ranks)
    pytest.fail(
        f"failed on rank(s) {ranks_phrase} of {_verdict_comm.Get_size()}:\n{details}", pytrace=False
    )


def _format(failure):
    """The traceback without pytest's and pluggy's own frames."""
    report = traceback.TracebackException.from_exception(failure)
    report.stack = traceback.StackSummary.from_list(
        [
            frame
            for frame in report.stack
            if not any(
                part in frame.filename for part in ("/_pytest/", "/pluggy/", "mpi_verdicts.py")
            )
        ]
    )
    return "".join(report.format())


def _agree_on_failures(item, rank, text):
    """Ranks on which this test failed, agreed by all ranks; abort the job if they do not all
    arrive."""
    flags = np.zeros(_verdict_comm.Get_size(), dtype=np.int32)
    flags[rank] = 0 if text is None else 1
    request = _verdict_comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    deadline = time.monotonic() + AGREE_SECONDS
    pause = 0.0
    while not request.Test():
        if time.monotonic() > deadline:
            outcome = "passed" if text is None else "failed"
            capture = item.config.pluginmanager.getplugin("capturemanager")
            with capture.global_and_fixture_disabled():  # to the real stderr, past pytest's capture
                sys.stderr.write(
                    f"\n[rank {rank}] {item.nodeid} {outcome} on this rank, "
                    "but not every rank finished it "
                    f"within {AGREE_SECONDS:g} s (stuck in a collective this rank left?); "
                    "aborting the job.\n" + (f"[rank {rank}] traceback:\n{text}" if text else "")
                )
                sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        time.sleep(pause)
        pause = min(0.001, pause + 0.0001)
    return [int(r) for r in np.flatnonzero(flags)]
