"""The flight recorder's signals: SIGUSR1 dumps the buffer and the rank goes on; SIGTERM (under the
launcher, with abort_on_exception) dumps it and ends the rank as SIGTERM would have.

A rank stuck inside MPI runs no Python, so the handlers also have the signals written to a pipe
(``signal.set_wakeup_fd``) that a thread of this module reads: the thread writes the dump while the
main thread waits in MPI (mpi4py releases the GIL there). A forked child (a data loader's worker)
forgets both, so that it never dumps as its parent's rank nor ends it.
"""

import contextlib
import os
import signal
import sys
import threading

from .recorder import _dumping, dump

__all__ = ["install_signal_handlers"]

_installed = False
_wakeup_registered: list[bool] = []
_wakeup = [None, None]  # the write end of the recorder's wakeup pipe, the pid that made it


def _forget_in_child():
    """A forked child (a data loader's worker) keeps the pipe and the handlers: it must not dump
    as its parent's rank, nor end the parent (its SIGTERM's byte would reach the parent's
    thread)."""
    global _installed
    if _wakeup[0] is None:
        return
    try:
        previous = signal.set_wakeup_fd(-1)
        if previous != _wakeup[0]:  # (someone else's since: theirs again)
            signal.set_wakeup_fd(previous)
        for s in (signal.SIGUSR1, signal.SIGTERM):
            if signal.getsignal(s) is _on_signal:
                signal.signal(s, signal.SIG_DFL)
    except ValueError:  # (forked from another thread than the main one: the handlers stay, inert)
        pass
    _installed = False


def install_signal_handlers(terminate=False):
    """SIGUSR1 dumps the buffer and goes on; with ``terminate``, SIGTERM dumps it and ends the rank
    as SIGTERM does. Only from the main thread, only where the signal's handler is the default and
    no wakeup fd is set (an event loop's): otherwise nothing is changed."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return
    wanted = [signal.SIGUSR1] + ([signal.SIGTERM] if terminate else [])
    free = [s for s in wanted if signal.getsignal(s) in (signal.SIG_DFL, _on_signal)]
    if not free:
        return
    if not _installed:
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            if signal.set_wakeup_fd(write, warn_on_full_buffer=False) != -1:
                signal.set_wakeup_fd(-1)  # (someone else's: leave it, and the signals, alone)
                os.close(read), os.close(write)
                return
        except ValueError:
            return
        threading.Thread(
            target=_read_signals, args=(read,), name="mpiallreduce-trace-signals", daemon=True
        ).start()
        _installed, _wakeup[:] = True, [write, os.getpid()]
        if hasattr(os, "register_at_fork") and not _wakeup_registered:
            os.register_at_fork(after_in_child=_forget_in_child)
            _wakeup_registered.append(True)
    for s in free:
        signal.signal(s, _on_signal)


def _on_signal(signum, frame):
    """The Python-level handler, on the main thread. While the wakeup fd is the recorder's, the
    thread that reads it writes the dump and ends the rank: doing it here too could meet this
    thread's own dump in progress (a timeout's), under the lock it holds (a rank left half a file
    and hung so, in a 10-minute soak). Where someone replaced the wakeup fd, it is done here."""
    if os.getpid() != _wakeup[1]:  # (a forked child whose handlers stayed: as if it had none)
        if signum == signal.SIGTERM:
            _terminate()
        return
    current = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(current)
    if current == _wakeup[0]:
        return
    if _dumping.acquire(blocking=False):  # (not inside a dump of this thread's own)
        _dumping.release()
        dump(signal.Signals(signum).name)
    if signum == signal.SIGTERM:
        _terminate()


def _read_signals(fd):
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if os.getpid() != _wakeup[1]:
            return
        for signum in data:  # (the pipe has every signal with a Python handler: these two count)
            if signum in (signal.SIGUSR1, signal.SIGTERM):
                dump(signal.Signals(signum).name)
            if signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is _on_signal:
                _terminate()  # (a handler of the program's own, a checkpoint's, decides instead)


def _terminate():
    """End this rank as SIGTERM would have (status 128 + 15), from any thread."""
    with contextlib.suppress(Exception):  # noqa: BLE001
        sys.stdout.flush(), sys.stderr.flush()
    os._exit(128 + signal.SIGTERM)
