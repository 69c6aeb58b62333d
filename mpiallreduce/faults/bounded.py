"""MPI's own collectives in a timed call: on a communicator of their own, every wait bounded.

A timed call whose plan runs MPI collectives (``mpi``'s MPI_Allreduce, ``reduce_bcast``, the
steps within a node of ``hierarchical`` and ``two_level``, ``shared_memory``'s barriers) posts
their nonblocking forms and waits for them through the call's PeerWatch (CallTags does it), so a
peer that stalls inside one, alive, is bounded by the timeout as a message is. The call then ends
alike on every rank (mpiallreduce.faults.outcome):

    call #n, timed, rendezvous passed
        no timed communicator yet  -> every rank: MPI_Comm_idup(library) -> T, waited for at most
                                      the timeout (each timed call that finds none, right after
                                      its rendezvous, whatever its plan: the same on every rank)
    the data's steps               -> Iallreduce / Ireduce / Ibcast / Ibarrier ... on T (or on
                                      T's node, leaders' or rails' communicators), waited for
                                      through the PeerWatch: a peer's FAILED, or the deadline
    the end                        -> all return or all raise (faults.outcome)
    it raised                      -> T is retired on every rank (every rank raised)

A collective cannot be cancelled. One that a rank posted and a peer never did (the peer gave up
before it got there) would pair with the next collective on its communicator, another call's:
that is why these collectives run on T, the library's for timed calls only, and why T is retired
after any timed call that raised, never freed (MPI may still complete what is posted on it). The
next timed call makes another; untimed calls never use T. docs/faults.md says what is left.
"""

import time

from .watch import PeerWatch, yield_core

__all__ = ["make_timed_communicator", "timed_communicator", "retire_timed_communicator"]


def make_timed_communicator(state, sequence, timeout):
    """Right after timed call #``sequence``'s rendezvous (every rank is in that call): make T
    where there is none, waiting for it at most ``timeout`` seconds. A duplicate given up on stays
    posted and is the next timed call's (a collective cannot be cancelled): a rank that made one
    more than its peers (they had not retired theirs) meets them again once they have."""
    if state.timed_collectives is not None or state.size == 1:
        return
    if state.timed_making is None:
        state.timed_making = state.library.Idup()
    comm, request = state.timed_making
    watch = PeerWatch(state, sequence, timeout, "making the timed calls' communicator")
    watch.start_waiting(time.monotonic())
    while not request.Test():
        watch.look_around([], time.monotonic())  # (a peer's FAILED, the deadline: raise)
        yield_core()
    state.timed_making, state.timed_collectives = None, comm


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
