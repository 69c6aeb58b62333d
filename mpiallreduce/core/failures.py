"""What a failed call raises, the one translation of MPI's errors for every call.

translated(state, n, collective)    a step of call #n before its run: a dead rank found while
                                    agreeing on it or making its buffers becomes RankFailure
raise_failed(error, state, n, ...)  a run that failed: RankFailure for a dead rank (ULFM), a
                                    ValueError for a truncated message, else the error itself
                                    (after telling a watched algorithm's peers)
"""

from mpi4py import MPI

from ..faults.errors import AllreduceAborted, AllreduceTimeout
from ..faults.recorder import finish
from ..faults.ulfm import failure_of
from ..faults.watch import set_up_or_rank_failure
from .consistency import SignatureMismatch

__all__ = ["raise_failed", "translated"]


def translated(state, sequence, collective):
    """``collective()``, a step of call #``sequence`` before its run (faults.watch says what it
    raises)."""
    return set_up_or_rank_failure(state.user, collective, sequence, state.library_communicators())


def raise_failed(error, state, sequence, watch, entry=None):
    """Raise what a call that failed with ``error`` on this rank raises: RankFailure for a dead rank
    (ULFM, on every survivor; faults.ulfm.failure_of says which errors mean one); ValueError for a
    truncated message (the ranks' calls differ in size: a prepared call, or a size the signature
    check was set to skip); else ``error`` itself, after telling the peers of a watched algorithm
    that this rank left it midway (AllreduceAborted is a peer's failure, already known to all; a
    timeout in the algorithm has told them; a signature mismatch is raised on every rank).
    ``entry``: the call's in the flight recorder, marked with it."""
    failure = failure_of(error, state.user, sequence, also_revoke=state.library_communicators())
    if failure is not None:
        finish(entry, failure)
        raise failure from error
    if isinstance(error, MPI.Exception) and error.Get_error_class() == MPI.ERR_TRUNCATE:
        if watch is not None:
            watch.fail()
        truncated = ValueError(
            f"rank {state.rank}: allreduce call #{sequence} received more data than its "
            "buffer holds: the ranks' calls differ in size (a prepared call, or calls below "
            "MPIALLREDUCE_SIGNATURE_MIN_BYTES, are not compared)"
        )
        finish(entry, truncated)
        raise truncated from error
    if watch is not None and not isinstance(
        error, (AllreduceAborted, AllreduceTimeout, SignatureMismatch)
    ):
        watch.fail()
    finish(entry, error)
    raise error
