"""The entries of ``mpiallreduce.jax``: JAX's names and argument order, over MPI processes.

    psum(x, axis_name, *, axis_index_groups=None)      x: a pytree of arrays
      axis_name: a process mesh axis ("data"), a JAX mapped axis (a vmap or pmap axis_name), or a
      tuple mixing both; None: every rank of COMM_WORLD
        ├─ JAX's own axes:  jax.lax.psum over them (inside vmap/pmap/shard_map)
        └─ process axes:    one MPI allreduce per leaf over that axis's ranks of the current
                            mpiallreduce.Mesh (``with mesh:``), within axis_index_groups
                            (mpiallreduce.jax.primitive: an XLA FFI call, ordered, in place)
    pmean, pmax, pmin   the same, mean / max / min
    allreduce(x, op="sum", comm=None)   over ``comm``'s ranks (COMM_WORLD if None)

An unknown axis and groups that do not partition the axis raise while tracing (the mesh is the
same on every rank). A call one rank cannot make (an integer mean, a dtype the handler does not
take) is handed to the handler as refused: compared like any call, raised on every rank.
"""

from collections.abc import Hashable
from typing import TypeGuard, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from mpi4py import MPI

from ..core.annotations import Groups, Timeout
from ..core.mesh import check_groups, current_mesh, group_communicator
from .primitive import allreduce_leaf

__all__ = ["allreduce", "psum", "pmean", "pmax", "pmin"]

_OPS = ("sum", "mean", "max", "min")

#: a pytree of arrays (jax arrays, numpy arrays, scalars; tracers inside jit): what goes in comes
#: out, reduced, of the same structure
PyTree = TypeVar("PyTree")
#: a process mesh axis (mpiallreduce.Mesh's, a str), one of JAX's mapped axes (any hashable name),
#: or a tuple mixing both; None: every rank of COMM_WORLD
AxisName = Hashable


def allreduce(
    x: PyTree,
    op: str = "sum",
    comm: MPI.Intracomm | None = None,
    *,
    algorithm: str = "auto",
    timeout: Timeout = None,
) -> PyTree:
    """Reduce every leaf of the pytree ``x`` elementwise over ``comm``'s ranks (COMM_WORLD if None):
    "sum", "mean", "max" or "min"; eagerly or traced (jit, vmap, grad). ``algorithm``: "auto" (the
    planner's choice: mpiallreduce.jax.choice) or one the handler has; ``timeout``: seconds (None:
    the MPIALLREDUCE_TIMEOUT setting), after which the call raises on every rank naming the late
    one."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}, got {op!r}")
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0 (or None), got {timeout!r}")
    return jax.tree_util.tree_map(lambda leaf: _reduce(leaf, op, comm, algorithm, timeout), x)


def psum(x: PyTree, axis_name: AxisName = None, *, axis_index_groups: Groups = None) -> PyTree:
    """Sum over ``axis_name`` (see the module's docstring), as ``jax.lax.psum``."""
    return _named(x, "sum", axis_name, axis_index_groups)


def pmean(x: PyTree, axis_name: AxisName = None, *, axis_index_groups: Groups = None) -> PyTree:
    """Mean over ``axis_name``; with groups, each rank divides by its own group's size."""
    return _named(x, "mean", axis_name, axis_index_groups)


def pmax(x: PyTree, axis_name: AxisName = None, *, axis_index_groups: Groups = None) -> PyTree:
    """Maximum over ``axis_name`` (no derivative, as ``jax.lax.pmax``)."""
    return _named(x, "max", axis_name, axis_index_groups)


def pmin(x: PyTree, axis_name: AxisName = None, *, axis_index_groups: Groups = None) -> PyTree:
    """Minimum over ``axis_name`` (no derivative, as ``jax.lax.pmin``)."""
    return _named(x, "min", axis_name, axis_index_groups)


def _named(x: PyTree, op: str, axis_name: AxisName, groups: Groups) -> PyTree:
    if isinstance(axis_name, tuple) and not axis_name:
        return x  # (no axis: nothing to reduce over, as jax.lax.psum(x, ()))
    process_axes, jax_axes = _split_axes(axis_name)
    if jax_axes:  # (JAX's own mapped axes first: a local reduction, then the processes')
        if groups is not None:
            raise ValueError(
                "axis_index_groups applies to the processes' axes only; got it with JAX's own "
                f"mapped axes {jax_axes}"
            )
        local = {
            "sum": jax.lax.psum,
            "mean": jax.lax.pmean,
            "max": jax.lax.pmax,
            "min": jax.lax.pmin,
        }
        x = local[op](x, jax_axes if len(jax_axes) > 1 else jax_axes[0])
        if process_axes is None:
            return x
    comm = _communicator(process_axes, groups)
    return jax.tree_util.tree_map(lambda leaf: _reduce(leaf, op, comm), x)


def _split_axes(axis_name: AxisName) -> tuple[tuple[str, ...] | None, tuple[Hashable, ...]]:
    """(the process mesh's axes, or None for every rank of COMM_WORLD when none is named at all;
    JAX's own mapped axes): a name is the process mesh's where the current mesh has it."""
    if axis_name is None:
        return None, ()
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    mesh = current_mesh()
    ours = tuple(n for n in names if mesh is not None and n in mesh.axis_names)
    theirs = tuple(n for n in names if n not in ours)
    for name in theirs:  # (an unknown name: JAX's own error where it is no mapped axis either)
        try:
            jax.lax.axis_size(name)
        except (NameError, ValueError) as error:
            known = mesh.axis_names if mesh is not None else "none (no `with mpiallreduce.Mesh`)"
            raise NameError(
                f"unknown axis name {name!r}: neither the process mesh's (its axes: {known}) nor "
                "one of JAX's mapped axes here"
            ) from error
    return (ours if ours else (None if not theirs else ())), theirs


def _communicator(process_axes: tuple[str, ...] | None, groups: Groups) -> MPI.Intracomm:
    """The communicator of ``process_axes`` (the current mesh's; () or None: COMM_WORLD), within
    ``groups`` (checked: they partition its ranks); made collectively on first use, at trace."""
    comm: MPI.Intracomm = MPI.COMM_WORLD
    if process_axes:
        mesh = current_mesh()
        assert mesh is not None  # (process axes are the current mesh's: _split_axes)
        comm = mesh.comm(process_axes)
    if groups is not None:
        comm = group_communicator(comm, check_groups(groups, comm.Get_size()))
    return comm


#: what the handler reduces as it is (_ffi.cc: DatatypeOf); bool and 16-bit floats are converted
_TAKEN = {
    np.dtype(t)
    for t in (
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float32", "float64", "complex64", "complex128",
    )
}  # fmt: skip


def _refused(leaf: jax.Array, op: str, wide: bool) -> str | None:
    """Why this rank cannot make this call, or None. Not raised here: a rank alone would leave
    its peers waiting in the call's comparison; the handler compares this text as the call's
    signature and raises it on every rank (or SignatureMismatch, where the others' calls differ)."""
    if not wide and np.dtype(leaf.dtype) not in _TAKEN:
        return (
            "refused: mpiallreduce.jax reduces bool, integer, float and complex arrays; "
            f"got {leaf.dtype}"
        )
    if op == "mean" and not jnp.issubdtype(leaf.dtype, jnp.inexact):
        return (
            f"refused: pmean of {leaf.dtype} values: a mean is taken of floating or complex "
            "arrays only (psum them, then divide as you mean to round)"
        )
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating) and op in ("max", "min"):
        return f"refused: p{op} of complex values: they have no order"
    if leaf.size > 2**31 - 1:  # (one MPI count: a C int)
        return f"refused: at most 2^31 - 1 elements a call; got {leaf.size}"
    return None


