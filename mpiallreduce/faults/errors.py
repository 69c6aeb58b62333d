"""The exceptions of stalls, stragglers and lost ranks, and the call site that messages name."""

import os
import sys

__all__ = ["AllreduceTimeout", "RankFailure", "AllreduceStallWarning", "call_site", "ranks_phrase"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class AllreduceTimeout(TimeoutError):
    """Raised on every waiting rank when a call did not gather all its ranks within the timeout.

    Attributes: ``missing_ranks`` (not arrived, as ranks of the call's communicator), ``sequence``
    (the call's number on this rank), ``waited`` (seconds), ``elsewhere`` ({rank: the number of the
    call that rank was found in}, for ranks in another call).
    """

    def __init__(self, message, missing_ranks=(), sequence=None, waited=None, elsewhere=None):
        super().__init__(message)
        self.missing_ranks = tuple(sorted(missing_ranks))
        self.sequence = sequence
        self.waited = waited
        self.elsewhere = dict(elsewhere or {})


class AllreduceAborted(RuntimeError):
    """Raised on every other rank of a call that one rank left in the middle, on an exception of its
    own (raised there). ``failed_rank``: that rank; ``sequence``: the call's number."""

    def __init__(self, message, failed_rank=None, sequence=None):
        super().__init__(message)
        self.failed_rank = failed_rank
        self.sequence = sequence

    @classmethod
    def by(cls, state, sequence, peer, algorithm="", gave_up=False):
        what = (
            "gave it up (its timeout ran out before every rank had arrived: did the ranks give "
            "this call different timeouts?)"
            if gave_up
            else "failed in the middle of it (its own exception is raised there)"
        )
        return cls(
            f"rank {state.rank}: allreduce call "
            f"#{sequence}{f' ({algorithm})' if algorithm else ''} on {state.size} ranks: rank "
            f"{peer} {what}; this rank gave up its part",
            failed_rank=peer,
            sequence=sequence,
        )


class RankFailure(RuntimeError):
    """Raised on every surviving rank when ranks died during a call (ULFM). ``failed_ranks``: ranks
    of the call's communicator known dead. Recover with ``mpiallreduce.survivors(comm)``."""

    def __init__(self, message, failed_ranks=(), sequence=None):
        super().__init__(message)
        self.failed_ranks = tuple(failed_ranks)
        self.sequence = sequence


class AllreduceStallWarning(RuntimeWarning):
    """A call has waited for some ranks longer than the warning fraction of its timeout."""


def call_site(depth=1):
    """'file.py:line' of the first caller outside this package (for messages and ``check``).

    Taken in the public entry points, on the caller's thread (never on allreduce_async's worker).
    """
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return ""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def ranks_phrase(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
