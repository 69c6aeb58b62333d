"""The flight recorder: every rank keeps its last calls in a ring buffer and writes them to a file
when something goes wrong, so that ``mpiallreduce trace DIR`` can say which rank and which call.

    numbered       record(state, n, what)  ->  [comm, n, what, state, queued, started, ended, error]
    started        entry[STATE] = RUNNING, entry[STARTED] = clock()      (asynchronous calls)
    ended          entry[STATE] = DONE, entry[ENDED] = clock()           (or finish(entry, error))
    dumped         TRACE_DIR/rank<R>.json: on AllreduceTimeout and RankFailure, on an abort
                   (mpiallreduce.faults.aborting), on SIGTERM while abort_on_exception is on (as
                   ``mpiallreduce launch`` sets it), on SIGUSR1, and on ``mpiallreduce.dump_trace()``

An entry's ``what`` is the object that describes the call (a Call, a prepared call, an Execution:
each has ``trace_fields()``), turned into text only when the buffer is dumped: recording a call is
a list made and stored, and two clock readings. A call's state: queued (numbered, waiting behind
asynchronous calls), running, done, failed (its own error on this rank: a timeout, a mismatch, an
exception), abandoned (given up because of another rank: AllreduceAborted, RankFailure).

Signals reach Python only between bytecodes of the main thread, which a rank stuck in MPI never
runs: the handlers here are also written to a pipe (``signal.set_wakeup_fd``) that a thread of
this module reads, and that thread writes the dump (mpi4py releases the GIL inside MPI calls).
"""
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time

from ..core.settings import settings

__all__ = ["dump_trace", "record_call", "run_traced", "finish", "array_fields", "Described", "dump", "recorder",
           "world_ranks", "install_signal_handlers", "QUEUED", "RUNNING", "DONE", "FAILED", "ABANDONED"]

QUEUED, RUNNING, DONE, FAILED, ABANDONED = "queued", "running", "done", "failed", "abandoned"
#: an entry's fields
COMM, NUMBER, WHAT, STATE, QUEUED_AT, STARTED, ENDED, ERROR = range(8)
clock = time.perf_counter


class Recorder:
    """The ring buffer of one process: its last ``capacity`` calls, on every communicator."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.entries = [None] * capacity
        self.counter = itertools.count()  # (next() is atomic under the GIL: any thread may record)

    def record(self, state, number, what, status=RUNNING):
        now = clock()
        entry = [state, number, what, status, now, now, None, None]
        self.entries[next(self.counter) % self.capacity] = entry
        return entry

    def ran(self, state, number, what, started):
        """The entry of a call that ran from ``started`` until now (numbered once it had)."""
        self.entries[next(self.counter) % self.capacity] = [state, number, what, DONE, started, started, clock(), None]

    def last(self):
        """The entries, oldest first."""
        entries = list(self.entries)  # (a copy: other threads go on recording)
        return [e for e in sorted((e for e in entries if e is not None), key=lambda e: e[QUEUED_AT])]


class Described(dict):
    """The description of a collective that is not an allreduce (the library's gathers, symmetric
    allocations), for the recorder: its fields as given."""

    def trace_fields(self):
        return dict(self)


_recorder = None
_dumping = threading.Lock()


def recorder():
    """This process's Recorder, or None when MPIALLREDUCE_TRACE is off."""
    global _recorder
    current = settings()
    if current.trace_entries and (_recorder is None or _recorder.capacity != current.trace_entries):
        _recorder = Recorder(current.trace_entries)
    elif not current.trace_entries:
        _recorder = None
    return _recorder


def world_ranks(comm):
    """``comm``'s ranks as COMM_WORLD's ranks (a tuple; local, no communication)."""
    from mpi4py import MPI
    size = comm.Get_size()
    if comm == MPI.COMM_WORLD:
        return tuple(range(size))
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(int(r) for r in group.Translate_ranks(list(range(size)), world))
    finally:
        group.Free(), world.Free()


def record_call(state, sequence, what, status=QUEUED):
    """The entry of call #``sequence`` on ``state``'s communicator, or None with no recorder."""
    current = state.recorder
    return None if current is None else current.record(state, sequence, what, status)


def run_traced(entry, function):
    """``function()``, its entry marked running, then done or failed (``entry`` None: just the call)."""
    if entry is None:
        return function()
    entry[STATE], entry[STARTED] = RUNNING, clock()
    try:
        result = function()
    except BaseException as error:
        finish(entry, error)
        raise
    entry[STATE], entry[ENDED] = DONE, clock()
    return result


