"""The jobs in jobs/ on a real single-node Slurm that the test suite starts and stops itself."""

import re
import sys
import time
from pathlib import Path

import pytest
from processes import processes_with
from slurm_cluster import SlurmCluster, missing_programs

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "jobs"
JOB_TIMEOUT = 240


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = missing_programs()
    if missing:
        pytest.skip(
            f"no Slurm here (missing {', '.join(missing)}); `make test` as root installs Debian's"
        )
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.env["PYTHON"] = sys.executable
    cluster.start()
    yield cluster
    cluster.stop()


def read(path):
    return path.read_text() if path.exists() else ""


def test_info_job_sees_every_task_through_pmix_and_binds_one_gpu_per_node_local_rank(
    slurm, tmp_path
):
    """Two tasks on one node, started by srun through PMIx: info sees both. With the GPUs Slurm
    leaves visible (here: CUDA_VISIBLE_DEVICES as --gpus-per-node=2 would set it), each task of a
    node takes the GPU of its node-local rank: rank i, visible GPU i."""
    job = slurm.submit(
        ["--nodes=1", "--ntasks=2", f"--chdir={tmp_path}", str(JOBS / "info.sbatch")],
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": "6,7"},
    )
    states = slurm.wait(job, JOB_TIMEOUT)
    output = read(tmp_path / f"mpiallreduce-info-{job}.out")
    assert list(states.values())[0][0] == "COMPLETED", (states, output, slurm.logs())
    assert re.search(r"^ranks\s+2$", output, re.M), output
    assert re.search(r"^launched by\s+srun", output, re.M), output
    assert "SLURM_JOB_ID=" + job in output and "WARNING" not in output, output
    assert re.search(r"^0\s+\S+\s+n\d\s+\d+\s+0 of 2\s+GPU 0 \(device 6\)$", output, re.M), output
    assert re.search(r"^1\s+\S+\s+n\d\s+\d+\s+1 of 2\s+GPU 1 \(device 7\)$", output, re.M), output


def test_info_job_on_two_nodes_names_each_ranks_node(slurm, tmp_path):
    """sbatch -N 2: srun --mpi=pmix starts one task on each Slurm node; info names the nodes."""
    job = slurm.submit(
        [
            "--nodes=2",
            "--ntasks=2",
            "--ntasks-per-node=1",
            f"--chdir={tmp_path}",
            str(JOBS / "info.sbatch"),
        ],
        cwd=tmp_path,
    )
    states = slurm.wait(job, JOB_TIMEOUT)
    output = read(tmp_path / f"mpiallreduce-info-{job}.out")
    assert list(states.values())[0][0] == "COMPLETED", (states, output, slurm.logs())
    assert re.search(r"^ranks\s+2$", output, re.M), output
    assert re.search(r"^0\s+\S+\s+n1\s+\d+\s+0 of 1$", output, re.M), output
    assert re.search(r"^1\s+\S+\s+n2\s+\d+\s+0 of 1$", output, re.M), output


def test_bench_job_array_writes_one_folder_per_rank_count(slurm, tmp_path):
    import json

    job = slurm.submit(
        [f"--chdir={tmp_path}", "--export=ALL,RANK_COUNTS=1 2", str(JOBS / "bench.sbatch")],
        cwd=tmp_path,
        env={
            "BENCH_ARGS": "--sizes 4,4K --repetitions 2 --max-repetitions 2 --openmpi-forced none"
        },
    )
    states = slurm.wait(job, JOB_TIMEOUT)
    outputs = "\n".join(read(p) for p in tmp_path.glob("mpiallreduce-bench-*.out"))
    assert len(states) == 2 and all(s[0] == "COMPLETED" for s in states.values()), (states, outputs)
    for ranks in (1, 2):
        data = json.loads(
            (tmp_path / "results" / f"slurm-{job}" / f"ranks-{ranks}" / "bench.json").read_text()
        )
        assert data["metadata"]["ranks"] == ranks and data["metadata"]["arguments"]["sizes"] == [
            4,
            4096,
        ]
        assert {m["nbytes"] for m in data["measurements"]} == {4, 4096}
        assert all(m["wrong"] == 0 for m in data["measurements"])


