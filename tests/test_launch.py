"""The launcher: flags and environment in one place, a timeout that leaves nothing running, and one
rank's exception or failing exit that ends the job (with its status) instead of hanging it."""

import os
import sys
import time

import pytest
from processes import processes_with

from mpiallreduce.tools import launch


def test_command_has_rank_count_and_oversubscribe():
    argv = launch.mpiexec_command(5, ["python", "x.py"])
    assert argv[1:4] == ["-n", "5", "--oversubscribe"] and argv[-2:] == ["python", "x.py"]
    assert os.path.basename(argv[0]) == "mpiexec"


def test_environment_allows_root_only_for_root():
    env = launch.launch_environment({"PATH": "/usr/bin"})
    is_root = os.geteuid() == 0
    assert ("OMPI_ALLOW_RUN_AS_ROOT" in env) == is_root
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(launch.find_mpiexec())


def test_outside_slurm_the_libfabric_btl_is_left_out_unless_the_user_chose():
    assert launch.launch_environment({"PATH": "/usr/bin"})["OMPI_MCA_btl"] == "^ofi"
    assert (
        launch.launch_environment({"PATH": "/usr/bin", "OMPI_MCA_btl": "self,tcp"})["OMPI_MCA_btl"]
        == "self,tcp"
    )
    assert "OMPI_MCA_btl" not in launch.launch_environment(
        {"PATH": "/usr/bin", "SLURM_JOB_ID": "7"}
    )


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


RANK_WAITING_FOR_SIGNALS = """
import os, signal, sys, time
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
def checkpoint(signum, frame):
    open(os.path.join(sys.argv[1], f"{signal.Signals(signum).name}-{rank}"), "w").close()
    sys.exit(0)
for s in (signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(s, checkpoint)
open(os.path.join(sys.argv[1], f"ready-{rank}"), "w").close()
time.sleep(120)
"""


