"""Fault injection under mpiexec (4 ranks), each run bounded in time: what the user sees, how soon.

tests/faults/inject.py injects one fault per run and prints what every rank saw; the training
program is killed into under ULFM. Each scenario runs for the ring, recursive doubling and `mpi`;
the three slowest for one of the two hand-written ones and `mpi`.
"""

import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpiallreduce.tools.launch import FAULT_TOLERANT_FLAGS, run

ROOT = Path(__file__).resolve().parent.parent
INJECT = ROOT / "tests" / "faults" / "inject.py"
RANKS = 4
LATE = RANKS - 2  # the misbehaving rank (inject.py's LATE)
TIMEOUT = 1.5  # inject.py's allreduce timeout
MARGIN = 1.5  # seconds allowed beyond a timeout, on a shared 2-core machine running 4 ranks
LAUNCH_TIMEOUT = 90
# (the id "mpi" would be taken by pytest-mpi for its marker, and the test skipped without
# --with-mpi)
ALGORITHMS = ["ring", "recursive_doubling", pytest.param("mpi", id="MPI_Allreduce")]
# The slowest scenarios (they sleep or train on purpose) run for one hand-written algorithm and
# MPI's, the two kinds of wait a fault can meet; the hand-written one alternates between them.
RING_AND_MPI = ["ring", pytest.param("mpi", id="MPI_Allreduce")]
RECURSIVE_DOUBLING_AND_MPI = ["recursive_doubling", pytest.param("mpi", id="MPI_Allreduce")]


def inject(scenario, algorithm, extra_flags=()):
    return run(
        RANKS,
        [sys.executable, str(INJECT), scenario, algorithm],
        timeout=LAUNCH_TIMEOUT,
        extra_flags=extra_flags,
        cwd=ROOT,
    )


def explain(result):
    return (
        f"{' '.join(map(str, result.argv))}\n"
        f"return code {result.returncode} after {result.seconds:.1f} s\n"
        f"{result.output[-12000:]}"
    )


def results(output):
    """[{'rank': '0', 'call': '1', ...}] from the RESULT lines."""
    return [
        dict(field.split("=", 1) for field in line.split()[1:])
        for line in output.splitlines()
        if line.startswith("RESULT ")
    ]


def inject_and_succeed(scenario, algorithm):
    """(the run, its RESULT rows) of a scenario whose program ends normally on every rank."""
    result = inject(scenario, algorithm)
    assert result.returncode == 0, explain(result)
    return result, results(result.output)


def by_rank(rows, **match):
    return {int(r["rank"]): r for r in rows if all(r.get(k) == v for k, v in match.items())}


@pytest.mark.parametrize(
    "algorithm", ["ring"]
)  # (MPI_Allreduce's: tests/test_trace.py, 3 ranks, two layouts)
def test_a_rank_that_sleeps_past_the_timeout_is_named_by_every_other_rank(algorithm):
    result, rows = inject_and_succeed("sleep_past_timeout", algorithm)
    timed = by_rank(rows, call="1")
    assert len(timed) == RANKS, explain(result)
    for rank, row in timed.items():
        assert row["outcome"] == "AllreduceTimeout", explain(result)
        if rank != LATE:
            assert row["missing"] == str(LATE) and row["sequence"] == "2", explain(result)
            assert TIMEOUT - 0.05 <= float(row["seconds"]) <= TIMEOUT + MARGIN, explain(result)
    assert f"rank {LATE} had not arrived at it (sequence number 2)" in result.output, explain(
        result
    )
    assert "gave up waiting for it" in result.output, explain(result)  # what the late rank is told
    after = by_rank(rows, call="2")
    assert (
        all(r["outcome"] == "ok" and r["right"] == "True" for r in after.values())
        and len(after) == RANKS
    ), explain(result)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_straggler_within_the_timeout_gives_the_right_answer_and_at_most_a_warning(algorithm):
    result, rows = inject_and_succeed("sleep_less_than_timeout", algorithm)
    call = by_rank(rows, call="1")
    assert len(call) == RANKS and all(
        r["outcome"] == "ok" and r["right"] == "True" for r in call.values()
    ), explain(result)
    warned = by_rank([r for r in rows if "warnings" in r])
    for (
        rank,
        row,
    ) in warned.items():  # the warning comes at half the timeout; the late rank waits for no one
        if rank != LATE:
            assert row["warnings"] == "1" and row["warned_of"] == str(LATE), explain(result)


