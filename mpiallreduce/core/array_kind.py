"""What kind of array this is: numpy's, a device (CuPy) array, whose array module is asked for
(``xp``: ``cupy``, or mpiallreduce.testing.fake_cupy's stand-in), or another library's device
memory. Answered without importing CuPy; the core's base (buffers, ops) asks it, and so does every
layer above (mpiallreduce.device.arrays gives the same names)."""

import sys
from typing import Any

__all__ = ["namespace", "is_device_array", "foreign_device_array"]

_FAKE_MODULE = "mpiallreduce.testing.fake_cupy"
_namespace_by_type: dict[type, Any] = {}  # (an array type -> its module, or None)
_UNSEEN = object()


def namespace(x):
    """The array module of device array ``x`` (``cupy`` or the test stand-in); None for anything
    else.

    Strict: an instance of ``cupy.ndarray`` (or of the stand-in's ndarray), subclasses included.
    Other types of CuPy's modules (``cupyx.scipy.sparse`` matrices, say) are not device arrays here.
    A CuPy array exists only once CuPy is imported, so CuPy is never imported to answer.
    """
    kind = type(x)
    xp = _namespace_by_type.get(kind, _UNSEEN)
    if xp is not _UNSEEN:
        return xp
    xp = None
    for name in ("cupy", _FAKE_MODULE):
        module = sys.modules.get(name)
        if module is not None and isinstance(x, module.ndarray):
            xp = module
            break
    _namespace_by_type[kind] = xp
    return xp


def is_device_array(x):
    return namespace(x) is not None


def foreign_device_array(x):
    """Whether ``x`` is device memory of a library other than CuPy (torch, numba...)."""
    return namespace(x) is None and hasattr(type(x), "__cuda_array_interface__")
