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
from .faults import Rendezvous, call_site, default_timeout, failure_of, next_sequence
from .device import cuda_aware, namespace
from .mesh import resolve_communicator
from .ops import ReduceOp, get_op
from .startup import check_world_matches_slurm
from .topology import node_communicator
from .transports import run_on_device

__all__ = ["allreduce", "psum", "pmean", "pmax", "pmin", "CHECK_ENV"]

check_world_matches_slurm()  # the silent-singleton trap, before anything is reduced

#: environment variable that turns ``check`` on for every call ("1", "true", "yes", "on"),
#: read once, when mpiallreduce is imported
CHECK_ENV = "MPIALLREDUCE_CHECK"
CHECK_BY_DEFAULT = os.environ.get(CHECK_ENV, "").strip().lower() in {"1", "true", "yes", "on"}
#: MPIALLREDUCE_TIMEOUT, read once, when mpiallreduce is imported (None: wait for ever)
TIMEOUT_BY_DEFAULT = default_timeout()


def allreduce(x, op="sum", algorithm="auto", comm=None, out=None, check=False, *, axis=None, mesh=None,
              groups=None, timeout=None):
    """Reduce ``x`` elementwise over every rank of ``comm``; every rank gets the same bits.

    Args:
        x: numpy or CuPy array, any shape, contiguous or strided, of an integer, float or complex
            dtype (float16 and bfloat16 included: the hand-written algorithms sum those in float32
            and round once). A CuPy array's result is a CuPy array on the same device, ordered on
            CuPy's current stream; see mpiallreduce.transports for how device memory travels.
        op: "sum", "prod", "min", "max" or "mean" (sum, then divided by the number of ranks;
            floating and complex dtypes only).
        algorithm: "auto" or one of ``mpiallreduce.ALGORITHMS``.
        comm: an mpi4py intracommunicator; ``MPI.COMM_WORLD`` if None.
        out: None for a new array, or an array of x's shape and dtype to write into; ``out=x``
            reduces in place. Otherwise ``x`` is not modified.
        check: if true (or if MPIALLREDUCE_CHECK=1 when mpiallreduce was imported), the ranks
            first agree that their arguments are valid and that shape, dtype, op, algorithm, the
            call's number on ``comm`` and its call site (file:line) match; otherwise every rank
            raises the same ValueError/TypeError naming the ranks and what differs.
        axis: a mesh axis name or tuple of names: reduce over the ranks along it, of ``mesh`` or of
            the mesh made current with ``with mesh:`` (instead of ``comm``).
        mesh: a :class:`mpiallreduce.Mesh`; without ``axis``, all its ranks.
        groups: a partition of the ranks (of the axis, or of the communicator) into lists; each
            rank reduces with its own group only (``mean`` divides by that group's size).
        timeout: seconds to wait for the other ranks to reach this call (default
            MPIALLREDUCE_TIMEOUT, read at import; None there: wait for ever); see mpiallreduce.faults.

    Returns:
        the result: ``out`` if given, else a new C-contiguous array shaped like ``x``.

    Raises:
        TypeError, ValueError: bad arguments, raised before any communication on the rank given
            them (on every rank, with ``check``); with ``check``, ValueError on every rank also when
            the ranks' call numbers on ``comm`` differ (a rank skipped a call).
        AllreduceTimeout: not every rank reached this call within ``timeout``, on every rank that did.
        RankFailure: a rank died during the call (under ULFM), on every survivor.
    """
    if asynchronous_calls_pending():  # keep to the order in which this process started collectives
        return run_in_order(lambda: _allreduce_now(x, op, algorithm, comm, out, check, axis=axis, mesh=mesh,
                                                   groups=groups, timeout=timeout))
    return _allreduce_now(x, op, algorithm, comm, out, check, axis=axis, mesh=mesh, groups=groups, timeout=timeout)


def _allreduce_now(x, op, algorithm, comm, out, check, *, axis=None, mesh=None, groups=None, timeout=None,
                   meeting=None):
    """The call itself. ``meeting``: a function (comm, sequence, site) -> Rendezvous for
    allreduce_async, whose handle may bring its deadline forward."""
    if axis is not None or mesh is not None or groups is not None:
        comm = resolve_communicator(comm, axis, mesh, groups)
    comm = _check_comm(MPI.COMM_WORLD if comm is None else comm)
    timeout = TIMEOUT_BY_DEFAULT if timeout is None else timeout
    check = check or CHECK_BY_DEFAULT
    if not check:
        call = _prepare(x, op, algorithm, comm, out)  # a bad argument raises here, before any communication
    sequence = next_sequence(comm)
    site = call_site() if (check or timeout is not None) else ""
    if meeting is not None:
        meeting(comm, sequence, site).run()
    elif timeout is not None:
        Rendezvous(comm, sequence, timeout, site).run()
    if check:
        # The call number and site too: a rank that skipped a call meets the others' call with its next
        # one, made from another line (or, in a loop, the last call finds it missing: see timeout).
        signature = dict(_signature(x, op, algorithm), call_number=sequence, call_site=site)
        call = agree_on_call(comm, lambda: _prepare(x, op, algorithm, comm, out), signature)
    return _execute(call, sequence)


