"""Facts about the MPI library this process runs on, asked of the library itself."""

import contextlib
import ctypes
import ctypes.util

from mpi4py import MPI

__all__ = ["library_version", "loaded_libmpi", "cuda_aware"]

# MPICH's mpi.h: #define MPIX_GPU_SUPPORT_CUDA (0)
MPIX_GPU_SUPPORT_CUDA = 0


def library_version():
    """The first line of ``MPI_Get_library_version``, e.g. 'Open MPI v5.0.11, package: ...' (without
    the NUL byte Open MPI leaves at its end, which would make logs binary to grep)."""
    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()


def loaded_libmpi():
    """Path of the libmpi that mpi4py loaded into this process, or None if it cannot be found."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.count(" ") >= 5 else ""
                if "/libmpi.so" in path or "/libmpich.so" in path:
                    return path
    except OSError:
        pass
    return ctypes.util.find_library("mpi")


def cuda_aware():
    """Whether the MPI library accepts CUDA device pointers: (True | False | None, how we know).

    Open MPI answers through ``MPIX_Query_cuda_support()``, MPICH through
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``; None ("unknown") when it has neither.
    """
    candidates = [ctypes.CDLL(None)]
    path = loaded_libmpi()
    if path:
        with contextlib.suppress(OSError):
            candidates.insert(0, ctypes.CDLL(path))
    for lib in candidates:
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            query.argtypes = []
            return bool(query()), "MPIX_Query_cuda_support()"
        query = getattr(lib, "MPIX_GPU_query_support", None)
        if query is not None:
            flag = ctypes.c_int(0)
            query.restype = ctypes.c_int
            query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            if query(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == MPI.SUCCESS:
                return bool(flag.value), "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)"
    return None, "the library has neither MPIX_Query_cuda_support nor MPIX_GPU_query_support"
