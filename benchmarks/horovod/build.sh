#!/bin/sh
# Builds Horovod 0.28.1 (PyTorch and MPI only) into the venv, as a contender of train_bench:
#   make horovod            (or: PYTHON=.venv/bin/python benchmarks/horovod/build.sh)
# Horovod's sdist asks for C++14; torch 2.x headers need C++17, so its two CMakeLists are raised
# to 17 first. Needs a C++ compiler and cmake (pip installs cmake when it is missing); it builds
# against the venv's Open MPI (its mpicxx). About 2-4 minutes on 2 cores.
set -eu
PYTHON=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PYTHON")
VERSION=0.28.1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
command -v cmake >/dev/null 2>&1 || "$PYTHON" -m pip install --quiet cmake
"$PYTHON" -m pip install --quiet cloudpickle psutil pyyaml packaging cffi  # (Horovod's own requirements)
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "horovod==$VERSION" -d "$WORK"
tar xzf "$WORK/horovod-$VERSION.tar.gz" -C "$WORK"
SOURCE="$WORK/horovod-$VERSION"
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$SOURCE/CMakeLists.txt" "$SOURCE/horovod/torch/CMakeLists.txt"
PATH="$(cd "$BIN" && pwd):$PATH" \
HOROVOD_WITH_MPI=1 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS="-j$(nproc)" \
    "$PYTHON" -m pip install --quiet --no-build-isolation --no-deps "$SOURCE"
"$PYTHON" -c "import horovod, horovod.torch as hvd; print('horovod', horovod.__version__, 'with MPI:', hvd.mpi_built())"
