"""Stalls, stragglers and lost ranks: a diagnosis instead of a hang.

- errors.py      the exceptions (AllreduceTimeout, RankFailure, AllreduceStallWarning), call_site
- rendezvous.py  timeouts: the ranks meet before a timed call moves data
- channel.py     the control messages (kind, call number, code) of rendezvous and watch
- watch.py       a rank that fails in the middle of an algorithm ends the call on every rank
- outcome.py     a timed call ends alike on every rank: all return, or all raise
- bounded.py     a timed call's MPI collectives: on a communicator of their own, each wait bounded
- ulfm.py        lost ranks under ULFM: RankFailure, survivors(), exit_after_rank_failures()

Names are loaded on first use, as in the package: importing ``mpiallreduce`` imports
``faults.aborting``, and so this package, and neither may start MPI (rendezvous and ulfm import
mpi4py.MPI, whose import is MPI_Init: a second and more where libfabric is probed).
"""

from .. import lazy_exports
from .errors import (
    AllreduceAborted,
    AllreduceStallWarning,
    AllreduceTimeout,
    RankFailure,
    call_site,
    ranks_phrase,
)

_LAZY = {
    "Rendezvous": ".rendezvous",
    "failure_of": ".ulfm",
    "caused_by_rank_failure": ".ulfm",
    "failed_ranks": ".ulfm",
    "survivors": ".ulfm",
    "exit_after_rank_failures": ".ulfm",
}

__all__ = [
    "AllreduceTimeout",
    "AllreduceAborted",
    "RankFailure",
    "AllreduceStallWarning",
    "call_site",
    "ranks_phrase",
    *_LAZY,
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
