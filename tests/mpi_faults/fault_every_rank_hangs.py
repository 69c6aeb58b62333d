"""Fails on purpose: a deadlock on every rank (each waits to receive first), ended by the per-test
timeout."""

import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi


def test_deadlock():
    comm = MPI.COMM_WORLD
    peer = (comm.Get_rank() + 1) % comm.Get_size()
    comm.recv(source=peer, tag=7)
