"""How a timed call ends: alike on every rank, within its timeout plus a stated grace.

A timed call's ranks meet first (mpiallreduce.faults.rendezvous), then each runs its part of the
algorithm, every wait bounded by the timeout (mpiallreduce.faults.watch) and the result in a buffer
of the call's own, not the user's. Then, where the plan talks in messages (so that one rank can
finish its part while another fails or stalls in its own):

    rank r, its part done   ──DONE(#n)──> every peer          (the control channel, 24 bytes each)
                            <──DONE(#n)── every peer          waited for at most timeout + GRACE
    every DONE came         -> the result is copied into the user's array; the call returns
    a FAILED/GAVE_UP came   -> AllreduceAborted naming that rank (it failed, was interrupted, or
                               timed out, and told every peer)
    the grace ran out       -> FAILED to every peer, AllreduceTimeout naming the silent ranks

So a rank returns only once every peer has finished its part, and a rank that leaves the call (an
error, a timeout, ``KeyboardInterrupt``) makes every peer still in it raise: the ones in the
algorithm at their next look at the channel, the ones here at once. What no bounded wait can rule
out is a peer whose DONE reaches one rank just before that rank's grace ends and another just after
(the sends leave together, so only a stall between them, or the deadline falling between two
arrivals, can split them); docs/faults.md says so. Untimed calls never come here: they cost no
message more than their data's.
"""

import time

from .channel import DONE, _channel
from .errors import AllreduceTimeout, ranks_phrase
from .watch import PeerWatch, yield_core

__all__ = ["end_alike", "GRACE_SECONDS"]

#: how long past the call's timeout a rank whose part is done waits for its peers' DONE
GRACE_SECONDS = 2.0
#: how often the wait reads the control channel
_LOOK_EVERY_SECONDS = 1e-4


def end_alike(state, sequence, timeout, name):
    """This rank's part of timed call #``sequence`` succeeded: tell every peer, then return once
    every peer has said the same; raise (having told them) where one failed or stayed silent."""
    channel = _channel(state)
    channel.send(DONE, sequence)
    waiting = set(channel.peers)
    watch = PeerWatch(state, sequence, None, name)  # (a peer's FAILED or GAVE_UP, ULFM's revoke)
    deadline = time.monotonic() + timeout + GRACE_SECONDS
    look_at = 0.0
    while True:
        now = time.monotonic()
        if now >= look_at:
            watch.look_around([], now)
            waiting -= channel.done_from(sequence)
            if not waiting:
                return
            if now >= deadline:
                watch.fail()
                silent = sorted(waiting)
                whose = "its" if len(silent) == 1 else "their"
                raise AllreduceTimeout(
                    f"rank {state.rank}: allreduce call #{sequence} ({name}) on {state.size} "
                    f"ranks: {ranks_phrase(silent)} did not finish {whose} part within "
                    f"{timeout:g} s + {GRACE_SECONDS:g} s; every rank raises, and no result was "
                    "written",
                    sequence=sequence,
                    waited=timeout + GRACE_SECONDS,
                    missing_ranks=silent,
                )
            look_at = now + _LOOK_EVERY_SECONDS
        yield_core()
