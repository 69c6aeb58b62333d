"""Stalls, stragglers and lost ranks: a diagnosis instead of a hang.

Timeouts. ``allreduce(x, timeout=T)`` (or ``MPIALLREDUCE_TIMEOUT=T``) first meets the other ranks
on a control communicator of its own (a duplicate of the user's, made on the first such call with
a non-blocking ``MPI_Comm_idup``), in two rounds of 8-byte messages tagged with the call's
sequence number (the how-many-th call of this rank on this communicator):

    round 1  every rank sends ARRIVED(#n) to every other and waits for all of theirs, at most T s
             (a warning names the ranks still missing at a fraction of T: default 0.5)
             -> all arrived: send GO(#n)          -> not all by T: send GAVE_UP(#n), raise
    round 2  wait for GO(#n) from every rank, or GAVE_UP(#n) from any
             -> all GO: reduce                    -> a GAVE_UP: raise

Every rank either sends GO or GAVE_UP for call #n, never both, so round 2 always ends and every
rank ends it the same way: either all reduce, or all raise ``AllreduceTimeout`` (a straggler that
comes after the others gave up learns it from their GAVE_UP). The error names the ranks that had
not arrived and the call's sequence number; ranks found waiting in a call of another number are
named too (a rank skipped a call, or made one more). The data phase itself is not timed: once all
have arrived it runs to the end, or fails as below.

Lost ranks (ULFM). Under ``mpiexec --with-ft ulfm`` (``mpiallreduce launch --fault-tolerant``) an
MPI call that meets a dead peer fails with MPI_ERR_PROC_FAILED; the rank that sees it revokes the
communicators (so that every rank blocked on a live peer wakes with MPI_ERR_REVOKED) and every
survivor raises ``RankFailure`` naming the lost ranks. ``survivors(comm)`` then returns the
shrunken communicator (``MPI_Comm_shrink``) to carry on with. Without ULFM, mpiexec (or ``srun
--kill-on-bad-exit``) ends the job when a rank dies, naming it.
"""
import collections
import math
import os
import sys
import time
import warnings

import numpy as np
from mpi4py import MPI

from .comms import cached

__all__ = ["AllreduceTimeout", "RankFailure", "AllreduceStallWarning", "TIMEOUT_ENV", "WARN_FRACTION_ENV",
           "default_timeout", "call_site", "exit_after_rank_failures", "next_sequence", "Rendezvous", "rendezvous", "failure_of", "survivors"]

TIMEOUT_ENV = "MPIALLREDUCE_TIMEOUT"
WARN_FRACTION_ENV = "MPIALLREDUCE_TIMEOUT_WARN_FRACTION"
DEFAULT_WARN_FRACTION = 0.5

# Control messages: tag = kind + KINDS * (sequence % SEQUENCE_TAGS); the tag upper bound is at least 32767.
ARRIVED, GO, GAVE_UP = 0, 1, 2
KINDS = 3
SEQUENCE_TAGS = 10000


class AllreduceTimeout(TimeoutError):
    """Raised on every waiting rank when a call did not gather all its ranks within the timeout.

    Attributes: ``missing_ranks`` (not arrived, as ranks of the call's communicator), ``sequence``
    (the call's number on this rank), ``waited`` (seconds), ``elsewhere`` ({rank: the sequence
    number of the call that rank was found waiting in}, for ranks in another call).
    """

    def __init__(self, message, missing_ranks=(), sequence=None, waited=None, elsewhere=None):
        super().__init__(message)
        self.missing_ranks = tuple(missing_ranks)
        self.sequence = sequence
        self.waited = waited
        self.elsewhere = dict(elsewhere or {})


class RankFailure(RuntimeError):
    """Raised on every surviving rank when ranks died during a call (ULFM). ``failed_ranks``: ranks
    of the call's communicator known dead. Recover with ``mpiallreduce.survivors(comm)``."""

    def __init__(self, message, failed_ranks=(), sequence=None):
        super().__init__(message)
        self.failed_ranks = tuple(failed_ranks)
        self.sequence = sequence


