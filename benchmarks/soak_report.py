"""What a chaos soak (benchmarks/soak.py) did, from its ranks' event logs and their flight
recorders' dumps: calls, errors, recoveries, wrong values, hangs, errors that did not name their
cause, and whether ``mpiallreduce trace``'s analyzer names each injected fault's rank at its call.

    python benchmarks/soak_report.py results/soak        (soak.py runs it at its end)
"""

import glob
import json
import os
import sys

from mpiallreduce.tools.trace import analyze, load_dumps

ORDINARY = ("clock", "sync", "async", "prepared", "bucketed")
FAULTS = ("delay", "mismatch", "raise", "kill")
#: calls each episode makes on each rank (the clock's call is an episode of its own)
CALLS = {
    "clock": 1,
    "sync": 1,
    "async": 3,
    "prepared": 3,
    "bucketed": 2,
    "delay": 1,
    "mismatch": 1,
    "raise": 1,
}


def events_of(output):
    events = []
    for path in sorted(glob.glob(os.path.join(output, "events-rank*.jsonl"))):
        rank = int(os.path.basename(path)[len("events-rank") : -len(".jsonl")])
        with open(path) as f:
            events += [dict(json.loads(line), rank=rank) for line in f if line.strip()]
    return events


def count(events, timeout):
    totals = {
        "episodes": len({e["episode"] for e in events}),
        "calls": 0,
        "errors": 0,
        "recoveries": 0,
        "wrong values": 0,
        "hangs": 0,
        "errors not naming their cause": 0,
        "unexpected errors": 0,
        "lost ranks at the run's end": 0,
        "faults injected": len({(e["episode"], e["kind"]) for e in events if e["kind"] in FAULTS}),
    }
    by_rank, last = {}, max((e["episode"] for e in events), default=None)
    for e in events:
        by_rank.setdefault(e["rank"], []).append(e)
        totals["calls"] += CALLS.get(e["kind"], 1)
        totals["wrong values"] += e.get("right") is False
        totals["hangs"] += e.get("seconds", 0) > timeout + 5
        if not e["ok"]:
            totals["errors"] += 1
            if e["episode"] == last and e.get("error") == "RankFailure" and e.get("failed"):
                # (the driver's SIGTERM ends ranks inside the last episode: a survivor's RankFailure
                # names them, whatever was injected there; counted apart, still an error)
                totals["lost ranks at the run's end"] += 1
            elif e["kind"] in FAULTS:
                totals["errors not naming their cause"] += not e.get("named")
            else:
                totals["unexpected errors"] += 1
    for mine in by_rank.values():  # a fault, then the next ordinary call right: a recovery
        for before, after in zip(mine, mine[1:], strict=False):
            totals["recoveries"] += (
                before["kind"] in FAULTS
                and after["kind"] in ORDINARY
                and after.get("right") is True
            )
    return totals


def check_analyzer(events, trace):
    """Each fault whose call is in the dumps: the analyzer's finding there names its culprit."""
    analysis = analyze(load_dumps(trace))
    # (by communicator: its ranks and the recorder's name of it, one of several of those ranks)
    findings = {(tuple(f.comm[0]), f.comm[1], f.call): f for f in analysis.findings}
    spans = {}  # communicator -> [(its first, its last call in one rank's dump)]
    for dump in analysis.dumps:
        calls = {}
        for entry in dump["entries"]:
            calls.setdefault((tuple(entry["comm"]), entry.get("comm_id", "")), []).append(
                entry["call"]
            )
        for comm, numbers in calls.items():
            spans.setdefault(comm, []).append((min(numbers), max(numbers)))
    # (the analyzer compares a call where every dump that has the communicator still holds it)
    windows = {
        comm: (max(low for low, _ in s), max(high for _, high in s)) for comm, s in spans.items()
    }
    checked = {"faults in the dumps": 0, "named by the analyzer": 0, "missed by the analyzer": []}
    seen = set()
    for e in events:
        if e["kind"] not in FAULTS or e.get("sequence") is None or e["rank"] == e.get("culprit"):
            continue
        comm = (tuple(e["comm"]), e.get("comm_id", ""))
        key = (*comm, e["sequence"])
        low, high = windows.get(comm, (0, -1))
        if key in seen or not low <= e["sequence"] <= high:
            continue
        seen.add(key)
        checked["faults in the dumps"] += 1
        finding = findings.get(key)
        if finding is not None and e["culprit"] in finding.ranks:
            checked["named by the analyzer"] += 1
        else:
            checked["missed by the analyzer"].append(
                {"event": e, "finding": finding and finding.__dict__}
            )
    return analysis, checked


def report(output, trace, timeout, returncode=None):
    events = events_of(output)
    totals = count(events, timeout)
    analysis, checked = check_analyzer(events, trace)
    summary = dict(
        totals,
        **{k: v for k, v in checked.items() if k != "missed by the analyzer"},
        **{
            "missed by the analyzer": len(checked["missed by the analyzer"]),
            "dumps": [f"rank {d['rank']}: {d['reason']}" for d in analysis.dumps],
            "launcher exit status": returncode,
        },
    )
    with open(os.path.join(output, "summary.json"), "w") as f:
        json.dump(dict(summary, missed=checked["missed by the analyzer"]), f, indent=1, default=str)
    print("\n".join(f"{key:<32} {value}" for key, value in summary.items()), flush=True)
    for e in [e for e in events if not e["ok"] and "traceback" in e][
        :2
    ]:  # (where an unexpected error came from)
        print(
            f"\nunexpected, rank {e['rank']}, episode {e['episode']} "
            f"({e['kind']} on {e['comm']}):\n{e['traceback']}"
        )
    print("\nmpiallreduce trace " + trace + ":\n" + "\n".join(analysis.lines[:12]), flush=True)
    met = (
        totals["wrong values"] == 0
        and totals["hangs"] == 0
        and totals["errors not naming their cause"] == 0
        and totals["unexpected errors"] == 0
        and not checked["missed by the analyzer"]
    )
    print(
        "\ntargets (0 wrong, 0 hangs, every error naming its cause, the analyzer naming every "
        "fault): "
        f"{'met' if met else 'NOT met'}",
        flush=True,
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from soak import TIMEOUT

    folder = sys.argv[1]
    sys.exit(report(folder, os.path.join(folder, "trace"), TIMEOUT))
