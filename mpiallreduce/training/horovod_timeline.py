"""Horovod's timeline: ``hvd.start_timeline(path)`` ... ``hvd.stop_timeline()`` writes, on rank 0,
a trace a person opens in chrome://tracing or Perfetto (the Chrome trace-event JSON): each op of
the facade as two spans, its negotiation (NEGOTIATE_ALLREDUCE) and its data's move (ALLREDUCE),
on a row named as Horovod names it (allreduce.<name>), with CYCLE_START marks where asked.

Where the library's own calls are wanted too, its flight recorder has them
(MPIALLREDUCE_TRACE_ENTRIES; ``mpiallreduce.dump_trace()``, ``mpiallreduce trace DIR``).
"""

import json
import os
import threading
import time
from typing import Any

from .horovod_engine import forget, observe
from .torch_tensors import default_comm

__all__ = ["start_timeline", "stop_timeline"]

_lock = threading.Lock()
_current: dict[str, Any] = {}


def start_timeline(file_path, mark_cycles=False):
    """Record the facade's ops from now into ``file_path`` (written by stop_timeline, on rank 0;
    a timeline already running is stopped first)."""
    stop_timeline()
    started = time.time()
    events, rows = [], {}

    def record(event, label, phase):
        if event == "CYCLE_START" and not mark_cycles:
            return
        with _lock:
            row = rows.setdefault(label, len(rows) + 1)
            events.append(
                {
                    "name": event,
                    "ph": phase,
                    "ts": (time.time() - started) * 1e6,
                    "pid": row,
                    "tid": 0,
                    **({"s": "p"} if phase == "i" else {}),
                }
            )

    observe(record)
    _current.update(path=os.fspath(file_path), events=events, rows=rows, started=started,
                    record=record)  # fmt: skip


def stop_timeline():
    """Stop recording and write the trace (rank 0)."""
    if not _current:
        return
    forget(_current["record"])
    path, events, rows, started = (_current[k] for k in ("path", "events", "rows", "started"))
    _current.clear()
    if default_comm().Get_rank() != 0:
        return
    with _lock:
        named = [
            {"name": "process_name", "ph": "M", "pid": row, "args": {"name": label}}
            for label, row in rows.items()
        ]
        document = {
            "traceEvents": named + events,
            "displayTimeUnit": "ms",
            "otherData": {"start_time_since_epoch_in_micros": int(started * 1e6)},
        }
    with open(path, "w") as out:
        json.dump(document, out)
