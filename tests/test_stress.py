"""Seeded stress test (issue #24, item 6): tests/scripts/stress.py, every kind of entry of the
public API interleaved under random rank skew, on 3 ranks of one node and 2 emulated nodes of 2
ranks.

The seed is MPIALLREDUCE_STRESS_SEED, else drawn from the clock once per session; it is printed,
and every failure message gives it with the command that replays the same operations (the
timings, and so a race, may still differ). MPIALLREDUCE_STRESS_OPS changes the operation count.
"""

import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from mpiallreduce.tools.launch import run

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
SCRIPT = TESTS / "scripts" / "stress.py"
TIMEOUT = (
    240  # seconds per launch (a layout takes 5-40 s on 2 cores); a hang the script misses ends it
)
# seconds without progress on a rank that the script itself reports as a hang, with its stacks
STALL = 45
SEED = int(os.environ.get("MPIALLREDUCE_STRESS_SEED") or time.time_ns() // 1000 % 1_000_000_000)
#: operations per layout: across nodes each costs about 4 times as much (the suite's time:
#: docs/performance.md)
OPS = {
    None: int(os.environ.get("MPIALLREDUCE_STRESS_OPS") or 300),
    2: int(os.environ.get("MPIALLREDUCE_STRESS_OPS") or 150),
}
EMULATED = os.geteuid() == 0 and shutil.which("unshare") is not None

# (ranks, emulated nodes or None): ids as tests/test_emulated_nodes.py names layouts, nodes x ranks
# per node. 3 ranks on one node (an odd count: every algorithm's folding, the shared window with a
# third rank) and 2 nodes x 2 ranks (the paths between nodes); 2 and 4 ranks on one node add no
# entry or path of their own, only time (the suite's: docs/performance.md); replay any layout with
# --seed S.
LAYOUTS = [
    pytest.param(3, None, id="1x3"),
    pytest.param(
        4,
        2,
        id="2x2",
        marks=pytest.mark.skipif(not EMULATED, reason="emulated nodes need root and unshare(1)"),
    ),
]
FINAL = re.compile(r"^stress: seed (\d+), ranks (\d+), (\d+) operations, (\d+) wrong", re.M)


def replay_command(nranks, nodes):
    return (
        f"mpiallreduce launch -n {nranks}{f' --nodes {nodes}' if nodes else ''} "
        f"--timeout {TIMEOUT} -- "
        f"python tests/scripts/stress.py --seed {SEED} --ops {OPS[nodes]}"
    )


def explain(result, nranks, nodes):
    outcome = (
        f"timed out after {result.seconds:.0f} s"
        if result.timed_out
        else f"return code {result.returncode} after {result.seconds:.1f} s"
    )
    return (
        f"stress seed {SEED}, {nranks} ranks{f' on {nodes} nodes' if nodes else ''}: {outcome}\n"
        f"replay: {replay_command(nranks, nodes)}\n{result.output[-12000:]}"
    )


@pytest.mark.parametrize("nranks, nodes", LAYOUTS)
def test_every_entry_interleaved_under_skew_gives_exact_results(nranks, nodes):
    print(f"stress seed {SEED}: {replay_command(nranks, nodes)}")
    result = run(
        nranks,
        [
            sys.executable,
            str(SCRIPT),
            "--seed",
            str(SEED),
            "--ops",
            str(OPS[nodes]),
            "--stall",
            str(STALL),
        ],
        timeout=TIMEOUT,
        cwd=ROOT,
        nodes=nodes,
    )
    message = explain(result, nranks, nodes)
    assert not result.timed_out, message
    assert result.returncode == 0, message
    assert (
        FINAL.findall(result.output) == [(str(SEED), str(nranks), str(OPS[nodes]), "0")] * nranks
    ), message
