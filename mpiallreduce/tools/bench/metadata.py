"""What a result file needs to be read later: library, ranks, hosts, date, versions, commit."""

import datetime
import os
import socket
import subprocess

import numpy as np
from mpi4py import MPI

from ... import __version__
from ...core.machine import cpu_set, machine_id
from ...core.mpilib import library_version
from ...core.state import state_of

__all__ = ["machine_load", "run_metadata"]


def _git_commit():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _machine():
    """(this machine, the cores this process may run on): emulated nodes of one machine share the
    machine (mpiallreduce.core.machine), so ranks are counted per machine, not per host name."""
    return machine_id(), len(cpu_set())


def oversubscribed(machines):
    """The first (ranks, cores) of a machine running more ranks than it has cores, else None."""
    for machine in sorted({m for m, _ in machines}):
        ranks = sum(1 for m, _ in machines if m == machine)
        cores = max(c for m, c in machines if m == machine)
        if ranks > cores:
            return ranks, cores
    return None


#: a 1-minute load average above this share of the cores makes the figures noise (issue 58: a run
#: at load 5 to 8 on 2 cores read a scheduler stall as a 170x gain)
BUSY_LOAD_PER_CORE = 0.5


def machine_load(comm):
    """What bench says at its start (rank 0 prints it): the load averages and cores of the
    machines, whether the ranks outnumber the cores, and a warning line for each that makes the
    figures noise. Collective. ({"load_at_start", "cores", "oversubscribed"}, [lines])."""
    machines = comm.allgather(_machine())
    load, cores = list(os.getloadavg()), max(c for _, c in machines)
    crowded = oversubscribed(machines)
    said = {
        "load_at_start": load,
        "cores": cores,
        "oversubscribed": list(crowded) if crowded else None,
    }
    lines = [
        f"# load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 minutes) on {cores} cores"
    ]
    if load[0] > BUSY_LOAD_PER_CORE * cores:
        lines.append(
            f"# warning: the machine is busy (load {load[0]:.1f} on {cores} cores): the times "
            "measure the other work too; rerun when it is quiet"
        )
    if crowded:
        lines.append(
            f"# warning: {crowded[0]} ranks on {crowded[1]} cores take turns on them: the times "
            "measure the scheduler more than the algorithms"
        )
    return said, lines


def run_metadata(comm, args=None):
    """What a result file needs to be read later: library, ranks, host, date, versions, commit."""
    import mpi4py

    hosts = sorted(set(comm.allgather(socket.gethostname())))
    slurm_nodes = sorted({n for n in comm.allgather(os.environ.get("SLURMD_NODENAME")) if n})
    nodes = (
        state_of(comm).make_ready().node_count
    )  # (as the library groups the ranks: mpiallreduce.topology)
    crowded = oversubscribed(comm.allgather(_machine()))
    return {
        "mpi_library": library_version(),
        "mpi_standard": "{:d}.{:d}".format(*MPI.Get_version()),
        "ranks": comm.Get_size(),
        "nodes": nodes,
        "hosts": hosts,
        **({"slurm_nodes": slurm_nodes} if slurm_nodes else {}),
        #: [ranks, cores] of a machine with more ranks than cores: times are not the hardware's
        "oversubscribed": list(crowded) if crowded else None,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mpiallreduce": __version__,
        "git_commit": _git_commit() if comm.Get_rank() == 0 else None,
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "arguments": args,
    }
