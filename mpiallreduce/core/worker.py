"""Allreduces that run while the caller goes on: a background thread per communicator, in order.

    caller thread:   allreduce_async(a) -> h1   allreduce_async(b) -> h2  ...  h2.wait()  h1.wait()
    comm's worker:                   [ allreduce(a) ][ allreduce(b) ] ...

Every rank submits its calls on a communicator in the same order and that communicator's worker
runs them in that order, so the collectives of all ranks match, as in Horovod's background thread;
handles may be waited on in any order. While calls are pending on a communicator, a synchronous
``allreduce`` on it from any thread joins the same queue, so it cannot overtake them. The order is
per communicator (as MPI's is): two threads that call on two communicators never wait on each
other, and calls on different communicators may run at the same time on their own workers. A call
that must first make something collective (its communicator's first call, a shared window that
grows) runs on the caller's thread instead, once its communicator's pending calls have finished
(``run_here``; its handle is done when returned): a worker never makes a communicator or a window,
so that every communicator and window is made by a thread of the user's program, in that thread's
program order. MPI must be initialised with MPI_THREAD_MULTIPLE (mpi4py's default). The caller must
not touch ``x`` (or ``out``) until the handle is done.
"""

import queue
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from mpi4py import MPI

from ..device.arrays import namespace, synchronize

__all__ = [
    "AllreduceHandle",
    "Worker",
    "submit",
    "submit_prepared",
    "asynchronous_calls_pending",
    "run_in_order",
    "run_here",
    "pending_calls_finished",
    "check_thread_level",
    "Meeting",
    "Done",
]


#: how long wait(timeout) waits beyond ``timeout`` for the call to give up on its own
#: (the ranks' GAVE_UP messages: see mpiallreduce.faults)
GIVE_UP_GRACE_SECONDS = 2.0


class Meeting:
    """The rendezvous of one asynchronous call, made when the worker starts it; a deadline asked
    for earlier (by ``wait(timeout)``) is applied then."""

    def __init__(self, timeout, site):
        self.timeout = timeout
        self.site = site
        self.rendezvous = None
        self.deadline = None

    def __call__(self, state, sequence, site):
        from ..faults.rendezvous import Rendezvous

        self.rendezvous = Rendezvous(state, sequence, self.timeout, self.site)
        if self.deadline is not None:
            self.rendezvous.bring_deadline_forward(self.deadline)
        return self.rendezvous

    def bring_deadline_forward(self, deadline):
        self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)
        if self.rendezvous is not None:
            self.rendezvous.bring_deadline_forward(deadline)


class AllreduceHandle:
    """What ``allreduce_async`` returns: ``wait(timeout=None)`` gives the result, ``done()``
    polls."""

    def __init__(self, future, description, meeting=None):
        self._future = future
        self._description = description
        self._meeting = meeting

    def done(self):
        return self._future.done()

    def wait(self, timeout=None):
        """The result (raises what the allreduce raised).

        With ``timeout``, for a call started with a timeout of its own (``allreduce_async(...,
        timeout=T)`` or MPIALLREDUCE_TIMEOUT): if not every rank has reached this call within
        ``timeout`` seconds, it gives up (on every rank, as a timed ``allreduce`` does) and this
        raises AllreduceTimeout naming the ranks that had not arrived. If they all had and the data
        is still moving, or the call is still queued behind earlier ones, or the call has no
        timeout of its own (its ranks do not meet first: whether they do must be the same on every
        rank), AllreduceTimeout says so and the call goes on.
        """
        if timeout is None:
            return self._future.result()
        timed = self._meeting.timeout is not None
        if timed:
            self._meeting.bring_deadline_forward(time.monotonic() + timeout)
        try:
            return self._future.result(timeout + (GIVE_UP_GRACE_SECONDS if timed else 0))
        except FutureTimeout:
            if (
                self._future.done()
            ):  # the call's own AllreduceTimeout (a TimeoutError, as FutureTimeout is)
                raise
        from ..faults.errors import AllreduceTimeout

        rendezvous = self._meeting.rendezvous
        if not timed:
            raise AllreduceTimeout(
                f"{self._description}: not finished after {timeout} s; it goes on (started "
                "without a timeout of its own, it cannot be given up on every rank)"
            ) from None
        if rendezvous is None:
            raise AllreduceTimeout(
                f"{self._description}: not started after {timeout} s: it is queued behind "
                "earlier asynchronous calls that have not finished"
            ) from None
        raise AllreduceTimeout(
            f"{self._description} (call #{rendezvous.sequence}): every rank arrived, but the "
            f"reduction has not finished after {timeout} s; it goes on",
            sequence=rendezvous.sequence,
            waited=timeout,
        ) from None

    def __repr__(self):
        return f"<AllreduceHandle {self._description} {'done' if self.done() else 'pending'}>"


