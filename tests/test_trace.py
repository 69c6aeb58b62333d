"""The flight recorder and ``mpiallreduce trace``: for each fault we know, injected on one rank
(tests/faults/inject.py's LATE), the dumps the ranks leave and what the analyzer says of them name
that rank and the call where it parted from the others: 3 ranks on one node, and 3 ranks across 2
emulated nodes (2 + 1). Every launch has a timeout."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpiallreduce.tools.launch import FAULT_TOLERANT_FLAGS, launch_environment, run
from mpiallreduce.tools.trace import analyze, load_dumps

ROOT = Path(__file__).resolve().parent.parent
INJECT = ROOT / "tests" / "faults" / "inject.py"
RANKS = 3
LATE = RANKS - 2  # inject.py's misbehaving rank
LAUNCH_TIMEOUT = 90
LAYOUTS = [pytest.param(None, id="one-node"), pytest.param(2, id="two-nodes")]
ON = {"MPIALLREDUCE_TRACE_ENTRIES": "512"}  # (off by default: docs/faults.md says why)


def traced(tmp_path, scenario, nodes, algorithm="mpi", extra_flags=(), env=None):
    """Run ``scenario`` with the dumps going to tmp_path/trace; (the run, the analysis, its
    text)."""
    folder = tmp_path / "trace"
    result = run(
        RANKS,
        [sys.executable, str(INJECT), scenario, algorithm],
        timeout=LAUNCH_TIMEOUT,
        extra_flags=extra_flags,
        cwd=ROOT,
        nodes=nodes,
        env={**os.environ, **ON, "MPIALLREDUCE_TRACE_DIR": str(folder), **(env or {})},
    )
    assert not result.timed_out, result.output[-6000:]
    analysis = analyze(load_dumps(folder))
    return result, analysis, "\n".join(analysis.lines) + "\n--- the run:\n" + result.output[-6000:]


def test_the_recorder_is_off_by_default_and_dumps_nothing(tmp_path):
    code = (
        "import numpy as np, mpiallreduce as mar\n"
        "mar.allreduce(np.ones(4))\n"
        "assert mar.dump_trace() is None\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MPIALLREDUCE_TRACE_ENTRIES"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=launch_environment(env),
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "mpiallreduce-trace").exists()


def test_nothing_is_dumped_without_a_fault_and_a_dump_on_demand_records_every_call(tmp_path):
    code = (
        "import numpy as np, mpiallreduce as mar\n"
        "x = np.ones(1000)\n"
        "for _ in range(5): mar.allreduce(x)\n"
        "p = mar.prepare(x, out=x)\n"
        "p(); p()\n"
        "mar.allreduce_async(np.ones(10)).wait()\n"
        "mar.allreduce(np.ones(10), timeout=30)\n"
        "import os, signal, time; assert not os.path.exists(os.environ['MPIALLREDUCE_TRACE_DIR'])\n"
        "child = os.fork()\n"  # (a worker stopped by its parent: it must not take the rank with it)
        "if child == 0: time.sleep(30); os._exit(0)\n"
        "time.sleep(0.2); os.kill(child, signal.SIGTERM); "
        "assert os.waitpid(child, 0)[1] == signal.SIGTERM\n"
        "time.sleep(0.3)\n"
        "print('DUMPED', mar.dump_trace())\n"
    )
    result = run(
        2,
        [sys.executable, "-c", code],
        timeout=LAUNCH_TIMEOUT,
        cwd=ROOT,
        env={**os.environ, **ON, "MPIALLREDUCE_TRACE_DIR": str(tmp_path / "trace")},
    )
    assert result.returncode == 0, result.output
    dumps = load_dumps(tmp_path / "trace")
    assert [d["rank"] for d in dumps] == [0, 1]
    for dump in dumps:
        calls = [(e["call"], e["kind"], e["state"]) for e in dump["entries"]]
        # 5 plain calls, the prepare (its agreement), 2 runs, the async call, the timed call
        assert [c[0] for c in calls] == list(range(1, 11)), calls
        assert all(state == "done" for _, _, state in calls), calls
        assert [kind for _, kind, _ in calls].count("prepared") == 2, calls
        assert dump["reason"] == "on demand"
        assert all(e["ended"] >= e["started"] for e in dump["entries"])
    analysis = analyze(dumps)
    assert analysis.finding is None and "every rank agrees" in "\n".join(analysis.lines)


@pytest.mark.parametrize("nodes", LAYOUTS)
def test_a_straggler_past_the_timeout_is_named_with_its_call(tmp_path, nodes):
    """What tests/test_faults.py asks of a straggler (there for the ring, 4 ranks), for
    MPI_Allreduce, then what the analyzer says of the dumps."""
    result, analysis, text = traced(tmp_path, "sleep_past_timeout", nodes)
    assert result.returncode == 0, text
    rows = [
        dict(f.split("=", 1) for f in line.split()[1:])
        for line in result.output.splitlines()
        if line.startswith("RESULT ")
    ]
    timed = {int(r["rank"]): r for r in rows if r.get("call") == "1"}
    assert len(timed) == RANKS and all(
        r["outcome"] == "AllreduceTimeout" for r in timed.values()
    ), text
    assert all(
        r["missing"] == str(LATE) and r["sequence"] == "2" and 1.45 <= float(r["seconds"]) <= 3.0
        for rank, r in timed.items()
        if rank != LATE
    ), text
    assert "gave up waiting for it" in result.output, text  # (what the late rank is told)
    after = [r for r in rows if r.get("call") == "2"]
    assert len(after) == RANKS and all(
        r["outcome"] == "ok" and r["right"] == "True" for r in after
    ), text
    finding = analysis.finding
    assert finding is not None, text
    assert (finding.call, finding.ranks) == (2, [LATE]), (
        text
    )  # the second timed call (#1 met everyone)
    assert re.search(rf"ranks concerned: {LATE}$", text, re.M), text
    entry = json.loads((tmp_path / "trace" / f"rank{LATE}.json").read_text())["entries"][-1]
    for key in (
        "call",
        "site",
        "shape",
        "dtype",
        "op",
        "algorithm",
        "bytes",
        "comm",
        "state",
        "started",
        "ended",
    ):
        assert key in entry, (key, entry)  # (what the issue asks each entry to hold)


@pytest.mark.parametrize("nodes", LAYOUTS)
@pytest.mark.parametrize("compared", [True, False], ids=["compared", "below-the-threshold"])
def test_a_mismatched_call_is_named_whether_the_ranks_compared_it_or_not(tmp_path, nodes, compared):
    env = {} if compared else {"MPIALLREDUCE_SIGNATURE_MIN_BYTES": "16M"}
    result, analysis, text = traced(tmp_path, "mismatch_then_dump", nodes, env=env)
    assert result.returncode == 0, text
    finding = analysis.finding
    assert finding is not None and finding.what == "different signatures", text
    assert (finding.call, finding.ranks) == (2, [LATE]), text
    assert "int64" in finding.detail and "float64" in finding.detail, text


@pytest.mark.parametrize("nodes", LAYOUTS)
def test_a_rank_that_raised_is_named_and_the_call_it_never_made(tmp_path, nodes):
    result, analysis, text = traced(tmp_path, "raise_on_one_rank", nodes)
    assert result.returncode != 0, text
    assert analysis.culprits == [LATE], text  # its own dump: the uncaught exception
    if (
        analysis.finding is not None
    ):  # the others' dumps too (their SIGTERM came before the SIGKILL)
        assert (analysis.finding.call, analysis.finding.ranks) == (2, [LATE]), text


@pytest.mark.parametrize("nodes", LAYOUTS)
def test_a_rank_killed_under_ulfm_is_named_by_the_survivors_dumps(tmp_path, nodes):
    result, analysis, text = traced(
        tmp_path, "killed_under_ulfm", nodes, algorithm="ring", extra_flags=FAULT_TOLERANT_FLAGS
    )
    assert result.returncode == 0, text
    assert sorted(d["rank"] for d in analysis.dumps) == [r for r in range(RANKS) if r != LATE], text
    failed_calls = {int(n) for n in re.findall(r"rank \d+ message: .*?call #(\d+)", result.output)}
    finding = analysis.finding
    assert finding is not None and finding.ranks == [LATE], text
    assert {finding.call} == failed_calls or finding.call in failed_calls, text


def stopped_by_sigterm(tmp_path, scenario, nodes, env=()):
    """Run ``scenario`` until every rank has said ``waiting=True``, then send the launcher SIGTERM
    (each rank dumps its recorder); (the analysis, its text with the run's output)."""
    folder = tmp_path / "trace"
    env = launch_environment(
        {**os.environ, **ON, **dict(env), "MPIALLREDUCE_TRACE_DIR": str(folder)}
    )
    argv = [
        sys.executable,
        "-m",
        "mpiallreduce",
        "launch",
        "-n",
        str(RANKS),
        "--grace",
        "20",
        *(["--nodes", str(nodes)] if nodes else []),
        "--",
        sys.executable,
        str(INJECT),
        scenario,
        "mpi",
    ]
    process = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        waiting = 0
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        lines = []
        while waiting < RANKS and time.monotonic() < deadline:
            line = process.stdout.readline()
            lines.append(line)
            waiting += "waiting=True" in line
        time.sleep(1.0)  # (the others are in their next call now)
        process.send_signal(signal.SIGTERM)
        output = "".join(lines) + process.communicate(timeout=LAUNCH_TIMEOUT)[0]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    analysis = analyze(load_dumps(folder))
    return analysis, "\n".join(analysis.lines) + "\n--- the run:\n" + output[-6000:]


@pytest.mark.parametrize("nodes", LAYOUTS)
def test_a_job_stopped_by_sigterm_leaves_every_ranks_dump_and_names_the_rank_that_hung(
    tmp_path, nodes
):
    # (on one node the calls are not compared: MPI_Allreduce on the short path, recorded before it
    # runs)
    unchecked = {} if nodes else {"MPIALLREDUCE_SIGNATURE_MIN_BYTES": "16M"}
    analysis, text = stopped_by_sigterm(tmp_path, "hang_until_stopped", nodes, unchecked)
    assert sorted(d["rank"] for d in analysis.dumps) == list(range(RANKS)), text
    assert {d["reason"] for d in analysis.dumps} == {"SIGTERM"}, text
    assert analysis.finding is not None and (analysis.finding.call, analysis.finding.ranks) == (
        3,
        [LATE],
    ), text


def test_untimed_prepared_calls_that_differ_hang_and_the_recorder_names_them(tmp_path):
    """Issue 54, item 5: two untimed persistent prepared calls (4 and 8 float64s), one run by the
    misbehaving rank where the others run the other. Untimed, prepared calls compare nothing, so
    (as docs/call.md says) the ranks wait for ever in MPI, as with MPI's persistent collectives;
    what tells is the flight recorder: the dumps at SIGTERM name that rank, both shapes and the
    call. (With a timeout the rendezvous raises SignatureMismatch: tests/mpi/test_errors.py.)"""
    analysis, text = stopped_by_sigterm(tmp_path, "prepared_apart_until_stopped", None)
    assert "persistent=2" in text and "right=True" in text, text  # (both persistent, both right)
    assert "outcome=" not in text, text  # (no rank returned from, or raised in, the apart call)
    assert sorted(d["rank"] for d in analysis.dumps) == list(range(RANKS)), text
    finding = analysis.finding
    assert finding is not None and finding.what == "different signatures", text
    assert (finding.call, finding.ranks) == (5, [LATE]), text
    assert "(4,)" in finding.detail and "(8,)" in finding.detail, text
