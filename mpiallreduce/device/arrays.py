"""Device (GPU) arrays: whose they are, which GPU a rank uses, and whether MPI takes device
pointers.

mpiallreduce accepts CuPy arrays (and, for tests, :mod:`mpiallreduce.testing.fake_cupy`'s stand-in,
which has the same API over host memory). The code that handles them asks this module for the
array's module (``xp``: ``cupy``, or the stand-in) and calls the same CuPy functions either way.
"""

import functools
import os
import sys

import numpy as np
from mpi4py import MPI

__all__ = [
    "CUDA_AWARE_ENV",
    "namespace",
    "is_device_array",
    "synchronize",
    "cuda_aware",
    "local_rank",
    "gpu_for_local_rank",
    "select_gpu",
]

#: "1" or "0": take (or do not take) the MPI library to be CUDA-aware, whatever it says of itself
CUDA_AWARE_ENV = "MPIALLREDUCE_CUDA_AWARE"

_FAKE_MODULE = "mpiallreduce.testing.fake_cupy"
_namespace_by_type = {}
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


def synchronize(xp):
    """Wait until the kernels queued on CuPy's current stream have finished: call before MPI reads
    or writes device memory (MPI knows nothing of CUDA streams; see docs/field-notes.md)."""
    xp.cuda.get_current_stream().synchronize()


@functools.cache
def _library_cuda_aware():
    from ..core.mpilib import cuda_aware as ask_library

    aware, how = ask_library()
    return bool(aware), how


def cuda_aware():
    """(aware, why): whether device pointers go straight to MPI here.

    ``MPIALLREDUCE_CUDA_AWARE=1|0`` (mpiallreduce.settings) decides if set; otherwise the MPI
    library is asked (``MPIX_Query_cuda_support`` / ``MPIX_GPU_query_support``), and "unknown"
    counts as no.
    """
    from ..core.settings import settings

    forced = settings().cuda_aware
    if forced is not None:
        return forced, f"{CUDA_AWARE_ENV}={int(forced)}"
    return _library_cuda_aware()


def agree_on_cuda_awareness(comm, forced):
    """Collective over ``comm`` unless ``forced`` (an agreed setting, the same on every rank):
    device pointers go to MPI only if every rank's MPI takes them (a rank-local fact the plan
    depends on is agreed, never assumed equal). Called by
    mpiallreduce.core.state.CommState.make_ready."""
    if forced is not None:
        return bool(forced)
    votes = np.array([1 if cuda_aware()[0] else 0], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, [votes, MPI.INT64_T], op=MPI.MIN)
    return bool(votes[0])


#: variables in which launchers tell a process its rank among the processes of its node
LOCAL_RANK_VARIABLES = (
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "SLURM_LOCALID",
    "PMIX_LOCAL_RANK",
)


def local_rank(comm=None):
    """This process's rank among the processes of its node.

    With ``comm``: its rank in ``comm``'s node communicator (collective over ``comm``). Without:
    what the launcher says (mpiexec, srun; no communication), else COMM_WORLD's node communicator.
    """
    if comm is None:
        for variable in LOCAL_RANK_VARIABLES:
            value = os.environ.get(variable, "").strip()
            if value.isdigit():
                return int(value)
    from mpi4py import MPI

    from ..core.state import state_of
    from ..core.topology import node_communicator

    comm = MPI.COMM_WORLD if comm is None else comm
    return node_communicator(state_of(comm).make_ready().library).Get_rank()


def gpu_for_local_rank(local_rank, device_count):
    """The GPU (an index among the visible ones) for node-local rank ``local_rank``: round robin,
    so that 8 ranks on 4 GPUs put two on each and any number of ranks can share one GPU."""
    if device_count < 1:
        raise RuntimeError(
            "no CUDA device is visible to this process "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})"
        )
    return local_rank % device_count


def select_gpu(comm=None, xp=None):
    """Make this rank's GPU current (``cupy.cuda.Device(i).use()``) and return its index.

    Call it once, first thing, before creating device arrays. The GPU is the node-local rank modulo
    the number of visible devices; CUDA numbers only the devices in CUDA_VISIBLE_DEVICES, so a
    scheduler's binding (``srun --gpus-per-task``, ``--gpu-bind``) is respected as it is.
    """
    if xp is None:
        try:
            import cupy as xp
        except ModuleNotFoundError:
            raise ModuleNotFoundError(
                "select_gpu needs CuPy: pip install 'mpiallreduce[cuda12]' (or [cuda13], "
                "for the CUDA major version of the driver)"
            ) from None
    try:
        count = xp.cuda.runtime.getDeviceCount()
    except (
        Exception
    ) as error:  # (cudaErrorInsufficientDriver, cudaErrorNoDevice, ...): one clear message
        raise RuntimeError(
            f"CuPy {getattr(xp, '__version__', '')} is installed but no GPU is usable here: "
            f"{type(error).__name__}: {error}. No NVIDIA driver, one older than CuPy's CUDA, or no "
            "device visible; `mpiallreduce info` says which. Without a GPU, use numpy arrays."
        ) from error
    index = gpu_for_local_rank(local_rank(comm), count)
    xp.cuda.Device(index).use()
    return index


def allocation_range(xp, ptr):
    """(base, size) of the device allocation that holds address ``ptr`` (``cuMemGetAddressRange``).

    CUDA IPC shares whole allocations: a handle made from an array inside a memory pool's block
    opens, in the peer, at the block's base, so the array's offset travels with the handle.
    """
    stand_in = getattr(xp, "_allocation_range", None)
    if stand_in is not None:
        return stand_in(ptr)
    import ctypes

    libcuda = _libcuda()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = libcuda.cuMemGetAddressRange_v2(
        ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)
    )
    if status != 0:
        raise RuntimeError(f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {status}")
    return base.value, size.value


@functools.cache
def _libcuda():
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


def close_ipc_mapping(xp, ptr):
    """Unmap a peer's allocation opened with ``ipcOpenMemHandle`` (CuPy may not wrap the close:
    then the driver's ``cuIpcCloseMemHandle``)."""
    close = getattr(xp.cuda.runtime, "ipcCloseMemHandle", None)
    if close is not None:
        close(ptr)
        return
    import ctypes

    _libcuda().cuIpcCloseMemHandle(ctypes.c_uint64(ptr))
