"""The names the package's annotations use (issue 59: the public API is annotated and the package
ships ``py.typed``, so that a user's type checker reads them too).

    Array       what the entries reduce: a numpy array, a CuPy array (device memory) or, for
                ``allreduce``, a jax array. They share no base class that can be named without
                importing CuPy and JAX, both optional, so to a type checker it is ``Any``: named
                here for the reader, and in one place should a Protocol ever fit all three
    Op          an op: "sum", "prod", "min", "max", "mean", mpi4py's ``MPI.SUM``..., or an op of
                mpiallreduce.core.ops
    Timeout     seconds, or None (the MPIALLREDUCE_TIMEOUT setting, else wait for ever)
    AxisName    a mesh axis, a tuple of them, or None (every rank)
    Groups      a partition of the ranks into lists of ranks, or None

Nothing here is imported at run time beyond ``typing`` (mpi4py's MPI would start MPI).
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:  # (not at run time: importing mpi4py.MPI starts MPI)
    from mpi4py import MPI

    from .ops import ReduceOp

__all__ = ["Array", "Op", "Timeout", "AxisName", "Groups"]

Array: TypeAlias = Any
Op: TypeAlias = "str | MPI.Op | ReduceOp"
Timeout: TypeAlias = float | None
AxisName: TypeAlias = str | tuple[str, ...] | None
Groups: TypeAlias = Sequence[Sequence[int]] | None
