"""Buffers: which arrays are accepted, their MPI datatypes, and the flat buffers an algorithm works on.

Every algorithm sees one-dimensional C-contiguous arrays: an optional send buffer (``None`` when the
call is in place) and a receive buffer that ends up holding the result. This module turns what the
user passed (any shape, strided or not, ``out`` or not) into those, and copies the result back where a
contiguous view was not possible. Later GPU work extends it with device arrays.
"""
import functools
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

__all__ = [
    "check_array",
    "check_out",
    "mpi_datatype",
    "aligned_empty",
    "scratch",
    "FlatBuffers",
    "flat_buffers",
]

# numpy kinds an allreduce makes sense for: signed, unsigned, floating, complex.
REDUCIBLE_KINDS = "iufc"


def check_array(x, name="x"):
    """Raise TypeError unless ``x`` is a numpy array of a dtype that can be reduced."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__module__}.{type(x).__qualname__}")
    dtype = x.dtype
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
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be None or a numpy.ndarray, got {type(out).__module__}.{type(out).__qualname__}")
    if out.shape != x.shape:
        raise ValueError(f"out has shape {out.shape}, but x has shape {x.shape}; they must match")
    if out.dtype != x.dtype:
        raise ValueError(f"out has dtype {out.dtype}, but x has dtype {x.dtype}; they must match")
    if not out.flags.writeable:
        raise ValueError("out is read-only; pass a writeable array (or out=None for a new one)")


@functools.lru_cache(maxsize=None)
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
    """The MPI datatype for one element of ``dtype``: predefined where MPI has one (cached; never free it)."""
    return _datatype_for(np.dtype(dtype))


def aligned_empty(count, dtype, alignment=4096):
    """An uninitialised 1-D array of ``count`` elements whose data starts on an ``alignment`` boundary.

    Page-aligned buffers keep an input and an output from sitting a few bytes apart modulo 4 KiB,
    which made MPI_Allreduce about 2x slower here at 4-64 KiB (cache aliasing; see FIELD.md).
    """
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + nbytes].view(dtype)


class _ScratchPool(threading.local):
    def __init__(self):
        self.buffers = {}


_scratch_pool = _ScratchPool()


def scratch(slot, count, dtype):
    """A reusable 1-D work array of ``count`` elements, one per (thread, slot); grown, never shrunk.

    Algorithms receive into scratch memory instead of allocating per call: a fresh allocation every
    call made 1-16 MiB allreduces about 1.6x slower here (FIELD.md). The contents are garbage.
    """
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    raw = _scratch_pool.buffers.get(slot)
    if raw is None or raw.nbytes < nbytes:
        raw = aligned_empty(max(nbytes, 1), np.uint8)
        _scratch_pool.buffers[slot] = raw
    return raw[:nbytes].view(dtype)


@dataclass
class FlatBuffers:
    """What an algorithm runs on, and how the user's arrays get the result.

    send: 1-D contiguous input, or None when the input already sits in ``recv`` (in place).
    recv: 1-D contiguous array that receives the result.
    result: the array returned to the user.
    write_back: copies ``recv`` into ``result`` when ``recv`` is a temporary, else None.
    """

    send: Optional[np.ndarray]
    recv: np.ndarray
    result: np.ndarray
    write_back: Optional[Callable[[], None]]

    def finish(self):
        if self.write_back is not None:
            self.write_back()
        return self.result


def _flat_view(a):
    """A 1-D view of ``a`` if it is C-contiguous, else None."""
    return a.reshape(-1) if a.flags.c_contiguous else None


def flat_buffers(x, out):
    """Plan the flat send/receive buffers for ``allreduce(x, out=out)``; never modifies ``x`` unless out is x."""
    overlapping = out is not None and out is not x and np.may_share_memory(out, x)
    in_place = out is x or (overlapping and _same_elements(out, x))
    result = np.empty(x.shape, dtype=x.dtype) if out is None else out
    recv = _flat_view(result)
    write_back = None
    if recv is None:  # a strided out (or strided x in place): reduce in a temporary, copy back after
        recv = np.empty(x.size, dtype=x.dtype)
        write_back = lambda: np.copyto(result, recv.reshape(result.shape))  # noqa: E731
    if in_place:
        if write_back is not None:
            np.copyto(recv.reshape(x.shape), x)
        return FlatBuffers(send=None, recv=recv, result=result, write_back=write_back)
    send = _flat_view(x)
    if send is None or overlapping:  # strided x, or an out that overlaps x without being x
        send = np.array(x, order="C", copy=True).reshape(-1)
    return FlatBuffers(send=send, recv=recv, result=result, write_back=write_back)


def _same_elements(a, b):
    """Whether two arrays of one shape and dtype view exactly the same memory, element for element."""
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.strides == b.strides
