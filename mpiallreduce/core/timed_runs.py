"""A timed call that raised: the timed calls' communicator (mpiallreduce.faults.bounded) retired
where something of the call may be left on it, every rank's call raising alike.
"""

from ..faults.bounded import retire_timed_communicator
from .consistency import SignatureMismatch

__all__ = ["timed_call_raised"]


def timed_call_raised(state, sequence, error, bounded, differ=False):
    """Timed call #``sequence`` raised ``error`` on this rank: retire the timed calls' communicator
    (faults.bounded) where every rank's call raised alike and something of the call may be left on
    it: its rendezvous committed (every rank's call then raises alike: faults.outcome), and its
    plan ran MPI's collectives there (``bounded``: the same plan on every rank, once compared) or
    the call made it (a peer may have given that up). Not where the ranks' calls differ (a
    mismatch, or a bad argument on one rank, ``differ``): the comparison comes first, so no rank
    posted anything there, and the rank whose call differs may not know the plan."""
    if (
        getattr(state, "committed_call", None) == sequence
        and not differ
        and not isinstance(error, SignatureMismatch)
        and (bounded or state.timed_made_in == sequence)
    ):
        retire_timed_communicator(state)
