"""The ranks' signature codes in shared memory: how one node compares a call with no collective.

    rank 0 slot  [code, #n | code, #n]      (a cache line per rank, in one shared window)
    rank 1 slot  [code, #n | code, #n]
    publish:     write call #n's code into the pair of n's parity, then n
    all_equal:   wait until every rank's pair of that parity holds n, then read their codes

So a comparison costs a few stores and loads, not a barrier, and shared_memory waits for the codes
in place of its own first barrier. The pairs are labelled by the call's number on the
communicator (mpiallreduce.core.call), not by a count of comparisons: a call that one rank gave up
(a timeout) or that compared nothing (a prepared call) leaves nothing to fall out of step. Two
pairs per rank, used in turn: a rank cannot publish call n + 2 before every rank has read call n,
because every call between them moves data with every rank.

The wait watches the peers (PeerWatch.look_around: a peer that failed or gave the call up, a
revoked communicator), so it never spins on a departed rank. It has no deadline of its own: a
timed call's rendezvous has bounded the ranks' arrival, and after it every rank has committed (a
rank that timed out here, its code published, once left a peer in MPI_Allreduce for ever).
"""

import time

from mpi4py import MPI

from .spinning import yield_core

__all__ = ["SignatureSlots", "yield_core", "wait_until"]

#: how long a wait only spins before it also looks at the peers and the clock, then how often
_QUIET_SECONDS = 5e-5
_LOOK_EVERY_SECONDS = 1e-3


class SignatureSlots:
    """The ranks' (code, count) pairs in a shared window over ``comm`` (every rank on one node)."""

    #: int64s per rank: (code, count) for odd counts, then for even counts; a cache line each
    _PER_RANK = 8

    def __init__(self, comm):
        self.comm = comm
        self.window = MPI.Win.Allocate_shared(8 * self._PER_RANK, 8, comm=comm)
        # memoryviews of int64s: indexing one costs a tenth of a numpy scalar's
        self.slots = [
            memoryview(self.window.Shared_query(r)[0]).cast("B")[: 8 * self._PER_RANK].cast("q")
            for r in range(comm.Get_size())
        ]
        self.mine = self.slots[comm.Get_rank()]
        self.others = [slot for r, slot in enumerate(self.slots) if r != comm.Get_rank()]
        self.window.Lock_all(MPI.MODE_NOCHECK)
        for i in range(self._PER_RANK):
            self.mine[i] = 0
        self.window.Sync()
        comm.Barrier()  # (every rank's numbers are zero before anyone reads them)
        self.window.Sync()

    def _progress(self):
        """Let MPI progress while this rank waits (as it would inside a barrier): a peer may still
        be finishing the previous call's transfers."""
        self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    def publish(self, code, number):
        """This rank's code for its call #``number``, visible to every rank after it together with
        everything this rank stored before it (the call's input, for shared_memory)."""
        at = 2 * (number & 1)
        mine = self.mine
        mine[at] = code
        self.window.Sync()  # (the code, and what came before, before the number)
        mine[at + 1] = number

    def agree(self, code, number):
        """publish and all_equal in one, for a call whose ranks have all published already (the
        common case, no wait): True when every rank's code for call #``number`` equals ``code``;
        False when some rank has not published yet or a code differs (then ``all_equal`` waits,
        compares and says which)."""
        at = 2 * (number & 1)
        mine = self.mine
        mine[at] = code
        self.window.Sync()
        mine[at + 1] = number
        for slot in self.others:
            if slot[at + 1] != number:
                return False
        self.window.Sync()
        for slot in self.others:  # noqa: SIM110 (the hot path: a plain loop, no generator for all())
            if slot[at] != code:
                return False
        return True

    def all_equal(self, code, number, watch):
        """Wait until every rank has published call #``number``; whether all their codes equal
        ``code``. Every rank reads the same codes. ``watch()`` (a PeerWatch, made only if the wait
        is long) raises when a peer failed or gave the call up."""
        at, count = 2 * (number & 1), number
        for slot in self.others:
            if slot[at + 1] != count:
                wait_until(lambda: slot[at + 1] == count, self._progress, watch)  # noqa: B023 (called in this iteration only)
        # (the counts before the codes, and before what the ranks stored earlier)
        self.window.Sync()
        for slot in self.others:  # noqa: SIM110 (as in agree: a plain loop, no generator for all())
            if slot[at] != code:
                return False
        return True

    def free(self):
        try:
            self.window.Unlock_all()
            self.window.Free()
        except MPI.Exception:
            pass


def wait_until(arrived, progress, watch):
    """Spin on ``arrived()`` (a load from shared memory); after the first two hundred tries, call
    ``progress()`` and yield the core (and the GIL) between tries (ranks may outnumber cores), and
    every millisecond let the PeerWatch ``watch()`` makes look at the peers (it raises)."""
    for _ in range(200):
        if arrived():
            return
    started = time.monotonic()
    watch = watch()
    watch.start_waiting(started)
    look_at = started + _QUIET_SECONDS
    while not arrived():
        progress()
        now = time.monotonic()
        if now >= look_at:
            watch.look_around((), now)
            look_at = now + _LOOK_EVERY_SECONDS
        yield_core()
