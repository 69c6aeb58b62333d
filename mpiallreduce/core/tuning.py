"""The table that ``algorithm="auto"`` reads: which algorithm for which rank count and message size.

``mpiallreduce tune`` (mpiallreduce/tune.py, under mpiexec/srun) measures every algorithm on the
current machine and rank count, and writes or updates the table. The table used is, in order: the
one given to ``set_tuning_table(path)``, the file named by ``MPIALLREDUCE_TUNING``
(mpiallreduce.settings), or the one shipped with the package (measured on this project's 2-core
machines). This module only reads the table; what a call runs is decided in mpiallreduce.planner.

Format (JSON)::

    {"metadata": {...},
     "by_ranks": {"2": [{"up_to_bytes": 65536, "algorithm": "mpi"},
                        {"up_to_bytes": null, "algorithm": "ring_pipelined"}], ...}}

For a rank count not in the table, the nearest smaller one is used (else the smallest).

In-place calls (``out=x``) have sections of their own, ``by_ranks_in_place`` and
``by_nodes_in_place``, in the same format: in place, Open MPI's MPI_Allreduce skips a copy that
our algorithms make, and wins sizes it loses out of place. Where the table has no in-place rules
for the rank count (the nearest one the out-of-place section has), an in-place call reads the
out-of-place ones: another count's in-place rules are not taken.

Communicators that span nodes have a section of their own, measured across nodes (``mpiallreduce
tune`` under ``launch --nodes N`` or on a multi-node allocation writes it), by node count, then
rank count, each the nearest smaller one as above::

     "by_nodes": {"2": {"2": [{"up_to_bytes": null, "algorithm": "two_level"}], "4": [...]}}

Without one for a node count, ``auto`` runs ``hierarchical`` there.

Where a call runs MPI's own allreduce on one node, a prepared call of it binds a persistent request
(MPI_Allreduce_init, then Start and Wait each run) or runs the blocking call each time, by the rules
of ``persistent_by_ranks`` (and ``persistent_by_ranks_in_place``), in the same format, read in the
same way, whose "algorithm" is ``"mpi:persistent"`` or ``"mpi"`` (blocking): ``tune`` measures the
two, each prepared, at every size. Across nodes, ``persistent_by_nodes`` (and ``_in_place``), by
node count then rank count as ``by_nodes``. A table without them: persistent below PERSISTENT_BELOW
on one node, never across nodes::

     "persistent_by_ranks": {"2": [{"up_to_bytes": 2896, "algorithm": "mpi:persistent"},
                                   {"up_to_bytes": null, "algorithm": "mpi"}]}

Device (CuPy) arrays have a section of their own: rules by size on one node, and the algorithm
across nodes by whether the MPI is CUDA-aware. ``"measured": false`` marks guesses (the planner
says so in its reason) until a GPU run (benchmarks/gpu/device_check.sh) replaces them::

     "device": {"measured": false,
                "one_node": [{"up_to_bytes": 65535, "algorithm": "mpi"},
                             {"up_to_bytes": null, "algorithm": "device_to_device"}],
                "across_nodes": {"cuda_aware": "ring", "not_cuda_aware": "staged_ring"}}
"""

import functools
import json
import math
import os
from typing import Any

from .digests import digest

__all__ = [
    "TUNING_ENV",
    "DEFAULT_TABLE",
    "set_tuning_table",
    "tuning_table",
    "choose_name",
    "choose_across_nodes",
    "choose_on_device",
    "shipped_device_section",
    "rules_from_measurements",
    "rules_kept_above",
    "rules_kept_outside",
    "table_digest",
    "PERSISTENT",
    "PERSISTENT_BELOW",
    "choose_persistent",
]

TUNING_ENV = "MPIALLREDUCE_TUNING"
DEFAULT_TABLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tuning.json"
)
#: tune prefers MPI_Allreduce (the reference) unless another algorithm is faster by more than this,
#: and by more than what a plain call of it costs over a plain call of MPI's own (tune measures
#: that: the compiled short path runs only MPI's own, mpiallreduce.tools.plain_price)
PREFER_MPI_WITHIN = 0.05
#: the persistent rules' name for MPI's own allreduce bound as a persistent request (tune's
#: contender)
PERSISTENT = "mpi:persistent"
#: where the table has no persistent rules (a table tune wrote before it measured them), a prepared
#: call of MPI's own below this size binds a persistent request. Open MPI 5, 2 ranks, persistent /
#: blocking: 0.50-0.65x from 4 B to 2 KiB, 1.9-2.2x at 4 KiB, 0.9-1.7x above; across 2 emulated
#: nodes 0.75-1.95x, uneven: never there (benchmarks/results-pipeline/persistent-below.txt: the runs
#: and their commands)
PERSISTENT_BELOW = 4 << 10


