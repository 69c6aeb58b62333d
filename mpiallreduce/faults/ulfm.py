"""Lost ranks (ULFM): a dead peer becomes ``RankFailure`` on every survivor, and a way to go on.

Under ``mpiexec --with-ft ulfm`` (``mpiallreduce launch --fault-tolerant``) an MPI call that meets a
dead peer fails with MPI_ERR_PROC_FAILED; the rank that sees it revokes the communicators (the
user's and the library's duplicates, so that every rank blocked on a live peer wakes with
MPI_ERR_REVOKED) and every survivor raises ``RankFailure`` naming the lost ranks.
``survivors(comm)`` then returns the shrunken communicator (``MPI_Comm_shrink``) to carry on with.
Without ULFM, mpiexec (or ``srun --kill-on-bad-exit``) ends the job when a rank dies, naming it.
"""

import contextlib
import os
import pickle
import sys

from mpi4py import MPI

from .coll_han import han_selectable
from .errors import RankFailure, ranks_phrase

__all__ = [
    "failed_ranks",
    "failure_of",
    "caused_by_rank_failure",
    "survivors",
    "exit_after_rank_failures",
    "fault_tolerant",
    "warn_of_han",
]


def _failure_classes():
    return {
        getattr(MPI, name)
        for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
        if hasattr(MPI, name)
    }


def fault_tolerant():
    """Whether this process runs under ULFM (``mpiexec --with-ft ulfm`` sets mpi_ft_enable)."""
    enabled = os.environ.get("OMPI_MCA_mpi_ft_enable", "")  # noqa: SIM112 (Open MPI's own name)
    return enabled.lower() in ("1", "true", "yes", "enabled")


def warn_of_han(spans_nodes):
    """A RuntimeWarning where a communicator across nodes runs under ULFM with Open MPI's coll/han
    selectable (OMPI_MCA_coll, and its priority not 0): when a peer dies inside han's MPI_Allreduce,
    a survivor's call can return success with its result never written (docs/faults.md).
    ``mpiallreduce launch --fault-tolerant`` takes it out (``without_han``)."""
    if spans_nodes and fault_tolerant() and han_selectable(os.environ):
        import warnings

        warnings.warn(
            "under ULFM, Open MPI's coll/han can return MPI_SUCCESS with a result never written "
            "when a peer dies inside its MPI_Allreduce: launch with `--mca coll ^han` "
            "(mpiallreduce launch --fault-tolerant does; docs/faults.md)",
            RuntimeWarning,
            stacklevel=2,
        )


def failed_ranks(comm):
    """Ranks of ``comm`` this process knows to have failed (ULFM); () where it cannot tell."""
    try:
        group = comm.Get_failed()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return ()
    try:
        return tuple(
            r
            for r in MPI.Group.Translate_ranks(
                group, list(range(group.Get_size())), comm.Get_group()
            )
            if r != MPI.UNDEFINED
        )
    finally:
        group.Free()


#: under ULFM, how long an MPI error of another class waits for this process to learn of a dead
#: rank before it is taken for what it says (a collective's schedule that met the dead peer fails
#: with MPI_ERR_INTERN, sometimes before the failure detector has told this process)
LEARN_OF_FAILURE_SECONDS = 2.0
#: what unpickling a dead rank's never-written bytes raises (its gathered bytes left as zeros)
MISSING_BYTES = (pickle.UnpicklingError, EOFError)


def _learns_of_failed_ranks(comm, others):
    """Whether this process knows (or, under ULFM, comes to know within a short wait) of a failed
    rank in ``comm`` or ``others`` (the library's duplicates may know first)."""
    return bool(_lost(comm, others))


