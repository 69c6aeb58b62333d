"""A failure in the middle of an algorithm ends the call on every rank, not only on the one that
failed.

A hand-written algorithm (``messages_only``) talks through CallTags, which hands every wait to the
call's PeerWatch instead of blocking in MPI:

    rank 1 raises in step 2 (a failed allocation, a KeyboardInterrupt, an injected fault)
        -> it sends FAILED(#n) to every peer on the control tag (mpiallreduce.faults.rendezvous)
           and raises its own exception
    rank 0, 2, ... waiting for a message of call #n
        -> test their requests; after a short spin, also look at the control channel
        -> FAILED(#n) from rank 1: leave the call's requests behind, raise AllreduceAborted
        -> the call's timeout (when it has one) passes in one wait with nothing coming: send
           FAILED(#n) so that the others learn it too, raise AllreduceTimeout

So every rank raises at once when the failure is local (and within the timeout when a rank hangs
instead); a timed call's ranks then agree on how it ends (mpiallreduce.faults.outcome). The
requests left behind use the failed call's tags (CallTags): no later call can match them; receives
are cancelled and every request is kept with its buffer until it completes.
"""

import contextlib
import math
import time

from mpi4py import MPI

from ..core.mpi_requests import request_done
from ..core.spinning import yield_core
from .channel import FAILED, GAVE_UP, _channel
from .errors import AllreduceAborted, AllreduceTimeout

__all__ = ["PeerWatch", "set_up_or_rank_failure", "request_done", "wait_for_set_up"]

#: how long a wait only tests its own requests before it also reads the control channel
_QUIET_SECONDS = 5e-5
#: then how often it reads the control channel and the clock
_LOOK_EVERY_SECONDS = 1e-3


def _test_all(requests, statuses):
    """MPI_Testall; a failed request's own error raised (a dead peer's ERR_PROC_FAILED under ULFM,
    which mpiallreduce.faults.ulfm turns into RankFailure), not MPI_ERR_IN_STATUS."""
    try:
        return MPI.Request.Testall(requests, statuses)
    except MPI.Exception as error:
        if error.Get_error_class() == MPI.ERR_IN_STATUS:
            for status in statuses:
                code = status.Get_error()
                if code not in (MPI.SUCCESS, MPI.ERR_PENDING):
                    raise MPI.Exception(code) from error
        raise


def _under_ulfm():
    global _ULFM
    if _ULFM is None:
        from .ulfm import fault_tolerant

        _ULFM = fault_tolerant() and hasattr(MPI, "ERR_REVOKED")
    return _ULFM


_ULFM = None


def _knows_failed(comm):
    from .ulfm import failed_ranks

    return bool(failed_ranks(comm))


def _revoked(comm):
    try:
        return comm.Is_revoked()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return False


