"""``mpiallreduce trace DIR``: merge the flight recorder's dumps (DIR/rank<R>.json, one per rank,
from ranks on any nodes: mpiallreduce.faults.recorder) and say where the ranks parted.

    the dumps       which ranks left one, and why (a timeout, a lost rank, an abort, SIGTERM...)
    divergence      per communicator, call by call in number order, the first call where
                    - the ranks' signatures differ (shape, dtype, op, in place, kind),
                    - some ranks never made it (their last call came before),
                    - a call failed, naming ranks (a timeout's missing ones, a lost rank),
                    - one rank still runs a call the others finished,
                    and the ranks concerned (world ranks)
    side by side    each rank's last calls there, a short table
    or agreement    every rank agrees on every call recorded, and the slowest rank of each of the
                    last calls (the last to start it: the one the others waited for)
"""

import glob
import json
import os
from dataclasses import dataclass, field

__all__ = ["load_dumps", "analyze", "Finding", "main"]

#: what must be equal across the ranks for the same call number
SIGNATURE = ("kind", "shape", "dtype", "op", "in_place")
STILL = ("running", "queued")


@dataclass
class Finding:
    # (its world ranks, its name in the dumps: COMM_WORLD and its duplicates have the same ranks)
    comm: tuple
    call: int
    what: str
    ranks: list[int]
    detail: str = ""


@dataclass
class Analysis:
    dumps: list
    finding: Finding | None
    findings: list[Finding] = field(
        default_factory=list
    )  # every one, each communicator's in call order
    culprits: list[int] = field(
        default_factory=list
    )  # ranks whose own dump says they ended the job
    lines: list[str] = field(default_factory=list)


def load_dumps(directory):
    """Every rank<R>.json under ``directory``, by rank (a FileNotFoundError naming it if none)."""
    paths = sorted(glob.glob(os.path.join(directory, "rank*.json")))
    if not paths:
        raise FileNotFoundError(f"no flight recorder dumps (rank<R>.json) in {directory}")
    dumps = []
    for path in paths:
        with open(path) as f:
            dumps.append(json.load(f))
    return sorted(dumps, key=lambda d: d["rank"])


def _kind(entry):
    return "allreduce" if entry.get("kind") in ("allreduce", "prepared") else entry.get("kind")


def _signature(entry):
    return tuple(_kind(entry) if key == "kind" else json.dumps(entry.get(key)) for key in SIGNATURE)


def _named_ranks(entry):
    """World ranks an entry's error names (a timeout's missing ranks, lost ranks, an aborting
    peer)."""
    error, members = entry.get("error") or {}, entry["comm"]
    named = list(error.get("missing_ranks", [])) + list(error.get("failed_ranks", []))
    if error.get("failed_rank") is not None:
        named.append(error["failed_rank"])
    return sorted({members[r] for r in named if 0 <= r < len(members)})


def _by_comm(dumps):
    """{(members, comm_id): {world rank: {call: entry}}}; a rank of the communicator whose dump has
    no entry on it is there with none (it never made a call there, as far as its dump says)."""
    comms = {}
    for dump in dumps:
        for entry in dump["entries"]:
            key = (tuple(entry["comm"]), entry.get("comm_id", ""))
            comms.setdefault(key, {}).setdefault(dump["rank"], {})[entry["call"]] = entry
    for (members, _), calls in comms.items():
        for dump in dumps:
            if dump["rank"] in members:
                calls.setdefault(dump["rank"], {})
    return comms


def _same_job(dumps):
    """(the dumps of the newest dump's job, the others): a folder may hold an older run's dumps."""
    newest = max(dumps, key=lambda d: d.get("dumped", 0))
    job = newest.get("job", "")
    return [d for d in dumps if d.get("job", "") == job], [
        d for d in dumps if d.get("job", "") != job
    ]


