"""Whether MPI runs, and this process's place in COMM_WORLD, asked without starting MPI: what the
abort (faults.aborting) and the flight recorder's dump (faults.recorder) need to know first."""

import sys

__all__ = ["world_rank_and_size"]


def world_rank_and_size():
    """(this process's COMM_WORLD rank, the world's size), or (None, None) while MPI is not running
    (not started, or finalized): the abort and the flight recorder's dump need MPI running."""
    mpi4py = sys.modules.get("mpi4py.MPI")
    if mpi4py is None or not mpi4py.Is_initialized() or mpi4py.Is_finalized():
        return None, None
    return mpi4py.COMM_WORLD.Get_rank(), mpi4py.COMM_WORLD.Get_size()
