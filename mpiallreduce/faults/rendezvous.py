"""Timeouts: the ranks meet before a timed call moves any data, so a straggler is a diagnosis, not a
hang.

``allreduce(x, timeout=T)`` (or ``MPIALLREDUCE_TIMEOUT=T``) first meets the other ranks on the
library's communicator (mpiallreduce.state), in two rounds of 24-byte messages
(kind, call number, code) on the control channel (mpiallreduce.faults.channel):

    round 1  every rank sends ARRIVED(#n) to every other and waits for all of theirs, at most T s
             (a warning names the ranks still missing at a fraction of T: default 0.5)
             -> all arrived: send GO(#n)          -> not all by T: send GAVE_UP(#n), raise
             -> GAVE_UP(#n) from another rank: raise (that rank's timeout ran out first)
    round 2  wait for GO(#n) from every rank, or GAVE_UP(#n) from any
             -> all GO: reduce                    -> a GAVE_UP: raise

Every rank sends GO or GAVE_UP for call #n, never both (an exception of its own in round 1, a
warning turned into an error or a KeyboardInterrupt, sends GAVE_UP on its way out), so round 2
always ends, the same way on every rank: all reduce, or all raise ``AllreduceTimeout``. ARRIVED
carries what kind of call the rank makes (``code``: 0 for a plain call, which compares its
signature next; a prepared call's own code, as it compares nothing more): once round 2 is over,
every rank holds every rank's code (``codes``), and the caller raises alike everywhere where they
differ (mpiallreduce.core.call: a prepared call run on some ranks only).

Messages carry their call number, and each peer's messages arrive in the order sent (one tag, one
source: MPI does not overtake), so none is ever mistaken for another call's: a message of an
earlier call (one given up on) is dropped when it comes, one of a later call (a rank that skipped
a call) is kept for that call and names where that rank is. Each peer has one receive always
posted into a buffer owned by the channel, never by a call, so no receive is left pointing at
freed memory, and tags never wrap around.

The first timed call on a communicator that was never used before also completes the control
channel (mpiallreduce.state starts it on first use): if a rank is missing, the others raise within
T, and send their GAVE_UP as soon as the channel is complete, so the straggler learns at once that
the call was given up and the call numbers stay in step.
"""

import math
import time
import warnings
from collections import deque

from mpi4py import MPI

from .bounded import made_at_commit
from .channel import ARRIVED, FAILED, GAVE_UP, GO, _channel, announce_given_up
from .errors import AllreduceAborted, AllreduceStallWarning, AllreduceTimeout, ranks_phrase
from .ulfm import failure_of

__all__ = ["Rendezvous"]