def wait_until(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.parametrize("signame", ["SIGUSR1", "SIGUSR2", "SIGKILL"])
def test_a_signal_to_launch_with_timeout_reaches_the_ranks_and_leaves_no_orphan(tmp_path, signame):
    """`mpiallreduce launch --timeout` stays the parent of mpiexec: it passes USR1 and USR2 on (they
    reach the ranks' handlers: a checkpoint), and if it is killed outright, mpiexec gets its
    parent-death signal. Either way no rank outlives it. (TERM, HUP and Ctrl-C:
    tests/test_training.py, with the training program's checkpoint and exit 99.)"""
    import signal
    import subprocess

    marker = f"mpiallreduce-signal-test-{os.getpid()}-{signame}"
    script = tmp_path / "rank.py"
    script.write_text(RANK_WAITING_FOR_SIGNALS)
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mpiallreduce",
            "launch",
            "-n",
            "2",
            "--timeout",
            "100",
            "--",
            sys.executable,
            str(script),
            str(tmp_path),
            marker,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert wait_until(lambda: all((tmp_path / f"ready-{r}").exists() for r in (0, 1)), 60), (
            "ranks never started"
        )
        launcher.send_signal(getattr(signal, signame))
        launcher.wait(30)
        if signame in ("SIGUSR1", "SIGUSR2"):
            assert all((tmp_path / f"{signame}-{r}").exists() for r in (0, 1)), (
                launcher.stdout.read()
            )
            assert launcher.returncode == 0
        else:
            assert launcher.returncode != 0
        assert wait_until(lambda: not processes_with(marker), 15), (
            f"orphans: {processes_with(marker)}"
        )
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in processes_with(marker):
            os.kill(int(pid), signal.SIGKILL)


def test_sighup_to_the_launcher_takes_sigterms_way():
    """tests/test_training.py sends SIGTERM, Ctrl-C and SIGUSR1 to a launched training job (the
    ranks get SIGTERM, checkpoint, exit 99); SIGHUP (a closed terminal) reaches the same handler:
    the grace starts, and a second signal ends it."""
    import signal
    import subprocess

    from mpiallreduce.tools.ranks import GracefulStop

    stand_in = subprocess.Popen(
        ["sleep", "30"], start_new_session=True
    )  # (an mpiexec without ranks)
    stop = GracefulStop(stand_in, grace=60)
    try:
        assert (
            signal.getsignal(signal.SIGHUP) == stop._stop == signal.getsignal(signal.SIGTERM)
        )  # (else: pytest dies)
        os.kill(os.getpid(), signal.SIGHUP)
        assert (
            wait_until(lambda: stop.signal is not None, 5)
            and stop.signal == "SIGHUP"
            and not stop.expired()
        )
        os.kill(os.getpid(), signal.SIGHUP)
        assert wait_until(stop.expired, 5)
    finally:
        stop.restore()
        stand_in.kill()
    assert signal.getsignal(signal.SIGHUP) != stop._stop


RANK_THAT_RAISES = """
from mpi4py import MPI
import mpiallreduce
if MPI.COMM_WORLD.Get_rank() == 1:
    raise RuntimeError("rank 1 went wrong")
MPI.COMM_WORLD.Barrier()
"""


def test_under_launch_one_ranks_exception_ends_the_job_unless_switched_off(tmp_path):
    import subprocess

    script = tmp_path / "raises.py"
    script.write_text(RANK_THAT_RAISES)
    command = [
        sys.executable,
        "-m",
        "mpiallreduce",
        "launch",
        "-n",
        "2",
        "--timeout",
        "20",
        "--",
        sys.executable,
        str(script),
    ]
    started = time.monotonic()
    ended = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert ended.returncode not in (0, 124) and time.monotonic() - started < 20, (
        ended.stdout + ended.stderr
    )
    assert "[rank 1] RuntimeError: rank 1 went wrong" in ended.stdout + ended.stderr
    assert_no_abort_notice(ended.stdout + ended.stderr)
    shown = subprocess.run(
        command[:4] + ["--mpi-notices"] + command[4:], capture_output=True, text=True, timeout=60
    )
    assert "MPI_ABORT was invoked on rank 1" in shown.stderr, shown.stdout + shown.stderr
    short_timeout = (
        command[: command.index("--timeout") + 1]
        + ["4"]
        + command[command.index("--timeout") + 2 :]
    )
    switched_off = subprocess.run(
        short_timeout,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, MPIALLREDUCE_ABORT_ON_EXCEPTION="0"),
    )
    assert switched_off.returncode == 124, (
        switched_off.stdout + switched_off.stderr
    )  # the hang it prevents


RANK_THAT_RAISES_BEFORE_MPI = """
import os
import numpy as np
import mpiallreduce as mar
if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
    raise RuntimeError("rank 1 went wrong before any call")
mar.allreduce(np.ones(4))
"""


