"""A stand-in for the few CuPy calls mpiallreduce makes: "device" arrays that live in host memory.

CI machines have no GPU, yet the device paths (dispatch, staging through pinned buffers, pipelining
over several streams, the device-to-device exchange of IPC handles, error paths) must run on every
CI run. This module imitates the part of CuPy they use, with the same names and signatures:

* ``ndarray`` exposes ``__cuda_array_interface__`` (so mpi4py takes it as a device buffer); its
  memory is a file in /dev/shm, so that ``cuda.runtime.ipcGetMemHandle`` / ``ipcOpenMemHandle``
  can map it into another process on the node, as CUDA IPC does for device memory.
* Kernels are asynchronous, as on a GPU: ``add``, ``copyto``, ``astype``, ``ndarray.set``... are
  queued on the current stream and run only when that stream is synchronized (or an event
  recorded after them is waited for). Reading device memory without synchronizing first gives the
  stale bytes a real GPU would give, so a missing ``synchronize`` fails tests here as on hardware.
* ``asnumpy`` and ``ndarray.get`` synchronize their stream first, as CuPy's blocking copies do.

Use it as ``import mpiallreduce.testing.fake_cupy as cp`` in place of ``import cupy as cp``.

The module is in three parts beside it: fake_cupy_memory.py (allocations in /dev/shm, IPC),
fake_cupy_streams.py (streams, events, devices) and fake_cupy_arrays.py (ndarray, the functions and
kernels); here they are put together under CuPy's names, with ``cuda`` and ``cuda.runtime``.
"""

import types

from numpy import bool_, float16, float32, float64, int16, int32, int64, uint8, uint16, uint32  # noqa: F401

from .fake_cupy_arrays import (
    ElementwiseKernel,
    MemoryPointer,
    UnownedMemory,
    _Flags,
    add,  # noqa: F401
    array,
    asarray,
    ascontiguousarray,
    asnumpy,
    bitwise_and,
    bitwise_or,
    copyto,
    divide,
    empty,
    empty_like,
    isnan,
    left_shift,
    maximum,
    may_share_memory,
    minimum,
    multiply,
    ndarray,
    right_shift,
    true_divide,
    where,
    zeros,
)
from .fake_cupy_memory import (
    _allocation_range,
    _ipc_close_mem_handle,
    _ipc_get_mem_handle,  # noqa: F401
    _ipc_open_mem_handle,
    _Memory,
    _opened,
    counts,
    open_ipc_mappings,
)
from .fake_cupy_streams import (
    Event,
    Stream,
    _Device,
    _device_count,
    _null_stream,
    get_current_stream,
)  # noqa: F401

__all__ = [
    "ndarray",
    "ElementwiseKernel",
    "empty",
    "empty_like",
    "zeros",
    "asarray",
    "asnumpy",
    "copyto",
    "ascontiguousarray",
    "may_share_memory",
    "add",
    "multiply",
    "minimum",
    "maximum",
    "divide",
    "cuda",
]

# the classes keep the module path they are known by (as in ``type(x).__module__`` in messages)
for _class in (
    ndarray,
    ElementwiseKernel,
    MemoryPointer,
    UnownedMemory,
    _Flags,
    _Memory,
    Stream,
    Event,
    _Device,
):
    _class.__module__ = __name__
del _class

runtime = types.SimpleNamespace(
    getDeviceCount=_device_count,
    getDevice=lambda: _Device._selected,
    getDeviceProperties=lambda device: {"name": b"the CuPy stand-in", "computeMode": 0},
    setDevice=lambda i: _Device(i).use(),
    ipcGetMemHandle=_ipc_get_mem_handle,
    ipcOpenMemHandle=_ipc_open_mem_handle,
    ipcCloseMemHandle=_ipc_close_mem_handle,
    cudaIpcMemLazyEnablePeerAccess=1,
)

cuda = types.SimpleNamespace(
    Stream=Stream,
    Event=Event,
    Device=_Device,
    MemoryPointer=MemoryPointer,
    UnownedMemory=UnownedMemory,
    get_current_stream=get_current_stream,
    alloc_pinned_memory=lambda nbytes: bytearray(max(int(nbytes), 1)),
    runtime=runtime,
    is_available=lambda: True,
)


def synchronize_all():
    """Run every queued kernel of every stream this module knows of (for tests' teardown)."""
    _null_stream.synchronize()


def refuse_ipc(refused=True):
    """Make opening a peer's memory fail (True) or work again (False), as in a sandbox that refuses
    CUDA IPC (MPIALLREDUCE_FAKE_CUPY_IPC=refuse does it from the start)."""
    from . import fake_cupy_memory

    fake_cupy_memory.refuse_ipc = bool(refused)