class Worker:
    """The background thread of one communicator (``CommState.worker``) and its queue: calls
    submitted to it run in submission order; ``exclusive`` is held by a call of that communicator
    that runs on the caller's thread (``run_here``), so no call of it joins the queue meanwhile.
    Nothing here is shared between communicators."""

    def __init__(self, name="mpiallreduce-worker"):
        self.name = name
        self.tasks = queue.Queue()
        self.pending = 0  # (read by _compiled.c from this object's __dict__: no property)
        self.lock = threading.Lock()
        self.thread = None
        self.exclusive = threading.RLock()
        with _workers_lock:
            _workers.add(self)

    def submit(self, function):
        future = Future()
        with self.exclusive, self.lock:
            self.pending += 1
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self.thread.start()
            self.tasks.put((function, future))
        return future

    def stop(self):
        """End the thread once the calls queued have run (the communicator is being freed)."""
        with self.lock:
            if self.thread is not None:
                self.tasks.put((None, None))
                self.thread = None

    def _run(self):
        while True:
            function, future = self.tasks.get()
            if function is None:
                return
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
        """Whether calls are queued or running here, seen from another thread than this worker's."""
        return self.pending > 0 and threading.current_thread() is not self.thread

    def run_in_order(self, function):
        """Run ``function`` now, or after this communicator's pending calls if there are any."""
        if self.busy():
            return self.submit(function).result()
        return function()

    def run_here(self, function):
        """Run ``function`` on this thread, once this communicator's pending calls have finished (a
        call that makes a communicator or a window: see the module's docstring)."""
        with self.exclusive:
            if self.busy():
                self.submit(lambda: None).result()
            return function()

    def finished(self, waited):
        """Whether this communicator's pending calls ended within ``waited`` seconds."""
        if not self.busy():
            return True
        try:
            self.submit(lambda: None).result(waited)
            return True
        except FutureTimeout:
            return False


#: every communicator's worker that is alive (asynchronous_calls_pending, the wait at exit)
_workers: weakref.WeakSet["Worker"] = weakref.WeakSet()
_workers_lock = threading.Lock()


def _every_worker():
    with _workers_lock:  # (another thread may make one meanwhile: a set changed in iteration)
        return list(_workers)


def check_thread_level():
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            "allreduce_async needs MPI initialised with MPI_THREAD_MULTIPLE "
            f"(this process has level {MPI.Query_thread()}); mpi4py asks for it by default"
        )


def asynchronous_calls_pending():
    """Whether calls started by allreduce_async are still queued or running on any communicator
    (seen from another thread than their worker)."""
    return any(worker.busy() for worker in _every_worker())


def run_in_order(state, function):
    """Run ``function`` now, or after ``state``'s communicator's pending calls if there are any."""
    return state.worker.run_in_order(function)


def run_here(state, function):
    """Run ``function`` on this thread, once ``state``'s communicator's pending calls have
    finished."""
    return state.worker.run_here(function)


def _done(worker, function):
    """A Future holding what ``worker.run_here(function)`` returned or raised."""
    future = Future()
    future.set_running_or_notify_cancel()
    try:
        future.set_result(worker.run_here(function))
    except Exception as exc:  # delivered to whoever waits, as the worker's are
        future.set_exception(exc)
    return future


