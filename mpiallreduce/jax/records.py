"""The flight recorder's view of the calls compiled programs make: the handler keeps its own ring
buffer of its last 256 calls (_ffi.cc: Record; no Python runs per call), read when a dump is
written (mpiallreduce.faults.recorder.add_source) and turned into the recorder's entries.

    traced      site(code, fields): what a call site is (shape, dtype, op, its description), by
                the code its lowering gives the handler (the handler records the code alone)
    dumped      entries(): each handler record as an entry, its comm named as the recorder names
                communicators (members, and a trace id the same on every rank)
"""

from ..core.settings import settings
from ..faults.recorder import add_source
from .handler import trace_records

__all__ = ["site", "name_communicator", "entries"]

_sites: dict[int, dict[str, object]] = {}  # code -> the call site's fields
#: trace id -> (world ranks, this rank's rank in the communicator)
_communicators: dict[str, tuple[tuple[int, ...], int]] = {}


def site(code, **fields):
    """Keep ``fields`` for the call site whose handler code is ``code``."""
    _sites[int(code)] = fields
    add_source(entries)


def name_communicator(trace_id, members, rank):
    _communicators[trace_id] = (tuple(members), rank)


def entries():
    """The handler's records as the recorder's entries (oldest first)."""
    made = []
    kept = settings().trace_entries
    for record in trace_records()[-kept:] if kept else []:
        members, rank = _communicators.get(record["comm"], ((), None))
        fields = {
            "comm": list(members),
            "comm_id": record["comm"],
            "rank_in_comm": rank,
            "call": record["call"],
            "state": record["state"],
            "kind": "allreduce",
            "api": "mpiallreduce.jax (compiled)",
            **_sites.get(record["code"], {}),
            "algorithm": record["algorithm"],
            "queued": record["started"],
            "started": record["started"],
            "ended": record["ended"],
        }
        if record["error"]:
            kind = record["error"].split(":", 1)[0]
            fields["error"] = {
                "type": kind if kind.isidentifier() else "JaxRuntimeError",
                "message": record["error"][:500],
            }
        made.append(fields)
    return made
