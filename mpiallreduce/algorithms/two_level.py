"""Two levels: every rank of a node carries its own share of the buffer across nodes, all at once.

The ranks of a node reduce-scatter the buffer among themselves (shared memory), each node-local
rank allreduces its shard with the ranks of the same node-local index on the other nodes (its
"rail": the k rails run in parallel, over the network), and the node allgathers the shards.
2 nodes x 3 ranks, buffer cut into shards s0 s1 s2:

    node 0: ranks 0 1 2                            node 1: ranks 3 4 5
    step 1  MPI_Reduce_scatter within the node     rank 0 holds s0 of node 0, rank 1 s1, rank 2 s2
                                                   rank 3 holds s0 of node 1, rank 4 s1, rank 5 s2
    step 2  allreduce along each rail (the plan    0 <-s0-> 3     1 <-s1-> 4     2 <-s2-> 5
            mpiallreduce.planner made for the node count, among algorithms that work across nodes)
    step 3  MPI_Allgatherv within the node         every rank: s0 s1 s2 of all 6

Each byte crosses the network once per node in each direction as in ``hierarchical``, but split over
k ranks instead of one leader, so every rank's link and core works (NCCL's and Horovod's scheme;
Open MPI's coll/han does the same). Every shard is reduced over the nodes by one rail whose
algorithm gives its ranks the same bits, then copied within each node: every rank ends with the
same bits. Needs the same rank count on every node (otherwise every rank raises ValueError and
names the nodes' sizes: use ``hierarchical``). In a timed call, steps 1 and 3 are the nonblocking
forms on the node communicator of the timed calls' own communicator, each waited for at most the
timeout (``within``, mpiallreduce.faults.bounded).
"""

from mpi4py import MPI

from ..core.topology import node_communicator, node_sizes, rail_communicator
from .base import Algorithm, CallTags, split_evenly, within


class TwoLevelAllreduce(Algorithm):
    name = "two_level"
    memory = "host"
    #: the planner hands it the plan for its rails (one rank per node), as for hierarchical
    takes_inner_plan = True
    #: every node must have the same rank count
    needs_equal_nodes = True
    bounded_collectives = True

    def plan(self, size, rank, count):
        return None

    def execute(self, plan, comm, send, recv, op, datatype, inner=None, wrap=None):
        """``inner``: the rails' CallPlan (mpiallreduce.core.planner); without one (a single node)
        the rails are one rank each and step 2 is empty. ``wrap(comm)``: the rail as the inner
        algorithm talks on it (the executor's: the call's tags and peer watch)."""
        sizes = node_sizes(comm)
        if len(set(sizes)) > 1:  # (the same sizes on every rank: every rank raises)
            raise ValueError(
                f"the two_level algorithm needs the same number of ranks on every node; these "
                f"{len(sizes)} nodes have {', '.join(map(str, sizes))} (use "
                "algorithm='hierarchical')"
            )
        node = within(comm, node_communicator)
        rail = within(comm, rail_communicator)
        k, local = node.Get_size(), node.Get_rank()
        offsets, counts = split_evenly(recv.size, k)
        a, b = offsets[local], offsets[local] + counts[local]
        shard = recv[a:b]
        mpi_op = op.mpi_op(recv.dtype)

        # Step 1: reduce-scatter within the node (this rank's shard lands in its place in recv)
        if k > 1:
            source = recv.copy() if send is None else send
            node.Reduce_scatter([source, datatype], [shard, datatype], recvcounts=counts, op=mpi_op)
        elif send is not None:
            recv[...] = send

        # Step 2: allreduce the shard along the rail
        if rail.Get_size() > 1 and shard.size:  # (the same on the whole rail: its shards are alike)
            if inner is None or inner.inner is not None:
                raise ValueError(
                    "two_level: the rails need a plan of their own (mpiallreduce.planner)"
                )
            if wrap is not None and not isinstance(rail, CallTags):
                rail = wrap(rail)  # (a timed call's rail talks on its tags already)
            inner.algorithm.run(rail, None, shard, op, datatype)

        # Step 3: allgather the shards within the node
        if k > 1:
            node.Allgatherv(MPI.IN_PLACE, [recv, (counts, offsets), datatype])


ALGORITHM = TwoLevelAllreduce()