def failure_of(error, comm, sequence=None, also_revoke=()):
    """The RankFailure for MPI error ``error`` if it says a rank died (or the communicator was
    revoked because one did), else None. Revokes ``comm`` and ``also_revoke`` so every rank wakes.

    An MPI error of another class (an internal error of a non-blocking schedule that met the dead
    peer, say) counts too when this process knows of failed ranks in ``comm``, or comes to know
    within LEARN_OF_FAILURE_SECONDS under ULFM; and so, under ULFM, does MISSING_BYTES: mpi4py's
    pickled collectives (the library's agreements, a mismatch's descriptions) unpickling what a rank
    that died mid-collective never sent, where Open MPI returned success (seen at the soak's
    SIGTERM).
    """
    if isinstance(error, MPI.Exception):
        if error.Get_error_class() not in _failure_classes() and not _learns_of_failed_ranks(
            comm, also_revoke
        ):
            return None
        cause = error.Get_error_string()
    elif (
        isinstance(error, MISSING_BYTES)
        and fault_tolerant()
        and _learns_of_failed_ranks(comm, also_revoke)
    ):
        cause = f"{type(error).__name__}: {error}, from bytes the dead rank never sent"
    else:
        return None
    for c in (comm, *also_revoke):
        try:
            if not c.Is_revoked():
                c.Revoke()
        except (MPI.Exception, NotImplementedError, AttributeError):
            pass
    lost = _lost(comm, also_revoke)
    rank = comm.Get_rank()
    what = f"{ranks_phrase(lost)} of {comm.Get_size()} failed" if lost else "a rank failed"
    call = (
        "allreduce call" if sequence is None else f"allreduce call #{sequence}"
    )  # (None: before it is numbered)
    return RankFailure(
        f"rank {rank}: {call}: {what} during the call "
        f"({cause}); recover with mpiallreduce.survivors(comm)",
        failed_ranks=lost,
        sequence=sequence,
    )


def _lost(comm, others):
    """The failed ranks of ``comm`` (or of its duplicates ``others``: the same ranks). A rank woken
    by a revoke may not know yet which rank died: under ULFM it waits up to
    LEARN_OF_FAILURE_SECONDS to learn it, so that its RankFailure names the rank. The wait drives
    MPI's progress (an Iprobe on COMM_SELF): the runtime's word of a dead rank is taken in there.
    Without it, a rank on the dead rank's node (shared memory: no broken connection to notice)
    never learned it (Get_failed empty after 4 s, 2 emulated nodes); with it, in about 20 ms."""
    import time

    deadline = time.monotonic() + (LEARN_OF_FAILURE_SECONDS if fault_tolerant() else 0.0)
    while True:
        lost = failed_ranks(comm) or next((f for f in map(failed_ranks, others) if f), ())
        if lost or time.monotonic() >= deadline:
            return lost
        with contextlib.suppress(MPI.Exception):
            MPI.COMM_SELF.Iprobe()
        time.sleep(0.01)


def caused_by_rank_failure(error, comm):
    """Whether ``error``, raised during a collective on ``comm``, comes from a rank's death: a
    RankFailure, an error that failure_of recognizes, or, under ULFM, any other exception once this
    process learns of a failed rank in ``comm``."""
    if isinstance(error, RankFailure):
        return True
    if isinstance(error, (MPI.Exception, *MISSING_BYTES)):
        return failure_of(error, comm) is not None
    return fault_tolerant() and _learns_of_failed_ranks(comm, ())


_shrunk: list[MPI.Intracomm] = []  # communicators survivors() made: their ranks lost peers


def survivors(comm):
    """After a RankFailure: the communicator of the ranks still alive (``MPI_Comm_shrink``), ranks
    renumbered in their old order. Collective over the survivors; the old communicator stays
    revoked. End such a program with ``exit_after_rank_failures`` (MPI_Finalize may wait for the
    dead)."""
    try:
        if not comm.Is_revoked():
            comm.Revoke()
    except MPI.Exception:
        pass
    shrunk = comm.Shrink()
    _shrunk.append(shrunk)
    return shrunk


def exit_after_rank_failures(status=0):
    """End this process with ``status``. If ranks were lost (``survivors`` was called), first wait
    for the other survivors, then leave without MPI_Finalize: under ULFM, Open MPI's MPI_Finalize
    can wait for ever for the dead ranks (open-mpi/ompi#11404; seen here about one run in four).
    Otherwise an ordinary ``sys.exit(status)``."""
    if not _shrunk:
        sys.exit(status)
    with contextlib.suppress(MPI.Exception):
        _shrunk[-1].Barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