@pytest.mark.parametrize("algorithm", RECURSIVE_DOUBLING_AND_MPI)
def test_a_rank_that_skips_a_call_is_named(algorithm):
    # In a loop (same line, same shapes) the calls pair up one off; the last call finds the rank
    # missing.
    result, rows = inject_and_succeed("skip_a_call", algorithm)
    last = by_rank(rows, call="2")
    waiting = {rank: row for rank, row in last.items() if rank != LATE}
    assert len(waiting) == RANKS - 1, explain(result)
    assert all(
        r["outcome"] == "AllreduceTimeout" and r["missing"] == str(LATE) and r["sequence"] == "3"
        for r in waiting.values()
    ), explain(result)
    # From another line, check=True names the call sites on every rank, the skipper included.
    result, rows = inject_and_succeed("skip_a_call_checked", algorithm)
    outcomes = by_rank(rows)
    assert len(outcomes) == RANKS and all(
        r["outcome"] == "ValueError" for r in outcomes.values()
    ), explain(result)
    assert (
        len(
            re.findall(
                r"call_site differs: 'inject.py:\d+' on ranks 0, 1, 3; "
                rf"'inject.py:\d+' on rank {LATE}",
                result.output,
            )
        )
        == RANKS
    ), explain(result)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_calls_with_another_length_dtype_or_op_raise_everywhere_and_the_next_call_works(algorithm):
    result, rows = inject_and_succeed("mismatch", algorithm)
    for what, text in [
        ("length", f"shape differs: (100003,) on ranks 0, 1, 3; (100002,) on rank {LATE}"),
        ("dtype", f"dtype differs: 'float64' on ranks 0, 1, 3; 'float32' on rank {LATE}"),
        ("op", f"op differs: 'sum' on ranks 0, 1, 3; 'max' on rank {LATE}"),
    ]:
        outcomes = by_rank([r for r in rows if "outcome" in r], mismatch=what)
        after = by_rank([r for r in rows if "after" in r], mismatch=what)
        assert len(outcomes) == RANKS and all(
            r["outcome"] == "ValueError" for r in outcomes.values()
        ), explain(result)
        assert result.output.count(text) == RANKS, explain(result)
        assert len(after) == RANKS and all(r["after"] == "ok" for r in after.values()), explain(
            result
        )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_rank_that_raises_ends_the_job_promptly_with_its_traceback(algorithm):
    result = inject("raise_on_one_rank", algorithm)
    assert not result.timed_out and result.returncode != 0, explain(result)
    assert f"[rank {LATE}] RuntimeError: injected failure on rank {LATE}" in result.output, explain(
        result
    )
    assert f"uncaught RuntimeError on rank {LATE}; aborting the MPI job" in result.output, explain(
        result
    )
    assert "not aborted" not in result.output, explain(result)
    assert result.seconds < 30, explain(result)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_without_ulfm_a_killed_rank_ends_the_job_with_an_error_naming_it(algorithm):
    result = inject("killed", algorithm)
    assert not result.timed_out and result.returncode != 0, explain(result)
    assert re.search(
        rf"process rank {LATE} with PID \d+ on node \S+ exited on\s+signal 9", result.output
    ), explain(result)
    assert "not ended" not in result.output, explain(result)
    assert result.seconds < 30, explain(result)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_under_ulfm_a_killed_rank_is_named_by_every_survivor_who_then_reduce_among_themselves(
    algorithm,
):
    assert_survivors_named_the_lost_rank_and_went_on(
        inject("killed_under_ulfm", algorithm, extra_flags=FAULT_TOLERANT_FLAGS)
    )


def assert_survivors_named_the_lost_rank_and_went_on(result):
    """Every survivor raised RankFailure promptly (the lost rank named where it was seen), then
    reduced right on the survivors' communicator."""
    assert not result.timed_out, explain(result)
    rows = results(result.output)
    failed = by_rank([r for r in rows if "outcome" in r])
    after = by_rank([r for r in rows if "survivors" in r])
    survivors = set(range(RANKS)) - {LATE}
    assert set(failed) == survivors and all(
        r["outcome"] == "RankFailure" for r in failed.values()
    ), explain(result)
    assert any(r["failed"] == str(LATE) for r in failed.values()), explain(
        result
    )  # known dead where seen
    assert all(float(r["seconds"]) < 10 for r in failed.values()), explain(result)
    assert set(after) == survivors and all(
        r["survivors"] == "3" and r["right"] == "True" for r in after.values()
    ), explain(result)


