"""Buffers: which arrays are accepted, their MPI datatypes, and the flat buffers an algorithm works
on.

Every algorithm sees one-dimensional C-contiguous arrays: an optional send buffer (``None`` when the
call is in place) and a receive buffer that ends up holding the result. This module turns what the
user passed (any shape, strided or not, ``out`` or not) into those, and copies the result back where
a contiguous view was not possible. Device arrays (CuPy, or the test stand-in) get the same
treatment through their own array module (``xp``), which has the same names as numpy.
"""

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

from .array_kind import foreign_device_array, namespace

__all__ = [
    "check_array",
    "retire_scratch",
    "check_out",
    "array_module",
    "views",
    "is_low_precision",
    "copy_into",
    "empty_like",
    "mpi_datatype",
    "aligned_empty",
    "scratch",
    "FlatBuffers",
    "flat_buffers",
]

# numpy kinds an allreduce makes sense for: signed, unsigned, floating, complex.
REDUCIBLE_KINDS = "iufc"
#: 16-bit floats: the hand-written algorithms accumulate them in float32 and round once
LOW_PRECISION = ("float16", "bfloat16")


def array_module(x):
    """numpy for host arrays; ``cupy`` (or the test stand-in) for device arrays."""
    if type(x) is np.ndarray:
        return np
    return namespace(x) or np


def views(a, b):
    """Whether flat ``a`` is a view of ``b``'s memory (a prepared call's input: no refresh
    needed)."""
    return a.size == b.size and array_module(a).may_share_memory(a, b)


@functools.cache
def _dtype_name(dtype):
    return dtype.name  # (numpy computes it anew each time, at a cost of microseconds)


def is_low_precision(dtype):
    dtype = np.dtype(dtype)
    return dtype.itemsize == 2 and dtype.kind in "fV" and _dtype_name(dtype) in LOW_PRECISION


def empty_like(array):
    """A new array of ``array``'s shape and dtype, in the same memory (host, or its device)."""
    return array_module(array).empty_like(array)


def copy_into(destination, source):
    """destination[...] = source, on the device (queued on the current stream) for device arrays."""
    array_module(destination).copyto(destination, source)


def check_array(x, name="x"):
    """Raise TypeError unless ``x`` is a numpy or CuPy array of a dtype that can be reduced."""
    if type(x) is not np.ndarray and not isinstance(x, np.ndarray) and namespace(x) is None:
        if type(x).__module__.split(".")[0] == "torch":
            where = getattr(getattr(x, "device", None), "type", "?")
            raise TypeError(
                f"{name} is a torch.Tensor ({where}); use mpiallreduce.torch.allreduce({name}), "
                "or pass "
                + (
                    f"{name}.numpy() (a numpy array sharing its memory)"
                    if where == "cpu"
                    else f"cupy.from_dlpack({name}) (a CuPy array sharing its memory)"
                )
            )
        if type(x).__module__.split(".")[0] in ("jax", "jaxlib"):
            raise TypeError(
                f"{name} is a jax array: mpiallreduce.allreduce takes it (through "
                "mpiallreduce.jax), as do mpiallreduce.jax.psum/pmean/pmax/pmin (docs/jax.md)"
            )
        if foreign_device_array(x):
            raise TypeError(
                f"{name} is a device array of type {type(x).__module__}.{type(x).__qualname__}; "
                f"pass a CuPy array instead (cupy.from_dlpack({name}) shares the memory "
                "without a copy)"
            )
        raise TypeError(
            f"{name} must be a numpy.ndarray or cupy.ndarray, "
            f"got {type(x).__module__}.{type(x).__qualname__}"
        )
    dtype = x.dtype
    if dtype.kind == "V" and _dtype_name(dtype) == "bfloat16":  # ml_dtypes' bfloat16
        return
    if dtype.kind not in REDUCIBLE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise TypeError(
            f"{name} has dtype {dtype!s}, which cannot be reduced; "
            "expected a signed, unsigned, floating or complex number type"
        )
    if not dtype.isnative:
        raise TypeError(
            f"{name} has non-native byte order ({dtype.str}); convert it with "
            f"{name}.astype({name}.dtype.newbyteorder('='))"
        )


def check_out(out, x):
    """Raise TypeError/ValueError unless ``out`` can receive the allreduce of ``x``."""
    if out is None:
        return
    if type(out) is not type(x) and (
        array_module(out) is not array_module(x)
        or not (isinstance(out, np.ndarray) or namespace(out))
    ):
        raise TypeError(
            f"out must be None or an array of the same kind as x ({type(x).__module__}."
            f"{type(x).__qualname__}), got {type(out).__module__}.{type(out).__qualname__}"
        )
    if out.shape != x.shape:
        raise ValueError(f"out has shape {out.shape}, but x has shape {x.shape}; they must match")
    if out.dtype != x.dtype:
        raise ValueError(f"out has dtype {out.dtype}, but x has dtype {x.dtype}; they must match")
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError("out is read-only; pass a writeable array (or out=None for a new one)")