class Rendezvous:
    """One timed call's meeting of the ranks. ``deadline`` (time.monotonic()) may be brought forward
    by another thread (``AllreduceHandle.wait(timeout)``); ``missing`` says who has not arrived
    yet."""

    def __init__(self, state, sequence, timeout, site="", code=0):
        self.state = state
        self.code = code  # what kind of call this rank makes (mpiallreduce.faults.channel)
        self.codes = (
            None  # once round 1 is over: {rank: its code}, every rank's, this one's included
        )
        self.sequence = sequence
        self.timeout = timeout
        self.site = site
        self.started = None
        self.deadline = math.inf
        self.missing = None  # set of ranks, once round 1 has begun
        self.first_contact = False
        self.arrived = False  # round 1 complete

    def bring_deadline_forward(self, deadline):
        self.deadline = min(self.deadline, deadline)

    def _describe(self):
        return f"allreduce call #{self.sequence}" + (f" ({self.site})" if self.site else "")

    def run(self):
        state = self.state
        self.started = time.monotonic()
        if self.timeout is not None:
            self.bring_deadline_forward(self.started + self.timeout)
        #: the communicator's duplicate was still being made: a peer that came and gave up before it
        #: was made could not say so (it will at its next call)
        self.first_contact = not state.control_ready()
        self._complete_control_channel()
        announce_given_up(state)
        channel = _channel(state)
        rank, size, number = state.rank, state.size, self.sequence
        self.missing = set(channel.peers)
        sent_go = False
        channel.send(ARRIVED, number, code=self.code)
        codes = {rank: self.code}
        try:
            # Round 1: arrivals
            went_early = set()  # peers whose GO came before this rank's round 2
            warned = False
            warn_at = (
                self.started + state.settings.warn_fraction * self.timeout
                if self.timeout is not None
                else math.inf
            )
            for _ in _polling():
                for peer, kind, code in channel.receive(number):
                    if kind == GAVE_UP:
                        raise self._given_up_in_round_1(channel, peer)
                    if kind == ARRIVED:
                        self.missing.discard(peer)
                        codes[peer] = code
                    elif kind == GO:  # the peer saw every arrival before we did: counted in round 2
                        went_early.add(peer)
                    # (FAILED cannot come in round 1: a peer starts the algorithm after this rank's
                    # GO)
                if not self.missing:
                    break
                now = time.monotonic()
                if now >= self.deadline:
                    raise self._timeout(channel, now)
                if not warned and now >= warn_at:
                    warned = True
                    where = "".join(
                        f" (rank {r} is in its call #{n})"
                        for r, n in self._elsewhere(channel).items()
                    )
                    warnings.warn(
                        f"rank {rank}: {self._describe()} on {size} ranks has waited "
                        f"{now - self.started:.1f} s for {ranks_phrase(self.missing)}{where}; it "
                        f"times out after {self.timeout:g} s",
                        AllreduceStallWarning,
                        stacklevel=4,
                    )
            self.arrived, self.codes = True, codes

            # Round 2: everyone arrived, or someone gave up
            channel.send(GO, number)
            sent_go = True
            waiting = set(channel.peers) - went_early
            for _ in _polling():
                for peer, kind, _ in channel.receive(number):
                    if kind == GAVE_UP:
                        raise self._given_up_by(peer)
                    if kind == GO:
                        waiting.discard(peer)
                    elif kind == FAILED:  # it saw every GO, started the algorithm and failed in it
                        made_at_commit(
                            state, number, self.timeout
                        )  # (committed: every rank sent GO)
                        raise AllreduceAborted.by(state, number, peer)
                if not waiting:
                    made_at_commit(state, number, self.timeout)  # (committed, faults.bounded)
                    return
        except MPI.Exception as error:  # a dead peer (ULFM): RankFailure on every survivor
            failure = failure_of(
                error, state.user, number, also_revoke=state.library_communicators()
            )
            if failure is None:
                raise
            raise failure from error
        except BaseException:
            if not sent_go:  # whatever ends this rank's round 1 ends the call for every rank
                channel.send(GAVE_UP, number)
            raise

    def _complete_control_channel(self):
        state = self.state
        for _ in _polling():
            try:
                if state.control_ready():
                    return
            except MPI.Exception as error:
                failure = failure_of(
                    error, state.user, self.sequence, also_revoke=state.library_communicators()
                )
                if failure is None:
                    raise
                raise failure from error
            now = time.monotonic()
            if now >= self.deadline:
                pending = getattr(state, "given_up_before_channel", None)
                if pending is None:
                    pending = state.given_up_before_channel = deque()
                pending.append(self.sequence)
                raise AllreduceTimeout(
                    f"rank {state.rank}: {self._describe()}, the first call on this communicator "
                    f"of {state.size} ranks: not every rank reached it within "
                    f"{now - self.started:.1f} s (which ranks cannot be told on a communicator's "
                    "first call: make an untimed call, or mpiallreduce.prepare, first to have them "
                    "named). The late ranks will learn that this call was given up",
                    sequence=self.sequence,
                    waited=now - self.started,
                )

    def _given_up_in_round_1(self, channel, peer):
        """Another rank's timeout ran out first: say so, and name the ranks still missing as this
        rank sees them (after taking in every message that has come)."""
        for other, kind, _ in channel.receive(self.sequence):
            if kind == ARRIVED:
                self.missing.discard(other)
        self.missing.discard(peer)
        return self._given_up_by(peer, self.missing)

    def _given_up_by(self, peer, missing=()):
        waited = time.monotonic() - self.started
        still = f"; not arrived here yet: {ranks_phrase(missing)}" if missing else ""
        return AllreduceTimeout(
            f"rank {self.state.rank}: {self._describe()} on {self.state.size} ranks: rank {peer} "
            "gave up waiting for it (its timeout ran out before every rank arrived; this rank "
            f"came {waited:.1f} s ago{still})",
            missing_ranks=missing,
            sequence=self.sequence,
            waited=waited,
        )

    def _elsewhere(self, channel):
        """{missing rank: the number of the call it was last seen in} where that is not this one."""
        found = {}
        for r in sorted(self.missing):
            if channel.early[r]:
                found[r] = channel.early[r][-1][1]
        return found

    def _timeout(self, channel, now):
        """The AllreduceTimeout for ranks still missing; names those waiting in a call of another
        number."""
        state = self.state
        elsewhere = self._elsewhere(channel)
        message = (
            f"rank {state.rank}: {self._describe()} on {state.size} ranks timed out after "
            f"{now - self.started:.1f} s: {ranks_phrase(self.missing)} had not arrived at it "
            f"(sequence number {self.sequence})"
        )
        if elsewhere:
            message += "; " + "; ".join(
                f"rank {r} is waiting in its call #{n}" for r, n in sorted(elsewhere.items())
            )
            message += " -- the ranks' calls do not match: a rank skipped a call or made one more"
        elif self.first_contact:
            message += (
                " -- or, this being the communicator's first call, had come and given up before "
                "this rank came: a rank can only tell the others once every rank has reached the "
                "first call"
            )
        return AllreduceTimeout(
            message,
            missing_ranks=self.missing,
            sequence=self.sequence,
            waited=now - self.started,
            elsewhere=elsewhere,
        )


def _polling(spin_seconds=2e-4, first_sleep=5e-5, longest_sleep=2e-3):
    """An endless iterator: at first back to back (an answer usually comes within microseconds),
    then sleeping a little longer each time (a long wait spends no core spinning)."""
    spin_until = time.monotonic() + spin_seconds
    while time.monotonic() < spin_until:
        yield
    sleep = first_sleep
    while True:
        yield
        time.sleep(sleep)
        sleep = min(longest_sleep, sleep * 2)