def test_bench_job_sweeps_node_counts_skips_what_needs_one_node_and_report_merges_them(
    slurm, tmp_path
):
    """jobs/bench.sbatch with -N 2 as a node sweep: array task 0 runs 1 rank on 1 node, task 1 two
    ranks over the 2 Slurm nodes, where what needs one node is left out, named in the output and the
    JSON, and every result is right. `mpiallreduce report` merges both into one table by nodes."""
    import json
    import subprocess

    job = slurm.submit(
        [
            f"--chdir={tmp_path}",
            "--nodes=2",
            "--ntasks=2",
            "--ntasks-per-node=1",
            "--array=0-1",
            "--export=ALL,NODE_COUNTS=1 2,RANK_COUNTS=1 2",
            str(JOBS / "bench.sbatch"),
        ],
        cwd=tmp_path,
        env={
            "BENCH_ARGS": "--sizes 4K,64K --repetitions 2 --max-repetitions 2 --openmpi-forced none"
        },
    )  # (commas: not in --export)
    states = slurm.wait(job, JOB_TIMEOUT)
    outputs = "\n".join(read(p) for p in tmp_path.glob("mpiallreduce-bench-*.out"))
    assert len(states) == 2 and all(s[0] == "COMPLETED" for s in states.values()), (states, outputs)
    assert (
        "# skipped: shared_memory (needs every rank on one node; these 2 ranks are on 2 nodes"
        in outputs
    ), outputs
    results = tmp_path / "results" / f"slurm-{job}"
    one = json.loads((results / "nodes-1-ranks-1" / "bench.json").read_text())
    two = json.loads((results / "nodes-2-ranks-2" / "bench.json").read_text())
    assert (one["metadata"]["nodes"], one["metadata"]["ranks"]) == (1, 1)
    assert (two["metadata"]["nodes"], two["metadata"]["ranks"]) == (2, 2)
    assert sorted(two["metadata"]["slurm_nodes"]) == ["n1", "n2"]
    assert any(s.startswith("shared_memory") for s in two["metadata"]["skipped"])
    assert {m["algorithm"] for m in two["measurements"]} >= {
        "ring",
        "two_level",
        "hierarchical",
        "auto",
    }
    assert all(m["wrong"] == 0 for m in one["measurements"] + two["measurements"])
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpiallreduce",
            "report",
            str(results),
            "--output",
            str(tmp_path / "report"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert report.returncode == 0, report.stderr
    assert "2 layouts (1 rank on 1 node, 2 ranks on 2 nodes)" in report.stdout, report.stdout
    rows = re.findall(r"^\s+(\d) +(\d) +(\S+) +(\d+) ", report.stdout, re.M)
    assert [(n, p, b) for n, p, _, b in rows] == [
        ("1", "1", "4096"),
        ("1", "1", "65536"),
        ("2", "2", "4096"),
        ("2", "2", "65536"),
    ], report.stdout
    assert (tmp_path / "report" / "scaling.png").read_bytes()[:4] == b"\x89PNG"


#: the training job's steps, 0.05 s each: USR1 comes after step 10, several seconds before the end
TRAIN_STEPS = 120


def test_train_job_on_two_nodes_checkpoints_on_usr1_requeues_and_resumes(slurm, tmp_path):
    """jobs/train.sbatch as a user submits it with -N 2 (one rank on each Slurm node): USR1, the
    checkpoint, the requeue and the resume, across the nodes."""
    job = slurm.submit(
        [
            f"--chdir={tmp_path}",
            "--nodes=2",
            "--ntasks=2",
            "--ntasks-per-node=1",
            f"--export=ALL,TRAIN_ARGS=--steps {TRAIN_STEPS} "
            "--step-seconds 0.05,CHECKPOINT_EVERY=1000",
            str(JOBS / "train.sbatch"),
        ],
        cwd=tmp_path,
    )
    log = tmp_path / f"mpiallreduce-train-{job}.out"
    deadline = time.monotonic() + JOB_TIMEOUT
    while "step    10 " not in read(log):
        assert time.monotonic() < deadline, (read(log), slurm.job_states(job), slurm.logs())
        time.sleep(0.5)
    slurm.command(["scancel", "--signal=USR1", "--batch", job])  # what --signal=B:USR1@120 sends
    while "requeueing job" not in read(log):
        assert time.monotonic() < deadline, (read(log), slurm.job_states(job), slurm.logs())
        time.sleep(0.5)
    # Slurm holds a requeued job back (BeginTime, about two minutes) while the old step winds down;
    # once the old ranks are gone, let it start now
    # (and once their step daemons are gone: a step launched while the old one's slurmstepd wound
    # down failed once, "StepId=N.0 aborted before step completely launched", in a clean-clone make
    # test)
    while (
        slurm.job_states(job).get(job, ("",))[0] != "PENDING"
        or processes_with(f"train-{job}.npz")
        or processes_with(f"slurmstepd: [{job}.")
    ):
        assert time.monotonic() < deadline, slurm.job_states(job)
        time.sleep(0.5)
    time.sleep(2)
    slurm.command(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    states = slurm.wait(job, JOB_TIMEOUT)
    output = read(log)
    state, restarts, exit_code = states[job]
    assert state == "COMPLETED" and restarts == "1", (states, output)
    assert re.search(rf"^job {job} restart 0 on n\[1-2\]$", output, re.M), output
    assert "USR1: asking the ranks for a checkpoint" in output, output
    assert "requeueing job" in output and "restart 1" in output, output
    resumed = re.search(r"resumed from \S+ at step (\d+) \(SLURM_RESTART_COUNT=1\)", output)
    assert resumed, output
    resumed_at = int(resumed.group(1))
    assert resumed_at >= 10
    assert f"step {resumed_at + 1:>5} " in output.split("resumed from")[1], output
    assert f"step {TRAIN_STEPS:>5} " in output, output
    # the same parameters as a run that was never interrupted (same rank count: the same bits)
    import numpy as np

    from mpiallreduce.tools.launch import run

    straight = tmp_path / "straight.npz"
    result = run(
        2,
        [
            sys.executable,
            "-m",
            "mpiallreduce.train",
            "--steps",
            str(TRAIN_STEPS),
            "--save-params",
            str(straight),
        ],
        timeout=JOB_TIMEOUT,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.output[-3000:]
    with (
        np.load(tmp_path / "checkpoints" / f"train-{job}.npz") as interrupted,
        np.load(straight) as reference,
    ):
        assert int(interrupted["step"]) == TRAIN_STEPS
        for name in reference.files:
            assert np.array_equal(interrupted[name], reference[name]), name


def test_a_job_launched_the_wrong_way_fails_with_the_singleton_message(slurm, tmp_path):
    script = (
        f"srun --mpi=pmi2 -n 2 {sys.executable} "
        "-c 'import numpy, mpiallreduce as m; m.allreduce(numpy.ones(1))'"
    )
    job = slurm.submit(
        [
            f"--chdir={tmp_path}",
            "--ntasks=2",
            f"--output={tmp_path}/wrong-%j.out",
            "--wrap",
            script,
        ],
        cwd=tmp_path,
    )
    states = slurm.wait(job, JOB_TIMEOUT)
    output = read(tmp_path / f"wrong-{job}.out")
    assert states[job][0] == "FAILED", (states, output)
    assert "SingletonUnderSlurm: Slurm started 2 tasks in this step" in output, output