@functools.cache
def _datatype_for(dtype):
    try:
        # The predefined type (MPI_FLOAT, MPI_SHORT_FLOAT, ...): MPI's predefined ops accept only
        # these, not duplicates of them such as mpi4py.util.dtlib.from_numpy_dtype returns.
        return MPI.Datatype.fromcode(dtype.char)
    except (KeyError, ValueError):
        pass
    try:
        datatype = dtlib.from_numpy_dtype(dtype)
    except (KeyError, ValueError, TypeError):
        # A number type MPI has no name for (bfloat16, say): moved as opaque bytes.
        datatype = MPI.BYTE.Create_contiguous(dtype.itemsize)
    return datatype.Commit()


def mpi_datatype(dtype):
    """The MPI datatype for one element of ``dtype``: predefined where MPI has one (cached; never
    free it)."""
    return _datatype_for(np.dtype(dtype))


def aligned_empty(count, dtype, alignment=4096):
    """An uninitialised 1-D array of ``count`` elements whose data starts on an ``alignment``
    boundary.

    Page-aligned buffers keep an input and an output from sitting a few bytes apart modulo 4 KiB,
    which made MPI_Allreduce about 2x slower here at 4-64 KiB (cache aliasing; see
    docs/field-notes.md).
    """
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start : start + nbytes].view(dtype)


class _ScratchPool(threading.local):
    def __init__(self):
        self.buffers = {}


_scratch_pool = _ScratchPool()


def scratch(slot, count, dtype, like=None):
    """A reusable 1-D work array of ``count`` elements, one per (thread, slot); grown, never shrunk.

    Algorithms receive into scratch memory instead of allocating per call: a fresh allocation every
    call made 1-16 MiB allreduces about 1.6x slower here (docs/field-notes.md). The contents are
    garbage. With ``like`` a device array, the scratch array is device memory of the same library.
    """
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    xp = None if like is None else namespace(like)
    key = slot if xp is None else (slot, xp.__name__)
    raw = _scratch_pool.buffers.get(key)
    if raw is None or raw.nbytes < nbytes:
        raw = (
            aligned_empty(max(nbytes, 1), np.uint8)
            if xp is None
            else xp.empty(max(nbytes, 1), np.uint8)
        )
        _scratch_pool.buffers[key] = raw
    return raw[:nbytes].view(dtype)


def retire_scratch(slot):
    """Never hand this thread's scratch array of ``slot`` out again (MPI may still read or write it:
    a request of a call given up, left behind, holds it); the next ``scratch`` makes a new one."""
    _scratch_pool.buffers.pop(slot, None)


@dataclass
class FlatBuffers:
    """What an algorithm runs on, and how the user's arrays get the result.

    send: 1-D contiguous input, or None when the input already sits in ``recv`` (in place).
    recv: 1-D contiguous array that receives the result.
    result: the array returned to the user.
    write_back: copies ``recv`` into ``result`` when ``recv`` is a temporary, else None.
    """

    send: np.ndarray | None
    recv: np.ndarray
    result: np.ndarray
    write_back: Callable[[], None] | None

    def finish(self):
        if self.write_back is not None:
            self.write_back()
        return self.result


def _flat_view(a):
    """A 1-D view of ``a`` if it is C-contiguous, else None."""
    return a.reshape(-1) if a.flags.c_contiguous else None


def flat_buffers(x, out):
    """Plan the flat send/receive buffers for ``allreduce(x, out=out)``; never modifies ``x`` unless
    out is x."""
    xp = array_module(x)
    overlapping = out is not None and out is not x and xp.may_share_memory(out, x)
    in_place = out is x or (overlapping and _same_elements(out, x))
    result = xp.empty(x.shape, dtype=x.dtype) if out is None else out
    recv = _flat_view(result)
    write_back = None
    if (
        recv is None
    ):  # a strided out (or strided x in place): reduce in a temporary, copy back after
        recv = xp.empty(x.size, dtype=x.dtype)
        write_back = lambda: xp.copyto(result, recv.reshape(result.shape))  # noqa: E731
    if in_place:
        if write_back is not None:
            xp.copyto(recv.reshape(x.shape), x)
        return FlatBuffers(send=None, recv=recv, result=result, write_back=write_back)
    send = _flat_view(x)
    if send is None or overlapping:  # strided x, or an out that overlaps x without being x
        send = xp.ascontiguousarray(x).reshape(-1)
        if send is x or xp.may_share_memory(send, x):
            send = send.copy()
    return FlatBuffers(send=send, recv=recv, result=result, write_back=write_back)


def _address(a):
    interface = a.__array_interface__ if isinstance(a, np.ndarray) else a.__cuda_array_interface__
    return interface["data"][0]


def _same_elements(a, b):
    """Whether two arrays of one shape and dtype view exactly the same memory, element for
    element."""
    return _address(a) == _address(b) and a.strides == b.strides
