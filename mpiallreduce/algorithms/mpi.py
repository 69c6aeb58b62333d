"""The MPI library's own allreduce: a thin wrapper over ``MPI_Allreduce``.

    every rank:  MPI_Allreduce(send or MPI_IN_PLACE, recv, count, datatype, op, comm)

Who sends what to whom is the library's choice (Open MPI's coll/tuned picks recursive doubling,
ring, segmented ring or Rabenseifner by size and rank count; see docs/field-notes.md). This is the
reference every hand-written algorithm is checked and timed against. Types MPI cannot reduce itself
(float16) go through a user-defined op that runs the numpy ufunc. In a timed call it is
``MPI_Iallreduce`` on the timed calls' own communicator, waited for at most the timeout
(mpiallreduce.faults.bounded).
"""

from mpi4py import MPI

from .base import Algorithm


class MPIAllreduce(Algorithm):
    name = "mpi"
    uses_point_to_point = False
    bounded_collectives = True

    def plan(self, size, rank, count):
        return None

    def execute(self, plan, comm, send, recv, op, datatype):
        sendbuf = MPI.IN_PLACE if send is None else [send, datatype]
        comm.Allreduce(sendbuf, [recv, datatype], op=op.mpi_op(recv.dtype))


ALGORITHM = MPIAllreduce()
