"""What the library gathers from every rank that is not a call's signature (GradientSync's gradients,
replicas' layouts and digests): a collective of its own, made like a call."""
from .call import check_comm
from .consistency import LIBRARY_GATHER, meet
from .executor import raise_failed
from .state import state_of
from .worker import run_here

__all__ = ["gather_from_ranks"]


def gather_from_ranks(comm, value, timeout=None, site=""):
    """Every rank's ``value``, in rank order: a collective of the library's own, made like a call
    (numbered here, on the caller's thread; run here after the pending asynchronous calls, on the
    library's duplicate of ``comm``). With ``timeout`` the ranks meet first, so a rank that does not
    come raises AllreduceTimeout on every rank that did; a dead peer raises RankFailure (ULFM).
    For what the library compares that is not a call's signature (GradientSync's gradients)."""
    state = state_of(check_comm(comm), blocking=timeout is None)
    sequence = state.number()

    def gather():
        if timeout is not None:
            meet(state, sequence, timeout, site, LIBRARY_GATHER)
        state.make_ready()
        try:
            return state.library.allgather(value)
        except BaseException as error:
            raise_failed(error, state, sequence, None)
    return run_here(gather)