#: the table's sections of rules, all that plans read (the metadata is not)
RULE_SECTIONS = (
    "by_ranks",
    "by_ranks_in_place",
    "by_nodes",
    "by_nodes_in_place",
    "device",
    "persistent_by_ranks",
    "persistent_by_ranks_in_place",
    "persistent_by_nodes",
    "persistent_by_nodes_in_place",
)

_table = None
_choices: dict[tuple[Any, ...], Any] = {}


def set_tuning_table(path_or_table):
    """Use this table (a path, or a dict in the JSON format) for "auto" from now on."""
    global _table
    if isinstance(path_or_table, dict):
        _table = path_or_table
    else:
        with open(path_or_table) as f:
            _table = json.load(f)
    _choices.clear()
    import sys

    planner, state = (
        sys.modules.get("mpiallreduce.core.planner"),
        sys.modules.get("mpiallreduce.core.state"),
    )
    if planner is not None:  # what was planned with the old table is forgotten
        planner.plan_call.cache_clear()
    if state is not None:
        state.forget_plans()


def tuning_table():
    if _table is None:
        from .settings import settings

        set_tuning_table(settings().tuning_path or DEFAULT_TABLE)
    return _table


def table_digest():
    """A short digest of the table in use: ranks must agree on it (see mpiallreduce.settings)."""
    table = tuning_table()
    text = json.dumps(
        {key: table.get(key) or {} for key in RULE_SECTIONS}, sort_keys=True
    )  # (by name: rules
    # moved from one section to another plan differently)
    return f"{digest(text):016x}"


def _nearest_key(section, count, or_smallest=True):
    """The key of ``section`` (counts as strings) for ``count``: itself, else the nearest smaller
    count, else (``or_smallest``) the smallest; None for an empty section."""
    counts = [int(k) for k in section]
    smaller = [k for k in counts if k <= count]
    if smaller:
        return str(max(smaller))
    return str(min(counts)) if counts and or_smallest else None


def _measured(section, in_place_section, count, in_place):
    """``section``'s entry for ``count`` (the nearest count it has); for an ``in_place`` call,
    ``in_place_section``'s entry for that same count where it has one (never another count's),
    else the out-of-place one."""
    key = _nearest_key(section, count) or (
        _nearest_key(in_place_section, count) if in_place else None
    )
    if key is None:
        return None
    if in_place and key in in_place_section:
        return in_place_section[key]
    return section.get(key)


def _rules_for(size, in_place=False):
    table = tuning_table()
    return (
        _measured(table.get("by_ranks", {}), table.get("by_ranks_in_place", {}), size, in_place)
        or []
    )


def _rule_choice(rules, nbytes, known):
    for rule in rules:
        if rule.get("up_to_bytes") is None or nbytes <= rule["up_to_bytes"]:
            return rule["algorithm"] if rule["algorithm"] in known else "mpi"
    return "mpi"


def choose_name(nbytes, size, known, in_place=False):
    """The algorithm name the table gives for ``nbytes`` on ``size`` ranks ("mpi" if none applies),
    for an ``in_place`` call or not."""
    key = (nbytes, size, in_place)
    choice = _choices.get(key)
    if choice is None:
        choice = _rule_choice(_rules_for(size, in_place), nbytes, known)
        if len(_choices) < 4096:
            _choices[key] = choice
    return choice


def choose_persistent(nbytes, size, in_place=False, nodes=1):
    """Whether a prepared call of MPI's own allreduce of ``nbytes`` on ``size`` ranks binds a
    persistent request: the table's persistent rules for that rank count (and, on ``nodes`` > 1,
    node count: ``persistent_by_nodes``), the nearest as above; without them, below
    PERSISTENT_BELOW on one node and never across nodes."""
    table = tuning_table()
    if nodes > 1:
        rules = _rules_across_nodes(table, "persistent_by_nodes", nodes, size, in_place)
    else:
        rules = _measured(
            table.get("persistent_by_ranks", {}),
            table.get("persistent_by_ranks_in_place", {}),
            size,
            in_place,
        )
    if not rules:
        return nodes == 1 and nbytes < PERSISTENT_BELOW
    return _rule_choice(rules, nbytes, (PERSISTENT,)) == PERSISTENT


def _rules_across_nodes(table, name, nodes, size, in_place):
    """The rules of section ``name`` (or ``name``_in_place) for ``size`` ranks on ``nodes`` nodes:
    the nearest smaller node count, then rank count, as for rank counts; None where it has none."""
    by_nodes, in_place_nodes = (
        table.get(name, {}),
        table.get(name + "_in_place", {}) if in_place else {},
    )
    # (the nearest smaller node count of the out-of-place section, as for rank counts; none smaller:
    # none)
    node_key = _nearest_key(by_nodes, nodes, or_smallest=False) or _nearest_key(
        in_place_nodes, nodes, False
    )
    return (
        None
        if node_key is None
        else _measured(by_nodes.get(node_key, {}), in_place_nodes.get(node_key, {}), size, in_place)
    )


