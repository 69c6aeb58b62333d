"""The processes of one launch, and ending them: the requeue contract of ``mpiallreduce launch``.

    launcher ── mpiexec (prterun) ──┬── rank 0, rank 1, ...             (one node)
                                    └── sh ── prted ── prted ── ranks   (an emulated node: its
                                                                          daemon leaves the session)

The ranks are found as mpiexec's descendants whose parent is a daemon (prterun or prted), through
/proc (Linux; elsewhere none are found and only mpiexec is signalled). ``GracefulStop``: SIGTERM,
SIGINT or SIGHUP to the launcher becomes SIGTERM to every rank (a program that checkpoints on
SIGTERM, ``python -m mpiallreduce.train``, then exits 99, which the launcher returns and Slurm
requeues on); after the grace period, or a second such signal, everything is killed.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time

__all__ = ["rank_pids", "session_members", "kill_group", "GracefulStop", "STOP_SIGNALS"]

#: the launcher's own processes: their children are the ranks
DAEMONS = frozenset({"prterun", "prted", "mpiexec", "orterun", "orted", "mpirun"})
#: what asks the launcher to stop the job (Slurm's scancel and --signal, a plain kill, Ctrl-C, a
#: closed terminal); each becomes SIGTERM to the ranks
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# after a timeout: SIGTERM to the processes, then SIGKILL this long after
KILL_GRACE_SECONDS = 5


def _processes():
    """{pid: (ppid, session, name)} of the live processes (Linux /proc; elsewhere empty)."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                head, tail = stat.read().rsplit(")", 1)
        except (OSError, ValueError):
            continue
        fields = tail.split()  # after the name: state, ppid, pgrp, session, ...
        if len(fields) > 3 and fields[0] != "Z":
            table[int(entry)] = (int(fields[1]), int(fields[3]), head.split("(", 1)[1])
    return table


def _descendants(pid, table):
    children = {}
    for child, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def rank_pids(launcher_pid):
    """The ranks that mpiexec ``launcher_pid`` started: its descendants whose parent is a daemon."""
    table = _processes()
    return [
        pid
        for pid in _descendants(launcher_pid, table)
        if table[pid][2] not in DAEMONS and table.get(table[pid][0], (0, 0, ""))[2] in DAEMONS
    ]


def session_members(session_id):
    """Pids whose session is ``session_id`` (elsewhere than Linux: just the leader). A rank may sit
    in a process group of its own, but it stays in the session mpiexec started."""
    table = _processes()
    return (
        [pid for pid, (_, session, _) in table.items() if session == session_id]
        if table
        else [session_id]
    )


def kill_group(process):
    """Terminate, then kill, mpiexec ``process`` (a Popen leading its own session), every process of
    its session and every descendant (an emulated node's daemon and ranks leave the session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        table = _processes()
        targets = (
            set(session_members(process.pid)) | set(_descendants(process.pid, table))
            if table
            else {process.pid}
        )
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        try:
            process.wait(KILL_GRACE_SECONDS)
            if sig == signal.SIGTERM and not session_members(process.pid):
                return
        except subprocess.TimeoutExpired:
            continue


class GracefulStop:
    """While installed (main thread): a STOP_SIGNALS signal sends SIGTERM to every rank of mpiexec
    ``process`` and gives them ``grace`` seconds (``expired()`` then says so); a second one, or
    SIGTERM again, leaves no grace. Other forwarded signals (SIGUSR1, SIGUSR2) go to mpiexec, which
    passes them on to the ranks."""

    def __init__(self, process, grace, forwarded=(signal.SIGUSR1, signal.SIGUSR2)):
        self.process, self.grace, self.deadline, self.signal = process, grace, None, None
        self.previous = {sig: signal.signal(sig, self._stop) for sig in STOP_SIGNALS}
        self.previous.update({sig: signal.signal(sig, self._forward) for sig in forwarded})

    def _forward(self, signum, _frame):
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signum)

    def _stop(self, signum, _frame):
        now = time.monotonic()
        if self.deadline is not None:  # (asked twice: no more grace)
            self.deadline = now
            return
        self.signal, self.deadline = signal.Signals(signum).name, now + self.grace
        ranks = rank_pids(self.process.pid)
        print(
            f"mpiallreduce launch: {self.signal}: SIGTERM to the {len(ranks)} ranks; they are "
            f"killed in {self.grace:g} s unless they end (a second signal kills them now)",
            file=sys.stderr,
            flush=True,
        )
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def expired(self):
        return self.deadline is not None and time.monotonic() >= self.deadline

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