def finish(entry, error=None):
    """Mark ``entry`` done, or failed/abandoned with ``error``; a timeout or a lost rank dumps the
    buffer (``entry`` None: nothing)."""
    if entry is None:
        return
    entry[ENDED] = clock()
    if error is None:
        entry[STATE] = DONE
        return
    from .errors import AllreduceAborted, AllreduceTimeout, RankFailure
    entry[STATE] = ABANDONED if isinstance(error, (AllreduceAborted, RankFailure)) else FAILED
    entry[ERROR] = error
    if isinstance(error, (AllreduceTimeout, RankFailure)):
        dump(f"{type(error).__name__} in call #{entry[NUMBER]}")


def array_fields(x, **fields):
    """``fields`` with the shape, dtype and bytes of array ``x`` (the calls' ``trace_fields``)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        fields.update(shape=list(x.shape), dtype=str(x.dtype), bytes=int(x.size * x.dtype.itemsize))
    return fields


def _error_fields(error):
    fields = {"type": type(error).__name__, "message": str(error).split("\n")[0][:500]}
    for name in ("missing_ranks", "failed_ranks", "failed_rank", "elsewhere"):
        value = getattr(error, name, None)
        if value not in (None, (), {}):
            fields[name] = ({str(k): v for k, v in value.items()} if isinstance(value, dict) else
                            list(value) if isinstance(value, (tuple, list)) else value)
    return fields


def _entry_fields(entry, offset):
    state = entry[COMM]
    fields = {"comm": list(state.members), "rank_in_comm": state.rank, "call": entry[NUMBER], "state": entry[STATE]}
    try:
        fields.update(entry[WHAT].trace_fields())
    except Exception as error:  # noqa: BLE001 - a dump must not fail on one entry
        fields["what"] = f"(not described: {type(error).__name__}: {error})"
    fields["queued"] = entry[QUEUED_AT] + offset
    fields["started"] = entry[STARTED] + offset
    fields["ended"] = None if entry[ENDED] is None else entry[ENDED] + offset
    if entry[ERROR] is not None:
        fields["error"] = _error_fields(entry[ERROR])
    return fields


def trace_dir():
    return settings().trace_dir or os.path.join(os.getcwd(), "mpiallreduce-trace")


def _world_rank():
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None, None
    return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()


def dump(reason="on demand", directory=None):
    """Write this rank's buffer to ``directory`` (MPIALLREDUCE_TRACE_DIR, else ./mpiallreduce-trace)
    as rank<R>.json, replacing an earlier dump of this rank; the file's path, or None (no recorder,
    or it could not be written: said on stderr, never raised)."""
    current = recorder()
    rank, size = _world_rank()
    if current is None or rank is None:
        return None
    with _dumping:
        try:
            directory = directory or trace_dir()
            os.makedirs(directory, exist_ok=True)
            offset = time.time() - clock()
            document = {"rank": rank, "size": size, "host": socket.gethostname(), "pid": os.getpid(),
                        "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("PMIX_NAMESPACE") or "",
                        "reason": reason, "dumped": time.time(),
                        "entries": [_entry_fields(e, offset) for e in current.last()]}
            path = os.path.join(directory, f"rank{rank}.json")
            partial = f"{path}.{os.getpid()}.partial"
            with open(partial, "w") as out:
                json.dump(document, out, default=str)
            os.replace(partial, path)
            return path
        except Exception as error:  # noqa: BLE001 - said, never raised: it runs where a call already failed
            print(f"[rank {rank}] mpiallreduce: could not write the flight recorder's dump: {error}",
                  file=sys.stderr, flush=True)
            return None


def dump_trace(reason="on demand", directory=None):
    """``mpiallreduce.dump_trace()``: write this rank's flight recorder to a file now (see ``dump``)."""
    return dump(reason, directory)


# -- signals --------------------------------------------------------------------------------------

_installed = False
_wakeup = [None]  # the write end of the recorder's wakeup pipe


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
        threading.Thread(target=_read_signals, args=(read,), name="mpiallreduce-trace-signals", daemon=True).start()
        _installed, _wakeup[0] = True, write
    for s in free:
        signal.signal(s, _on_signal)


def _on_signal(signum, frame):
    """The Python-level handler, on the main thread. While the wakeup fd is the recorder's, the
    thread that reads it writes the dump and ends the rank: doing it here too could meet this
    thread's own dump in progress (a timeout's), under the lock it holds (a rank left half a file
    and hung so, in a 10-minute soak). Where someone replaced the wakeup fd, it is done here."""
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
        for signum in data:  # (the pipe has every signal with a Python handler: these two count)
            if signum in (signal.SIGUSR1, signal.SIGTERM):
                dump(signal.Signals(signum).name)
            if signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is _on_signal:
                _terminate()  # (a handler of the program's own, a checkpoint's, decides instead)


def _terminate():
    """End this rank as SIGTERM would have (status 128 + 15), from any thread."""
    try:
        sys.stdout.flush(), sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    os._exit(128 + signal.SIGTERM)