def choose_across_nodes(nbytes, nodes, size, known, in_place=False):
    """The algorithm name the table's ``by_nodes`` section (or ``by_nodes_in_place``) gives for
    ``nbytes`` on ``size`` ranks over ``nodes`` nodes; None when it has nothing for that node
    count (nor a smaller one)."""
    key = (nbytes, size, nodes, in_place)
    if key not in _choices:
        rules = _rules_across_nodes(tuning_table(), "by_nodes", nodes, size, in_place)
        choice = None if not rules else _rule_choice(rules, nbytes, known)
        if len(_choices) < 4096:
            _choices[key] = choice
        return choice
    return _choices[key]


@functools.cache
def shipped_device_section():
    """The shipped table's device section: what "auto" runs on device arrays when the table in use
    has none (a table ``tune`` wrote before it had one, say)."""
    with open(DEFAULT_TABLE) as f:
        return json.load(f)["device"]


def choose_on_device(nbytes, spans_nodes, cuda_aware, known):
    """(algorithm name, measured) for device arrays of ``nbytes`` bytes: the table's device section
    (``measured`` False while its rules are guesses)."""
    section = tuning_table().get("device") or shipped_device_section()
    if spans_nodes:
        name = section["across_nodes"]["cuda_aware" if cuda_aware else "not_cuda_aware"]
        return (name if name in known else "staged_ring"), bool(section.get("measured"))
    return _rule_choice(section["one_node"], nbytes, known), bool(section.get("measured"))


def rules_from_measurements(measurements, prices=None):
    """Rules for one rank count from (nbytes, algorithm, time) triples: the fastest per size of
    MPI's own and the algorithms that beat it by more than PREFER_MPI_WITHIN and by more than their
    ``prices`` ({algorithm: what a plain call of it costs over one of MPI's own}, in the times'
    unit; none: 0), sizes with one winner merged, boundaries halfway (geometrically) between
    measured sizes."""
    prices = prices or {}
    by_size = {}
    for nbytes, algorithm, seconds in measurements:
        by_size.setdefault(nbytes, {})[algorithm] = seconds
    winners = []
    for nbytes in sorted(by_size):
        times = by_size[nbytes]
        mpi = times.get("mpi")
        ahead = {
            name: t
            for name, t in times.items()
            if mpi is None
            or name == "mpi"
            or (mpi > t * (1 + PREFER_MPI_WITHIN) and mpi - t > prices.get(name, 0.0))
        }
        winners.append((nbytes, min(ahead, key=ahead.get)))
    rules = []
    for i, (nbytes, best) in enumerate(winners):
        if rules and rules[-1]["algorithm"] == best:
            continue
        if rules:
            previous = winners[i - 1][0]
            rules[-1]["up_to_bytes"] = int(math.sqrt(previous * nbytes))
        rules.append({"up_to_bytes": None, "algorithm": best})
    return rules


def rules_kept_above(new, kept, cut):
    """``new`` rules up to ``cut`` bytes, ``kept`` (the table's earlier rules) above it: ``tune
    --keep-above`` (measured again where the choice is clear, the earlier rules kept where runs
    differ by more than the algorithms do). Adjacent rules of one algorithm merge."""
    return rules_kept_outside(new, kept, 0, cut)


def rules_kept_outside(new, kept, low, high=None):
    """``new`` rules from ``low`` to ``high`` bytes (None: no end), ``kept`` (the table's earlier
    rules) below ``low`` and above ``high``: what ``tune`` did not measure keeps what it had (the
    new rule spanning a bound ends, or starts, there). Adjacent rules of one algorithm merge."""

    def choose(rules, nbytes):
        return next(
            rule["algorithm"]
            for rule in rules
            if rule["up_to_bytes"] is None or nbytes <= rule["up_to_bytes"]
        )

    pieces = []
    if low > 0:
        pieces += [
            (rule["up_to_bytes"], rule["algorithm"])
            for rule in kept
            if rule["up_to_bytes"] is not None and rule["up_to_bytes"] < low - 1
        ] + [(low - 1, choose(kept, low - 1))]
    pieces += [
        (rule["up_to_bytes"], rule["algorithm"])
        for rule in new
        if rule["up_to_bytes"] is not None
        and rule["up_to_bytes"] >= low
        and (high is None or rule["up_to_bytes"] < high)
    ]
    if high is None:
        pieces.append((None, choose(new, float("inf"))))
    else:
        pieces.append((high, choose(new, high)))
        pieces += [
            (rule["up_to_bytes"], rule["algorithm"])
            for rule in kept
            if rule["up_to_bytes"] is None or rule["up_to_bytes"] > high
        ]
    merged = []
    for up_to, algorithm in pieces:
        if merged and merged[-1]["algorithm"] == algorithm:
            merged[-1]["up_to_bytes"] = up_to
        else:
            merged.append({"algorithm": algorithm, "up_to_bytes": up_to})
    return merged