class PeerWatch:
    """One call's waits: complete the requests, or learn that a peer gave up, or time out."""

    __slots__ = (
        "state",
        "sequence",
        "deadline",
        "timeout",
        "failed",
        "name",
        "posted",
        "collectives",
    )

    def __init__(self, state, sequence, timeout=None, name=""):
        self.state = state
        self.sequence = sequence
        self.timeout = timeout
        self.deadline = math.inf  # (set by each wait)
        self.failed = False
        self.name = name
        # the call's requests posted through CallTags (left behind with a wait's own)
        self.posted = []
        #: nonblocking collectives' requests (by id): their buffers, kept with them when left
        #: behind (mpi4py's request holds no reference to them); never cancelled
        self.collectives = {}

    def wait(self, requests):
        """Wait for every request in the list, watching the peers. Like MPI's own blocking wait it
        polls without sleeping (yielding the core to other ranks where they share it): a sleep would
        add its length to every message of a call between nodes. The control channel and the
        deadline are looked at every millisecond. A wait that ends in an error (a failed request, an
        interrupt) leaves its requests, and those the call posted through CallTags for later steps,
        behind as a given-up call does: none is freed while MPI may still write into its buffer."""
        statuses = [MPI.Status() for _ in requests]
        try:
            if _test_all(requests, statuses):
                return
            started = time.monotonic()
            self.start_waiting(started)
            look_at = started + _QUIET_SECONDS
            while True:
                if _test_all(requests, statuses):
                    return
                now = time.monotonic()
                if now >= look_at:
                    self.look_around(requests, now)
                    look_at = now + _LOOK_EVERY_SECONDS
                yield_core()
        except BaseException:
            self._leave_behind(requests)
            raise

    def wait_collective(self, request, buffers):
        """``wait([request])`` for a nonblocking collective's request, whose ``buffers`` (its
        arguments) MPI may write into until it completes: left behind, they are kept with it (the
        call's own result buffer, say, which Python would free); it is never cancelled."""
        self.collectives[id(request)] = buffers
        self.wait([request])

    def start_waiting(self, now):
        """A wait begins: the timeout bounds each wait, not the whole algorithm (a long call that
        keeps moving is not a stall; the rendezvous bounded the arrival)."""
        self.deadline = now + self.timeout if self.timeout is not None else math.inf

    def look_around(self, requests, now):
        """Raise if a peer gave the call up, the communicator was revoked (ULFM), or the deadline
        has passed (``requests``, the wait's own, are left behind first)."""
        if _under_ulfm() and any(
            _revoked(c) or _knows_failed(c) for c in self.state.library_communicators()
        ):
            # A survivor that saw the failure revoked the communicator, or this process knows of a
            # dead rank in it; a request here that waits for a live peer (which has left the call)
            # may never be completed with the error (seen across emulated nodes): leave it and
            # raise what that means (failure_of makes it a RankFailure).
            self._leave_behind(requests)
            raise MPI.Exception(MPI.ERR_REVOKED)
        for peer, kind, _ in _channel(self.state).receive(self.sequence):
            if kind in (FAILED, GAVE_UP):
                self._leave_behind(requests)
                raise AllreduceAborted.by(
                    self.state, self.sequence, peer, self.name, gave_up=kind == GAVE_UP
                )
        if now >= self.deadline:
            self._leave_behind(requests)
            self.fail()
            where, missing = (
                ("in the middle of the algorithm", "a message it waited for from a peer")
                if requests
                else ("comparing the ranks' calls", "every rank's signature")
            )
            raise AllreduceTimeout(
                f"rank {self.state.rank}: allreduce call #{self.sequence} ({self.name}) on "
                f"{self.state.size} ranks timed out {where}: {self.timeout:g} s without {missing}; "
                "the other ranks are told",
                sequence=self.sequence,
                waited=self.timeout,
            )

    def fail(self):
        """This rank leaves the call midway: tell every peer (once)."""
        if not self.failed:
            self.failed = True
            _channel(self.state).send(FAILED, self.sequence)

    def _leave_behind(self, requests):
        kept, held = self.state.left_behind, self.state.held_buffers
        kept[:] = [
            r for r in kept if not request_done(r)
        ]  # (earlier calls' requests that have completed)
        held[:] = [(r, b) for r, b in held if any(r is k for k in kept)]
        for request in {id(r): r for r in [*requests, *self.posted]}.values():  # (each once)
            if any(request is r for r in kept) or request_done(
                request
            ):  # (kept already: look_around raised)
                continue
            if id(request) in self.collectives:  # (MPI_Cancel of a collective is erroneous)
                held.append((request, self.collectives[id(request)]))
            else:
                with contextlib.suppress(MPI.Exception):
                    request.Cancel()  # (receives; Open MPI does not cancel sends)
            kept.append(request)  # (the request holds its buffer)


def set_up_or_rank_failure(comm, set_up, sequence=None, also_revoke=()):
    """``set_up()``: collectives of a call before its run (the library's duplicate of ``comm``, the
    ranks' agreement). An error it raises because a rank of ``comm`` died is raised as RankFailure
    (faults.ulfm.failure_of), as in a run; any other as it is."""
    try:
        return set_up()
    except (
        Exception
    ) as error:  # (an MPI error, or what a dead rank's missing bytes unpickle to: failure_of)
        from .ulfm import failure_of

        failure = failure_of(error, comm, sequence, also_revoke=also_revoke)
        if failure is None:
            raise
        raise failure from error


def wait_for_set_up(state, request, sequence):
    """Wait for ``request``, a collective of the set-up of call #``sequence``
    (CommState.make_ready), as a call's wait does: the control channel looked at every millisecond.
    A peer that gave that call up (a timed call makes its communicator ready only after its
    rendezvous, which an untimed one never joins) ends the wait with AllreduceAborted; the request
    stays pending (a collective cannot be cancelled), for the next set-up. Done, the channel is
    looked at once more (the peer's next set-up may have completed it): the AllreduceAborted to
    raise once this set-up is complete (the peer is in it), or None."""
    watch = PeerWatch(state, sequence, None, "setting up the communicator")
    look_at = time.monotonic() + _QUIET_SECONDS
    while not request.Test():
        now = time.monotonic()
        if now >= look_at:
            watch.look_around([], now)  # (no request of its own to leave behind: this one is kept)
            look_at = now + _LOOK_EVERY_SECONDS
        yield_core()
    try:
        watch.look_around([], time.monotonic())
    except AllreduceAborted as aborted:
        return aborted
    return None
