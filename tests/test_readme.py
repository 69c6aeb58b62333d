"""The README's examples run as written: Python on the rank count each needs, shell with sizes cut.

Every ```python block of README.md and jobs/README.md must have an entry in EXAMPLES (keyed by its
first line): the ranks it needs and the few names it takes from the text around it (``x``, a
model...). A block added without an entry fails here, so that no snippet goes untried; a changed
API or a snippet that cannot run on its own rank count fails CI.

Every ```sh block runs line by line in one folder, in order (so later lines read what earlier
ones wrote), with `bench` and `tune` cut to two sizes (64 B, 4 KiB) and two repetitions. Not run here: `make`
(CI runs it), `pip` (it would reinstall), the GPU check (tests/test_device_check.py runs its dry
run), and what needs a cluster (`srun`, `sbatch`, `launch` without -n, which is for inside an
allocation). Plain `mpiexec` runs as written, its 4 ranks allowed onto this 2-core machine by
PRRTE's oversubscribe policy in the environment (a cluster node has the slots).
"""
import os
import re
import sys
from pathlib import Path

import pytest

from mpiallreduce.tools.launch import run

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120

COMMON = """
import numpy as np
import mpiallreduce as mar
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
x = np.arange(1000, dtype=np.float32) * (rank + 1)
g = np.ones(1000, dtype=np.float32) * rank
"""

#: first line of the block -> (ranks, what the block takes from the text around it, module it needs)
EXAMPLES = {
    "import numpy as np": (2, "", None),
    "import cupy as cp, mpiallreduce as mar": (2, "", "cupy"),
    "h = mar.allreduce_async(x, op=\"mean\")": (2, COMMON + """
import torch
grads = [np.full(n, rank, np.float32) for n in (10, 300, 7)]
params = [np.full(5, rank, np.float64), np.zeros(3)]
model = torch.nn.Linear(3, 2)
""", "torch"),
    "mar.allreduce(x, timeout=60)": (2, COMMON + "comm = MPI.COMM_WORLD\nstatus = 0\n", None),
    "mesh = mar.Mesh((2, 3), (\"data\", \"model\"))": (6, COMMON, None),
    "y = mar.allreduce(x, reproducible=True)": (2, COMMON + "named = {'g': np.ones(4)}\n", None),
}


def python_blocks():
    for path in (ROOT / "README.md", ROOT / "jobs" / "README.md"):
        for block in re.findall(r"^```python\n(.*?)^```", path.read_text(), re.M | re.S):
            yield f"{path.relative_to(ROOT)}: {block.splitlines()[0][:40]}", block


BLOCKS = list(python_blocks())


@pytest.mark.parametrize("block", [b for _, b in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_readme_python_example_runs_as_written(block, tmp_path):
    first = block.splitlines()[0]
    entry = next((value for key, value in EXAMPLES.items() if first.startswith(key)), None)
    assert entry is not None, f"a README example without an entry in tests/test_readme.py EXAMPLES: {first!r}"
    ranks, preamble, needs = entry
    if needs:
        module = pytest.importorskip(needs)
        if needs == "cupy":
            try:
                module.cuda.runtime.getDeviceCount()
            except Exception as e:  # (no driver, no device)
                pytest.skip(f"no GPU: {e}")
    script = tmp_path / "example.py"
    script.write_text(preamble + block)
    result = run(ranks, [sys.executable, str(script)], timeout=TIMEOUT, cwd=tmp_path,
                 env=dict(os.environ, MPIALLREDUCE_ABORT_ON_EXCEPTION="1"))
    assert result.returncode == 0, f"{preamble + block}\n---\n{result.output[-4000:]}"


NOT_RUN_HERE = ("make ", "python -m pip", "srun ", "sbatch ", "benchmarks/gpu/", "OUT=")
MY_SCRIPT = "import numpy as np, mpiallreduce as mar\nprint(mar.allreduce(np.ones(4)))\n"


def shell_blocks():
    for path in (ROOT / "README.md", ROOT / "jobs" / "README.md"):
        for block in re.findall(r"^```sh\n(.*?)^```", path.read_text(), re.M | re.S):
            lines = [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
            yield f"{path.relative_to(ROOT)}: {lines[0][:40]}", [line for line in lines if line]


def cut_down(line):
    """The command to run here: None if it is not for this machine; bench and tune made short."""
    if line.startswith(NOT_RUN_HERE) or (line.startswith("mpiallreduce launch") and " -n " not in line):
        return None
    if re.search(r"mpiallreduce (bench|tune)\b", line):
        line = re.sub(r"--sizes \S+", "", line) + " --sizes 64,4K --repetitions 2"
        if "mpiallreduce bench" in line and "--openmpi-forced" not in line:
            line += " --openmpi-forced 4"
    return line


SHELL_BLOCKS = list(shell_blocks())


@pytest.mark.parametrize("lines", [b for _, b in SHELL_BLOCKS], ids=[name for name, _ in SHELL_BLOCKS])
def test_readme_shell_example_runs_with_sizes_cut_down(lines, tmp_path):
    import subprocess
    from mpiallreduce.tools.launch import launch_environment
    (tmp_path / "my_script.py").write_text(MY_SCRIPT)
    env = launch_environment(dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
                                  PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe"))
    commands = [c for c in map(cut_down, lines) if c]
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
        assert done.returncode == 0, f"{command}\n---\n{(done.stdout + done.stderr)[-4000:]}"
