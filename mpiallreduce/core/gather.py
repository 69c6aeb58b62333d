"""The library's own collectives that are not allreduces, made like a call: what it gathers from
every rank that is not a call's signature (GradientSync's gradients, replicas' layouts and digests),
and symmetric allocations (mpiallreduce.empty)."""

from ..faults.recorder import Described, record_call, run_traced
from ..faults.watch import PeerWatch
from . import symmetric
from .call import WORLD, check_comm
from .consistency import LIBRARY_GATHER, compare, digest, meet
from .failures import raise_failed
from .state import state_of
from .worker import run_here

__all__ = ["gather_from_ranks", "symmetric_array"]


def gather_from_ranks(comm, value, timeout=None, site=""):
    """Every rank's ``value``, in rank order: a collective of the library's own, made like a call
    (numbered here, on the caller's thread; run here after the pending asynchronous calls, on the
    library's duplicate of ``comm``). With ``timeout`` the ranks meet first, so a rank that does not
    come raises AllreduceTimeout on every rank that did; a dead peer raises RankFailure (ULFM).
    Untimed, the ranks compare first, as a call's signature (watched): a peer in a timed call's
    rendezvous, which this rank never joins, gives it up (AllreduceAborted), and a peer in another
    kind of call raises SignatureMismatch everywhere, where a blocking allgather waited for ever.
    For what the library compares that is not a call's signature (GradientSync's gradients)."""
    state = state_of(check_comm(comm), blocking=timeout is None)
    sequence = state.number()
    entry = record_call(state, sequence, Described(kind="gather", site=site, timeout=timeout))

    def gather():
        if timeout is not None:
            meet(state, sequence, timeout, site, LIBRARY_GATHER)
        state.make_ready(sequence)
        if timeout is None and state.size > 1:
            compare(
                state,
                LIBRARY_GATHER,
                lambda: {"call": "a gather of the library's own"},
                lambda: PeerWatch(state, sequence, None, "gather"),
                sequence,
            )
        try:
            return state.library.allgather(value)
        except BaseException as error:
            raise_failed(error, state, sequence, None)

    return run_here(state, lambda: run_traced(entry, gather))


def symmetric_array(comm, shape, dtype, zero):
    """``mpiallreduce.empty``/``zeros``: a collective made like a call (numbered here, on the
    caller's thread; run here after the pending asynchronous calls): the ranks compare shape and
    dtype, or the error a bad one raised on a rank (which raises it there, SignatureMismatch
    elsewhere), then allocate (mpiallreduce.core.symmetric)."""
    state = state_of(check_comm(WORLD if comm is None else comm))
    sequence = state.number()
    entry = record_call(
        state, sequence, Described(kind="symmetric allocation", shape=str(shape), dtype=str(dtype))
    )

    def make():
        state.make_ready(sequence)
        try:
            agreed, rejected = symmetric.checked(shape, dtype), None
            signature = {"symmetric allocation": agreed[0], "dtype": str(agreed[1])}
        except (TypeError, ValueError) as error:
            rejected, signature = (
                error,
                {"symmetric allocation": "rejected", "error": f"{type(error).__name__}: {error}"},
            )
        try:
            compare(
                state,
                digest(tuple(signature.items())),
                lambda: signature,
                lambda: PeerWatch(state, sequence, None, "symmetric allocation"),
                sequence,
            )
        except Exception as other:
            if rejected is not None:
                raise rejected from other
            raise
        if rejected is not None:
            raise rejected
        return symmetric.allocate(state, *agreed, zero)

    return run_here(state, lambda: run_traced(entry, make))
