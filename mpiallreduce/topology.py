"""Which ranks share a node, and one leader per node; cached on the communicator.

``MPIALLREDUCE_RANKS_PER_NODE=k`` (mpiallreduce.settings) pretends that every k consecutive ranks
form a node, so that multi-node algorithms can be exercised on one machine (tests, experiments).
"""
from mpi4py import MPI

from .comms import cached
from .settings import settings

__all__ = ["RANKS_PER_NODE_ENV", "node_communicator", "leader_communicator"]

RANKS_PER_NODE_ENV = "MPIALLREDUCE_RANKS_PER_NODE"


def _split_by_node(comm, pretend):
    if pretend:
        return comm.Split(color=comm.Get_rank() // pretend, key=comm.Get_rank())
    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


def node_communicator(comm):
    """The ranks of ``comm`` on this rank's node, in ``comm``'s order (collective on first use)."""
    pretend = settings().ranks_per_node
    return cached(comm, ("node", pretend), lambda: _split_by_node(comm, pretend))


def leader_communicator(comm):
    """The node leaders (rank 0 of each node communicator), or COMM_NULL on other ranks."""
    def make():
        is_leader = node_communicator(comm).Get_rank() == 0
        return comm.Split(color=0 if is_leader else MPI.UNDEFINED, key=comm.Get_rank())
    return cached(comm, ("leaders", settings().ranks_per_node), make)
