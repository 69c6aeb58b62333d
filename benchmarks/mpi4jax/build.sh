#!/bin/sh
# Builds mpi4jax 0.9.1 from its sdist into the venv, a contender of make bench-jax:
#   make mpi4jax            (or: PYTHON=.venv/bin/python benchmarks/mpi4jax/build.sh)
# Its setup.py looks for a CUDA toolchain (nvidia's pip packages, nvcc, CUDA_PATH) and builds GPU
# extensions where it finds one; here its get_cuda_info() is made to find none (CPU only). The
# build needs cython and nanobind, and the venv's Open MPI (its mpicc). About a minute on 2 cores.
set -eu
PYTHON=${PYTHON:-.venv/bin/python}
BIN=$(cd "$(dirname "$PYTHON")" && pwd)
VERSION=${MPI4JAX_VERSION:-0.9.1.post2}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m pip install --quiet cython nanobind setuptools wheel
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
    "mpi4jax==$VERSION" -d "$WORK"
tar xzf "$WORK"/mpi4jax-*.tar.gz -C "$WORK"
SOURCE=$(ls -d "$WORK"/mpi4jax-*/)
# (CUDA detection off: the function that finds the toolchain returns nothing found)
sed -i 's/^def get_cuda_info():/def get_cuda_info():\n    return {"compile": [], "libdirs": [], "libs": [], "rpaths": []}\n\n\ndef _found_cuda_info():/' \
    "$SOURCE/setup.py"
PATH="$BIN:$PATH" MPI4JAX_BUILD_MPICC="$BIN/mpicc" \
    "$PYTHON" -m pip install --quiet --no-build-isolation --no-deps "$SOURCE"
"$PYTHON" -c "import mpi4jax; print('mpi4jax', mpi4jax.__version__)"
