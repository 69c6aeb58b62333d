"""Run under ``mpiallreduce launch -n 3``: shared windows on a two-rank and a one-rank half and on
the world, made and grown, then exit, once through Python's exit and once (``explicit``) through the
program's own MPI_Finalize: both must end (Open MPI freed the library's windows inside
MPI_Finalize in an order that differed between the ranks, and waited there for ever). With
``unwaited``, asynchronous calls are still running at exit: the library waits for them before it
frees their windows (it freed the shared slots under a running call: a segmentation fault)."""

import sys

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
half = world.Split(rank % 2, rank)
reverse = world.Split(0, size - 1 - rank)
for count in (10, 20000, 200000):  # windows made, then grown
    for comm in (half, world, reverse):
        assert (
            mar.allreduce(np.ones(count), algorithm="shared_memory", comm=comm)[0]
            == comm.Get_size()
        )
if sys.argv[1:] == ["unwaited"]:
    handles = [
        mar.allreduce_async(np.ones(count), comm=comm)
        for count in (3, 400000, 400000)
        for comm in (world, half)
    ]
print(f"rank {rank} done", flush=True)
if sys.argv[1:] == ["explicit"]:
    MPI.Finalize()
