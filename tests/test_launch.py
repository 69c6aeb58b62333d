"""The launcher: flags and environment in one place, and a timeout that leaves nothing running."""
import os
import sys
import time

from mpiallreduce import launch
from processes import processes_with


def test_command_has_rank_count_and_oversubscribe():
    argv = launch.mpiexec_command(5, ["python", "x.py"])
    assert argv[1:4] == ["-n", "5", "--oversubscribe"] and argv[-2:] == ["python", "x.py"]
    assert os.path.basename(argv[0]) == "mpiexec"


def test_environment_allows_root_only_for_root():
    env = launch.launch_environment({"PATH": "/usr/bin"})
    is_root = os.geteuid() == 0
    assert ("OMPI_ALLOW_RUN_AS_ROOT" in env) == is_root
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(launch.find_mpiexec())


def test_timeout_kills_every_rank():
    marker = f"mpiallreduce-timeout-test-{os.getpid()}"
    script = f"import time, sys; sys.argv.append('{marker}'); time.sleep(600)"
    started = time.monotonic()
    result = launch.run(2, [sys.executable, "-c", script, marker], timeout=5)
    assert result.timed_out and result.returncode is None
    assert time.monotonic() - started < 30
    time.sleep(0.5)
    survivors = processes_with(marker)
    assert not survivors, f"processes left running after the timeout: {survivors}"
