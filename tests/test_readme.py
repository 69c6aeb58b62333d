"""The README's Python examples run as written, on the rank count each needs.

Every ```python block of README.md and jobs/README.md must have an entry in EXAMPLES (keyed by its
first line): the ranks it needs and the few names it takes from the text around it (``x``, a
model...). A block added without an entry fails here, so that no snippet goes untried; a changed
API or a snippet that cannot run on its own rank count fails CI.
"""
import os
import re
import sys
from pathlib import Path

import pytest

from mpiallreduce.launch import run

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
