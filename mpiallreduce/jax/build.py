"""How mpiallreduce.jax's XLA handler (``_ffi.cc``) is built: the one recipe, used at install and
at first use.

    pip install (setup.py)    where JAX is importable in the build environment (make installs JAX
                              first, then the package without build isolation), Open MPI's mpicxx
                              compiles _ffi.cc against jax.ffi.include_dir() into the package, next
                              to this file, marked inside with what it was made from: a digest of
                              the sources, JAX's version and the MPI it was compiled for
    first use (handler.py)    the installed build, where its mark matches this source, this JAX
                              and this MPI (read from its bytes, before it is loaded); else a build
                              of its own in MPIALLREDUCE_CACHE (default ~/.cache/mpiallreduce),
                              once per source, JAX and MPI

setup.py loads this file by itself (no package import: the build environment may lack numpy and
mpi4py), so it imports nothing but the standard library. ``python -m mpiallreduce.jax``
prints the handler's path, building it where there is none.
"""

import hashlib
import importlib.machinery
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "_ffi.cc"
#: the headers it includes (the waits, the algorithms): part of what names a build
HEADERS = (HERE / "_ffi_waits.h", HERE / "_ffi_algorithms.h", HERE / "_ffi_slots.h")
#: the install's build: mpiallreduce/jax/_ffi<the interpreter's extension suffix>
INSTALLED = tuple(HERE / f"_ffi{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES)
#: how a build says what it was made from, in its bytes (_ffi.cc: mpiallreduce_made_by)
MARK = b"mpiallreduce-made-by:"


def mpicxx(prefix):
    """Open MPI's C++ compiler wrapper: ``prefix``'s (the environment's, whose libmpi mpi4py
    loads at run time), else the first on PATH; None where there is none."""
    return shutil.which("mpicxx", path=str(Path(prefix) / "bin")) or shutil.which("mpicxx")


def mpi_family(compiler):
    """The MPI a wrapper compiles for, as "Open MPI 5" (library and major version: the ABI)."""
    said = subprocess.run(
        [compiler, "--showme:version"], capture_output=True, text=True, timeout=60
    )
    words = (said.stdout + said.stderr).split()
    if "Open" in words and "MPI" in words:
        at = words.index("MPI", words.index("Open"))
        if at + 1 < len(words):
            return f"Open MPI {words[at + 1].split('.')[0]}"
    return "unknown"


def made_by(jax_version, family):
    """What names a build, as a hex digest: the sources, JAX's version (its FFI), the MPI family."""
    digest = hashlib.sha256()
    for path in (SOURCE, *HEADERS):
        digest.update(path.read_bytes())
    digest.update(f"\0{jax_version}\0{family}".encode())
    return digest.hexdigest()[:32]


def command(compiler, include_dir, output, mark):
    """The compiler's command line: one shared library from _ffi.cc and its headers, marked."""
    return [
        compiler,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-w",
        f'-DMPIALLREDUCE_MADE_BY="{mark}"',
        f"-I{include_dir}",
        f"-I{HERE}",
        str(SOURCE),
        "-o",
        str(output),
    ]


def compile_handler(compiler, include_dir, output, jax_version, family):
    """Build it into ``output``; RuntimeError with the compiler's words where that fails."""
    line = command(compiler, include_dir, output, made_by(jax_version, family))
    done = subprocess.run(line, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(
            f"mpiallreduce.jax: building its XLA handler failed ({' '.join(line)}):\n"
            + done.stderr[-3000:]
        )


def install_build(compiler, include_dir, jax_version, output):
    """setup.py's build, into ``output``."""
    compile_handler(compiler, include_dir, output, jax_version, mpi_family(compiler))


def is_made_by(library, jax_version, family):
    """Whether the build at ``library`` is marked as made from this source, JAX and MPI."""
    try:
        data = Path(library).read_bytes()
    except OSError:
        return False
    return MARK + made_by(jax_version, family).encode() + b";" in data


def installed(jax_version, family):
    """The install's build where it was made from this source for this JAX and MPI; else None."""
    return next((lib for lib in INSTALLED if is_made_by(lib, jax_version, family)), None)
