"""MPI's own collectives in a timed call: on a communicator of their own, every wait bounded.

A timed call whose plan runs MPI collectives (``mpi``'s MPI_Allreduce, ``reduce_bcast``, the
steps within a node of ``hierarchical`` and ``two_level``, ``shared_memory``'s barriers) posts
their nonblocking forms and waits for them through the call's PeerWatch (CallTags does it), so a
peer that stalls inside one, alive, is bounded by the timeout as a message is. The call then ends
alike on every rank (mpiallreduce.faults.outcome):

    a timed call's set-up           -> every rank: MPI_Comm_idup(library) -> T (and of the
                                       library's node, leaders' and rails' communicators: T's)
    call #n, timed, rendezvous      -> committed (every rank sent GO); where there is no T (the
                                       set-up was untimed, or T was retired), make it now, at most
                                       the timeout (every rank, this point)
    the data's steps                -> Iallreduce / Ireduce / Ibcast / Ibarrier ... on T (or on
                                       T's node, leaders' or rails' communicators), waited for
                                       through the PeerWatch: a peer's FAILED, or the deadline
    the end                         -> all return or all raise (faults.outcome)
    it raised, committed, plan on T -> T is retired on every rank (core.executor.timed_call_raised;
    (or T made in it), no mismatch     the buffers of a collective left behind kept with it)

A collective cannot be cancelled. One that a rank posted and a peer never did (the peer gave up
before it got there) would pair with the next collective on its communicator, another call's:
that is why these collectives run on T, the library's for timed calls only, and why T is retired
after a timed call that raised, never freed (MPI may still complete what is posted on it); a
collective's request left behind is never cancelled (erroneous in MPI). The next timed call makes
another; untimed calls never use T. docs/faults.md says what is left.
"""

import math
import time

from .errors import AllreduceTimeout
from .watch import PeerWatch, yield_core

__all__ = [
    "made_at_commit",
    "make_timed_communicator",
    "timed_communicator",
    "retire_timed_communicator",
]


def made_at_commit(state, sequence, timeout):
    """Timed call #``sequence``'s rendezvous is committed on this rank (every rank sent GO, so
    every rank commits, whether its round 2 ends in every GO or in a peer's FAILED): where there is
    no T, make it now, before anything else of the call, at this same point of the library's
    collectives on every rank (waited for to its end: Open MPI's making of another communicator
    from the library's, the set-up's, must not overlap it). A communicator not set up yet makes it
    at the end of its set-up instead (a timed call's), where a set-up left by a call given up is
    put right first. Communicators no timed call uses never make it."""
    state.committed_call = sequence
    if state.ready:  # (else the set-up makes it, once done: CommState.make_ready)
        make_timed_communicator(state, sequence, timeout)


def make_timed_communicator(state, sequence, timeout):
    """T made where there is none, with the node's, leaders' and rails' communicators that
    hierarchical and two_level derive from it: nonblocking duplicates of the library's (a split
    of T in a call would block, and a peer that left the call never joins it), all posted first,
    then waited for at most ``timeout`` seconds. The wait heeds no peer's FAILED: every rank
    posted its part at the same point, so the duplicates complete. At the deadline (a peer
    stalled) they are given up for good, as a call given up is, and this rank raises: the late
    peer posts its part once it wakes, gets T, raises in the call, and retires it
    (core.executor.timed_call_raised: T made in the call)."""
    if state.timed_collectives is not None or state.size == 1:
        return
    from mpi4py import MPI

    from ..core.comms import replace_cached
    from ..core.topology import node_level_communicators

    parts = [(None, state.library), *node_level_communicators(state.library)]
    made = [(key, *c.Idup()) if c != MPI.COMM_NULL else (key, c, None) for key, c in parts]
    requests = [request for _, _, request in made if request is not None]
    deadline = time.monotonic() + (math.inf if timeout is None else timeout)
    while not MPI.Request.Testall(requests):
        if time.monotonic() >= deadline:
            state.retired_communicators.extend(c for _, c, _ in made)
            state.left_behind.extend(requests)  # (never freed while MPI may complete them)
            PeerWatch(state, sequence, timeout, "").fail()  # (tell the peers: they raise too)
            raise AllreduceTimeout(
                f"rank {state.rank}: allreduce call #{sequence} on {state.size} ranks: the "
                f"communicator of timed calls' MPI collectives was not made within {timeout:g} s "
                "(a rank is late); every rank raises",
                sequence=sequence,
                waited=timeout,
            )
        yield_core()
    timed = made[0][1]
    for key, comm, _ in made[1:]:
        replace_cached(timed, key, comm)
    state.timed_collectives, state.timed_made_in = timed, sequence


def timed_communicator(state, sequence, timeout):
    """T, for timed call #``sequence``'s collectives (made at its rendezvous: see the module)."""
    make_timed_communicator(state, sequence, timeout)
    return state.timed_collectives


def retire_timed_communicator(state):
    """A timed call raised on this rank (and so on every rank): T may hold a collective that some
    rank posted and another never will; no later call uses it."""
    comm = state.timed_collectives
    if comm is not None:
        state.timed_collectives = None
        state.retired_communicators.append(comm)
