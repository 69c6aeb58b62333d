#!/bin/bash
# The GPU check of mpiallreduce, in one script, for a machine with one NVIDIA GPU, CuPy, 16 cores and
# no network. It finishes within 8 minutes and:
#   1. makes a virtual environment over the system's Python (which has CuPy, numpy, ml_dtypes, pytest,
#      pytest-timeout) and installs the wheels carried in benchmarks/gpu/wheels/ (Open MPI, mpi4py,
#      pytest-mpi; fetch_wheels.sh downloads them where pip has a network);
#   2. runs the real-CuPy and torch-CUDA tests (tests/mpi/test_device.py, test_torch.py) under mpiexec with 2 and 4 ranks
#      sharing the GPU;
#   3. runs `mpiallreduce bench --device gpu` from 1 MiB to 1 GiB with 4 ranks: Open MPI's path for
#      device memory against our staged ring and device-to-device path, busbw as a share of the
#      GPU's device-to-device copy bandwidth measured in the same run.
# Results (logs, bench.json, bench.csv, the table) go to $OUT if set, else results/gpu/.
# Usage: benchmarks/gpu/device_check.sh        (PYTHON=... to pick the interpreter; default python3)
set -u
here=$(cd "$(dirname "$0")" && pwd)
wheels=${WHEELS:-$here/wheels}
root=$(cd "$here/../.." && pwd)
out=${OUT:-$root/results/gpu}
mkdir -p "$out"
cd "$root"
export PYTHONUNBUFFERED=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
venv=/tmp/mpiallreduce-gpu-venv
started=$(date +%s)
say() { echo "[device_check $(( $(date +%s) - started ))s] $*"; }

say "environment"
# The system's python3 may itself be a virtual environment (it is on the GPU machines here): a venv
# made from it sees only the base interpreter's packages, so a .pth file adds its site-packages,
# after the new venv's own (whose Open MPI, mpi4py and pytest-mpi come first).
system_python=${PYTHON:-python3}
system_site=$("$system_python" -c "import site; print(site.getsitepackages()[0])") || exit 1
"$system_python" -m venv --system-site-packages "$venv" || exit 1
venv_site=$("$venv/bin/python" -c "import site; print(site.getsitepackages()[0])") || exit 1
echo "$system_site" > "$venv_site/system-python-packages.pth"
"$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --ignore-installed "$wheels"/*.whl || exit 1
py="$venv/bin/python"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$out/info.txt"
"$py" -c "import cupy, mpi4py, numpy; print('cupy', cupy.__version__, 'mpi4py', mpi4py.__version__, 'numpy', numpy.__version__)" \
    2>&1 | tee -a "$out/info.txt"
timeout 60 "$py" -m mpiallreduce launch -n 1 -- "$py" -m mpiallreduce info 2>&1 | tr -d '\000' | tee -a "$out/info.txt"

status=0
for ranks in 2 4; do
    say "real-CuPy tests, $ranks ranks on one GPU"
    timeout 150 "$py" -m mpiallreduce launch -n "$ranks" -- "$py" tests/mpi_pytest.py tests/mpi/test_device.py tests/mpi/test_torch.py \
        -k "cupy or torch_cuda" -q --color=no -rs --timeout=120 2>&1 | tr -d '\000' > "$out/tests-${ranks}ranks.txt"
    code=${PIPESTATUS[0]}
    tail -5 "$out/tests-${ranks}ranks.txt"
    [ "$code" = 0 ] || { say "tests with $ranks ranks FAILED (exit $code)"; status=1; }
done

say "GPU benchmark, 4 ranks, 1 MiB .. 1 GiB"
timeout 270 "$py" -m mpiallreduce launch -n 4 -- "$py" -m mpiallreduce bench --device gpu \
    --sizes 1M,4M,16M,64M,256M,1G --repetitions 3 --mode out-of-place --output "$out" 2>&1 \
    | tr -d '\000' > "$out/bench-table.txt"
code=${PIPESTATUS[0]}
cat "$out/bench-table.txt"
[ "$code" = 0 ] || { say "benchmark FAILED (exit $code)"; status=1; }
say "done, status $status; results in $out"
exit $status
