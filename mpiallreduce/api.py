"""The public call: ``allreduce(x, op, algorithm, comm, out, check)``."""
import os
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from . import buffers
from .agreement import agree_on_call
from .asynchronous import asynchronous_calls_pending, run_in_order
from .algorithms import Algorithm, choose_algorithm, get_algorithm
from .comms import cached, private_duplicate
from .mesh import resolve_communicator
from .ops import ReduceOp, get_op
from .startup import check_world_matches_slurm
from .topology import node_communicator

__all__ = ["allreduce", "psum", "pmean", "pmax", "pmin", "CHECK_ENV"]

check_world_matches_slurm()  # the silent-singleton trap, before anything is reduced

#: environment variable that turns ``check`` on for every call ("1", "true", "yes", "on"),
#: read once, when mpiallreduce is imported
CHECK_ENV = "MPIALLREDUCE_CHECK"
CHECK_BY_DEFAULT = os.environ.get(CHECK_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def allreduce(x, op="sum", algorithm="auto", comm=None, out=None, check=False, *, axis=None, mesh=None,
              groups=None):
    """Reduce ``x`` elementwise over every rank of ``comm``; every rank gets the same bits.

    Args:
        x: numpy array, any shape, contiguous or strided, of an integer, float or complex dtype.
        op: "sum", "prod", "min", "max" or "mean" (sum, then divided by the number of ranks;
            floating and complex dtypes only).
        algorithm: "auto" or one of ``mpiallreduce.ALGORITHMS``.
        comm: an mpi4py intracommunicator; ``MPI.COMM_WORLD`` if None.
        out: None for a new array, or an array of x's shape and dtype to write into; ``out=x``
            reduces in place. Otherwise ``x`` is not modified.
        check: if true (or if MPIALLREDUCE_CHECK=1 when mpiallreduce was imported), the ranks
            first agree that their arguments are valid and that shape, dtype, op and algorithm
            match; otherwise every rank raises the same ValueError/TypeError naming the ranks and
            what differs.
        axis: a mesh axis name or tuple of names: reduce over the ranks along it, of ``mesh`` or of
            the mesh made current with ``with mesh:`` (instead of ``comm``).
        mesh: a :class:`mpiallreduce.Mesh`; without ``axis``, all its ranks.
        groups: a partition of the ranks (of the axis, or of the communicator) into lists; each
            rank reduces with its own group only (``mean`` divides by that group's size).

    Returns:
        the result: ``out`` if given, else a new C-contiguous array shaped like ``x``.

    Raises:
        TypeError, ValueError: bad arguments, raised before any communication on the rank given
            them (on every rank, with ``check``).
    """
    if asynchronous_calls_pending():  # keep to the order in which this process started collectives
        return run_in_order(lambda: _allreduce_now(x, op, algorithm, comm, out, check, axis=axis, mesh=mesh,
                                                   groups=groups))
    return _allreduce_now(x, op, algorithm, comm, out, check, axis=axis, mesh=mesh, groups=groups)


def _allreduce_now(x, op, algorithm, comm, out, check, *, axis=None, mesh=None, groups=None):
    if axis is not None or mesh is not None or groups is not None:
        comm = resolve_communicator(comm, axis, mesh, groups)
    comm = _check_comm(MPI.COMM_WORLD if comm is None else comm)
    if check or CHECK_BY_DEFAULT:
        signature = _signature(x, op, algorithm)
        call = agree_on_call(comm, lambda: _prepare(x, op, algorithm, comm, out), signature)
    else:
        call = _prepare(x, op, algorithm, comm, out)
    return _execute(call)


@dataclass
class _Call:
    comm: MPI.Intracomm
    op: ReduceOp
    algorithm: Algorithm
    datatype: MPI.Datatype
    flat: buffers.FlatBuffers
    auto: bool


def _check_comm(comm):
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator (MPI.Intracomm), got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL")
    return comm


def _signature(x, op, algorithm):
    """What must be equal on every rank, in a form that pickles and compares whatever x is."""
    names = {"op": _plain(op), "algorithm": _plain(algorithm)}
    if isinstance(x, np.ndarray):
        return {"shape": x.shape, "dtype": str(x.dtype), **names}
    return {"x": type(x).__name__, **names}


def _plain(value):
    return value if isinstance(value, str) else repr(value)


def _prepare(x, op, algorithm, comm, out):
    """Validate everything and plan the buffers; no communication."""
    buffers.check_array(x)
    reduce_op = get_op(op)
    reduce_op.check_dtype(x.dtype)
    auto = isinstance(algorithm, str) and algorithm == "auto"
    chosen = choose_algorithm(x.nbytes, comm.Get_size()) if auto else get_algorithm(algorithm)
    buffers.check_out(out, x)
    return _Call(comm, reduce_op, chosen, buffers.mpi_datatype(x.dtype), buffers.flat_buffers(x, out), auto)


def _spans_nodes(comm):
    """Whether ``comm``'s ranks sit on more than one node (collective the first time; cached)."""
    return cached(comm, "spans_nodes",
                  lambda: node_communicator(private_duplicate(comm)).Get_size() != comm.Get_size())


def _execute(call):
    flat = call.flat
    size = call.comm.Get_size()
    if size == 1 or flat.recv.size == 0:
        if flat.send is not None:
            np.copyto(flat.recv, flat.send)
    else:
        algorithm = call.algorithm
        if call.auto and _spans_nodes(call.comm):
            # The table is measured on one node. Across nodes: reduce within each node, then the
            # table's choice among the node leaders (all ranks agree on the topology).
            algorithm = get_algorithm("hierarchical")
        comm = private_duplicate(call.comm) if algorithm.uses_point_to_point else call.comm
        algorithm.run(comm, flat.send, flat.recv, call.op, call.datatype)
    call.op.finish(flat.recv, size)
    return flat.finish()


# JAX's names and argument order (jax.lax.psum(x, axis_name, *, axis_index_groups=None)).
# axis_name=None: every rank of COMM_WORLD.

def psum(x, axis_name=None, *, axis_index_groups=None):
    """Sum over the mesh axis ``axis_name`` (within ``axis_index_groups`` if given)."""
    return allreduce(x, op="sum", axis=axis_name, groups=axis_index_groups)


def pmean(x, axis_name=None, *, axis_index_groups=None):
    """Mean over the axis; with groups, each rank divides by the size of its own group."""
    return allreduce(x, op="mean", axis=axis_name, groups=axis_index_groups)


def pmax(x, axis_name=None, *, axis_index_groups=None):
    return allreduce(x, op="max", axis=axis_name, groups=axis_index_groups)


def pmin(x, axis_name=None, *, axis_index_groups=None):
    return allreduce(x, op="min", axis=axis_name, groups=axis_index_groups)