@pytest.mark.parametrize(
    "scenario",
    [
        "killed_before_a_timed_call_under_ulfm",
        "killed_before_a_prepare_under_ulfm",
        "killed_before_a_first_call_under_ulfm",
        "killed_before_a_first_timed_call_under_ulfm",
    ],
)
def test_under_ulfm_a_rank_killed_before_a_call_or_its_set_up_is_a_rank_failure_not_a_bare_mpi_error(  # noqa: E501
    scenario,
):
    """Timeouts and lost ranks compose: the rendezvous meets the dead rank and every survivor
    raises RankFailure (as without a timeout), then reduces on the survivors. So does the
    allgather that agrees on a prepared call (before, a bare MPI_ERR_PROC_FAILED: seen in the soak),
    and the set-up of a communicator's first call."""
    assert_survivors_named_the_lost_rank_and_went_on(
        inject(scenario, "ring", extra_flags=FAULT_TOLERANT_FLAGS)
    )


@pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0,
    reason="emulated nodes need root and unshare",
)
def test_under_ulfm_peers_that_die_inside_mpi_allreduce_never_leave_a_survivor_a_wrong_sum():
    """2 emulated nodes x 2 ranks, timed 64-byte MPI_Allreduce calls in a row, two ranks ending
    inside one (tests/faults/inject.py): each survivor's calls were all right until RankFailure.
    With Open MPI's coll/han, which mpiallreduce launch --fault-tolerant now excludes, survivors
    got MPI_SUCCESS and a result never written in about half the runs; so five runs."""
    for _ in range(5):
        result = run(
            RANKS,
            [sys.executable, str(INJECT), "peers_die_mid_call", "mpi"],
            timeout=LAUNCH_TIMEOUT,
            extra_flags=FAULT_TOLERANT_FLAGS,
            cwd=ROOT,
            nodes=2,
        )
        rows = by_rank(results(result.output))
        # (ranks 0 and 3 end on a timer: one of them may see the other's end first, and report too)
        assert {1, 2} <= set(rows) and all(
            r["outcome"] in ("RankFailure", "AllreduceTimeout")
            and r["wrong"] == "0"
            and int(r["right"]) > 10
            for r in rows.values()
        ), explain(result)


@pytest.mark.parametrize("algorithm", RING_AND_MPI)
def test_under_ulfm_training_goes_on_with_the_survivors_when_a_rank_is_killed(algorithm, tmp_path):
    """Kill one of 4 ranks mid-run: the 3 survivors finish, replicas bitwise identical after every
    step (--check-replicas), and the final parameters are those of a run that had 3 ranks from the
    failed step on."""
    params = tmp_path / "params.npz"
    script = tmp_path / "train_and_die.py"
    script.write_text(
        "import os, signal, sys\n"
        "from mpi4py import MPI\n"
        "import mpiallreduce as mar\n"
        "from mpiallreduce.train import main\n"
        f"if MPI.COMM_WORLD.Get_rank() == {LATE}:  "
        "# killed at its 5th step's wait, whatever the load\n"
        "    wait, waits = mar.GradientSync.wait, []\n"
        "    def wait_then_die(self, *args, **kwargs):\n"
        "        waits.append(1)\n"
        "        if len(waits) == 5:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "        return wait(self, *args, **kwargs)\n"
        "    mar.GradientSync.wait = wait_then_die\n"
        "mar.exit_after_rank_failures(main(sys.argv[1:]))\n"
    )
    started = time.monotonic()
    result = run(
        RANKS,
        [
            sys.executable,
            str(script),
            "--fault-tolerant",
            "--check-replicas",
            "--steps",
            "40",
            "--local-batch",
            "16",
            "--step-seconds",
            "0.05",
            "--algorithm",
            algorithm,
            "--save-params",
            str(params),
        ],
        timeout=LAUNCH_TIMEOUT,
        extra_flags=FAULT_TOLERANT_FLAGS,
        cwd=ROOT,
    )
    assert result.returncode == 0, explain(result)
    failure = re.search(
        rf"rank failure at step (\d+): lost rank\(s\) {LATE} of 4; redoing the step and going on "
        r"with 3 ranks",
        result.output,
    )
    assert failure, explain(result)
    assert re.search(r"step\s+40\s+loss [\d.]+\s+[\d,]+ samples/s\s+\(3 ranks\)", result.output), (
        explain(result)
    )
    assert params.exists(), explain(result)
    assert time.monotonic() - started < LAUNCH_TIMEOUT
    failed_step = int(failure.group(1))
    # The same training, uninterrupted on 4 ranks up to the failed step, then on 3: same parameters.
    reference = tmp_path / "reference.npz"
    checkpoint = tmp_path / "reference-checkpoint.npz"
    common = [
        sys.executable,
        "-m",
        "mpiallreduce.train",
        "--local-batch",
        "16",
        "--algorithm",
        algorithm,
    ]
    first = run(
        RANKS,
        common + ["--steps", str(failed_step - 1), "--checkpoint", str(checkpoint)],
        timeout=LAUNCH_TIMEOUT,
        cwd=ROOT,
    )
    assert first.returncode == 0, explain(first)
    second = run(
        RANKS - 1,
        common
        + [
            "--steps",
            "40",
            "--checkpoint",
            str(checkpoint),
            "--resume",
            "--save-params",
            str(reference),
        ],
        timeout=LAUNCH_TIMEOUT,
        cwd=ROOT,
    )
    assert second.returncode == 0, explain(second)
    with np.load(params) as got, np.load(reference) as want:
        for name in want.files:
            assert np.allclose(got[name], want[name], rtol=1e-12, atol=1e-14), name


