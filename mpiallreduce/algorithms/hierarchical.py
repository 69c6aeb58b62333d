"""Hierarchical: reduce within each node, allreduce among one leader per node, broadcast within each.

    node 0: ranks 0 1 2           node 1: ranks 3 4 5
    step 1  MPI_Reduce to the node leader          0 <- 1, 2            3 <- 4, 5
    step 2  the leaders allreduce (the tuning     0 <--------------------> 3
            table's choice for their count; one that needs shared memory is replaced by the ring)
    step 3  MPI_Bcast from the node leader         0 -> 1, 2            3 -> 4, 5

Only one rank per node touches the network, with the whole buffer once: what a multi-node job
wants when links between nodes are the bottleneck. The leaders' algorithm gives them the same
bits; the broadcast copies them: every rank ends with the same bits. Nodes come from
``Split_type(COMM_TYPE_SHARED)`` (or MPIALLREDUCE_RANKS_PER_NODE, see topology.py).
"""
from mpi4py import MPI

from ..comms import private_duplicate
from ..topology import leader_communicator, node_communicator
from .base import Algorithm

LEADER = 0
#: algorithms the leaders may not use: they are on different nodes
NOT_ACROSS_NODES = {"shared_memory", "hierarchical"}


class HierarchicalAllreduce(Algorithm):
    name = "hierarchical"
    memory = "host"

    def plan(self, size, rank, count):
        return None

    def execute(self, plan, comm, send, recv, op, datatype):
        node = node_communicator(comm)
        leaders = leader_communicator(comm)
        mpi_op = op.mpi_op(recv.dtype)

        # Step 1: reduce within the node
        if node.Get_rank() == LEADER:
            node.Reduce(MPI.IN_PLACE if send is None else [send, datatype], [recv, datatype], op=mpi_op, root=LEADER)
        else:
            node.Reduce([recv if send is None else send, datatype], None, op=mpi_op, root=LEADER)

        # Step 2: allreduce among the leaders
        if leaders != MPI.COMM_NULL and leaders.Get_size() > 1:
            from . import REGISTRY, choose_algorithm
            inner = choose_algorithm(recv.nbytes, leaders.Get_size())
            if inner.name in NOT_ACROSS_NODES:
                inner = REGISTRY["ring"]
            talk_on = private_duplicate(leaders) if inner.uses_point_to_point else leaders
            inner.run(talk_on, None, recv, op, datatype)

        # Step 3: share within the node
        node.Bcast([recv, datatype], root=LEADER)


ALGORITHM = HierarchicalAllreduce()
