"""Open MPI's own allreduce algorithms, forced one at a time, on communicators made for the purpose.

Open MPI's coll/tuned picks among six allreduce algorithms by size and rank count; the MCA
variables ``coll_tuned_use_dynamic_rules`` and ``coll_tuned_allreduce_algorithm`` force one. They
are control variables of the MPI tool interface (MPI_T), so a running program can set them
(``MPI_T_cvar_write`` through ctypes; mpi4py has no MPI_T) and then ``Dup`` a communicator, which
takes the forced choice; the variables are put back at once. So one benchmark run can time Open
MPI's default, each of its algorithms and ours side by side.
"""
import ctypes

from .mpilib import loaded_libmpi

__all__ = ["TUNED_ALLREDUCE_ALGORITHMS", "forced_allreduce_communicator"]

#: coll_tuned_allreduce_algorithm values (ompi_info --param coll tuned --level 9)
TUNED_ALLREDUCE_ALGORITHMS = {
    1: "basic_linear", 2: "nonoverlapping", 3: "recursive_doubling",
    4: "ring", 5: "segmented_ring", 6: "rabenseifner",
}
MPI_T_THREAD_MULTIPLE = 3

_lib = None


def _tool_interface():
    """libmpi with MPI_T initialised, or None where that is not Open MPI's or fails."""
    global _lib
    if _lib is None:
        path = loaded_libmpi()
        try:
            lib = ctypes.CDLL(path) if path else None
        except OSError:
            lib = None
        provided = ctypes.c_int()
        if lib is None or not hasattr(lib, "MPI_T_cvar_get_index") or \
                lib.MPI_T_init_thread(MPI_T_THREAD_MULTIPLE, ctypes.byref(provided)) != 0:
            _lib = False
        else:
            _lib = lib
    return _lib or None


def _cvar(lib, name):
    index = ctypes.c_int()
    if lib.MPI_T_cvar_get_index(name.encode(), ctypes.byref(index)) != 0:
        return None
    handle, count = ctypes.c_void_p(), ctypes.c_int()
    if lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) != 0:
        return None
    return handle


def _write(lib, handle, value):
    return lib.MPI_T_cvar_write(handle, ctypes.byref(ctypes.c_int(value))) == 0


def _read(lib, handle):
    value = ctypes.c_int()
    return value.value if lib.MPI_T_cvar_read(handle, ctypes.byref(value)) == 0 else 0


def forced_allreduce_communicator(comm, algorithm):
    """A Dup of ``comm`` on which MPI_Allreduce runs Open MPI's tuned algorithm number ``algorithm``.

    Collective. Returns None on every rank if any rank cannot force it (not Open MPI, no MPI_T).
    The caller frees the communicator.
    """
    lib = _tool_interface()
    dynamic = _cvar(lib, "coll_tuned_use_dynamic_rules") if lib else None
    choice = _cvar(lib, "coll_tuned_allreduce_algorithm") if lib else None
    saved = (_read(lib, dynamic), _read(lib, choice)) if dynamic and choice else None
    able = bool(saved and _write(lib, dynamic, 1) and _write(lib, choice, algorithm))

    def restore():
        if saved:
            _write(lib, dynamic, saved[0])
            _write(lib, choice, saved[1])

    from mpi4py import MPI
    if not comm.allreduce(able, op=MPI.LAND):
        restore()
        return None
    try:
        return comm.Dup()
    finally:
        restore()