def _divergences(comm, calls, dumped):
    """Every Finding on one communicator (``calls``: {rank: {call: entry}}), in call order: a call
    whose signatures differ, that failed, that some ranks never made (each such rank once: its
    later calls are not known), or that one rank still runs while the others finished it."""
    last = {rank: max(entries, default=0) for rank, entries in calls.items()}
    start = max(
        min(entries) for entries in calls.values() if entries
    )  # (older calls may have left some buffers)
    gone = set()  # ranks known to have stopped before (never reached an earlier call)
    for n in range(start, max(last.values()) + 1):
        present = {rank: entries[n] for rank, entries in calls.items() if n in entries}
        began = min((e["started"] for e in present.values()), default=None)
        # (a rank whose dump was written before the others began call n cannot say it never made it:
        # killed since, it left an older dump)
        never = sorted(
            rank
            for rank in calls
            if rank not in gone and last[rank] < n and began is not None and dumped[rank] >= began
        )
        groups = {}
        for rank, entry in present.items():
            groups.setdefault(_signature(entry), []).append(rank)
        failed = {rank: e for rank, e in present.items() if e["state"] in ("failed", "abandoned")}
        still = sorted(rank for rank, e in present.items() if e["state"] in STILL)
        if len(groups) > 1:
            sizes = sorted((len(g) for g in groups.values()), reverse=True)
            largest = sizes[0] if sizes[0] > sizes[1] else None  # (a tie: every rank is concerned)
            odd = sorted(r for g in groups.values() if len(g) != largest for r in g)
            detail = "; ".join(
                f"{_ranks(g)}: {_describe_signature(present[g[0]])}" for g in groups.values()
            )
            yield Finding(comm, n, "different signatures", odd, detail)
        elif failed:
            named = sorted({r for e in failed.values() for r in _named_ranks(e)})
            own = sorted(
                rank for rank, e in failed.items() if e["state"] == "failed" and not _named_ranks(e)
            )
            detail = "; ".join(
                f"rank {r}: {e['state']} ({e['error']['type']}: {e['error']['message'][:160]})"
                for r, e in sorted(failed.items())
            )
            yield Finding(comm, n, "failed", named or own or sorted(failed), detail)
        elif never and present:
            detail = "; ".join(f"rank {r}'s last call is #{last[r]}" for r in never)
            yield Finding(
                comm,
                n,
                f"made by {_ranks(sorted(present))}, never reached by {_ranks(never)}",
                never,
                detail,
            )
        elif still and len(still) < len(present):
            yield Finding(
                comm, n, f"still running on {_ranks(still)}, finished on the others", still
            )
        gone.update(never)


def _ranks(ranks):
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _describe_signature(entry):
    shape, dtype = entry.get("shape"), entry.get("dtype")
    return (
        f"{entry.get('kind')} {tuple(shape) if shape is not None else ''} {dtype or ''} "
        f"op={entry.get('op')}{' in place' if entry.get('in_place') else ''}"
        f"{' at ' + entry['site'] if entry.get('site') else ''}"
    )


def _comm_name(comm, size):
    members, name = comm
    if list(members) == list(range(size)):
        return (
            f"COMM_WORLD ({size} ranks)"
            if name.endswith("#0") or not name
            else f"a duplicate of COMM_WORLD ({name})"
        )
    return f"the communicator of world ranks {list(members)}"


def _bytes(n):
    if n is None:
        return ""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def _cell(entry):
    if entry is None:
        return "-"
    took = (
        "" if entry.get("ended") is None else f" {(entry['ended'] - entry['started']) * 1e3:.3g} ms"
    )
    error = f" {entry['error']['type']}" if entry.get("error") else ""
    return (
        f"{entry['state']} {entry.get('algorithm', '')} {_bytes(entry.get('bytes'))}{took}{error}"
    ).strip()


def side_by_side(comm, calls, around, count=6):
    """Each rank's calls on ``comm`` up to call ``around`` (and one after), a table of lines."""
    ranks = sorted(calls)
    numbers = sorted({n for entries in calls.values() for n in entries if n <= around + 1})[-count:]
    cells = [[str(n)] + [_cell(calls[r].get(n)) for r in ranks] for n in numbers]
    header = ["call"] + [f"rank {r}" for r in ranks]
    widths = [max(len(row[i]) for row in cells + [header]) for i in range(len(header))]
    return [
        "  ".join(text.ljust(w) for text, w in zip(row, widths, strict=True)).rstrip()
        for row in [header] + cells
    ]


