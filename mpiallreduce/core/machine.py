r"""Which machine a rank runs on, and how many cores it has to itself.

    rank 0 (cores {0,1})   rank 1 (cores {0,1})      one machine, 2 cores, 2 ranks sharing them:
         \                  /                        each has 2 / 2 = 1 core
          gather (machine id, cores) from every rank
    rank 0 (cores {0})     rank 1 (cores {1})        bound to a core each: 1 / 1 = 1 core each

A machine is its kernel's boot id (emulated nodes of one machine share it, so their ranks count
as the one machine's), else its host name. A rank's cores are its CPU affinity; they are shared
by every rank of its machine whose affinity overlaps it.
"""

import os
import socket

from .gather import gather_from_ranks

__all__ = ["machine_id", "cpu_set", "cores_per_rank", "share_of_cores"]


def machine_id():
    """This machine's kernel boot id (emulated nodes share it), else its host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def cpu_set():
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def cores_per_rank(comm, timeout=None):
    """This rank's share of its cores (collective over ``comm``, bounded by ``timeout``): its CPU
    affinity divided by the ranks of ``comm`` on its machine whose affinity overlaps it (itself
    included). Processes outside ``comm`` are not seen."""
    mine = (machine_id(), cpu_set())
    return share_of_cores(mine, gather_from_ranks(comm, mine, timeout))


def share_of_cores(mine, everyone):
    """``mine`` = (machine, cores) of this rank; ``everyone``: every rank's (itself included)."""
    sharers = sum(1 for machine, cores in everyone if machine == mine[0] and cores & mine[1])
    return len(mine[1]) / max(sharers, 1)
