#!/bin/bash
# Horovod 0.28.1's own test/parallel/test_torch.py against mpiallreduce.torch: its CPU tests of
# allreduce, broadcast, the optimizer, allgather, alltoall, reducescatter, join, barrier, rank and
# size (cpu_subset.txt, in the file's order), all in one pytest run, with only the import line
# changed (`import horovod.torch as hvd` -> `import mpiallreduce.torch as hvd`).
#
#   tests/horovod_upstream/run.sh TEST_TORCH_PY [RANKS]      (from the repository root; RANKS: 2)
#
# Horovod's sdist does not ship its tests: take the file from its repository at the tag, e.g.
#   git clone --depth 1 --branch v0.28.1 https://github.com/horovod/horovod
#   tests/horovod_upstream/run.sh horovod/test/parallel/test_torch.py 3
# common.py here stands in for Horovod's test/utils/common.py (which needs horovod.runner).
#
# Deselected, as faults of the test, not of the library:
# - test_broadcast_state, test_broadcast_state_options, test_force_allreduce: they build every
#   torch.optim optimizer, and torch 2.13's Muon refuses the models' 1-D parameters;
#   (Horovod itself fails these three here)
# - at 3 ranks and more, test_horovod_allreduce_prescale and test_horovod_reducescatter_prescale:
#   they compare a float16 sum of 3 inputs with threshold 0 to that sum in float32, which float16
#   cannot hold (a float16 result can equal it only where the ranks are a power of two).
set -euo pipefail
source="$(realpath "$1")"
ranks="${2:-2}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
sed 's/^import horovod\.torch as hvd$/import mpiallreduce.torch as hvd/' "$source" > "$work/test_torch.py"
grep -q '^import mpiallreduce.torch as hvd$' "$work/test_torch.py"
cp "$here/common.py" "$work/"
skip="test_broadcast_state test_broadcast_state_options test_force_allreduce"
if [ "$ranks" -ge 3 ]; then
  skip="$skip test_horovod_allreduce_prescale test_horovod_reducescatter_prescale"
fi
ids=()
while read -r name; do
  case " $skip " in *" $name "*) continue ;; esac
  ids+=("test_torch.py::TorchTests::$name")
done < "$here/cpu_subset.txt"
cd "$work"
"$root/.venv/bin/mpiallreduce" launch -n "$ranks" --timeout 900 -- \
  "$root/.venv/bin/python" -m pytest "${ids[@]}" -q --color=no -p no:cacheprovider -rfEs
