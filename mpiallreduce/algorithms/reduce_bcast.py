"""Reduce to one rank, then broadcast from it: the textbook composition of two MPI collectives.

    step 1  MPI_Reduce  every rank -> rank 0      (the library's tree; rank 0 holds the result)
    step 2  MPI_Bcast   rank 0 -> every rank      (the library's tree; everyone holds a copy)

Cost about 2 lg(p) latencies and 2 n lg(p) bytes per rank with binomial trees: a baseline that the
ring beats on large messages. Every rank ends with a copy of rank 0's bits.
"""

from mpi4py import MPI

from .base import Algorithm

ROOT = 0


class ReduceBcastAllreduce(Algorithm):
    name = "reduce_bcast"
    uses_point_to_point = False
    bounded_collectives = True

    def plan(self, size, rank, count):
        return None

    def execute(self, plan, comm, send, recv, op, datatype):
        mpi_op = op.mpi_op(recv.dtype)
        if comm.Get_rank() == ROOT:
            sendbuf = MPI.IN_PLACE if send is None else [send, datatype]
            comm.Reduce(sendbuf, [recv, datatype], op=mpi_op, root=ROOT)
        else:
            # MPI_IN_PLACE is only for the root; elsewhere the receive buffer is not significant.
            comm.Reduce([recv if send is None else send, datatype], None, op=mpi_op, root=ROOT)
        comm.Bcast([recv, datatype], root=ROOT)


ALGORITHM = ReduceBcastAllreduce()