def test_the_library_warns_where_ulfm_runs_with_coll_han_across_nodes(monkeypatch):
    """Under ULFM across nodes, with coll/han not excluded (a launch of the user's own), the first
    call's set-up warns (mpiallreduce.faults.ulfm.warn_of_han); excluded or chosen away, on one
    node or without ULFM, it does not."""
    import warnings

    from mpiallreduce.faults.ulfm import warn_of_han

    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "1")
    cases = [
        ("", True, True),
        ("^han", True, False),
        ("^hcoll,han", True, False),
        ("tuned,basic", True, False),
        ("han,tuned", True, True),
        ("", False, False),
    ]
    for selection, spans_nodes, warned in cases:
        monkeypatch.setenv("OMPI_MCA_coll", selection)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_of_han(spans_nodes)
        assert (len(caught) == 1 and "coll ^han" in str(caught[0].message)) == warned, (
            selection,
            spans_nodes,
        )
    monkeypatch.setenv("OMPI_MCA_coll", "")
    monkeypatch.setenv("OMPI_MCA_coll_han_priority", "0")  # (han switched off by its priority)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_of_han(True)
    assert not caught
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "0")
    monkeypatch.delenv("OMPI_MCA_coll_han_priority")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_of_han(True)
    assert not caught


def test_launch_fault_tolerant_keeps_the_users_coll_selection_but_for_han():
    """--fault-tolerant takes coll/han out of the environment's OMPI_MCA_coll, and keeps the rest:
    an exclusion list grows by han, an inclusion list loses it."""
    from mpiallreduce.tools.launch import launch_command

    cases = {
        "": "^han",
        "^hcoll": "^hcoll,han",
        "^hcoll,han": "^hcoll,han",
        "tuned,basic": "tuned,basic",
        "han,tuned,basic": "tuned,basic",
        "han": "^han",
    }
    for selection, wanted in cases.items():
        argv = launch_command(
            2, ["python", "x.py"], environ={"OMPI_MCA_coll": selection}, fault_tolerant=True
        )
        at = [i for i in range(len(argv) - 2) if argv[i] == "--mca" and argv[i + 1] == "coll"]
        assert len(at) == 1 and argv[at[0] + 2] == wanted, (selection, argv)
        assert "--with-ft" in argv


def test_a_dead_ranks_missing_bytes_unpickled_are_a_rank_failure_under_ulfm(monkeypatch):
    """mpi4py's pickled collectives (a mismatch's descriptions, the library's agreements) can get
    success and zeros where a rank died mid-collective (seen at the soak's SIGTERM): under ULFM,
    once the failed rank is known, the UnpicklingError or EOFError is a RankFailure naming it;
    without ULFM, or with no rank known dead, it stays what it is; other errors are never one."""
    import pickle

    from mpiallreduce.faults import RankFailure, ulfm

    class Revoked:  # (a communicator revoked already, of 4 ranks: no MPI call made here)
        def Is_revoked(self):
            return True

        def Get_rank(self):
            return 0

        def Get_size(self):
            return 4

    comm = Revoked()
    monkeypatch.setattr(ulfm, "_lost", lambda comm, others: (2,))
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "1")
    for error in (
        pickle.UnpicklingError("invalid load key, '\\x00'."),
        EOFError("Ran out of input"),
    ):
        failure = ulfm.failure_of(error, comm, 7)
        assert (
            isinstance(failure, RankFailure)
            and failure.failed_ranks == (2,)
            and "#7" in str(failure)
        ), failure
        assert ulfm.caused_by_rank_failure(error, comm)
    assert ulfm.failure_of(ValueError("shape differs"), comm) is None
    monkeypatch.setattr(ulfm, "_lost", lambda comm, others: ())
    assert ulfm.failure_of(pickle.UnpicklingError("x"), comm) is None
    monkeypatch.setattr(ulfm, "_lost", lambda comm, others: (2,))
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "0")
    assert ulfm.failure_of(pickle.UnpicklingError("x"), comm) is None