class AllreduceStallWarning(RuntimeWarning):
    """A call has waited for some ranks longer than the warning fraction of its timeout."""


def default_timeout(environ=None):
    """``MPIALLREDUCE_TIMEOUT`` in seconds, or None (unset, empty or 0: wait for ever)."""
    text = (os.environ if environ is None else environ).get(TIMEOUT_ENV, "").strip()
    if not text:
        return None
    value = float(text)
    if value < 0 or math.isnan(value):
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: expected seconds >= 0")
    return value or None


def warn_fraction(environ=None):
    text = (os.environ if environ is None else environ).get(WARN_FRACTION_ENV, "").strip()
    value = float(text) if text else DEFAULT_WARN_FRACTION
    if not 0 < value <= 1:
        raise ValueError(f"{WARN_FRACTION_ENV}={text!r}: expected a fraction in (0, 1]")
    return value


class _Counter:
    def __init__(self):
        self.value = 0


def next_sequence(comm):
    """Number this rank's next call on ``comm`` (1, 2, ...): the calls that reach communication."""
    counter = cached(comm, "sequence", _Counter)
    counter.value += 1
    return counter.value


def call_site():
    """'file.py:line' of the first caller outside this package (for messages only)."""
    frame = sys._getframe(1)
    package = os.path.dirname(os.path.abspath(__file__))
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame = frame.f_back
    if frame is None:
        return ""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _ranks(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Rendezvous:
    """One call's meeting of the ranks. ``deadline`` (time.monotonic()) may be brought forward by
    another thread (``AllreduceHandle.wait(timeout)``); ``missing`` says who has not arrived yet."""

    def __init__(self, comm, sequence, timeout, site=""):
        self.comm = comm
        self.sequence = sequence
        self.timeout = timeout
        self.site = site
        self.started = None
        self.deadline = math.inf
        self.missing = None  # set of ranks, once round 1 has begun
        self.arrived = False  # round 1 complete

    def bring_deadline_forward(self, deadline):
        self.deadline = min(self.deadline, deadline)

    def _describe(self):
        return f"allreduce call #{self.sequence}" + (f" ({self.site})" if self.site else "")

    def run(self):
        comm = self.comm
        self.started = time.monotonic()
        if self.timeout is not None:
            self.bring_deadline_forward(self.started + self.timeout)
        control = self._control()
        holder = cached(comm, "control", _ControlHolder)
        holder.drain_given_up_calls()
        rank, size = comm.Get_rank(), comm.Get_size()
        others = [r for r in range(size) if r != rank]
        base = KINDS * (self.sequence % SEQUENCE_TAGS)
        token = np.array([self.sequence], dtype=np.int64)
        incoming = np.zeros((size, 1), dtype=np.int64)

        # Round 1: arrivals
        receives = {r: control.Irecv([incoming[r], MPI.INT64_T], r, base + ARRIVED) for r in others}
        _send_to(control, others, token, base + ARRIVED)
        self.missing = set(others)
        warned = False
        warn_at = (self.started + warn_fraction() * self.timeout) if self.timeout is not None else math.inf
        for _ in _polling():
            self._test(receives, self.missing)
            if not self.missing:
                break
            now = time.monotonic()
            if now >= self.deadline:
                for r in self.missing:
                    _cancel(receives[r])
                _send_to(control, others, token, base + GAVE_UP)
                holder.given_up.append(self.sequence)
                raise self._timeout(control, now)
            if not warned and now >= warn_at:
                warned = True
                where = "".join(f" (rank {r} is in its call #{n})" for r, n in self._elsewhere(control).items())
                warnings.warn(f"rank {rank}: {self._describe()} on {size} ranks has waited {now - self.started:.1f} s "
                              f"for {_ranks(self.missing)}{where}; it times out after {self.timeout:g} s",
                              AllreduceStallWarning, stacklevel=5)
        self.arrived = True

        # Round 2: everyone arrived, or someone gave up
        go = {r: control.Irecv([incoming[r], MPI.INT64_T], r, base + GO) for r in others}
        gave_up_from = np.zeros(1, dtype=np.int64)
        status = MPI.Status()
        gave_up = control.Irecv([gave_up_from, MPI.INT64_T], MPI.ANY_SOURCE, base + GAVE_UP)
        _send_to(control, others, token, base + GO)
        waiting = set(others)
        for _ in _polling():
            self._test(go, waiting)
            if not waiting:
                _cancel(gave_up)
                return
            if gave_up.Test(status):
                for r in waiting:
                    _cancel(go[r])
                holder.given_up.append(self.sequence)
                who = status.Get_source()
                raise AllreduceTimeout(
                    f"rank {rank}: {self._describe()} on {size} ranks: rank {who} gave up waiting for it "
                    f"(its timeout ran out before every rank arrived; this rank came "
                    f"{time.monotonic() - self.started:.1f} s ago)",
                    missing_ranks=(), sequence=self.sequence, waited=time.monotonic() - self.started)

    def _control(self):
        """The control communicator (a non-blocking duplicate of the user's, made once)."""
        holder = cached(self.comm, "control", _ControlHolder)
        if holder.comm is None:
            if holder.request is None:
                holder.pending, holder.request = self.comm.Idup()
            for _ in _polling():
                if holder.request.Test():
                    holder.comm, holder.pending, holder.request = holder.pending, None, None
                    break
                if time.monotonic() >= self.deadline:
                    raise AllreduceTimeout(
                        f"rank {self.comm.Get_rank()}: {self._describe()}, the first with a timeout on this "
                        f"communicator of {self.comm.Get_size()} ranks: not every rank entered it within "
                        f"{time.monotonic() - self.started:.1f} s. Which ranks are missing can be told from the "
                        "second such call on (the first sets up the control channel)",
                        sequence=self.sequence, waited=time.monotonic() - self.started)
        return holder.comm

    def _test(self, requests, waiting):
        for r in list(waiting):
            try:
                done = requests[r].Test()
            except MPI.Exception as error:
                failure = failure_of(error, self.comm, self.sequence)
                if failure is None:
                    raise
                raise failure from error
            if done:
                waiting.discard(r)

    def _elsewhere(self, control):
        """{missing rank: the number of the call it waits in} for missing ranks whose arrival message
        for another call is here (looked at, not received)."""
        found = {}
        status = MPI.Status()
        for r in sorted(self.missing):
            if control.Iprobe(r, MPI.ANY_TAG, status) and status.Get_tag() % KINDS == ARRIVED:
                residue = status.Get_tag() // KINDS  # the call number modulo SEQUENCE_TAGS
                number = self.sequence + (residue - self.sequence) % SEQUENCE_TAGS
                if number - self.sequence > SEQUENCE_TAGS // 2:
                    number -= SEQUENCE_TAGS
                if number != self.sequence:
                    found[r] = number
        return found

    def _timeout(self, control, now):
        """The AllreduceTimeout for ranks still missing; finds those waiting in a call of another number."""
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        elsewhere = self._elsewhere(control)
        message = (f"rank {rank}: {self._describe()} on {size} ranks timed out after {now - self.started:.1f} s: "
                   f"{_ranks(self.missing)} had not arrived at it (sequence number {self.sequence})")
        if elsewhere:
            message += "; " + "; ".join(f"rank {r} is waiting in its call #{n}" for r, n in sorted(elsewhere.items()))
            message += " -- the ranks' calls do not match: a rank skipped a call or made one more"
        return AllreduceTimeout(message, missing_ranks=self.missing, sequence=self.sequence,
                                waited=now - self.started, elsewhere=elsewhere)


class _ControlHolder:
    """The control communicator of one user communicator, and the numbers of calls given up on there."""

    def __init__(self):
        self.comm = None
        self.pending = None
        self.request = None
        #: calls this rank gave up on: their late messages are received and dropped, so that they
        #: mislead no later diagnosis
        self.given_up = collections.deque(maxlen=64)

    def drain_given_up_calls(self):
        status = MPI.Status()
        dropped = np.zeros(1, dtype=np.int64)
        for sequence in self.given_up:
            for kind in (ARRIVED, GO, GAVE_UP):
                tag = kind + KINDS * (sequence % SEQUENCE_TAGS)
                while self.comm.Iprobe(MPI.ANY_SOURCE, tag, status):
                    self.comm.Recv([dropped, MPI.INT64_T], status.Get_source(), tag)

    def free(self):
        for comm in (self.comm,):
            if comm is not None and comm != MPI.COMM_NULL:
                try:
                    comm.Free()
                except MPI.Exception:
                    pass


_unfinished_sends = []


def _send_to(control, ranks, token, tag):
    """8-byte messages (sent eagerly; their requests are completed later, never waited for here)."""
    _unfinished_sends[:] = [request for request in _unfinished_sends if not request.Test()]
    _unfinished_sends.extend(control.Isend([token, MPI.INT64_T], r, tag) for r in ranks)


def _cancel(request):
    try:
        request.Cancel()
        request.Wait()
    except MPI.Exception:
        pass


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


def rendezvous(comm, sequence, timeout, site=""):
    """Meet every rank of ``comm`` at call ``sequence`` within ``timeout`` seconds, or raise AllreduceTimeout."""
    Rendezvous(comm, sequence, timeout, site).run()


# ---------------------------------------------------------------------------------------------
# Lost ranks (ULFM)

def _failure_classes():
    return {getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
            if hasattr(MPI, name)}


def failed_ranks(comm):
    """Ranks of ``comm`` this process knows to have failed (ULFM); () where it cannot tell."""
    try:
        group = comm.Get_failed()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return ()
    try:
        return tuple(r for r in MPI.Group.Translate_ranks(group, list(range(group.Get_size())), comm.Get_group())
                     if r != MPI.UNDEFINED)
    finally:
        group.Free()


def failure_of(error, comm, sequence=None, also_revoke=()):
    """The RankFailure for MPI error ``error`` if it says a rank died (or the communicator was
    revoked because one did), else None. Revokes ``comm`` and ``also_revoke`` so every rank wakes."""
    if not isinstance(error, MPI.Exception) or error.Get_error_class() not in _failure_classes():
        return None
    for c in (comm, *also_revoke):
        try:
            if not c.Is_revoked():
                c.Revoke()
        except (MPI.Exception, NotImplementedError, AttributeError):
            pass
    lost = failed_ranks(comm)
    rank = comm.Get_rank()
    what = f"{_ranks(lost)} of {comm.Get_size()} failed" if lost else "a rank failed"
    return RankFailure(f"rank {rank}: allreduce call #{sequence}: {what} during the call "
                       f"({error.Get_error_string()}); recover with mpiallreduce.survivors(comm)",
                       failed_ranks=lost, sequence=sequence)


_shrunk = []  # communicators survivors() made: their ranks lost peers


def survivors(comm):
    """After a RankFailure: the communicator of the ranks still alive (``MPI_Comm_shrink``), ranks
    renumbered in their old order. Collective over the survivors; the old communicator stays revoked.
    End such a program with ``exit_after_rank_failures`` (MPI_Finalize may wait for the dead)."""
    try:
        if not comm.Is_revoked():
            comm.Revoke()
    except MPI.Exception:
        pass
    shrunk = comm.Shrink()
    _shrunk.append(shrunk)
    return shrunk


def exit_after_rank_failures(status=0):
    """End this process with ``status``. If ranks were lost (``survivors`` was called), first wait
    for the other survivors, then leave without MPI_Finalize: under ULFM, Open MPI's MPI_Finalize can
    wait for ever for the dead ranks (open-mpi/ompi#11404; seen here about one run in four).
    Otherwise an ordinary ``sys.exit(status)``."""
    if not _shrunk:
        sys.exit(status)
    try:
        _shrunk[-1].Barrier()
    except MPI.Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
