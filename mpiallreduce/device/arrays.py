"""Device (GPU) arrays: whose they are, which GPU a node-local rank uses, and whether MPI takes
device pointers.

mpiallreduce accepts CuPy arrays (and, for tests, :mod:`mpiallreduce.testing.fake_cupy`'s stand-in,
which has the same API over host memory). The code that handles them asks this module for the
array's module (``xp``: ``cupy``, or the stand-in) and calls the same CuPy functions either way.
What kind of array one is (``namespace``, ``is_device_array``, ``foreign_device_array``) is
mpiallreduce.core.array_kind's, below the core's buffers that ask it too, and given here as well.
"""

import functools
import os

import numpy as np
from mpi4py import MPI

from ..core.array_kind import (  # noqa: F401 (given here too: foreign_device_array, its old path)
    foreign_device_array,
    is_device_array,
    namespace,
)

__all__ = [
    "CUDA_AWARE_ENV",
    "namespace",
    "is_device_array",
    "synchronize",
    "cuda_aware",
    "launcher_local_rank",
    "gpu_for_local_rank",
    "visible_gpus",
]

#: "1" or "0": take (or do not take) the MPI library to be CUDA-aware, whatever it says of itself
CUDA_AWARE_ENV = "MPIALLREDUCE_CUDA_AWARE"


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


def launcher_local_rank():
    """This process's rank among the processes of its node as its launcher says it (mpiexec, srun:
    LOCAL_RANK_VARIABLES), or None where none does. Without communication; the rank in a
    communicator's node communicator: mpiallreduce.core.node_rank.local_rank."""
    for variable in LOCAL_RANK_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if value.isdigit():
            return int(value)
    return None


def gpu_for_local_rank(local_rank, device_count):
    """The GPU (an index among the visible ones) for node-local rank ``local_rank``: round robin,
    so that 8 ranks on 4 GPUs put two on each and any number of ranks can share one GPU."""
    if device_count < 1:
        raise RuntimeError(
            "no CUDA device is visible to this process "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})"
        )
    return local_rank % device_count


def visible_gpus(xp=None):
    """(xp, the number of GPUs visible to this process): CuPy (imported here where ``xp`` is None)
    and its device count, or one clear error where CuPy is missing or no GPU is usable. What
    mpiallreduce.core.node_rank.select_gpu asks first, before it communicates."""
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
    return xp, count


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
