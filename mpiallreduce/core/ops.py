"""Reduction operations: an op's name, its MPI op, and the numpy ufunc that applies it locally.

``mean`` is ``sum`` followed by a division by the number of ranks, done once on the finished sum
(Horovod's order, not torch's divide-first): the sum is the same bits on every rank, so the mean is
too, and integer-valued inputs give the correctly rounded mean. The cost is that float16 sums can
overflow where a divide-first mean would not; GPU/low-precision work accumulates those in float32.
"""

import functools
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .array_kind import namespace
from .buffers import mpi_datatype

__all__ = [
    "ReduceOp",
    "Bfloat16Bits",
    "OPS",
    "get_op",
    "name_of",
    "ignore_float_errors",
    "restore_float_errors",
    "divide_by_size",
    "host_division",
]

# numpy 2: the error state is a context variable, set here directly (entering np.errstate
# costs ~2 us)
try:
    from numpy._core.umath import _extobj_contextvar, _make_extobj

    _IGNORED = _make_extobj(all="ignore")

    def ignore_float_errors():
        """From here on this thread's numpy ufuncs ignore overflow, underflow, invalid and divide,
        as MPI's own reductions do; returns the token for ``restore_float_errors`` (np.errstate,
        faster)."""
        return _extobj_contextvar.set(_IGNORED)

    restore_float_errors = _extobj_contextvar.reset
except (
    ImportError,
    AttributeError,
    TypeError,
):  # numpy 1 (or a numpy 2 that moved them): np.errstate itself

    def ignore_float_errors():
        state = np.errstate(all="ignore")
        state.__enter__()
        return state

    def restore_float_errors(state):
        state.__exit__(None, None, None)


@dataclass(frozen=True)
class ReduceOp:
    """One reduction: ``ufunc(a, b, out=...)`` locally, ``mpi`` inside MPI collectives."""

    name: str
    ufunc: np.ufunc
    mpi: MPI.Op
    divide_by_size: bool = False
    defined_for_complex: bool = True
    #: True for mpiallreduce.reproducible.ExactSumOp (reproducible sums), which never reduces
    #: pairwise
    exact = False

    def check_dtype(self, dtype):
        """Raise TypeError if this op is not defined for ``dtype``."""
        if self.divide_by_size and dtype.kind in "iu":
            raise TypeError(
                f"op '{self.name}' needs a floating or complex dtype, got {dtype}; "
                "use op='sum' and divide yourself, or cast to a float type"
            )
        if not self.defined_for_complex and dtype.kind == "c":
            raise TypeError(f"op '{self.name}' is not defined for complex dtype {dtype}")

    def reduce_local(self, a, b, out):
        """out = a (op) b, elementwise; ``out`` may alias ``a`` or ``b``.

        numpy for host arrays; for device arrays the same-named CuPy ufunc, queued on the current
        stream.
        """
        if type(out) is np.ndarray:
            self.ufunc(a, b, out=out)
        else:
            getattr(namespace(out), self.ufunc.__name__)(a, b, out=out)

    def mpi_op(self, dtype):
        """The MPI op to hand to MPI collectives for elements of ``dtype``.

        The predefined op where the MPI library reduces this type itself, else a user-defined op
        that runs the numpy ufunc (float16 on an MPI without MPI_SHORT_FLOAT arithmetic, say).
        """
        dtype = np.dtype(dtype)
        if _library_reduces(self.name, dtype):
            return self.mpi
        return _numpy_mpi_op(self.ufunc, dtype)

    def finish(self, result, size):
        """Apply what remains after the reduction proper (mean's division), in place."""
        if self.divide_by_size and size != 1:
            divide_by_size(
                np if type(result) is np.ndarray else namespace(result), result, size, result
            )

    def host_finish(self, dtype, size):
        """``finish`` of numpy results of ``dtype`` bound once, for a call's short path: a function
        of the result, or None where nothing remains (a sum; one rank). The same bits as
        ``finish``."""
        if not self.divide_by_size or size == 1:
            return None
        ufunc, factor = _division(np, np.dtype(dtype), size)
        return lambda result: ufunc(result, factor, out=result)

    def widened_op(self):
        """The op the algorithm runs on the widened values (this one: Bfloat16Bits's differs)."""
        return self

    def widen(self, values, dtype):
        """``values`` in the plan's accumulation dtype (a new array)."""
        return values.astype(dtype)

    def narrow(self, wide, out):
        """``wide`` rounded once into ``out`` (of the call's dtype)."""
        _module(out).copyto(out, wide, casting="unsafe")


def _module(array):
    return np if type(array) is np.ndarray else namespace(array)