#: how long a free (at exit, or of a communicator) waits for asynchronous calls nobody waited for
FREE_WAIT_SECONDS = 60


def pending_calls_finished(when, workers=None):
    """Wait for the asynchronous calls still queued or running on ``workers`` (default: every
    communicator's; every rank made them: they end) before the windows and communicators they use
    are freed, at ``when``; False, said on stderr, if they have not ended within FREE_WAIT_SECONDS
    (or twice the timeout setting)."""
    workers = [
        worker for worker in (_every_worker() if workers is None else workers) if worker.busy()
    ]
    if not workers:
        return True
    from .settings import settings

    timeout = settings().timeout
    waited = FREE_WAIT_SECONDS if timeout is None else max(FREE_WAIT_SECONDS, 2 * timeout)
    deadline = time.monotonic() + waited
    if all(worker.finished(max(0.0, deadline - time.monotonic())) for worker in workers):
        return True
    print(
        f"mpiallreduce: rank {MPI.COMM_WORLD.Get_rank()}: asynchronous allreduces still running at "
        f"{when} after {waited} s; the library's communicators are left to MPI_Finalize",
        file=sys.stderr,
    )
    return False


def submit_prepared(prepared, run, here=False):
    """Run a PreparedAllreduce (``run``: its numbered run) on the worker (``here``: on this thread,
    after the pending calls); an AllreduceHandle."""
    if not here:
        check_thread_level()
    meeting = Meeting(None, prepared.site)
    return submit(
        prepared.state,
        run,
        prepared.x,
        f"prepared allreduce of {prepared.x.shape} {prepared.x.dtype}",
        meeting,
        here=here,
    )


def submit(state, run, x, description, meeting, checksum_comm=None, here=False):
    """Run ``run`` on the worker of ``state``'s communicator (``here``: on this thread, after its
    pending calls); an AllreduceHandle.

    ``checksum_comm`` (check=True, or MPIALLREDUCE_DEBUG_INPUTS=1: the call's communicator): ``x``
    is checksummed here and again once the reduction has finished (unless ``x`` is the output); the
    ranks then agree, so that if ``x`` changed on any rank meanwhile, every rank's ``wait()`` raises
    RuntimeError naming the ranks. A change after the reduction has finished is harmless and not
    seen.
    """
    xp = namespace(x)
    checksum = None if checksum_comm is None else _checksum(x)

    def finish(result):
        if checksum is not None:
            from .consistency import agree_on_outcome

            error = None
            if x is not result and _checksum(x) != checksum:
                error = RuntimeError(
                    "x changed between allreduce_async and the end of the reduction"
                )
            agree_on_outcome(
                checksum_comm,
                error,
                f"{description} (check: x must not change until wait() returns; "
                "the results may mix old and new values on every rank)",
            )
        return result

    if xp is None:
        job = lambda: finish(run())  # noqa: E731
    else:
        # Device arrays: the caller's kernels that wrote x finish before the worker thread (with
        # its own current stream) reads it: an event on the caller's stream, waited for by the
        # worker, so the caller is not held up. The worker uses x's GPU (the current device is per
        # thread), and the result is complete when the handle says done.
        written = xp.cuda.get_current_stream().record()

        def on_device():
            with x.device:
                written.synchronize()
                result = run()
                synchronize(xp)
                return finish(result)

        job = on_device
    future = _done(state.worker, job) if here else state.worker.submit(job)
    return AllreduceHandle(future, description, meeting)


def _checksum(x):
    from .consistency import content_digest

    return content_digest(x)


class Done:
    """What a call run here returned or raised, waited for like a background call's handle."""

    def __init__(self, result=None, error=None):
        self.result, self.error = result, error

    @classmethod
    def of(cls, function):
        def run(*args, **kwargs):
            try:
                return cls(function(*args, **kwargs))
            except Exception as error:  # noqa: BLE001 - raised by wait(), as a background call's is
                return cls(error=error)

        return run

    def wait(self):
        if self.error is not None:
            raise self.error
        return self.result