@dataclass
class _Call:
    comm: MPI.Intracomm
    op: ReduceOp
    algorithm: Algorithm
    datatype: MPI.Datatype
    flat: buffers.FlatBuffers
    auto: bool
    #: the array module of device arrays (cupy, or the test stand-in); None for numpy arrays
    xp: object = None
    #: float16 or bfloat16 (summed in float32 by the hand-written algorithms)
    low_precision: bool = False


def _check_comm(comm):
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator (MPI.Intracomm), got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL")
    return comm


def _signature(x, op, algorithm):
    """What must be equal on every rank, in a form that pickles and compares whatever x is."""
    names = {"op": _plain(op), "algorithm": _plain(algorithm)}
    if isinstance(x, np.ndarray) or namespace(x) is not None:
        return {"memory": "host" if isinstance(x, np.ndarray) else "device", "shape": tuple(x.shape),
                "dtype": str(x.dtype), **names}
    return {"x": type(x).__name__, **names}


def _plain(value):
    return value if isinstance(value, str) else repr(value)


def _prepare(x, op, algorithm, comm, out):
    """Validate everything and plan the buffers; no communication."""
    buffers.check_array(x)
    reduce_op = get_op(op)
    reduce_op.check_dtype(x.dtype)
    xp = None if type(x) is np.ndarray else namespace(x)
    auto = isinstance(algorithm, str) and algorithm == "auto"
    if auto:
        chosen = (choose_algorithm if xp is None else choose_device_algorithm)(x.nbytes, comm.Get_size())
    else:
        chosen = get_algorithm(algorithm)
    if chosen.memory == "device" and xp is None:
        raise TypeError(f"algorithm {chosen.name!r} runs on device (CuPy) arrays; x is a numpy array")
    buffers.check_out(out, x)
    return _Call(comm, reduce_op, chosen, buffers.mpi_datatype(x.dtype), buffers.flat_buffers(x, out), auto, xp,
                 buffers.is_low_precision(x.dtype))


#: device arrays from this size up take the device-to-device path under "auto" (on one node);
#: smaller ones MPI_Allreduce (straight, or through host memory). A first guess, not yet measured.
DEVICE_TO_DEVICE_MIN_BYTES = 64 << 10


def choose_device_algorithm(nbytes, size):
    """What "auto" runs for device arrays (before the topology is known; see _execute)."""
    if size == 1 or nbytes < DEVICE_TO_DEVICE_MIN_BYTES:
        return get_algorithm("mpi")
    return get_algorithm("device_to_device")


def _spans_nodes(comm):
    """Whether ``comm``'s ranks sit on more than one node (collective the first time; cached)."""
    return cached(comm, "spans_nodes",
                  lambda: node_communicator(private_duplicate(comm)).Get_size() != comm.Get_size())


def _execute(call, sequence=None):
    try:
        return _execute_plainly(call)
    except MPI.Exception as error:  # a dead rank (ULFM): every survivor raises RankFailure
        failure = failure_of(error, call.comm, sequence, also_revoke=_private_duplicates(call.comm))
        if failure is None:
            raise
        raise failure from error


def _private_duplicates(comm):
    from .comms import cached_if_made
    return tuple(c for c in (cached_if_made(comm, "duplicate"),) if c is not None)


def _execute_plainly(call):
    flat = call.flat
    size = call.comm.Get_size()
    if size == 1 or flat.recv.size == 0:
        if flat.send is not None:
            buffers.copy_into(flat.recv, flat.send)
        call.op.finish(flat.recv, size)
        return flat.finish()
    algorithm = call.algorithm
    if call.auto and _spans_nodes(call.comm):
        # The table is measured on one node. Across nodes: reduce within each node, then the
        # table's choice among the node leaders (all ranks agree on the topology). Device arrays:
        # a ring, straight through a CUDA-aware MPI or staged through host memory.
        if call.xp is None:
            algorithm = get_algorithm("hierarchical")
        else:
            algorithm = get_algorithm("ring" if cuda_aware()[0] else "staged_ring")
    comm = private_duplicate(call.comm) if algorithm.uses_point_to_point else call.comm
    if call.xp is None and not call.low_precision:  # the common case, in the fewest steps
        algorithm.run(comm, flat.send, flat.recv, call.op, call.datatype)
        call.op.finish(flat.recv, size)
        return flat.finish()
    if call.low_precision and (algorithm.name != "mpi" or call.xp is not None):
        # float16/bfloat16: accumulate in float32, round once at the end
        wide = (flat.recv if flat.send is None else flat.send).astype(np.float32)
        _run(algorithm, comm, None, wide, call.op, buffers.mpi_datatype(np.float32), call.xp)
        call.op.finish(wide, size)
        buffers.array_module(wide).copyto(flat.recv, wide, casting="unsafe")
    else:
        _run(algorithm, comm, flat.send, flat.recv, call.op, call.datatype, call.xp)
        call.op.finish(flat.recv, size)
    return flat.finish()


def _run(algorithm, comm, send, recv, op, datatype, xp):
    if xp is None:
        algorithm.run(comm, send, recv, op, datatype)
    else:
        run_on_device(algorithm, comm, send, recv, op, datatype, xp)


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
