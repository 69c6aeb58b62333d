"""The data-parallel training program: same parameters as one process on the whole batch, replicas
identical after every step, checkpoint and resume, and a signal that checkpoints and exits."""

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpiallreduce.tools.launch import run

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 180
TOLERANCE = 1e-12  # float64; p ranks and one process sum the same numbers in another order


def train(nranks, *args):
    result = run(
        nranks,
        [sys.executable, "-m", "mpiallreduce.train", *map(str, args)],
        timeout=TIMEOUT,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.output[-5000:]
    return result


def params(path):
    with np.load(path) as saved:
        return {k: saved[k] for k in saved.files if k != "step"}


def assert_close(a, b, tolerance=TOLERANCE):
    assert a.keys() == b.keys()
    for k in a:
        assert np.max(np.abs(a[k] - b[k])) <= tolerance, (k, np.max(np.abs(a[k] - b[k])))


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_p_ranks_with_batch_b_train_like_one_process_with_batch_pb(framework, tmp_path):
    """numpy's program on 3 ranks, torch's on 2 (torch's import and first optimizer cost about 7 s
    of CPU per process here), each against numpy's program in one process on the whole batch: the
    ranks train as one process does, and the two frameworks' programs agree."""
    if framework == "torch":
        pytest.importorskip("torch")
    common = ["--steps", 15, "--check-replicas"]
    p = 3 if framework == "numpy" else 2
    together = train(
        p,
        "--framework",
        framework,
        *common,
        "--local-batch",
        12 // p,
        "--bucket-bytes",
        600,
        "--save-params",
        tmp_path / "pp.npz",
    )
    train(
        1,
        "--framework",
        "numpy",
        *common,
        "--local-batch",
        12,
        "--save-params",
        tmp_path / "p1.npz",
    )
    assert_close(params(tmp_path / "pp.npz"), params(tmp_path / "p1.npz"))
    assert together.output.count(" samples/s") == 15 and "loss" in together.output


def test_checkpoint_and_resume_continue_exactly(tmp_path):
    checkpoint = tmp_path / "ckpt.npz"
    train(2, "--steps", 8, "--checkpoint", checkpoint, "--checkpoint-every", 4)
    resumed = train(
        2,
        "--steps",
        16,
        "--checkpoint",
        checkpoint,
        "--resume",
        "--save-params",
        tmp_path / "resumed.npz",
    )
    assert "resumed from" in resumed.output and "at step 8" in resumed.output
    assert "step     9 " in resumed.output and "step     8 " not in resumed.output
    train(2, "--steps", 16, "--save-params", tmp_path / "straight.npz")
    assert_close(params(tmp_path / "resumed.npz"), params(tmp_path / "straight.npz"), tolerance=0)


@pytest.mark.parametrize(
    "how", ["SIGUSR1", "SIGTERM", "Ctrl-C"]
)  # (SIGHUP takes SIGTERM's handler: test_launch.py)
def test_a_signal_to_the_launcher_checkpoints_at_the_next_step_and_exits_99_for_requeue(
    how, tmp_path
):
    """The requeue contract (jobs/train.sbatch): ``mpiallreduce launch -n 2 -- python -m
    mpiallreduce.train --checkpoint ...`` told to stop (SIGUSR1 passed on by mpiexec; SIGTERM and
    Ctrl-C, SIGINT to the launcher's process group, reaching the ranks as SIGTERM) checkpoints
    at the next step on every rank and exits 99, and no rank is left."""
    checkpoint = tmp_path / "ckpt.npz"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mpiallreduce",
            "launch",
            "-n",
            "2",
            "--grace",
            "60",
            "--",
            sys.executable,
            "-m",
            "mpiallreduce.train",
            "--steps",
            "100000",
            "--step-seconds",
            "0.05",
            "--checkpoint",
            str(checkpoint),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        seen = ""
        while "step     3 " not in seen and time.monotonic() < deadline:
            seen += launcher.stdout.readline()
        if how == "Ctrl-C":  # (the terminal sends SIGINT to the foreground process group)
            os.killpg(launcher.pid, signal.SIGINT)
        else:
            launcher.send_signal(getattr(signal, how))
        rest, _ = launcher.communicate(timeout=60)
    except BaseException:
        os.killpg(launcher.pid, signal.SIGKILL)
        raise
    output = seen + rest
    assert launcher.returncode == 99, output[-3000:]
    assert "MPI_ABORT was invoked" not in output, output[
        -3000:
    ]  # (the ranks said why: tools/notices.py)
    assert output.count("signal received: checkpoint at step") >= 1, output[-3000:]
    with np.load(checkpoint) as saved:
        assert int(saved["step"]) >= 3
    left = subprocess.run(
        ["pgrep", "-f", str(checkpoint)], capture_output=True, text=True
    ).stdout.split()
    assert not left, f"ranks left after the launcher exited: {left}"
    if how == "SIGUSR1":
        resumed = train(
            2,
            "--steps",
            int(np.load(checkpoint)["step"]) + 2,
            "--checkpoint",
            checkpoint,
            "--resume",
        )
        assert "resumed from" in resumed.output


def test_the_end_to_end_benchmark_compares_every_contender_with_one_process(tmp_path):
    """A small transformer (the MLP runs in the GPU check's dry run) through make bench-train's
    program: a row per contender, and the synchronized ones end where one process on the whole batch
    ends (float32), the unsynchronized one does not."""
    pytest.importorskip("torch")
    import json

    result = run(
        2,
        [
            sys.executable,
            "-m",
            "mpiallreduce.tools.train_bench",
            "--model",
            "transformer",
            "--width",
            "16",
            "--depth",
            "2",
            "--rounds",
            "1",
            "--steps-per-round",
            "3",
            "--bucket-bytes",
            "4096",
            "--output",
            str(tmp_path),
        ],
        timeout=TIMEOUT,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.output[-5000:]
    report = json.loads((tmp_path / "train.json").read_text())
    rows = report["rows"]
    from mpiallreduce.tools.train_bench import horovod_importable

    horovod = (
        ["none-horovod", "horovod"] if horovod_importable() else []
    )  # (make horovod builds it)
    assert list(rows) == [
        "none",
        "mpiallreduce",
        "mpiallreduce-fp16",
        "mpi4py",
        "mpi4py-fused",
        "ddp-gloo",
        "ddp-mpiallreduce",
        *horovod,
    ]
    for name in (
        "mpiallreduce",
        "mpi4py",
        "mpi4py-fused",
        "ddp-gloo",
        "ddp-mpiallreduce",
        *horovod[1:],
    ):
        assert rows[name]["max_abs_difference"] < 1e-6, (name, rows[name])
    if horovod:  # against its own baseline too: Horovod's thread runs from hvd.init() on
        own = max(
            statistics.median(
                a - b
                for a, b in zip(
                    rows["horovod"]["rounds_step_s"],
                    rows["none-horovod"]["rounds_step_s"],
                    strict=True,
                )
            ),
            0.0,
        )
        assert abs(rows["horovod"]["comm_s_vs_own_baseline"] - own) < 1e-12, rows
        assert rows["mpi4py"]["comm_s_vs_own_baseline"] == rows["mpi4py"]["comm_s_per_step"], rows
    else:
        assert "make horovod" in result.output, result.output[-3000:]
    assert rows["mpiallreduce-fp16"]["max_abs_difference"] < 1e-3  # 16 bits on the wire
    assert rows["none"]["max_abs_difference"] > 10 * rows["mpiallreduce"]["max_abs_difference"]
    assert "comm s/epoch" in (tmp_path / "train.txt").read_text()
    assert (
        "transformer 2 layers x 16 wide (28 parameter tensors)"
        in (tmp_path / "train.txt").read_text()
    )
    text = (
        tmp_path / "train.txt"
    ).read_text()  # (one round: too few for an interval, and no verdict either way)
    assert "  mpiallreduce - mpi4py: " in text and "  mpiallreduce - 0.5 x ddp-gloo: " in text, text
    assert (
        "  mpiallreduce - mpi4py-fused: " in text and "  mpi4py-fused - 0.5 x ddp-gloo: " in text
    ), text
    assert text.count("not measured apart") == 5 and rows["mpi4py"]["comm_s_interval"] == [
        None,
        None,
    ], text


def test_a_medians_interval_is_the_order_statistics_tables_give():
    """The distribution-free 95% interval of a median: the k-th and (n+1-k)-th of n ordered values
    (tables of the sign test: n=6: 1st and 6th, n=10: 2nd and 9th, n=25: 8th and 18th, n=50: 18th
    and 33rd)."""
    from mpiallreduce.tools.train_table import median_interval

    for n, (first, last) in {6: (1, 6), 10: (2, 9), 25: (8, 18), 50: (18, 33)}.items():
        values = [(7 * i) % n + 0.5 for i in range(n)]  # (0.5 .. n-0.5, shuffled)
        middle, low, high = median_interval(values)
        assert (low, high) == (first - 0.5, last - 0.5) and middle == n / 2, (n, low, high)
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (
        3.0,
        None,
        None,
    )  # (5 values: no 95% interval)


def test_the_step_trace_splits_every_contenders_step_into_its_phases(tmp_path):
    """benchmarks/train_trace.py (make bench-trace), on a tiny transformer: a row per contender, the
    forced overlap and at-wait variants included, each phase a time, and the phases within the
    step."""
    pytest.importorskip("torch")
    out = tmp_path / "trace.txt"
    result = run(
        2,
        [
            sys.executable,
            "benchmarks/train_trace.py",
            "--model",
            "transformer",
            "--width",
            "16",
            "--depth",
            "1",
            "--steps",
            "2",
            "--output",
            str(out),
        ],
        timeout=TIMEOUT,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.output[-5000:]
    lines = out.read_text().splitlines()
    assert lines[1].split() == ["contender", "forward", "backward", "sync", "optimizer", "step"], (
        lines
    )
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[2:]}
    assert {
        "none",
        "mpiallreduce",
        "mpiallreduce-overlap",
        "mpiallreduce-at-wait",
        "mpi4py",
        "ddp-gloo",
        "ddp-mpiallreduce",
    } <= set(rows), rows
    for name, (forward, backward, sync, optimizer, step) in rows.items():
        assert (
            min(forward, backward, sync, optimizer) >= 0 and forward + backward <= step * 1.5 + 1
        ), (name, rows)
    assert rows["none"][2] < 0.5 and rows["mpi4py"][2] > rows["none"][2], (
        rows
    )  # (none waits for nothing)


def test_reproducible_training_ends_bitwise_equal_whatever_the_bucket_size(tmp_path):
    """3 ranks (on 2, any sum is reproducible already: IEEE addition of two numbers commutes): with
    --reproducible, 600-byte and 25 MiB buckets end with the same bits; without, they do not. The
    ring, whose order of additions for an element depends on where the bucket cuts it (auto may
    pick MPI's own allreduce for both sizes, whose order need not)."""
    ends = {}
    for reproducible in ("", "--reproducible"):
        for bucket_bytes in (600, 25 << 20):
            path = tmp_path / f"p{reproducible}{bucket_bytes}.npz"
            train(
                3,
                "--steps",
                10,
                "--bucket-bytes",
                bucket_bytes,
                "--save-params",
                path,
                "--algorithm",
                "ring",
                *([reproducible] if reproducible else []),
            )
            ends[reproducible, bucket_bytes] = params(path)
    same = {
        flag: all(
            np.array_equal(ends[flag, 600][k], ends[flag, 25 << 20][k]) for k in ends[flag, 600]
        )
        for flag in ("", "--reproducible")
    }
    assert same == {"": False, "--reproducible": True}
    assert_close(
        ends["--reproducible", 600], ends["", 600], tolerance=1e-12
    )  # and the same training


def test_a_script_written_for_horovod_runs_with_one_line_changed():
    """Horovod's PyTorch MNIST example (tests/scripts/horovod_mnist.py: synthetic data, `import
    mpiallreduce.torch as hvd`), with fp16 compression and two backward passes per step: it trains,
    its replicas end identical and its averaged metrics are the ranks' mean (the script checks)."""
    pytest.importorskip("torch")
    result = run(
        2,
        [
            sys.executable,
            "tests/scripts/horovod_mnist.py",
            "--fp16-allreduce",
            "--batches-per-allreduce",
            "2",
        ],
        timeout=TIMEOUT,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.output[-5000:]
    assert "horovod-style mnist: ok, 2 ranks" in result.output, result.output[-5000:]


def test_resume_without_a_checkpoint_is_a_usage_error():
    """Issue 58: ``--resume`` without ``--checkpoint`` started over without a word."""
    done = subprocess.run(
        [sys.executable, "-m", "mpiallreduce.tools.train", "--resume", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--resume needs --checkpoint" in done.stderr, done.stderr
