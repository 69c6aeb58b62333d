"""Fails on purpose: an assertion fails on the last rank only; the next test must still run."""

import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi


def test_assertion_fails_on_last_rank():
    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.Get_rank())
    assert comm.Get_rank() != comm.Get_size() - 1, (
        f"injected assertion on the last rank (total {total})"
    )


def test_the_next_test_still_runs():
    comm = MPI.COMM_WORLD
    assert comm.allreduce(1) == comm.Get_size()
