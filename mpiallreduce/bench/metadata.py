"""What a result file needs to be read later: library, ranks, hosts, date, versions, commit."""
import datetime
import os
import socket
import subprocess

import numpy as np
from mpi4py import MPI

from .. import __version__
from ..mpilib import library_version
from ..state import state_of

__all__ = ["run_metadata"]


def _git_commit():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def run_metadata(comm, args=None):
    """What a result file needs to be read later: library, ranks, host, date, versions, commit."""
    import mpi4py
    hosts = sorted(set(comm.allgather(socket.gethostname())))
    slurm_nodes = sorted({n for n in comm.allgather(os.environ.get("SLURMD_NODENAME")) if n})
    nodes = state_of(comm).make_ready().node_count  # (as the library groups the ranks: mpiallreduce.topology)
    return {
        "mpi_library": library_version(),
        "mpi_standard": "%d.%d" % MPI.Get_version(),
        "ranks": comm.Get_size(),
        "nodes": nodes,
        "hosts": hosts,
        **({"slurm_nodes": slurm_nodes} if slurm_nodes else {}),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mpiallreduce": __version__,
        "git_commit": _git_commit() if comm.Get_rank() == 0 else None,
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "arguments": args,
    }