def _on_a_device(leaf: object) -> TypeGuard[jax.Array]:
    """Whether ``leaf`` is a concrete jax array on a GPU (eager: a tracer is not concrete)."""
    if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array):
        return False
    return any(device.platform in ("gpu", "cuda", "rocm") for device in leaf.devices())


def _reduce_on_device(leaf: jax.Array, op: str, comm: MPI.Intracomm, timeout: Timeout) -> jax.Array:
    """An eager GPU array: seen by CuPy through DLPack (no copy), reduced by the device layer
    (mpiallreduce's call on a CuPy array: CUDA-aware MPI, staging or device-to-device, as
    docs/gpu.md says), its result seen by JAX the same way. Not run on a GPU here."""
    import cupy

    from ..core.call import Call

    result = Call.start(
        cupy.from_dlpack(leaf), op, "auto", comm, None, False, None, None, None, timeout
    ).in_turn()
    return jax.dlpack.from_dlpack(result)


def _reduce(
    leaf: ArrayLike,
    op: str,
    comm: MPI.Intracomm,
    algorithm: str = "auto",
    timeout: Timeout = None,
) -> jax.Array:
    if _on_a_device(leaf):
        return _reduce_on_device(leaf, op, comm, timeout)
    leaf = jnp.asarray(leaf)
    if leaf.dtype == jnp.bool_ and op != "mean":  # (as jax.lax: a sum counts, max/min stay bool)
        wider = leaf.astype(jnp.int32 if op == "sum" else jnp.uint8)
        counted = _reduce(wider, op, comm, algorithm, timeout)
        return counted if op == "sum" else counted.astype(jnp.bool_)
    wide = leaf.dtype in (jnp.float16, jnp.bfloat16)  # (summed in float32, rounded once)
    refused = _refused(leaf, op, wide)
    if refused is not None:  # (told to the peers by the handler's comparison: every rank raises)
        return allreduce_leaf(leaf, "refused", comm, refused, timeout=timeout)
    size = comm.Get_size()  # (one rank too: the same call, its rules and its errors)
    value = leaf.astype(jnp.float32) if wide else leaf
    result = allreduce_leaf(
        value,
        "max" if op == "max" else "min" if op == "min" else "sum",
        comm,
        str(leaf.dtype),
        algorithm,
        timeout,
    )
    if op == "mean":
        result = result / np.asarray(size, dtype=result.dtype)
    return result.astype(leaf.dtype) if wide else result