def _slowest(calls, count=6):
    lines = []
    common = sorted(set.intersection(*(set(e) for e in calls.values())))[-count:]
    for n in common:
        starts = {r: calls[r][n]["started"] for r in calls}
        slow = max(starts, key=starts.get)
        lag = (starts[slow] - min(starts.values())) * 1e3
        lines.append(f"  call #{n}: rank {slow} started last, {lag:.3g} ms after the first")
    return lines


def analyze(dumps):
    dumps, other_jobs = _same_job(dumps)
    size = max(d["size"] for d in dumps)
    ranks = [d["rank"] for d in dumps]
    lines = [
        f"{len(dumps)} dump(s), from {_ranks(ranks)} of {size}"
        + (
            f"; none from {_ranks(sorted(set(range(size)) - set(ranks)))}"
            if len(dumps) < size
            else ""
        )
    ]
    lines += [
        f"  left out: rank {d['rank']}'s dump, of another job ({d.get('job') or 'none named'})"
        for d in other_jobs
    ]
    culprits = []
    for d in dumps:
        lines.append(
            f"  rank {d['rank']} on {d['host']}: {d['reason']} ({len(d['entries'])} calls recorded)"
        )
        if d["reason"].startswith(("uncaught", "sys.exit")):
            culprits.append(d["rank"])
    comms = _by_comm(dumps)
    dumped = {d["rank"]: d.get("dumped", float("inf")) for d in dumps}
    findings = [f for comm, calls in comms.items() for f in _divergences(comm, calls, dumped)]
    finding = min(
        findings,
        key=lambda f: min(
            comms[f.comm][r][f.call]["started"] for r in comms[f.comm] if f.call in comms[f.comm][r]
        ),
        default=None,
    )
    if culprits:
        lines.append(f"ended the job itself: {_ranks(culprits)}")
    if finding is not None:
        lines.append(
            f"first divergence: call #{finding.call} on {_comm_name(finding.comm, size)}: "
            f"{finding.what}"
        )
        if finding.detail:
            lines.append(f"  {finding.detail}")
        lines.append(f"ranks concerned: {', '.join(map(str, finding.ranks))}")
        if len(findings) > 1:
            lines.append(
                f"and {len(findings) - 1} later call(s) where they parted: "
                + "; ".join(
                    f"#{f.call} ({f.what}: {', '.join(map(str, f.ranks))})"
                    for f in findings
                    if f is not finding
                )[:2000]
            )
        lines.append("last calls there, side by side:")
        lines += [
            "  " + line for line in side_by_side(finding.comm, comms[finding.comm], finding.call)
        ]
    else:
        lines.append(
            "every rank agrees on every call recorded "
            f"({sum(len(e) for c in comms.values() for e in c.values())} entries on {len(comms)} "
            "communicator(s))" + (f"; rank(s) {culprits} ended the job" if culprits else "")
        )
        for comm, calls in comms.items():
            lines.append(f"the slowest rank of the last calls on {_comm_name(comm, size)}:")
            lines += _slowest(calls)
    return Analysis(dumps, finding, findings, culprits, lines)


def main(argv):
    from .arguments import ArgumentParser

    parser = ArgumentParser(
        prog="mpiallreduce trace",
        description="merge the flight recorder's dumps (one per rank) and say where the ranks "
        "parted",
        examples=("mpiallreduce trace mpiallreduce-trace",),
    )
    parser.add_argument(
        "directory",
        help="where the dumps are (MPIALLREDUCE_TRACE_DIR; default ./mpiallreduce-trace)",
    )
    args = parser.parse_args(argv)
    try:
        analysis = analyze(load_dumps(args.directory))
    except FileNotFoundError as error:
        parser.error(str(error))
    print("\n".join(analysis.lines))
    return 0
