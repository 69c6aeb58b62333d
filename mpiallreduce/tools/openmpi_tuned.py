"""Open MPI's own allreduce algorithms, forced one at a time, on communicators made for the purpose.

Open MPI's coll/tuned picks among six allreduce algorithms by size and rank count; the MCA
variables ``coll_tuned_use_dynamic_rules`` and ``coll_tuned_allreduce_algorithm`` force one. They
are control variables of the MPI tool interface (MPI_T), so a running program can set them
(``MPI_T_cvar_write`` through ctypes; mpi4py has no MPI_T) and then ``Dup`` a communicator, which
takes the forced choice; the variables are put back at once. So one benchmark run can time Open
MPI's default, each of its algorithms and ours side by side.
"""

import ctypes

from ..core.mpilib import loaded_libmpi

__all__ = [
    "TUNED_ALLREDUCE_ALGORITHMS",
    "forced_allreduce_communicator",
    "han_off_communicator",
    "default_allreduce_component",
]

#: coll_tuned_allreduce_algorithm values (ompi_info --param coll tuned --level 9)
TUNED_ALLREDUCE_ALGORITHMS = {
    1: "basic_linear",
    2: "nonoverlapping",
    3: "recursive_doubling",
    4: "ring",
    5: "segmented_ring",
    6: "rabenseifner",
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
        if (
            lib is None
            or not hasattr(lib, "MPI_T_cvar_get_index")
            or lib.MPI_T_init_thread(MPI_T_THREAD_MULTIPLE, ctypes.byref(provided)) != 0
        ):
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
    """A Dup of ``comm`` on which MPI_Allreduce runs Open MPI's tuned algorithm number
    ``algorithm``.

    coll/han is switched off on it too (across nodes han, priority 35, would otherwise take
    allreduce before tuned, priority 30). Collective. Returns None on every rank if any rank cannot
    force it (not Open MPI, no MPI_T). The caller frees the communicator.
    """
    return _dup_with(
        comm,
        {
            "coll_tuned_use_dynamic_rules": 1,
            "coll_tuned_allreduce_algorithm": algorithm,
            "coll_han_priority": 0,
        },
        needed=("coll_tuned_use_dynamic_rules", "coll_tuned_allreduce_algorithm"),
    )


def han_off_communicator(comm):
    """A Dup of ``comm`` without coll/han: Open MPI's default with han switched off (tuned's own
    choice across nodes). Collective; None on every rank where han cannot be switched off."""
    return _dup_with(comm, {"coll_han_priority": 0}, needed=("coll_han_priority",))


def default_allreduce_component(comm, spans_nodes):
    """Which coll component Open MPI 5 gives MPI_Allreduce on ``comm`` by default, from the
    components' priorities (MPI_T): 'han' across nodes when its priority beats tuned's (han
    disqualifies itself on one node; seen with coll_base_verbose), else 'tuned'; None where the
    priorities cannot be read."""
    lib = _tool_interface()
    han = _cvar(lib, "coll_han_priority") if lib else None
    tuned = _cvar(lib, "coll_tuned_priority") if lib else None
    if not (han and tuned):
        return None
    return "han" if spans_nodes and _read(lib, han) > _read(lib, tuned) else "tuned"


def _dup_with(comm, values, needed):
    """A Dup of ``comm`` made while the MCA variables ``values`` are set (put back at once after);
    None on every rank if any rank cannot set those ``needed``, or if the ranks could set different
    ones (the others are set where they exist): a communicator whose ranks chose their collective
    components differently would hang or mix algorithms."""
    lib = _tool_interface()
    handles = {name: _cvar(lib, name) for name in values} if lib else {}
    saved = {name: _read(lib, handle) for name, handle in handles.items() if handle}
    able = all(name in saved for name in needed)
    written = []
    if able:
        for name, value in values.items():
            if name in saved:
                if _write(lib, handles[name], value):
                    written.append(name)
                elif name in needed:
                    able = False

    def restore():
        for name in written:
            _write(lib, handles[name], saved[name])

    outcomes = comm.allgather((able, sorted(written)))
    if not all(a for a, _ in outcomes) or any(w != outcomes[0][1] for _, w in outcomes):
        restore()
        return None
    try:
        return comm.Dup()
    finally:
        restore()
