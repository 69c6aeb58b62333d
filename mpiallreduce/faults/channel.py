"""The control channel of a communicator: 24-byte messages (kind, call number, code) on a tag of
their own, MPI_TAG_UB (the algorithms' tags stay below it), for timed calls' rendezvous
(mpiallreduce.faults.rendezvous) and a rank that leaves a call midway (mpiallreduce.faults.watch).

Each peer has one receive always posted into a buffer owned by the channel, never by a call, so no
receive is left pointing at freed memory. Each peer's messages arrive in the order sent (one tag,
one source): a message of an earlier call (one given up on) is dropped when it comes, one of a
later call is kept for that call. ``code`` says what kind of call a rank makes (ARRIVED's: 0 for a
plain call, a prepared call's own number), so that the ranks see a mismatch before data moves.
"""

from collections import deque

import numpy as np
from mpi4py import MPI

__all__ = [
    "ARRIVED",
    "GO",
    "GAVE_UP",
    "FAILED",
    "DONE",
    "CONTROL_TAG",
    "announce_given_up",
    "free_channel",
]

# FAILED: a rank left a call midway (mpiallreduce.faults.watch); DONE: a rank's part of a timed call
# succeeded (mpiallreduce.faults.outcome)
ARRIVED, GO, GAVE_UP, FAILED, DONE = 0, 1, 2, 3, 4
#: the control messages' tag: the highest there is (CallTags keeps every algorithm's tag below it)
CONTROL_TAG = None


def _control_tag():
    global CONTROL_TAG
    if CONTROL_TAG is None:
        CONTROL_TAG = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    return CONTROL_TAG


class _Channel:
    """One communicator's control messages: a posted receive per peer, what came early, what was
    sent."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.peers = [r for r in range(self.size) if r != self.rank]
        self.inbox = np.zeros((self.size, 3), dtype=np.int64)
        self.tag = _control_tag()
        self.receives = {
            r: comm.Irecv([self.inbox[r], MPI.INT64_T], r, self.tag) for r in self.peers
        }
        #: messages of calls later than the one being met, per peer: (kind, number, code)
        self.early = {r: deque() for r in self.peers}
        #: the highest call number seen from each peer
        self.latest = {r: 0 for r in self.peers}
        self.sends = deque()  # (request, buffer): completed and dropped as we go
        #: the peers whose DONE of call n has come, by n (whoever read it: a wait, or the agreement)
        self.done = {}

    def send(self, kind, number, ranks=None, code=0):
        while self.sends and self.sends[0][0].Test():
            self.sends.popleft()
        message = np.array([kind, number, code], dtype=np.int64)
        for r in self.peers if ranks is None else ranks:
            self.sends.append((self.comm.Isend([message, MPI.INT64_T], r, self.tag), message))

    def receive(self, number):
        """Yield (peer, kind, code) for every message of call ``number`` that has come; keep later
        ones."""
        for r in self.peers:
            early = self.early[r]
            while early and early[0][1] <= number:
                kind, n, code = early.popleft()
                if n == number:
                    self._note(r, kind, n)
                    yield r, kind, code
            request = self.receives[r]
            while not early:  # a peer's later messages wait behind its early ones
                if not request.Test():
                    break
                kind, n, code = (int(v) for v in self.inbox[r])
                request = self.receives[r] = self.comm.Irecv(
                    [self.inbox[r], MPI.INT64_T], r, self.tag
                )
                self.latest[r] = max(self.latest[r], n)
                if n == number:
                    self._note(r, kind, n)
                    yield r, kind, code
                elif n > number:
                    early.append((kind, n, code))
                # n < number: a message of a call given up on; dropped

    def _note(self, peer, kind, number):
        if kind == DONE:
            self.done.setdefault(number, set()).add(peer)

    def done_from(self, number):
        """The peers whose DONE of call ``number`` has come (forgetting earlier calls' record)."""
        for old in [n for n in self.done if n < number]:
            del self.done[old]
        return self.done.get(number, set())

    def free(self):
        for request in self.receives.values():
            try:
                request.Cancel()
                request.Wait()
            except MPI.Exception:
                pass
        self.receives.clear()


def _channel(state):
    if state.channel is None:
        state.channel = _Channel(state.control)
    return state.channel


def free_channel(state):
    if state.channel is not None:
        state.channel.free()
        state.channel = None


def announce_given_up(state):
    """Send GAVE_UP for the calls given up on before the control channel was complete."""
    pending = getattr(state, "given_up_before_channel", None)
    if pending:
        channel = _channel(state)
        while pending:
            channel.send(GAVE_UP, pending.popleft())
