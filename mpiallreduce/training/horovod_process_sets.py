"""Horovod's process sets as MPI communicators.

    ps = hvd.add_process_set([0, 2])     collective over every rank of the facade's communicator
                                         (MPI_Comm_create: the members get a communicator of
                                         their own, in the order of ``ranks``' sorted ranks)
    hvd.allreduce(t, process_set=ps)     over ps's ranks: an Engine of its own (negotiated apart)
    hvd.remove_process_set(ps)           collective again; its communicator freed
    hvd.global_process_set               every rank (process_set_id 0)

A rank outside a set that calls a collective on it gets a ValueError at once (it would have no
peers to meet).
"""

import itertools

from mpi4py import MPI

from ..core.gather import gather_from_ranks
from ..core.settings import settings
from .horovod_engine import engine_for, forget_engine
from .torch_tensors import default_comm

__all__ = [
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "forget_process_sets",
]

_ids = itertools.count(1)
_added: list["ProcessSet"] = []  # the ProcessSets added and not removed (forgotten at hvd.shutdown)


class ProcessSet:
    """A set of ranks (of the facade's communicator): Horovod's ``hvd.ProcessSet(ranks)``."""

    def __init__(self, ranks_or_comm=None):
        self.ranks = None if ranks_or_comm is None else sorted(int(r) for r in ranks_or_comm)
        self.process_set_id = None
        self._comm = None

    def communicator(self):
        """Its communicator (this rank must be in the set)."""
        if self is global_process_set:
            return default_comm()
        if self.process_set_id is None:
            raise ValueError(f"process set {self.ranks} was not added (hvd.add_process_set)")
        if self._comm is None or self._comm == MPI.COMM_NULL:
            raise ValueError(
                f"rank {default_comm().Get_rank()} is not in process set {self.ranks}: it cannot "
                "take part in its collectives"
            )
        return self._comm

    def included(self):
        return self is global_process_set or (
            self._comm is not None and self._comm != MPI.COMM_NULL
        )

    def rank(self):
        return self.communicator().Get_rank() if self.included() else None

    def size(self):
        return len(self.ranks) if self.ranks is not None else default_comm().Get_size()

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()
global_process_set.process_set_id = 0


def add_process_set(process_set):
    """Make ``process_set`` (a ProcessSet or a list of ranks) usable: collective over every rank
    of the facade's communicator, called alike on each. Returns the ProcessSet."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    comm = default_comm()
    size = comm.Get_size()
    if not process_set.ranks or any(not 0 <= r < size for r in process_set.ranks):
        raise ValueError(f"a process set's ranks must be ranks of {size}: {process_set.ranks}")
    group = comm.Get_group().Incl(process_set.ranks)
    try:
        process_set._comm = comm.Create(group)
    finally:
        group.Free()
    process_set.process_set_id = next(_ids)
    _added.append(process_set)
    if process_set._comm != MPI.COMM_NULL:  # (its engine made here, with its members, collectively)
        engine_for(process_set._comm)
    return process_set


def remove_process_set(process_set):
    """Forget ``process_set`` (collective over every rank, as add_process_set); whether it was
    there."""
    if process_set is global_process_set or process_set.process_set_id is None:
        return False
    # (every rank meets first, bounded by the timeout setting: the library's own collective)
    gather_from_ranks(default_comm(), None, timeout=settings().timeout, site="remove_process_set")
    if process_set._comm is not None and process_set._comm != MPI.COMM_NULL:
        forget_engine(process_set._comm)
        process_set._comm.Free()
    process_set._comm, process_set.process_set_id = None, None
    if process_set in _added:
        _added.remove(process_set)
    return True


def forget_process_sets():
    """hvd.shutdown: every added set is forgotten (its engine went with the others); add it again
    after init."""
    for process_set in _added:
        process_set._comm, process_set.process_set_id = None, None
    _added.clear()