def test_under_launch_an_exception_before_any_mpi_call_ends_the_job_too(tmp_path):
    """``import mpiallreduce`` does not start MPI, but under the launcher (abort on exception) it
    does: a rank that raised before its first call once left alone, and the job hung in about half
    the runs (Open MPI left the other rank in MPI_Init or its allreduce)."""
    import subprocess

    script = tmp_path / "raises_early.py"
    script.write_text(RANK_THAT_RAISES_BEFORE_MPI)
    for _ in range(3):
        started = time.monotonic()
        ended = subprocess.run(
            [
                sys.executable,
                "-m",
                "mpiallreduce",
                "launch",
                "-n",
                "2",
                "--timeout",
                "20",
                "--",
                sys.executable,
                str(script),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        output = ended.stdout + ended.stderr
        assert ended.returncode not in (0, 124) and time.monotonic() - started < 20, output
        assert "[rank 1] RuntimeError: rank 1 went wrong before any call" in output, output


RANK_THAT_EXITS = """
import sys
import numpy as np
from mpi4py import MPI
import mpiallreduce as mar
mar.allreduce(np.ones(4))
# per rank: the status it exits with, "-" to go on to a second allreduce, "caught" to go on after
# a sys.exit(5) it catches
status = sys.argv[1].split(",")[MPI.COMM_WORLD.Get_rank()]
if status == "caught":
    try:
        sys.exit(5)
    except SystemExit:
        pass
elif status != "-":
    sys.exit(int(status))
mar.allreduce(np.ones(4))
"""


def assert_no_abort_notice(output):
    """The ranks said why the job ended: Open MPI's notices about it are left out
    (tools/notices.py)."""
    for phrase in ("MPI_ABORT was invoked", "prterun has exited due to", "-" * 74):
        assert phrase not in output, output


def launch_exits(tmp_path, statuses):
    """`mpiallreduce launch -n 2 --timeout 60` of RANK_THAT_EXITS: (its return code, seconds,
    output)."""
    import subprocess

    script = tmp_path / "exits.py"
    script.write_text(RANK_THAT_EXITS)
    started = time.monotonic()
    ended = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpiallreduce",
            "launch",
            "-n",
            "2",
            "--timeout",
            "60",
            "--",
            sys.executable,
            str(script),
            statuses,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return ended.returncode, time.monotonic() - started, ended.stdout + ended.stderr


def test_under_launch_one_ranks_nonzero_exit_ends_the_job_with_its_status(tmp_path):
    """Rank 1 leaves with sys.exit(3) while rank 0 waits for it in an allreduce: not a hang until
    the timeout (rank 1 waiting in MPI_Finalize for rank 0) but the job's end, with status 3."""
    returncode, seconds, output = launch_exits(tmp_path, "-,3")
    assert returncode == 3 and seconds < 20, (returncode, seconds, output)
    assert "[rank 1] mpiallreduce: rank 1 exits with status 3" in output, output
    assert_no_abort_notice(output)


@pytest.mark.parametrize(
    "statuses, expected",
    [("99,99", 99), ("0,0", 0), ("caught,caught", 0)],
    ids=["every-rank-exits-99", "every-rank-exits-0", "a-caught-exit-is-no-exit"],
)
def test_under_launch_exits_that_end_every_rank_keep_their_status(tmp_path, statuses, expected):
    """99 (the training program's "checkpoint written, requeue me") still comes out as 99, and
    sys.exit(0), or a nonzero sys.exit that the program catches and goes on from, ends normally."""
    returncode, seconds, output = launch_exits(tmp_path, statuses)
    assert returncode == expected and seconds < 20, (returncode, seconds, output)
    assert_no_abort_notice(output)


RULE = "-" * 74
ABORT_NOTICE = (
    f"{RULE}\nMPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\n  Errorcode: 99\n"
    f"{RULE}\n"
)
SETPGID = (
    "[vm:21363] plm:ssh: Warning: setpgid(21366,21366) failed in parent with "
    "errno=Permission denied(13)\n"
)
OTHER_NOTICE = (
    f"{RULE}\nThere are not enough slots available in the system to satisfy the 9\n{RULE}\n"
)


def test_notices_are_left_out_only_once_a_rank_said_why_and_others_stay():
    from mpiallreduce.tools.notices import filter_text

    said = (
        "[rank 1] mpiallreduce: rank 1 exits with status 99; aborting the MPI job with it in 3 s\n"
    )
    assert filter_text(said + ABORT_NOTICE + "after\n") == said + "after\n"
    assert (
        filter_text(ABORT_NOTICE) == ABORT_NOTICE
    )  # (nobody said why: the notice is all there is)
    # (the notice came through PRRTE before the rank's own line: CI saw it once)
    assert filter_text(ABORT_NOTICE + "before\n" + said) == "before\n" + said
    assert filter_text(ABORT_NOTICE + "before\n") == "before\n" + ABORT_NOTICE  # (held to the end)
    other_rank = said.replace("rank 1", "rank 0")  # (rank 0's line does not explain rank 1's abort)
    assert filter_text(ABORT_NOTICE + other_rank) == other_rank + ABORT_NOTICE
    assert filter_text(other_rank + ABORT_NOTICE + said) == other_rank + said
    table = (
        RULE + "\n" + "".join(f"row {i}\n" for i in range(60))
    )  # (a rank's own dashes between them)
    assert filter_text(ABORT_NOTICE + table + said) == table + said
    assert filter_text(said + OTHER_NOTICE) == said + OTHER_NOTICE
    assert filter_text("a\n" + SETPGID + "b\n") == "a\nb\n"
    assert (
        filter_text(said + ABORT_NOTICE + SETPGID, show_all=True) == said + ABORT_NOTICE + SETPGID
    )
    unfinished = RULE + "\n" + "".join(f"line {i}\n" for i in range(60))  # (dashes, then no notice)
    assert filter_text(unfinished) == unfinished


def test_the_output_pump_writes_partial_lines_at_once_and_filters_whole_ones():
    """A prompt without its newline goes out before the rest of its line comes; whole lines are
    filtered."""
    import io
    import threading

    from mpiallreduce.tools.notices import NoticeFilter, pump

    read_end, write_end = os.pipe()
    written = []
    wrote = threading.Event()

    class Destination(io.BytesIO):
        def flush(self):
            written.append(self.getvalue().decode(errors="replace"))
            wrote.set()

    destination = Destination()
    thread = pump(os.fdopen(read_end, "rb"), destination, NoticeFilter())
    os.write(write_end, b"password? ")
    assert wrote.wait(10) and written[-1] == "password? "
    os.write(write_end, b"secret\n" + SETPGID.encode() + b"[rank 0] done\n")
    os.write(
        write_end, RULE.encode() + b"\nstep 1\n"
    )  # (a rank's own dashes: held while they may be a notice)
    time.sleep(1.0)
    assert written[-1].endswith(
        "[rank 0] done\n" + RULE + "\nstep 1\n"
    )  # (then let go in the quiet)
    raw = (
        b"\xff\xfe not UTF-8, " + "é".encode() * 40000 + b"\n"
    )  # (and a character split between reads)
    os.write(write_end, raw[:7] + raw[7:8])
    os.write(write_end, raw[8:])
    os.close(write_end)
    thread.join(10)
    assert destination.getvalue().endswith(raw)


def test_a_held_abort_notice_goes_out_after_hold_seconds_while_the_output_stays_open(monkeypatch):
    """A rank's orphaned child may keep the output open long after the job's end: a notice that
    no rank's line explained goes out after HOLD_SECONDS, not when the output ends."""
    import io
    import threading

    from mpiallreduce.tools import notices

    monkeypatch.setattr(notices, "HOLD_SECONDS", 0.5)
    read_end, write_end = os.pipe()
    wrote = threading.Event()

    class Destination(io.BytesIO):
        def flush(self):
            if b"MPI_ABORT" in self.getvalue():
                wrote.set()

    destination = Destination()
    thread = notices.pump(os.fdopen(read_end, "rb"), destination, notices.NoticeFilter())
    os.write(write_end, ABORT_NOTICE.encode() + b"[rank 0] still here\n")
    started = time.monotonic()
    assert wrote.wait(10) and 0.4 < time.monotonic() - started < 5
    assert destination.getvalue().decode() == "[rank 0] still here\n" + ABORT_NOTICE
    os.close(write_end)
    thread.join(10)


def test_a_closed_reader_of_the_output_is_told_once_and_the_rest_is_read():
    """`mpiallreduce launch ... | head -1`: the launcher passes SIGPIPE on (on_broken), keeps
    reading."""
    from mpiallreduce.tools.notices import pump

    read_end, write_end = os.pipe()
    told = []

    class Closed:
        def write(self, data):
            raise BrokenPipeError

        def flush(self):
            pass

    thread = pump(os.fdopen(read_end, "rb"), Closed(), on_broken=lambda: told.append(1))
    for _ in range(100):
        os.write(write_end, b"x" * 10000 + b"\n")  # (more than a pipe holds: nothing blocks)
    os.close(write_end)
    thread.join(10)
    assert not thread.is_alive() and told == [1]


def test_the_abort_banner_reaches_the_processs_stderr_when_sys_stderr_is_a_buffer(
    capfd, monkeypatch
):
    """torch.distributed's excepthook runs the previous hook (ours) with sys.stderr swapped for an
    io.StringIO and prints it once that hook returns: after MPI_Abort, never. Ours writes to the
    process's own stderr then."""
    import io

    from mpiallreduce.faults import aborting

    buffer = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buffer)
    aborting._say(3, "mpiallreduce: uncaught ValueError on rank 3\nTraceback")
    monkeypatch.undo()
    assert buffer.getvalue() == ""
    assert (
        capfd.readouterr().err
        == "[rank 3] mpiallreduce: uncaught ValueError on rank 3\n[rank 3] Traceback\n"
    )


def test_more_ranks_than_cores_are_said_once():
    """Issue 58: ``launch -n 8`` on 2 cores ran silently. One line says so; as many ranks as cores
    say nothing."""
    import subprocess

    cores = len(os.sched_getaffinity(0))
    launcher = os.path.join(os.path.dirname(sys.executable), "mpiallreduce")
    said = {}
    for nranks in (cores, cores + 1):
        done = subprocess.run(
            [
                launcher,
                "launch",
                "-n",
                str(nranks),
                "--timeout",
                "60",
                "--",
                sys.executable,
                "-c",
                "",
            ],
            capture_output=True,
            text=True,
            timeout=90,
            env=launch.launch_environment(),
        )
        assert done.returncode == 0, done.stdout + done.stderr
        said[nranks] = done.stderr.count("oversubscribed")
    assert said == {cores: 0, cores + 1: 1}, said


def test_a_usage_error_under_launch_is_one_line_once():
    """Issue 58: ``launch -n 2 -- mpiallreduce bench --algorithms rign`` printed the usage block,
    a notice per rank that it ends the job, Open MPI's abort notices, and a NUL byte (PRRTE ends
    its notices with one). Now: the error in one line, once, status 2, nothing else."""
    import subprocess

    launcher = os.path.join(os.path.dirname(sys.executable), "mpiallreduce")
    done = subprocess.run(
        [launcher, "launch", "-n", "2", "--timeout", "60", "--"]
        + [launcher, "bench", "--algorithms", "rign"],
        capture_output=True,
        timeout=90,
        env=launch.launch_environment(),
    )
    assert done.returncode == 2, done
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and "error: --algorithms: unknown algorithm 'rign'" in lines[0], lines
    assert b"\0" not in done.stderr and not done.stdout, done


def test_the_commands_help_has_examples_and_no_markup_nor_the_tests_stand_in():
    """Issue 58: --help showed rST double backticks, the tests' fake-gpu, "..." for launch's
    command, no examples, options without help; a mistyped option got no "did you mean"."""
    import subprocess

    launcher = os.path.join(os.path.dirname(sys.executable), "mpiallreduce")
    for command in ("info", "bench", "launch", "plot", "tune", "report", "model", "trace"):
        shown = subprocess.run(
            [launcher, command, "--help"], capture_output=True, text=True, timeout=60
        ).stdout
        assert "examples:\n  " in shown and "``" not in shown and "fake-gpu" not in shown, (
            command,
            shown,
        )
    bench = subprocess.run(
        [launcher, "bench", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    options = bench.split("\noptions:\n", 1)[1]  # (their help, past the usage block)
    for option in ("--dtype DTYPE", "--op OP", "--mode {both,out-of-place,in-place}"):
        after = options.split(f"  {option}", 1)[1]
        assert after.split("\n  -", 1)[0].strip(), (option, options)
    launch_help = subprocess.run(
        [launcher, "launch", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    assert "-- command [args ...]" in launch_help.split("\n\n")[0], launch_help
    mistyped = subprocess.run(
        [launcher, "launch", "--timout", "3", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--timout: did you mean --timeout?" in mistyped.stderr, mistyped.stderr
