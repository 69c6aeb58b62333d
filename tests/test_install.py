"""README's "Installing without the Makefile": `pip install .` into a fresh virtual environment
gives a working package (numpy, mpi4py and Open MPI from PyPI), the launcher and the extras it
names."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = (
    "import numpy as np, mpiallreduce as mar; print(mar.__file__); print(mar.allreduce(np.ones(4)))"
)


def test_pip_install_dot_into_a_fresh_venv_runs_two_ranks(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {
        key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", str(ROOT)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-3000:]

    # from outside the source tree, so that the installed copy is the one imported
    ran = subprocess.run(
        [
            str(venv / "bin" / "mpiallreduce"),
            "launch",
            "-n",
            "2",
            "--timeout",
            "90",
            "--",
            str(python),
            "-c",
            SCRIPT,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    assert ran.stdout.count("[2. 2. 2. 2.]") == 2, ran.stdout
    assert str(venv) in ran.stdout and str(ROOT / "mpiallreduce") not in ran.stdout

    # the extras the README names, declared (not installed here: CuPy and torch are large)
    requires = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.requires('mpiallreduce'))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    for extra, package in (
        ("cuda12", "cupy-cuda12x"),
        ("cuda13", "cupy-cuda13x"),
        ("torch", "torch"),
        ("bench", "matplotlib"),
        ("fast", "numba"),
    ):
        assert package in requires and f'extra == "{extra}"' in requires, (extra, requires)
