"""Fails on purpose: rank 1 raises while the other ranks wait for it in a collective."""

import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi


def test_rank_1_raises_before_the_allreduce():
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 1:
        raise RuntimeError("injected failure on rank 1, before the collective")
    comm.allreduce(1)  # rank 1 never comes: without the verdict agreement this hangs forever
