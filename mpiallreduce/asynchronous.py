"""Allreduces that run while the caller goes on: one background thread per process, in call order.

    caller thread:   allreduce_async(a) -> h1   allreduce_async(b) -> h2   ...   h2.wait()  h1.wait()
    worker thread:                   [ allreduce(a) ][ allreduce(b) ] ...

Every rank submits its calls in the same order and one worker per process runs them in that order,
so the collectives of all ranks match, as in Horovod's background thread; handles may be waited on
in any order. While calls are pending, a synchronous ``allreduce`` from any thread joins the same
queue, so it cannot overtake them. MPI must be initialised with MPI_THREAD_MULTIPLE (mpi4py's
default). The caller must not touch ``x`` (or ``out``) until the handle is done.
"""
import queue
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout

from mpi4py import MPI

from .device import namespace, synchronize
from .faults import call_site

__all__ = ["AllreduceHandle", "allreduce_async", "asynchronous_calls_pending", "run_in_order"]


#: how long wait(timeout) waits beyond ``timeout`` for the call to give up on its own
#: (the ranks' GAVE_UP messages: see mpiallreduce.faults)
GIVE_UP_GRACE_SECONDS = 2.0


class _Meeting:
    """The rendezvous of one asynchronous call, made when the worker starts it; a deadline asked
    for earlier (by ``wait(timeout)``) is applied then."""

    def __init__(self, timeout, site):
        self.timeout = timeout
        self.site = site
        self.rendezvous = None
        self.deadline = None

    def __call__(self, comm, sequence, site):
        from .faults import Rendezvous
        self.rendezvous = Rendezvous(comm, sequence, self.timeout, self.site)
        if self.deadline is not None:
            self.rendezvous.bring_deadline_forward(self.deadline)
        return self.rendezvous

    def bring_deadline_forward(self, deadline):
        self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)
        if self.rendezvous is not None:
            self.rendezvous.bring_deadline_forward(deadline)


class AllreduceHandle:
    """What ``allreduce_async`` returns: ``wait(timeout=None)`` gives the result, ``done()`` polls."""

    def __init__(self, future, description, meeting=None):
        self._future = future
        self._description = description
        self._meeting = meeting

    def done(self):
        return self._future.done()

    def wait(self, timeout=None):
        """The result (raises what the allreduce raised).

        With ``timeout``: if not every rank has reached this call within ``timeout`` seconds, it
        gives up (on every rank, as a timed ``allreduce`` does) and this raises AllreduceTimeout
        naming the ranks that had not arrived. If they all had and the data is still moving, or
        the call is still queued behind earlier ones, AllreduceTimeout says so and the call goes on.
        """
        if timeout is None:
            return self._future.result()
        self._meeting.bring_deadline_forward(time.monotonic() + timeout)
        try:
            return self._future.result(timeout + GIVE_UP_GRACE_SECONDS)
        except FutureTimeout:
            if self._future.done():  # the call's own AllreduceTimeout (a TimeoutError, as FutureTimeout is)
                raise
        from .faults import AllreduceTimeout
        rendezvous = self._meeting.rendezvous
        if rendezvous is None:
            raise AllreduceTimeout(f"{self._description}: not started after {timeout} s: it is queued behind "
                                   "earlier asynchronous calls that have not finished") from None
        raise AllreduceTimeout(f"{self._description} (call #{rendezvous.sequence}): every rank arrived, but the "
                               f"reduction has not finished after {timeout} s; it goes on",
                               sequence=rendezvous.sequence, waited=timeout) from None

    def __repr__(self):
        return f"<AllreduceHandle {self._description} {'done' if self.done() else 'pending'}>"


class _Worker:
    def __init__(self):
        self.tasks = queue.Queue()
        self.pending = 0
        self.lock = threading.Lock()
        self.thread = None

    def submit(self, function):
        future = Future()
        with self.lock:
            self.pending += 1
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="mpiallreduce-worker", daemon=True)
                self.thread.start()
        self.tasks.put((function, future))
        return future

    def _run(self):
        while True:
            function, future = self.tasks.get()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(function())
                    except BaseException as exc:  # delivered to whoever waits
                        future.set_exception(exc)
            finally:
                with self.lock:
                    self.pending -= 1

    def busy(self):
        return self.pending > 0 and threading.current_thread() is not self.thread


_worker = _Worker()


def _check_thread_level():
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("allreduce_async needs MPI initialised with MPI_THREAD_MULTIPLE "
                           f"(this process has level {MPI.Query_thread()}); mpi4py asks for it by default")


def asynchronous_calls_pending():
    """Whether calls started by allreduce_async are still queued or running (seen from another thread)."""
    return _worker.busy()


def run_in_order(function):
    """Run ``function`` now, or after the pending asynchronous calls if there are any."""
    if _worker.busy():
        return _worker.submit(function).result()
    return function()


def allreduce_async(x, op="sum", algorithm="auto", comm=None, out=None, check=False, **kwargs):
    """Start ``allreduce(x, ...)`` (same arguments) in the background; returns an AllreduceHandle."""
    from .api import _allreduce_now
    _check_thread_level()
    from .api import TIMEOUT_BY_DEFAULT
    description = f"allreduce of {getattr(x, 'shape', '?')} {getattr(x, 'dtype', type(x).__name__)} op={op}"
    timeout = kwargs.pop("timeout", None)
    meeting = _Meeting(TIMEOUT_BY_DEFAULT if timeout is None else timeout, call_site())
    kwargs["meeting"] = meeting
    xp = namespace(x)
    if xp is None:
        future = _worker.submit(lambda: _allreduce_now(x, op, algorithm, comm, out, check, **kwargs))
    else:
        # Device arrays: the caller's kernels that wrote x finish before the worker thread (with
        # its own current stream) reads it, the worker uses x's GPU (the current device is per
        # thread), and the result is complete when the handle says done.
        synchronize(xp)

        def on_device():
            with x.device:
                result = _allreduce_now(x, op, algorithm, comm, out, check, **kwargs)
                synchronize(xp)
            return result

        future = _worker.submit(on_device)
    return AllreduceHandle(future, description, meeting)