class Bfloat16Bits(ReduceOp):
    """``op`` over bfloat16 values held as their 16-bit words, in uint16 arrays: CUDA bfloat16
    tensors (mpiallreduce.torch), which CuPy has no dtype for. The planner gives such a call the
    route "bfloat16 bits" and float32 accumulation, as for any bfloat16 array: the words are widened
    exactly (``widen``), reduced in float32 and rounded once to nearest even (``narrow``, the
    rounding of ml_dtypes and torch), so the result has the bits a numpy bfloat16 array's would."""

    def __init__(self, op):
        # (no MPI op of its own: the algorithm runs ``op`` on the widened values)
        super().__init__(f"bfloat16_bits_{op.name}", op.ufunc, None, op.divide_by_size, False)
        object.__setattr__(self, "_widened", op)

    def widened_op(self):
        return self._widened

    def mpi_op(self, dtype):
        raise TypeError(f"{self.name} is no MPI op: its words are widened to float32 first")

    def __repr__(self):
        return self.name

    def check_dtype(self, dtype):
        if dtype != np.uint16:
            raise TypeError(f"{self.name} reduces bfloat16 words held as uint16, got dtype {dtype}")

    def widen(self, values, dtype):
        xp = _module(values)
        wide = xp.empty(values.shape, xp.float32)
        xp.left_shift(values.astype(xp.uint32), xp.uint32(16), out=wide.view(xp.uint32))
        return wide

    def narrow(self, wide, out):
        xp, bits = _module(wide), wide.view(np.uint32)
        top = xp.right_shift(bits, xp.uint32(16))
        rounded = xp.add(xp.add(bits, xp.uint32(0x7FFF)), xp.bitwise_and(top, xp.uint32(1)))
        xp.right_shift(rounded, xp.uint32(16), out=rounded)
        quiet = xp.bitwise_or(top, xp.uint32(0x40))  # (a NaN stays a NaN, its sign kept)
        xp.copyto(out, xp.where(xp.isnan(wide), quiet, rounded), casting="unsafe")


@functools.cache
def _library_reduces(op_name, dtype):
    """Whether the MPI library applies op ``op_name`` to ``dtype`` itself: a one-element local
    reduction."""
    mpi_op = OPS[op_name].mpi
    datatype = mpi_datatype(dtype)
    if not datatype.is_predefined:
        return False
    a, b = np.ones(1, dtype), np.ones(1, dtype)
    try:
        mpi_op.Reduce_local([a, datatype], [b, datatype])
    except MPI.Exception:
        return False
    return True


@functools.cache
def _numpy_mpi_op(ufunc, dtype):
    """A commutative user-defined MPI op that applies ``ufunc`` to elements of ``dtype``."""

    def reduce_into(invec, inoutvec, datatype):
        a = np.frombuffer(invec, dtype=dtype)
        b = np.frombuffer(inoutvec, dtype=dtype)
        with np.errstate(all="ignore"):  # as MPI's own ops: overflow gives inf, never an exception
            ufunc(a, b, out=b)

    return MPI.Op.Create(reduce_into, commute=True)


OPS = {
    "sum": ReduceOp("sum", np.add, MPI.SUM),
    "prod": ReduceOp("prod", np.multiply, MPI.PROD),
    "min": ReduceOp("min", np.minimum, MPI.MIN, defined_for_complex=False),
    "max": ReduceOp("max", np.maximum, MPI.MAX, defined_for_complex=False),
    "mean": ReduceOp("mean", np.add, MPI.SUM, divide_by_size=True),
}


#: mpi4py's predefined ops that are ops here too (an MPI.Op is unhashable; == compares handles, no
#: MPI call)
_MPI_NAMES = ((MPI.SUM, "sum"), (MPI.PROD, "prod"), (MPI.MIN, "min"), (MPI.MAX, "max"))


def name_of(op):
    """``op`` as the library names it: mpi4py's MPI.SUM, PROD, MIN or MAX its name, else ``op``
    itself."""
    return (
        next((name for mpi, name in _MPI_NAMES if op == mpi), op) if isinstance(op, MPI.Op) else op
    )


def get_op(name):
    """The ReduceOp called ``name``; ValueError (TypeError for a non-string) naming the choices
    otherwise. A ReduceOp is itself (the library's own ops: mpiallreduce.reproducible.EXACT_OPS)."""
    if isinstance(name, ReduceOp):
        return name
    name = name_of(name)  # (op=MPI.SUM, as with mpi4py)
    if not isinstance(name, str):
        raise TypeError(
            f"op must be a string, one of {', '.join(OPS)} (or MPI.SUM, MPI.PROD, MPI.MIN, "
            f"MPI.MAX); got {type(name).__name__} {name!r}"
        )
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; expected one of {', '.join(OPS)}") from None


def divide_by_size(xp, values, size, out):
    """``out`` = ``values`` / ``size`` (a mean), bit for bit. For real floats and a power of two,
    as a multiplication by 1/size: exact, so the same bits as the division, and cheaper (a vector
    division is slower than a multiplication: docs/training-notes.md says how to compare them)."""
    ufunc, factor = _division(xp, values.dtype, size)
    ufunc(values, factor, out=out)


def host_division(dtype, size):
    """("multiply" or "divide", the operand as a float) of a mean's division of numpy ``dtype`` by
    ``size`` (what the compiled paths do with the same IEEE operation:
    mpiallreduce.core.compiled)."""
    ufunc, factor = _division(np, np.dtype(dtype), size)
    return ufunc.__name__, float(factor)


def _division(xp, dtype, size):
    """(the ufunc, its second operand) that divide by ``size`` (see divide_by_size)."""
    if dtype.kind == "f" and size & (size - 1) == 0:
        return xp.multiply, dtype.type(1.0 / size)
    return xp.divide, dtype.type(size)
