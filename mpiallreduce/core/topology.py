"""Which ranks share a node, and one leader per node; cached on the communicator.

``MPIALLREDUCE_RANKS_PER_NODE=k`` (mpiallreduce.settings) pretends that every k consecutive ranks
form a node, so that multi-node algorithms can be exercised on one machine (tests, experiments).
"""

from mpi4py import MPI

from .comms import cached
from .settings import settings

__all__ = [
    "RANKS_PER_NODE_ENV",
    "node_communicator",
    "leader_communicator",
    "rail_communicator",
    "node_sizes",
]

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


def rail_communicator(comm):
    """The ranks with this rank's node-local rank on every node (one per node), in ``comm``'s order:
    the "rail" its node-local rank talks to other nodes on (collective on first use)."""

    def make():
        return comm.Split(color=node_communicator(comm).Get_rank(), key=comm.Get_rank())

    return cached(comm, ("rail", settings().ranks_per_node), make)


def node_sizes(comm):
    """Every node's rank count, nodes in the order of their leaders' ranks: the same tuple on every
    rank (collective on first use)."""

    def make():
        node = node_communicator(comm)
        mine = (comm.Get_rank(), node.Get_size()) if node.Get_rank() == 0 else None
        return tuple(size for _, size in sorted(f for f in comm.allgather(mine) if f is not None))

    return cached(comm, ("node_sizes", settings().ranks_per_node), make)


def node_level_communicators(comm):
    """[(key, communicator)]: what ``node_communicator``, ``leader_communicator`` and
    ``rail_communicator`` give for ``comm`` (collective where one is missing), under the keys they
    are cached by: another communicator of the same ranks can be given duplicates of them
    (``comms.replace_cached``) in place of splitting itself (mpiallreduce.faults.bounded)."""
    pretend = settings().ranks_per_node
    return [
        (("node", pretend), node_communicator(comm)),
        (("leaders", pretend), leader_communicator(comm)),
        (("rail", pretend), rail_communicator(comm)),
    ]
