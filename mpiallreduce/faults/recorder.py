"""The flight recorder: every rank keeps its last calls in a ring buffer and writes them to a file
when something goes wrong, so that ``mpiallreduce trace DIR`` can say which rank and which call.

    numbered       record(state, n, what)  ->  [comm, n, what, state, queued, started, ended, error]
    started        entry[STATE] = RUNNING, entry[STARTED] = clock()      (asynchronous calls)
    ended          entry[STATE] = DONE, entry[ENDED] = clock()           (or finish(entry, error))
    dumped         TRACE_DIR/rank<R>.json: on AllreduceTimeout and RankFailure, on an abort
                   (mpiallreduce.faults.aborting), on SIGTERM while abort_on_exception is on (as
                   ``mpiallreduce launch`` sets it), on SIGUSR1, and on
                   ``mpiallreduce.dump_trace()``

An entry's ``what`` is the object that describes the call (a Call while it runs, an Execution,
a prepared call's or a finished call's ``Described`` snapshot: each has ``trace_fields()``, and
none holds a user's array once the call is over), turned into text only when the buffer is
dumped: recording a call is a list made and stored, and two clock readings. A call's state: queued
(numbered, waiting behind asynchronous calls), running, done, failed (its own error on this rank: a
timeout, a mismatch, an exception), abandoned (given up because of another rank: AllreduceAborted,
RankFailure).

The signals that dump it: mpiallreduce.faults.recorder_signals.
"""

import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..core.settings import settings
from .world import world_rank_and_size

__all__ = [
    "dump_trace",
    "record_call",
    "run_traced",
    "finish",
    "array_fields",
    "Described",
    "dump",
    "recorder",
    "world_ranks",
    "trace_id",
    "named_members",
    "QUEUED",
    "RUNNING",
    "DONE",
    "FAILED",
    "ABANDONED",
    "add_source",
]

QUEUED, RUNNING, DONE, FAILED, ABANDONED = "queued", "running", "done", "failed", "abandoned"
WITHDRAWN = (
    "withdrawn"  # (recorded, then not made: the short path handed the call to the general one)
)
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

    def last(self):
        """The entries, oldest first."""
        entries = list(self.entries)  # (a copy: other threads go on recording)
        return [
            e for e in sorted((e for e in entries if e is not None), key=lambda e: e[QUEUED_AT])
        ]


class Described(dict):
    """The description of a collective that is not an allreduce (the library's gathers, symmetric
    allocations), for the recorder: its fields as given."""

    def trace_fields(self):
        return dict(self)


_recorder = None
_dumping = threading.Lock()
#: more entries for a dump, kept outside the ring buffer (mpiallreduce.jax: its handler's record
#: of the calls compiled programs made); each a function giving entry fields as _entry_fields does
_sources: list[Callable[[], list[dict[str, Any]]]] = []


def add_source(entries):
    """Add ``entries()`` (a list of dicts of entry fields, times as wall-clock seconds) to every
    dump of this process (once per function)."""
    if entries not in _sources:
        _sources.append(entries)


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


#: members -> how many communicators of these members this process has recorded so far
_ids: dict[tuple[int, ...], int] = {}


def trace_id(members):
    """A name for a new communicator of ``members`` (world ranks) that is the same on every rank
    where the ranks make their communicators in the same order: COMM_WORLD and its duplicates
    have the same members and number their calls from 1 each, so the members alone are not one."""
    k = _ids[members] = _ids.get(members, -1) + 1
    return f"{','.join(map(str, members))}#{k}"


def named_members(comm):
    """(``comm``'s world ranks, its trace_id): what CommState records calls under."""
    members = world_ranks(comm)
    return members, trace_id(members)


def record_call(state, sequence, what, status=QUEUED):
    """The entry of call #``sequence`` on ``state``'s communicator, or None with no recorder."""
    current = state.recorder
    return None if current is None else current.record(state, sequence, what, status)


def run_traced(entry, function):
    """``function()``, its entry marked running, then done or failed (``entry`` None: just the
    call). A description that holds the call's arrays (``holds_arrays``: a Call) is then replaced by
    a snapshot of its fields, so that the ring never keeps a user's array alive."""
    if entry is None:
        return function()
    entry[STATE], entry[STARTED] = RUNNING, clock()
    try:
        result = function()
    except BaseException as error:
        finish(entry, error)
        raise
    finally:
        if getattr(entry[WHAT], "holds_arrays", False):
            entry[WHAT] = Described(entry[WHAT].trace_fields())
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
    entry[ERROR] = _error_fields(
        error
    )  # (not the exception: its traceback holds the call's arrays)
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
            fields[name] = (
                {str(k): v for k, v in value.items()}
                if isinstance(value, dict)
                else list(value)
                if isinstance(value, (tuple, list))
                else value
            )
    return fields


def _entry_fields(entry, offset):
    state = entry[COMM]
    fields = {
        "comm": list(state.members),
        "comm_id": state.trace_id,
        "rank_in_comm": state.rank,
        "call": entry[NUMBER],
        "state": entry[STATE],
    }
    try:
        fields.update(entry[WHAT].trace_fields())
    except Exception as error:  # noqa: BLE001 - a dump must not fail on one entry
        fields["what"] = f"(not described: {type(error).__name__}: {error})"
    fields["queued"] = entry[QUEUED_AT] + offset
    fields["started"] = entry[STARTED] + offset
    fields["ended"] = None if entry[ENDED] is None else entry[ENDED] + offset
    if entry[ERROR] is not None:
        fields["error"] = entry[ERROR]
    return fields


def _entries_from_sources():
    entries = []
    for source in _sources:
        try:
            entries.extend(source())
        except Exception as error:  # noqa: BLE001 - a dump must not fail on one source
            print(f"mpiallreduce: a flight recorder source failed: {error}", file=sys.stderr)
    return entries


def trace_dir():
    return settings().trace_dir or os.path.join(os.getcwd(), "mpiallreduce-trace")


def dump(reason="on demand", directory=None):
    """Write this rank's buffer to ``directory`` (MPIALLREDUCE_TRACE_DIR, else ./mpiallreduce-trace)
    as rank<R>.json, replacing an earlier dump of this rank; the file's path, or None (no recorder,
    or it could not be written: said on stderr, never raised)."""
    current = recorder()
    rank, size = world_rank_and_size()
    if current is None or rank is None:
        return None
    with _dumping:
        try:
            directory = directory or trace_dir()
            os.makedirs(directory, exist_ok=True)
            offset = time.time() - clock()
            document = {
                "rank": rank,
                "size": size,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("PMIX_NAMESPACE") or "",
                "reason": reason,
                "dumped": time.time(),
                "entries": sorted(
                    [_entry_fields(e, offset) for e in current.last() if e[STATE] != WITHDRAWN]
                    + _entries_from_sources(),
                    key=lambda fields: fields["queued"],
                ),
            }
            path = os.path.join(directory, f"rank{rank}.json")
            partial = f"{path}.{os.getpid()}.partial"
            with open(partial, "w") as out:
                json.dump(document, out, default=str)
            os.replace(partial, path)
            return path
        except Exception as error:  # noqa: BLE001 - said, never raised: it runs where a call already failed
            print(
                f"[rank {rank}] mpiallreduce: could not write the flight recorder's dump: {error}",
                file=sys.stderr,
                flush=True,
            )
            return None


def dump_trace(reason="on demand", directory=None):
    """``mpiallreduce.dump_trace()``: write this rank's flight recorder to a file now (see
    ``dump``)."""
    return dump(reason, directory)
