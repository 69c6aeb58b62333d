"""A real Slurm of several nodes on this one host for the tests of jobs/: Debian's slurmctld and one
slurmd per node (``slurmd -N n1``...), configured in a temporary folder, started and stopped by the
test suite (tests/test_slurm_jobs.py). The nodes share the host and its cores; each slurmd runs in
a UTS namespace named after its node (so its tasks see that host name, as on a cluster), with its
own port, spool, log and TmpFS (without a TmpFS of its own, the second node's PMIx step fails:
``Cannot create directory "/tmp/spmix_appdir_..."``). ``srun --mpi=pmix`` spreads a job's tasks
over them, and Slurm's variables (SLURMD_NODENAME, SLURM_JOB_NODELIST) name the nodes.

Debian's packages are installed by `make test` where it runs as root (see the Makefile); elsewhere,
without them, the Slurm tests are skipped with the reason.
"""

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

NEEDED = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "srun", "sacct", "unshare")
START_SECONDS = 60

CONFIG = """\
ClusterName=mpiallreduce
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
AuthType=auth/none
CredType=cred/none
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
TmpFS={dir}/tmp-%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
{node_lines}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def missing_programs():
    return [p for p in NEEDED if shutil.which(p) is None]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """slurmctld + one slurmd per node (n1, n2...) on this host; ``env`` points Slurm's commands at
    it."""

    def __init__(self, directory, cpus=8, nodes=2):
        self.dir = Path(directory)
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        for sub in ["state"] + [
            f"{kind}-{node}" for node in self.nodes for kind in ("spool", "tmp")
        ]:
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        node_lines = "\n".join(
            f"NodeName={node} NodeHostname={node} NodeAddr=127.0.0.1 Port={_free_port()} "
            f"CPUs={cpus} State=UNKNOWN"
            for node in self.nodes
        )
        self.conf = self.dir / "slurm.conf"
        self.conf.write_text(
            CONFIG.format(
                host=self.host,
                ctld_port=_free_port(),
                dir=self.dir,
                node_lines=node_lines,
                node_names=",".join(self.nodes),
            )
        )
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for key in [
            k
            for k in self.env
            if k.startswith(("SLURM_", "OMPI_", "PMIX_", "PRTE_")) and k != "SLURM_CONF"
        ]:
            del self.env[key]
        self.daemons = []

    def start(self):
        daemons = [("slurmctld", ["slurmctld", "-D", "-i"])]
        # each slurmd in a UTS namespace of its own, named after its node (as mpiallreduce launch
        # --nodes does for mpiexec): its tasks' host name is then Slurm's name for the node, and
        # Open MPI groups the tasks of one node (with the shared host name it saw every task alone)
        daemons += [
            (
                f"slurmd-{node}",
                [
                    "unshare",
                    "--uts",
                    "sh",
                    "-c",
                    f'hostname {node} && exec slurmd -D -f "{self.conf}" -N {node}',
                ],
            )
            for node in self.nodes
        ]
        for name, argv in daemons:
            log = open(self.dir / f"{name}.out", "w")  # noqa: SIM115 (the daemon's output)
            self.daemons.append(
                subprocess.Popen(
                    argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            states = self.command(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()
            if len(states) == len(self.nodes) and all(
                s in ("idle", "mixed", "allocated") for s in states
            ):
                return self
            if any(d.poll() is not None for d in self.daemons):
                break
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"Slurm did not come up: {self.logs()}")

    def command(self, argv, check=True, timeout=60):
        return subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=check
        )

    def submit(self, argv, cwd, env=None):
        """sbatch ... (with ``env`` added to the environment it exports); returns the job id."""
        out = subprocess.run(
            ["sbatch", "--parsable", *argv],
            env=dict(self.env, **(env or {})),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed: {out.stderr}")
        return out.stdout.strip().split(";")[0]

    def job_states(self, job_id):
        """{job or array task id: state} from scontrol (completed jobs stay MinJobAge seconds)."""
        out = self.command(["scontrol", "-o", "show", "job", job_id], check=False).stdout
        states = {}
        for line in out.splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            key = fields.get("JobId", "?")
            if fields.get("ArrayTaskId"):
                key = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}"
            states[key] = (fields.get("JobState"), fields.get("Restarts"), fields.get("ExitCode"))
        return states

    def wait(
        self,
        job_id,
        timeout,
        done=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
    ):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.job_states(job_id)
            if states and all(s[0] in done for s in states.values()):
                return states
            time.sleep(1)
        self.command(["scancel", job_id], check=False)
        raise TimeoutError(
            f"job {job_id} not finished after {timeout} s: {self.job_states(job_id)}\n{self.logs()}"
        )

    def logs(self):
        texts = []
        names = ["slurmctld.log", "slurmctld.out"]
        names += [f"slurmd-{node}.{kind}" for node in self.nodes for kind in ("log", "out")]
        for name in names:
            path = self.dir / name
            if path.exists():
                texts.append(f"--- {name}\n" + path.read_text()[-3000:])
        return "\n".join(texts)

    def stop(self):
        subprocess.run(["scancel", "--user", "root"], env=self.env, capture_output=True, timeout=30)
        for daemon in self.daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, 15)
        for daemon in self.daemons:
            try:
                daemon.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, 9)
                daemon.wait(10)
