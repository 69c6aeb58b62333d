"""Hierarchical: reduce within each node, allreduce among one leader per node, broadcast within
each.

    node 0: ranks 0 1 2           node 1: ranks 3 4 5
    step 1  MPI_Reduce to the node leader          0 <- 1, 2            3 <- 4, 5
    step 2  the leaders allreduce (the plan       0 <--------------------> 3
            mpiallreduce.planner made for their count, among algorithms that work across nodes)
    step 3  MPI_Bcast from the node leader         0 -> 1, 2            3 -> 4, 5

Only one rank per node touches the network, with the whole buffer once: what a multi-node job
wants when links between nodes are the bottleneck. The leaders' algorithm gives them the same
bits; the broadcast copies them: every rank ends with the same bits. Nodes come from
``Split_type(COMM_TYPE_SHARED)`` (or MPIALLREDUCE_RANKS_PER_NODE, see topology.py). In a timed call,
steps 1 and 3 are ``MPI_Ireduce`` and ``MPI_Ibcast`` on the node communicator of the timed calls'
own communicator, each waited for at most the timeout (``within``, mpiallreduce.faults.bounded).
"""

from mpi4py import MPI

from ..core.topology import leader_communicator, node_communicator
from .base import Algorithm, CallTags, within

LEADER = 0


class HierarchicalAllreduce(Algorithm):
    name = "hierarchical"
    memory = "host"
    #: the planner hands it the plan for its node leaders
    takes_inner_plan = True
    bounded_collectives = True

    def plan(self, size, rank, count):
        return None

    def execute(self, plan, comm, send, recv, op, datatype, inner=None, wrap=None):
        """``inner``: the leaders' CallPlan (mpiallreduce.core.planner); without one (a single node)
        the leaders are one rank and step 2 is empty. ``wrap(comm)``: the leaders' communicator as
        the inner algorithm talks on it (the executor's: the call's tags and peer watch)."""
        node = within(comm, node_communicator)
        leaders = within(comm, leader_communicator)
        mpi_op = op.mpi_op(recv.dtype)

        # Step 1: reduce within the node
        if node.Get_rank() == LEADER:
            node.Reduce(
                MPI.IN_PLACE if send is None else [send, datatype],
                [recv, datatype],
                op=mpi_op,
                root=LEADER,
            )
        else:
            node.Reduce([recv if send is None else send, datatype], None, op=mpi_op, root=LEADER)

        # Step 2: allreduce among the leaders
        if leaders != MPI.COMM_NULL and leaders.Get_size() > 1:
            if inner is None or inner.inner is not None:
                raise ValueError(
                    "hierarchical: the node leaders need a plan of their own (mpiallreduce.planner)"
                )
            # The leaders' communicator is the library's own (split from its duplicate): messages
            # cannot meet the user's.
            if wrap is not None and not isinstance(leaders, CallTags):
                leaders = wrap(leaders)  # (a timed call's leaders talk on its tags already)
            inner.algorithm.run(leaders, None, recv, op, datatype)

        # Step 3: share within the node
        node.Bcast([recv, datatype], root=LEADER)


ALGORITHM = HierarchicalAllreduce()
