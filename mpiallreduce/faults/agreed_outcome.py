"""A step that can fail on one rank only (opening a peer's memory, inside an algorithm), made to
fail on every rank: a rank that raised alone would leave the others waiting in the next collective
for ever. The outcome is agreed in place of the barrier that follows the step; the core's
consistency service (mpiallreduce.core.consistency) gives it too."""

import numpy as np
from mpi4py import MPI

from .errors import ranks_phrase

__all__ = ["agree_on_outcome"]


def agree_on_outcome(comm, local_error, what):
    """Collective: raise on every rank of ``comm`` if ``local_error`` (an exception or None) is set
    on any; the message names the ranks and their errors (the rank's own error is chained).

    For steps inside an algorithm that can fail on one rank only (opening a peer's memory, say):
    called instead of the barrier that follows them, it keeps the others from going on into the
    next collective and waiting there for ever.
    """
    flags = np.zeros(comm.Get_size(), dtype=np.int8)  # the common case: one small Allgather
    comm.Allgather(
        [np.array([local_error is not None], dtype=np.int8), MPI.INT8_T], [flags, MPI.INT8_T]
    )
    if flags.any():
        reports = comm.allgather(
            None if local_error is None else f"{type(local_error).__name__}: {local_error}"
        )
        failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
        raise RuntimeError(
            f"{what} failed on {ranks_phrase([r for r, _ in failed])} of {len(reports)}:\n  "
            + "\n  ".join(f"rank {r}: {report}" for r, report in failed)
        ) from local_error
