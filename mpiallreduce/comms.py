"""Private communicators: a duplicate of each user communicator, cached on it as an MPI attribute.

Hand-written algorithms send point-to-point messages; on the user's own communicator those could
match the user's receives (``ANY_TAG``). So they talk on a duplicate made on first use (a collective
``MPI_Comm_dup``) and kept as an attribute of the user's communicator, which frees it when the user's
communicator is freed (or at ``MPI_Finalize`` for ``COMM_WORLD``).
"""
from mpi4py import MPI

__all__ = ["private_duplicate"]


def _free_duplicate(comm, keyval, duplicate):
    if duplicate != MPI.COMM_NULL and not MPI.Is_finalized():
        duplicate.Free()


_DUPLICATE_KEYVAL = None


def private_duplicate(comm):
    """The library's own duplicate of ``comm`` (collective the first time it is asked for)."""
    global _DUPLICATE_KEYVAL
    if _DUPLICATE_KEYVAL is None:
        _DUPLICATE_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_duplicate)
    duplicate = comm.Get_attr(_DUPLICATE_KEYVAL)
    if duplicate is None:
        duplicate = comm.Dup()
        comm.Set_attr(_DUPLICATE_KEYVAL, duplicate)
    return duplicate
