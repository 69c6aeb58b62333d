"""Plans checked without MPI: a simulator plays every rank's plan and tracks which ranks' inputs
each element holds. Every element must end up holding every rank's input exactly once, on every
rank."""

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mpiallreduce.algorithms import REGISTRY
from mpiallreduce.algorithms.base import split_evenly

RANK_COUNTS = list(range(1, 18))
ROOT = Path(__file__).resolve().parent.parent


def counts_for(p):
    return sorted({0, 1, p - 1, p, p + 1, 37})


def test_split_evenly_covers_everything_in_order():
    for count in range(0, 40):
        for parts in range(1, 12):
            offsets, counts = split_evenly(count, parts)
            assert sum(counts) == count and max(counts) - min(counts) <= 1
            assert list(offsets) == [sum(counts[:i]) for i in range(parts)]


def full(p):
    return Counter(range(p))


@pytest.mark.parametrize("p", RANK_COUNTS)
def test_ring_plan_reduces_every_element_once_everywhere(p):
    for count in counts_for(p):
        plans = [REGISTRY["ring"].plan(p, r, count) for r in range(p)]
        # buffers[r][i] = multiset of ranks whose input element i of rank r holds
        buffers = [[Counter([r]) for _ in range(count)] for r in range(p)]

        def chunk(plan, c):
            return range(plan.chunk_offsets[c], plan.chunk_offsets[c] + plan.chunk_counts[c])

        for step in range(p - 1):
            sent = {r: plans[r].reduce_scatter_steps[step][0] for r in range(p)}
            messages = {
                plans[r].right: [Counter(buffers[r][i]) for i in chunk(plans[r], sent[r])]
                for r in range(p)
            }
            for r in range(p):
                received = plans[r].reduce_scatter_steps[step][1]
                assert received == sent[plans[r].left], (
                    "receives a chunk its left neighbour did not send"
                )
                for i, contribution in zip(chunk(plans[r], received), messages[r], strict=True):
                    buffers[r][i] += contribution
        for step in range(p - 1):
            sent = {r: plans[r].allgather_steps[step][0] for r in range(p)}
            messages = {
                plans[r].right: [Counter(buffers[r][i]) for i in chunk(plans[r], sent[r])]
                for r in range(p)
            }
            for r in range(p):
                copied = plans[r].allgather_steps[step][1]
                assert copied == sent[plans[r].left]
                for i, value in zip(chunk(plans[r], copied), messages[r], strict=True):
                    buffers[r][i] = value
        for r in range(p):
            assert all(element == full(p) for element in buffers[r]), (p, count, r)


@pytest.mark.parametrize("p", RANK_COUNTS)
def test_recursive_doubling_plan_reduces_every_element_once_everywhere(p):
    plans = [REGISTRY["recursive_doubling"].plan(p, r, 5) for r in range(p)]
    held = [Counter([r]) for r in range(p)]
    folded = [r for r in range(p) if plans[r].fold.fold_into is not None]
    for r in folded:  # fold in
        target = plans[r].fold.fold_into
        assert plans[target].fold.fold_from == r
        held[target] += held[r]
    rounds = {len(plans[r].exchange_partners) for r in range(p) if r not in folded}
    assert len(rounds) == 1, "every exchanging rank must take the same number of rounds"
    assert 2 ** rounds.pop() == p - len(folded), "the exchange must run on a power of two of ranks"
    for step in range(len(plans[-1].exchange_partners)):
        before = [Counter(h) for h in held]
        for r in range(p):
            if r in folded:
                continue
            partner = plans[r].exchange_partners[step]
            assert plans[partner].exchange_partners[step] == r, "partners must choose each other"
            held[r] = before[r] + before[partner]
    for r in folded:  # fold out
        held[r] = Counter(held[plans[r].fold.fold_into])
    assert all(h == full(p) for h in held), (p, held)


def test_auto_follows_the_tuning_table():
    from mpiallreduce.core import tuning
    from mpiallreduce.core.planner import choose_algorithm

    table = {
        "by_ranks": {
            "2": [
                {"up_to_bytes": 1000, "algorithm": "recursive_doubling"},
                {"up_to_bytes": None, "algorithm": "ring"},
            ],
            "4": [{"up_to_bytes": None, "algorithm": "rabenseifner"}],
        }
    }
    try:
        tuning.set_tuning_table(table)
        assert choose_algorithm(1000, 2).name == "recursive_doubling"
        assert choose_algorithm(1001, 2).name == "ring"
        assert choose_algorithm(10, 3).name == "recursive_doubling"  # nearest smaller rank count
        assert choose_algorithm(10, 9).name == "rabenseifner"
        assert choose_algorithm(10, 1).name == "mpi"  # one rank: nothing to reduce
        tuning.set_tuning_table(
            {"by_ranks": {"2": [{"up_to_bytes": None, "algorithm": "not_here"}]}}
        )
        assert choose_algorithm(10, 2).name == "mpi"  # a table from a newer version
    finally:
        tuning.set_tuning_table(tuning.DEFAULT_TABLE)


def test_in_place_calls_follow_the_tables_in_place_rules_where_it_has_them():
    """In place (out=x), Open MPI skips a copy that the hand-written algorithms make: the table has
    rules of its own for such calls, by rank count and across nodes; where it has none for a count,
    the out-of-place rules apply. The plan says so, and the ranks compare it (the signature)."""
    import numpy as np

    from mpiallreduce.core import tuning
    from mpiallreduce.core.planner import CallFacts, plan_call

    f32 = np.dtype(np.float32)
    table = {
        "by_ranks": {
            "2": [{"up_to_bytes": None, "algorithm": "shared_memory"}],
            "3": [{"up_to_bytes": None, "algorithm": "ring"}],
        },
        "by_ranks_in_place": {
            "2": [
                {"up_to_bytes": 1000, "algorithm": "mpi"},
                {"up_to_bytes": None, "algorithm": "ring_pipelined"},
            ]
        },
        "by_nodes": {"2": {"2": [{"up_to_bytes": None, "algorithm": "ring"}]}},
        "by_nodes_in_place": {"2": {"2": [{"up_to_bytes": None, "algorithm": "rabenseifner"}]}},
    }
    try:
        tuning.set_tuning_table(table)
        two, three = CallFacts(size=2), CallFacts(size=3)
        nodes = CallFacts(size=2, spans_nodes=True, node_count=2)
        assert plan_call(two, False, f32, 1000, "sum", "auto").name == "shared_memory"
        in_place = plan_call(two, False, f32, 1000, "sum", "auto", True)
        assert in_place.name == "mpi" and in_place.in_place and "in place" in in_place.reason
        assert plan_call(two, False, f32, 1004, "sum", "auto", True).name == "ring_pipelined"
        assert (
            plan_call(three, False, f32, 1000, "sum", "auto", True).name == "ring"
        )  # (3's, out of place: never
        assert (
            plan_call(CallFacts(size=2), False, f32, 1000, "sum", "auto", True).name == "mpi"
        )  # another count's)
        del table["by_ranks"]["3"]
        tuning.set_tuning_table(table)
        assert (
            plan_call(three, False, f32, 1000, "sum", "auto", True).name == "mpi"
        )  # (nearest: 2, in place)
        assert plan_call(nodes, False, f32, 1000, "sum", "auto").name == "ring"
        assert plan_call(nodes, False, f32, 1000, "sum", "auto", True).name == "rabenseifner"
        del table["by_ranks_in_place"]
        tuning.set_tuning_table(table)
        assert (
            plan_call(three, False, f32, 1000, "sum", "auto", True).name == "shared_memory"
        )  # (none in place)
        assert (
            plan_call(
                CallFacts(size=2, spans_nodes=True, node_count=3),
                False,
                f32,
                1000,
                "sum",
                "auto",
                True,
            ).name
            == "rabenseifner"
        )  # (the nearest smaller node count's, in place)
    finally:
        tuning.set_tuning_table(tuning.DEFAULT_TABLE)


def test_a_large_mean_across_nodes_runs_one_that_divides_as_it_reduces_where_the_table_says_mpi():
    """The table is measured on sums; a mean by MPI's own takes a pass of its own to divide. From
    MEAN_ACROSS_NODES_FROM, where the table says an algorithm that does not divide slices as it
    reduces, a mean across nodes runs MEAN_ACROSS_NODES (not float16: MPI's own keeps its
    arithmetic)."""
    from mpiallreduce.core import tuning
    from mpiallreduce.core.overrides import MEAN_ACROSS_NODES, MEAN_ACROSS_NODES_FROM
    from mpiallreduce.core.planner import CallFacts, plan_call

    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    assert REGISTRY[MEAN_ACROSS_NODES].finishes_slices and MEAN_ACROSS_NODES not in ("mpi",)
    table = {
        "by_ranks": {"2": [{"up_to_bytes": None, "algorithm": "mpi"}]},
        "by_nodes": {
            "2": {
                "2": [
                    {"up_to_bytes": 8 << 20, "algorithm": "mpi"},
                    {"up_to_bytes": None, "algorithm": "rabenseifner"},
                ]
            }
        },
        "by_nodes_in_place": {"2": {"2": [{"up_to_bytes": None, "algorithm": "mpi"}]}},
    }
    try:
        tuning.set_tuning_table(table)
        nodes, one = CallFacts(size=2, spans_nodes=True, node_count=2), CallFacts(size=2)
        for in_place in (False, True):
            plan = plan_call(nodes, False, f32, MEAN_ACROSS_NODES_FROM, "mean", "auto", in_place)
            assert plan.name == MEAN_ACROSS_NODES and "a mean" in plan.reason, plan.describe()
            assert (
                plan_call(
                    nodes, False, f32, MEAN_ACROSS_NODES_FROM - 4, "mean", "auto", in_place
                ).name
                == "mpi"
            )
            assert (
                plan_call(nodes, False, f32, MEAN_ACROSS_NODES_FROM, "sum", "auto", in_place).name
                == "mpi"
            )
            assert (
                plan_call(nodes, False, f16, MEAN_ACROSS_NODES_FROM, "mean", "auto", in_place).name
                == "mpi"
            )
            assert (
                plan_call(one, False, f32, MEAN_ACROSS_NODES_FROM, "mean", "auto", in_place).name
                == "mpi"
            )
        assert (
            plan_call(nodes, False, f32, 16 << 20, "mean", "auto").name == "rabenseifner"
        )  # (it divides already)
        assert (
            plan_call(nodes, False, f32, 16 << 20, "mean", "mpi").name == "mpi"
        )  # (asked for by name)
    finally:
        tuning.set_tuning_table(tuning.DEFAULT_TABLE)


def test_the_table_digest_the_ranks_compare_tells_rules_in_one_section_from_the_same_in_another():
    """Ranks agree on the table by its digest: the same rules under another section (in place, or
    persistent, rather than the algorithms' out-of-place ones) plan otherwise, so digest
    otherwise."""
    from mpiallreduce.core import tuning

    rules = [{"up_to_bytes": None, "algorithm": "mpi"}]
    digests = set()
    try:
        for section in tuning.RULE_SECTIONS:
            tuning.set_tuning_table(
                {
                    "by_ranks": {"2": rules},
                    section: {
                        "2": [
                            {"up_to_bytes": 8, "algorithm": "mpi"},
                            {"up_to_bytes": None, "algorithm": "ring"},
                        ]
                    },
                }
            )
            digests.add(tuning.table_digest())
        tuning.set_tuning_table(
            {"by_ranks": {"2": rules}, "metadata": {"2": {"date_utc": "another"}}}
        )
        digests.add(tuning.table_digest())
        tuning.set_tuning_table({"by_ranks": {"2": rules}})
        assert tuning.table_digest() in digests  # (the metadata is not part of it)
        assert (
            len(digests) == len(tuning.RULE_SECTIONS) + 1
        )  # (each section's apart, and the plain table's)
    finally:
        tuning.set_tuning_table(tuning.DEFAULT_TABLE)


def test_a_prepared_call_of_mpi_is_persistent_at_4_bytes_with_the_shipped_table_and_never_where_it_cannot_be():  # noqa: E501
    """The shipped table binds a persistent request for MPI's own at 4 B on one node (Open MPI's
    persistent allreduce there: 0.6x of its blocking one's time); never for another algorithm,
    device arrays, ULFM (persistent_collectives off), or another route (a reproducible sum)."""
    import dataclasses

    import numpy as np

    from mpiallreduce.core.planner import CallFacts, plan_call

    f32, facts = np.dtype(np.float32), CallFacts(size=2)
    assert plan_call(facts, False, f32, 4, "sum", "mpi").persistent is True
    assert plan_call(facts, False, f32, 4, "sum", "mpi", True).persistent is True
    assert plan_call(facts, False, f32, 4, "sum", "ring").persistent is None
    assert plan_call(facts, True, f32, 4, "sum", "mpi").persistent is None  # (device arrays)
    assert (
        plan_call(
            dataclasses.replace(facts, persistent_collectives=False), False, f32, 4, "sum", "mpi"
        ).persistent
        is None
    )


def test_the_tables_persistent_rules_say_by_size_where_a_prepared_call_of_mpi_is_a_persistent_request():  # noqa: E501
    """tune measures MPI's persistent allreduce against its blocking one per size and writes
    persistent_by_ranks (and _in_place; across nodes persistent_by_nodes) rules; the plan follows
    them (True/False), by rank count as the algorithm rules are read, in place by its own where it
    has them. None: it cannot be one."""
    import dataclasses

    import numpy as np

    from mpiallreduce.core import tuning
    from mpiallreduce.core.planner import CallFacts, plan_call

    f32, two, four = np.dtype(np.float32), CallFacts(size=2), CallFacts(size=4)
    table = {
        "by_ranks": {"2": [{"up_to_bytes": None, "algorithm": "mpi"}]},
        "persistent_by_ranks": {
            "2": [
                {"up_to_bytes": 1000, "algorithm": "mpi:persistent"},
                {"up_to_bytes": 9000, "algorithm": "mpi"},
                {"up_to_bytes": 20000, "algorithm": "mpi:persistent"},
                {"up_to_bytes": None, "algorithm": "mpi"},
            ]
        },
        "persistent_by_ranks_in_place": {
            "2": [
                {"up_to_bytes": 100, "algorithm": "mpi:persistent"},
                {"up_to_bytes": None, "algorithm": "mpi"},
            ]
        },
    }
    try:
        tuning.set_tuning_table(table)
        said = [
            plan_call(two, False, f32, n, "sum", "mpi").persistent
            for n in (4, 1000, 1004, 9004, 20000, 20004)
        ]
        assert said == [True, True, False, True, True, False]
        assert (
            plan_call(two, False, f32, 1000, "sum", "auto").persistent is True
        )  # (auto chose mpi)
        assert [
            plan_call(two, False, f32, n, "sum", "mpi", True).persistent for n in (100, 104)
        ] == [True, False]
        assert (
            plan_call(four, False, f32, 20000, "sum", "mpi", True).persistent is False
        )  # (nearest count: 2's)
        assert plan_call(four, False, f32, 12000, "sum", "mpi").persistent is True
        assert plan_call(two, False, f32, 1000, "sum", "ring").persistent is None
        assert plan_call(two, True, f32, 1000, "sum", "mpi").persistent is None  # (device arrays)
        assert (
            plan_call(
                two, False, np.dtype(np.float16), 8, "mean", "mpi", symmetric=False
            ).persistent
            is True
        )
        assert (
            plan_call(two, False, np.dtype(np.float32), 8, "reproducible_sum", "mpi").persistent
            is None
        )
        nodes = CallFacts(
            size=2, spans_nodes=True, node_count=2
        )  # (across nodes: their own rules, or never)
        assert plan_call(nodes, False, f32, 4, "sum", "mpi").persistent is False
        table["persistent_by_nodes"] = {
            "2": {
                "2": [
                    {"up_to_bytes": 4096, "algorithm": "mpi"},
                    {"up_to_bytes": None, "algorithm": "mpi:persistent"},
                ]
            }
        }
        tuning.set_tuning_table(table)
        assert [
            plan_call(nodes, False, f32, n, "sum", "mpi", i).persistent
            for n in (4096, 4100)
            for i in (False, True)
        ] == [False, False, True, True]
        assert (
            plan_call(
                dataclasses.replace(nodes, node_count=3, size=4), False, f32, 8192, "sum", "mpi"
            ).persistent
            is True
        )  # (the nearest smaller node and rank counts: 2 and 2)
        assert (
            plan_call(two, False, f32, 8192, "sum", "mpi").persistent is False
        )  # (one node: its own rules)
        del (
            table["persistent_by_ranks"],
            table["persistent_by_ranks_in_place"],
            table["persistent_by_nodes"],
        )
        tuning.set_tuning_table(
            table
        )  # (a table without them: below PERSISTENT_BELOW, as before tune measured it)
        assert [
            plan_call(two, False, f32, n, "sum", "mpi").persistent
            for n in (tuning.PERSISTENT_BELOW - 4, tuning.PERSISTENT_BELOW)
        ] == [True, False]
    finally:
        tuning.set_tuning_table(tuning.DEFAULT_TABLE)


def test_an_in_place_mean_takes_the_out_of_place_rule_where_that_one_divides_as_it_reduces():
    """MPI's own allreduce leaves a mean's division to a pass over the whole result; the algorithms
    that finish slices divide each slice where it was reduced (1/p of it per rank). So where the
    in-place rule says mpi and the out-of-place one an algorithm that finishes slices, an in-place
    mean runs the latter; a sum, a float16 mean (accumulated apart) and other ops keep the rule."""
    import numpy as np

    from mpiallreduce.core import tuning
    from mpiallreduce.core.planner import CallFacts, plan_call

    f32, f16, two = np.dtype(np.float32), np.dtype(np.float16), CallFacts(size=2)
    table = {
        "by_ranks": {
            "2": [
                {"up_to_bytes": 1000, "algorithm": "recursive_doubling"},
                {"up_to_bytes": None, "algorithm": "ring_pipelined"},
            ]
        },
        "by_ranks_in_place": {"2": [{"up_to_bytes": None, "algorithm": "mpi"}]},
    }
    try:
        tuning.set_tuning_table(table)
        assert plan_call(two, False, f32, 4000, "sum", "auto", True).name == "mpi"
        assert plan_call(two, False, f32, 4000, "max", "auto", True).name == "mpi"
        mean = plan_call(two, False, f32, 4000, "mean", "auto", True)
        assert mean.name == "ring_pipelined" and "divides" in mean.reason and mean.in_place
        assert (
            plan_call(two, False, f32, 1000, "mean", "auto", True).name == "mpi"
        )  # (recursive_doubling: no)
        assert plan_call(two, False, f16, 4000, "mean", "auto", True).name == "mpi"
        assert (
            plan_call(two, False, f32, 4000, "mean", "mpi", True).name == "mpi"
        )  # (asked for by name)
    finally:
        tuning.set_tuning_table(tuning.DEFAULT_TABLE)


def test_auto_on_device_arrays_follows_the_device_table_and_says_when_it_guesses():
    import json

    import numpy as np

    from mpiallreduce.core import tuning
    from mpiallreduce.core.planner import CallFacts, plan_call

    f32 = np.dtype(np.float32)

    def plan(nbytes, **facts):
        return plan_call(CallFacts(size=4, **facts), True, f32, nbytes, "sum", "auto")

    # the shipped section: measured by the GPU check on the H200 (benchmarks/results-gpu/), whose
    # fastest contender at each size auto runs (Open MPI's path as mpi)
    shipped = tuning.tuning_table()["device"]
    assert shipped["measured"] is True
    bench = json.loads((ROOT / "benchmarks" / "results-gpu" / "bench-gpu.json").read_text())
    fastest = {}
    for m in bench["measurements"]:
        if (
            m["algorithm"] != "auto"
            and not m["in_place"]
            and m["time_us"] < fastest.get(m["nbytes"], ("", 1e300))[1]
        ):
            fastest[m["nbytes"]] = (
                "mpi" if m["algorithm"] == "openmpi" else m["algorithm"],
                m["time_us"],
            )
    assert len(fastest) >= 2 and len({name for name, _ in fastest.values()}) == 2
    for nbytes, (name, _) in fastest.items():
        assert plan(nbytes).name == name, nbytes
        assert "unmeasured" not in plan(nbytes).reason
    guesses = dict(
        shipped,
        measured=False,
        one_node=[
            {"up_to_bytes": 65535, "algorithm": "mpi"},
            {"up_to_bytes": None, "algorithm": "device_to_device"},
        ],
    )
    try:
        tuning.set_tuning_table(dict(tuning.tuning_table(), device=guesses))
        assert plan(65535).name == "mpi" and plan(65536).name == "device_to_device"
        assert "unmeasured guess" in plan(1 << 20).reason
    finally:
        tuning.set_tuning_table(tuning.DEFAULT_TABLE)
    assert plan(1 << 20, spans_nodes=True, node_count=2).name == "staged_ring"
    assert plan(1 << 20, spans_nodes=True, node_count=2, cuda_aware=True).name == "ring"
    measured = {
        "measured": True,
        "one_node": [
            {"up_to_bytes": 1 << 20, "algorithm": "staged_ring"},
            {"up_to_bytes": None, "algorithm": "device_to_device"},
        ],
        "across_nodes": {"cuda_aware": "rabenseifner", "not_cuda_aware": "staged_ring"},
    }
    try:
        tuning.set_tuning_table(dict(tuning.tuning_table(), device=measured))
        assert plan(65536).name == "staged_ring" and plan((1 << 20) + 1).name == "device_to_device"
        assert "unmeasured" not in plan(65536).reason
        assert plan(1 << 20, spans_nodes=True, node_count=2, cuda_aware=True).name == "rabenseifner"
        tuning.set_tuning_table(
            {"by_ranks": {"2": [{"up_to_bytes": None, "algorithm": "ring"}]}}
        )  # no device section
        assert {n: plan(n).name for n in fastest} == {
            n: name for n, (name, _) in fastest.items()
        }  # (the shipped one)
    finally:
        tuning.set_tuning_table(tuning.DEFAULT_TABLE)


def test_a_gpu_bench_run_becomes_the_measured_device_section():
    """tune --from-bench: the fastest per size of Open MPI's path (as mpi) and ours, out of place,
    wrong results and auto left out; the planner then follows it and stops calling it a guess."""
    import numpy as np

    from mpiallreduce.core import tuning
    from mpiallreduce.core.planner import CallFacts, plan_call
    from mpiallreduce.tools.tune import device_section_from_bench

    def m(nbytes, algorithm, us, in_place=False, wrong=0):
        return dict(nbytes=nbytes, algorithm=algorithm, time_us=us, in_place=in_place, wrong=wrong)

    bench = {
        "metadata": {"device": "gpu", "git_commit": "abc", "ranks": 4},
        "measurements": [
            m(1 << 20, "openmpi", 50),
            m(1 << 20, "device_to_device", 80),
            m(1 << 20, "auto", 1),
            m(1 << 26, "openmpi", 5000),
            m(1 << 26, "device_to_device", 600),
            m(1 << 26, "staged_ring", 400, wrong=3),
            m(1 << 26, "ring", 100, in_place=True),
        ],
    }
    section = device_section_from_bench(bench)
    assert section["measured"] is True and section["source"]["git_commit"] == "abc"
    assert [r["algorithm"] for r in section["one_node"]] == ["mpi", "device_to_device"]
    try:
        tuning.set_tuning_table(dict(tuning.tuning_table(), device=section))
        plan = plan_call(CallFacts(size=4), True, np.dtype(np.float32), 1 << 26, "sum", "auto")
        assert plan.name == "device_to_device" and "unmeasured" not in plan.reason
    finally:
        tuning.set_tuning_table(tuning.DEFAULT_TABLE)


def test_shipped_table_names_only_known_algorithms():
    from mpiallreduce.algorithms import ALGORITHMS
    from mpiallreduce.core import tuning

    table = tuning.tuning_table()
    assert table["by_ranks"], "the package ships a measured table"
    for rules in table["by_ranks"].values():
        assert rules[-1]["up_to_bytes"] is None
        assert all(rule["algorithm"] in ALGORITHMS for rule in rules)
        bounds = [rule["up_to_bytes"] for rule in rules[:-1]]
        assert bounds == sorted(bounds)


def test_tune_keep_above_takes_the_new_rules_below_the_cut_and_the_tables_above():
    """tune --keep-above: the new rules up to the cut (the one spanning it ends there), the kept
    rules above it (those ending below it dropped), one rule where both sides name one algorithm."""
    from mpiallreduce.core.tuning import rules_kept_above

    new = [
        {"algorithm": "mpi", "up_to_bytes": 100},
        {"algorithm": "shared_memory", "up_to_bytes": 5000},
        {"algorithm": "ring", "up_to_bytes": None},
    ]
    kept = [
        {"algorithm": "mpi", "up_to_bytes": 400},
        {"algorithm": "ring", "up_to_bytes": 3000},
        {"algorithm": "ring_pipelined", "up_to_bytes": None},
    ]
    assert rules_kept_above(new, kept, 2000) == [
        {"algorithm": "mpi", "up_to_bytes": 100},
        {"algorithm": "shared_memory", "up_to_bytes": 2000},
        {"algorithm": "ring", "up_to_bytes": 3000},
        {"algorithm": "ring_pipelined", "up_to_bytes": None},
    ]
    assert rules_kept_above(new, kept, 100) == [  # (mpi on both sides of the cut: one rule)
        {"algorithm": "mpi", "up_to_bytes": 400},
        {"algorithm": "ring", "up_to_bytes": 3000},
        {"algorithm": "ring_pipelined", "up_to_bytes": None},
    ]
    assert rules_kept_above(new, kept, 10_000) == [  # (the new open-ended rule ends at the cut)
        {"algorithm": "mpi", "up_to_bytes": 100},
        {"algorithm": "shared_memory", "up_to_bytes": 5000},
        {"algorithm": "ring", "up_to_bytes": 10_000},
        {"algorithm": "ring_pipelined", "up_to_bytes": None},
    ]


def test_tune_keeps_the_tables_rules_below_the_smallest_size_it_measured():
    """A tune of 64 KiB and up does not rewrite what it did not measure: below its smallest size the
    table's earlier rules stay (persistent ones of 4 B among them), the new ones from there on."""
    from mpiallreduce.core.tuning import rules_kept_outside

    kept = [
        {"algorithm": "mpi:persistent", "up_to_bytes": 2896},
        {"algorithm": "mpi", "up_to_bytes": 5792},
        {"algorithm": "mpi:persistent", "up_to_bytes": 46340},
        {"algorithm": "mpi", "up_to_bytes": None},
    ]
    new = [
        {"algorithm": "mpi", "up_to_bytes": None}
    ]  # (all it measured, from 64 KiB: the blocking call)
    assert rules_kept_outside(new, kept, 65536) == kept
    new = [{"algorithm": "ring", "up_to_bytes": 100_000}, {"algorithm": "mpi", "up_to_bytes": None}]
    assert rules_kept_outside(new, kept, 65536, 1 << 20) == [
        {"algorithm": "mpi:persistent", "up_to_bytes": 2896},
        {"algorithm": "mpi", "up_to_bytes": 5792},
        {"algorithm": "mpi:persistent", "up_to_bytes": 46340},
        {"algorithm": "mpi", "up_to_bytes": 65535},
        {"algorithm": "ring", "up_to_bytes": 100_000},
        {"algorithm": "mpi", "up_to_bytes": None},
    ]


def test_rules_from_measurements_prefers_mpi_when_close_and_merges():
    from mpiallreduce.core.tuning import rules_from_measurements

    measured = [
        (4, "mpi", 1.0),
        (4, "ring", 0.97),  # ring 3% faster: keep MPI's own
        (64, "mpi", 1.0),
        (64, "ring", 2.0),
        (1024, "mpi", 10.0),
        (1024, "ring", 5.0),
        (4096, "mpi", 40.0),
        (4096, "ring", 20.0),
    ]
    assert rules_from_measurements(measured) == [
        {"up_to_bytes": 256, "algorithm": "mpi"},
        {"up_to_bytes": None, "algorithm": "ring"},
    ]
    # a plain call of ring costing 6 (us) more than one of MPI's own: ring's 5 ahead at 1024 is not
    # enough (though 50% faster), its 20 at 4096 is; a gain equal to the price is not enough either
    assert rules_from_measurements(measured, {"ring": 6.0}) == [
        {"up_to_bytes": 2048, "algorithm": "mpi"},
        {"up_to_bytes": None, "algorithm": "ring"},
    ]
    assert rules_from_measurements(measured, {"ring": 5.0})[0] == {
        "up_to_bytes": 2048,
        "algorithm": "mpi",
    }
    assert rules_from_measurements(measured, {"ring": 4.9})[0] == {
        "up_to_bytes": 256,
        "algorithm": "mpi",
    }
    # each algorithm its own price: where the fastest is priced out, a cheaper one that still gains
    # wins
    cheap = measured + [(1024, "rabenseifner", 7.0), (4096, "rabenseifner", 25.0)]
    assert rules_from_measurements(cheap, {"ring": 6.0, "rabenseifner": 1.0}) == [
        {"up_to_bytes": 256, "algorithm": "mpi"},
        {"up_to_bytes": 2048, "algorithm": "rabenseifner"},
        {"up_to_bytes": None, "algorithm": "ring"},
    ]
    # a size MPI's own was not measured at: the fastest; an algorithm without a price: priced at 0
    assert rules_from_measurements(
        [(4, "ring", 2.0), (4, "rabenseifner", 1.0)], {"rabenseifner": 9.0}
    ) == [{"up_to_bytes": None, "algorithm": "rabenseifner"}]
    assert rules_from_measurements(measured, {"other": 9.0}) == rules_from_measurements(measured)


def test_cost_model_fits_synthetic_times_within_and_between_nodes():
    """Times made from known constants on 1, 2 and 3 nodes give those constants back, exactly."""
    from mpiallreduce.tools.model import MODELLED, Row, cost_terms, fit

    constants = np.array([1e-6, 1 / 10e9, 30e-6, 1 / 1e9, 1 / 4e9])
    rows = [
        Row(
            (nodes, p),
            a,
            n,
            cost_terms(a, p, n, nodes),
            float(cost_terms(a, p, n, nodes) @ constants),
        )
        for a in MODELLED
        for nodes, p in ((1, 2), (1, 3), (1, 4), (2, 2), (2, 4), (3, 3))
        for n in (4, 4096, 1 << 20, 1 << 26)
    ]
    fitted, error = fit(rows)
    assert error < 1e-6
    assert np.allclose(fitted, constants, rtol=1e-6)


def test_cost_model_leaves_oversubscribed_runs_out_of_its_fit_and_says_so():
    """Rows of a run with more ranks than cores (10x too slow here) do not move the fit; the report
    says they were not fitted and how far off they are."""
    from mpiallreduce.tools.model import MODELLED, Row, cost_terms, fit, fitted_rows, report_fit

    constants = np.array([1e-6, 1 / 10e9, 30e-6, 1 / 1e9, 1 / 4e9])
    rows = [
        Row(
            (nodes, p),
            a,
            n,
            cost_terms(a, p, n, nodes),
            slow * float(cost_terms(a, p, n, nodes) @ constants),
            crowded,
        )
        for nodes, p, slow, crowded in ((1, 2, 1, None), (2, 2, 1, None), (2, 4, 10, (4, 2)))
        for a in MODELLED
        for n in (4, 4096, 1 << 20, 1 << 26)
    ]
    fitted, error = fit(fitted_rows(rows))
    assert error < 1e-6 and np.allclose(fitted[2:], constants[2:], rtol=1e-6)
    text = report_fit(rows, fitted, error)
    assert (
        "2 nodes x 2 ranks: the model is off by 90% (median)" in text
        and "not fitted: 4 ranks ran on 2 cores" in text
    )
    assert "not fitted" not in text.split("2 nodes x 1 rank:")[1].splitlines()[0]


def test_cost_terms_send_across_nodes_only_what_crosses():
    from mpiallreduce.tools.model import cost_terms

    n = 1 << 20
    # one node: nothing on the network
    assert not cost_terms("rabenseifner", 4, n, nodes=1)[2:4].any()
    # 2 nodes x 2 ranks, recursive doubling: distance 1 within the node, distance 2 across, where
    # both ranks of a node send the whole buffer over the node's link at once
    assert list(cost_terms("recursive_doubling", 4, n, nodes=2)) == [1, n, 1, 2 * n, 2 * n]
    # the ring crosses once per node per step: 2(p-1) steps of n/p on the link
    assert list(cost_terms("ring", 4, n, nodes=2)[2:4]) == [6, 6 * n / 4]
    # 2 ranks crossing at distance 2 with half the buffer each, in the reduce-scatter and the
    # allgather
    assert cost_terms("rabenseifner", 4, n, nodes=2)[3] == 2 * n
    # two_level: each node's 2 rails carry half the buffer each (Rabenseifner on 2 ranks: a quarter
    # each way), over the same link; reduce-scatter and allgather within the node move n/2 each
    two_level = cost_terms("two_level", 4, n, nodes=2)
    assert (two_level[1], two_level[3]) == (n, n)
    # hierarchical: the leaders alone cross, with the whole buffer; reduce and bcast within the node
    hierarchical = cost_terms("hierarchical", 4, n, nodes=2)
    assert (hierarchical[1], hierarchical[3]) == (2 * n, n)


def exchange(plans, core, buffers, steps_name, combine):
    """Play one phase of pairwise steps (partner, elements sent, elements updated): each partner
    must send exactly the elements this rank updates, which become combine(mine, theirs)."""
    for step in range(len(getattr(plans[core[0]], steps_name))):
        before = [list(map(Counter, b)) for b in buffers]
        for r in core:
            partner, _, (u0, u1) = getattr(plans[r], steps_name)[step]
            partners_partner, sent, _ = getattr(plans[partner], steps_name)[step]
            assert partners_partner == r and sent == (u0, u1), (
                f"{steps_name}: partner must send what this rank updates"
            )
            for i in range(u0, u1):
                buffers[r][i] = combine(before[r][i], before[partner][i])


@pytest.mark.parametrize("p", RANK_COUNTS)
def test_rabenseifner_plan_reduces_every_element_once_everywhere(p):
    for count in counts_for(p):
        plans = [REGISTRY["rabenseifner"].plan(p, r, count) for r in range(p)]
        buffers = [[Counter([r]) for _ in range(count)] for r in range(p)]
        for r in range(p):  # fold in
            target = plans[r].fold.fold_into
            if target is not None:
                assert plans[target].fold.fold_from == r
                buffers[target] = [a + b for a, b in zip(buffers[target], buffers[r], strict=True)]
        core = [r for r in range(p) if plans[r].fold.fold_into is None]
        assert len({len(plans[r].reduce_scatter_steps) for r in core}) == 1
        exchange(plans, core, buffers, "reduce_scatter_steps", lambda mine, theirs: mine + theirs)
        exchange(plans, core, buffers, "allgather_steps", lambda mine, theirs: theirs)
        for r in range(p):  # fold out
            if plans[r].fold.fold_into is not None:
                buffers[r] = list(buffers[plans[r].fold.fold_into])
        for r in range(p):
            assert all(element == full(p) for element in buffers[r]), (p, count, r)


@pytest.mark.parametrize("p", RANK_COUNTS)
def test_pairwise_exchange_plan_gives_every_rank_every_contribution_of_its_slice(p):
    """Step 1 sends slice q of every input to rank q (which then holds all p contributions of it);
    step 3 sends every reduced slice to every other rank: each element ends reduced once,
    everywhere."""
    for count in counts_for(p):
        plans = [REGISTRY["pairwise_exchange"].plan(p, r, count) for r in range(p)]
        assert all(plan.slices == plans[0].slices for plan in plans)
        assert [i for a, b in plans[0].slices for i in range(a, b)] == list(range(count))
        for r, plan in enumerate(plans):
            assert sorted(plan.peers) == [q for q in range(p) if q != r]
            received = Counter(
                [r] + [q for q in range(p) if r in plans[q].peers]
            )  # (whose slice r arrives here)
            assert received == full(p)


def test_reproducible_sums_take_the_direct_route_unless_an_algorithm_is_asked_for():
    """op reproducible_sum (mpiallreduce.reproducible.EXACT_OPS): auto runs an algorithm that holds
    every contribution of an element on one rank: shared_memory on one node below 4 MiB,
    pairwise_exchange from there and across nodes, single_copy on symmetric buffers of one node from
    64 KiB; an algorithm asked for
    runs as asked, and one that reduces pairwise is told to reduce words; never a wider
    accumulator."""
    import numpy as np

    from mpiallreduce.core.planner import CallFacts, Route, plan_call

    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    for facts in (CallFacts(size=4), CallFacts(size=8, spans_nodes=True, node_count=2)):
        plan = plan_call(facts, False, f32, 4 << 20, "reproducible_sum", "auto")
        assert plan.name == "pairwise_exchange" and "exactly from the floats" in plan.reason
        small = plan_call(facts, False, f32, (4 << 20) - 4, "reproducible_sum", "auto")
        assert small.name == ("pairwise_exchange" if facts.spans_nodes else "shared_memory")
        assert ("across nodes" if facts.spans_nodes else "below 4 MiB on one node") in small.reason
        assert plan_call(facts, False, f16, 1 << 10, "reproducible_mean", "auto").accumulate is None
        assert (
            "exactly from the floats"
            not in plan_call(facts, False, f32, 4 << 20, "sum", "auto").reason
        )  # (the table's)
    ring = plan_call(CallFacts(size=4), False, f16, 1 << 20, "reproducible_sum", "ring")
    assert ring.name == "ring" and "fixed-point words" in ring.reason and ring.accumulate is None
    shared = plan_call(CallFacts(size=4), False, f32, 1 << 20, "reproducible_sum", "shared_memory")
    assert shared.name == "shared_memory" and "words" not in shared.reason
    # symmetric buffers on one node: single_copy, which sums every slice from the p floats, from 64
    # KiB
    for dtype in (f32, f16):
        one_node = plan_call(
            CallFacts(size=4), False, dtype, 1 << 20, "reproducible_mean", "auto", symmetric=True
        )
        assert one_node.name == "single_copy" and one_node.route is Route.REPRODUCIBLE_DIRECT
        assert one_node.accumulate is None
    assert plan_call(
        CallFacts(size=4), False, f32, 1 << 10, "reproducible_sum", "auto", symmetric=True
    ).name == ("shared_memory")
    across = plan_call(
        CallFacts(size=8, spans_nodes=True, node_count=2),
        False,
        f32,
        1 << 20,
        "reproducible_sum",
        "auto",
        symmetric=True,
    )
    assert across.name == "pairwise_exchange"


def test_device_to_device_runs_only_where_cuda_ipc_works():
    """device_to_device maps the peers' memory: untested, its plan asks the executor to probe first
    (and plan again with these arguments); refused, auto takes the device table's choice across
    nodes and says why, and asking for it by name is a ValueError; small calls are not affected."""
    import dataclasses

    from mpiallreduce.core.planner import CallFacts, plan_call

    f32 = np.dtype(np.float32)
    big = 1 << 26  # (where the shipped device table runs device_to_device on one node)
    untested = CallFacts(size=4)
    plan = plan_call(untested, True, f32, big, "sum", "auto")
    assert plan.name == "device_to_device" and plan.ipc_probe == (
        True,
        f32,
        big,
        "sum",
        "auto",
        False,
    )
    assert "CUDA IPC not yet probed" in plan.describe()
    works = dataclasses.replace(untested, cuda_ipc="works")
    assert plan_call(works, True, f32, big, "sum", "auto").ipc_probe is None
    assert plan_call(works, True, f32, big, "sum", "device_to_device").name == "device_to_device"
    for aware, fallback in ((False, "staged_ring"), (True, "ring")):
        refused = dataclasses.replace(
            untested, cuda_ipc="refused: rank 1: cudaErrorMapBufferObjectFailed", cuda_aware=aware
        )
        plan = plan_call(refused, True, f32, big, "sum", "auto")
        assert plan.name == fallback and plan.ipc_probe is None, plan.describe()
        assert (
            "not device_to_device, which needs CUDA IPC, refused: rank 1: "
            "cudaErrorMapBufferObjectFailed" in plan.reason
        )
        with pytest.raises(
            ValueError,
            match=r"maps the peers' device memory \(CUDA IPC\), which this machine "
            r"refused \(use algorithm='staged_ring' or 'auto'\)",
        ):
            plan_call(refused, True, f32, big, "sum", "device_to_device")
        assert plan_call(refused, True, f32, 1024, "sum", "auto").name == "mpi"
        assert plan_call(refused, False, f32, big, "sum", "auto").name != "device_to_device"


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64])
def test_a_mean_divides_bit_for_bit_as_numpy_does(dtype):
    from mpiallreduce.core.ops import divide_by_size

    info = np.finfo(dtype)
    values = np.arange(-500, 500).astype(dtype) * 7 + 3
    # subnormals, the largest and the smallest: a multiplication by 1/size must round alike
    extremes = np.array(
        [info.tiny, info.tiny / 3, info.max, -info.max, info.smallest_subnormal], dtype=dtype
    )
    values = np.concatenate([values, extremes, values[:50] / np.array(3, dtype)])
    for size in range(1, 9):
        out = np.empty_like(values)
        with np.errstate(all="ignore"):
            divide_by_size(np, values, size, out)
            expected = values / np.array(size, dtype=dtype)
        assert np.array_equal(out.view(np.uint8), expected.astype(out.dtype).view(np.uint8)), (
            dtype,
            size,
        )


@pytest.mark.parametrize("p", RANK_COUNTS)
def test_dissemination_plan_gives_every_rank_every_input_once_in_the_signature_checks_rounds(p):
    """Played message by message: block j of rank r must hold rank r - j's input, every block once,
    and each round pairs with the signature check's (mpiallreduce.core.consistency)."""
    from mpiallreduce.core.signature_messages import dissemination_peers

    plans = [REGISTRY["dissemination"].plan(p, r, 3) for r in range(p)]
    held = [[r] for r in range(p)]  # (the ranks whose inputs rank r holds, block by block)
    for step in range(len(plans[0].rounds)):
        sent = {}
        for r in range(p):
            to, source, count, at = plans[r].rounds[step]
            assert (to, source) == dissemination_peers(r, p)[step]
            assert at == len(held[r]) and plans[to].rounds[step][1] == r
            sent[to] = held[r][:count]
        for r in range(p):
            held[r] = held[r] + sent[r]
    for r in range(p):
        assert held[r] == [(r - j) % p for j in range(p)], (p, r, held[r])
    largest = max((count for _, _, count, _ in plans[0].rounds), default=0)
    assert (
        plans[0].largest_message(10) == 32 + 10 * largest
    )  # (the codes: the signature's, and the call's number)
    from mpiallreduce.algorithms.dissemination import split
    from mpiallreduce.core.signature_messages import SIGNATURE_MESSAGE_BYTES as HEAD

    for nbytes in (
        0,
        8,
        HEAD - 32,
        HEAD - 31,
        2 * HEAD - 65,
        2 * HEAD - 64,
        10 * largest * 4096 + 3,
    ):
        head, tail = split(nbytes)  # (one head; past it, halves while they fit, else a full head)
        assert head + tail == nbytes and 32 + head <= HEAD, nbytes
        assert tail == 0 or head == min(HEAD - 32, (nbytes + 1) // 2), (nbytes, head, tail)
        assert (tail == 0) == (nbytes <= HEAD - 32), nbytes
    assert REGISTRY["dissemination"].can_carry(
        p, 1 << 20
    )  # (what does not fit a head goes in its tail)


def test_auto_runs_dissemination_for_small_plain_calls_whose_signature_goes_in_messages():
    """It carries the comparison in its rounds: across nodes (or without shared slots), every rank
    compiled, an ordinary sum or mean, up to DISSEMINATION_UP_TO and where its messages fit (on 2
    ranks up to DISSEMINATION_TWO_RANKS_UP_TO, whatever the table says); a prepared call (compared
    once) keeps the table's MPI_Allreduce."""
    from mpiallreduce.core.overrides import (
        DISSEMINATION_TWO_RANKS_IN_PLACE_UP_TO,
        DISSEMINATION_TWO_RANKS_UP_TO,
        DISSEMINATION_UP_TO,
    )
    from mpiallreduce.core.planner import CallFacts, Signature, plan_call

    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    nodes = CallFacts(size=2, spans_nodes=True, node_count=2, compiled=True)
    plan = plan_call(nodes, False, f32, 4, "sum", "auto")
    assert plan.name == "dissemination" and plan.signature is Signature.CARRIED, plan.describe()
    assert plan.signature_text == "carried by dissemination", plan.describe()
    assert (
        plan_call(nodes, False, f32, DISSEMINATION_UP_TO - 32, "mean", "auto").signature_text
        == "carried by dissemination"
    )
    assert plan_call(nodes, False, f32, 4, "sum", "auto", once=True).name == "mpi"
    three = CallFacts(size=3, spans_nodes=True, node_count=3, compiled=True)
    assert plan_call(three, False, f32, 4096, "sum", "auto").name == "dissemination"
    assert (
        plan_call(three, False, f32, DISSEMINATION_UP_TO + 4, "sum", "auto").name != "dissemination"
    )
    # on 2 ranks one exchange of the whole buffer, with a tail past one head: whatever the table
    # says, up to a size
    for nbytes in (DISSEMINATION_UP_TO + 4, 40000, 200000, DISSEMINATION_TWO_RANKS_UP_TO):
        assert (
            plan_call(nodes, False, f32, nbytes, "sum", "auto").signature_text
            == "carried by dissemination"
        ), nbytes
        assert (
            plan_call(nodes, False, f32, nbytes, "sum", "auto", once=True).name != "dissemination"
        )
    assert (
        plan_call(nodes, False, f32, DISSEMINATION_TWO_RANKS_UP_TO + 4, "sum", "auto").name
        != "dissemination"
    )
    # in place (rank 1 copies its result out, where MPI's own in place copies nothing) to a bound of
    # its own
    assert DISSEMINATION_TWO_RANKS_IN_PLACE_UP_TO < DISSEMINATION_TWO_RANKS_UP_TO
    for nbytes, carried in (
        (DISSEMINATION_TWO_RANKS_IN_PLACE_UP_TO, True),
        (DISSEMINATION_TWO_RANKS_IN_PLACE_UP_TO + 4, False),
        (DISSEMINATION_TWO_RANKS_UP_TO, False),
    ):
        assert (
            plan_call(nodes, False, f32, nbytes, "sum", "auto", in_place=True).name
            == "dissemination"
        ) == carried, nbytes
    assert plan_call(nodes, False, f16, 4, "sum", "auto").name != "dissemination"
    assert plan_call(nodes, False, f32, 4, "reproducible_sum", "auto").name != "dissemination"
    assert plan_call(
        CallFacts(size=2, spans_nodes=True, node_count=2), False, f32, 4, "sum", "auto"
    ).signature is (
        Signature.MESSAGES
    )  # (not compiled everywhere: the Python rounds lose to the check and MPI's own)
    assert plan_call(
        CallFacts(size=2, shared_slots=True, compiled=True), False, f32, 4, "sum", "auto"
    ).signature is (Signature.SHARED_SLOTS)
    wide = CallFacts(
        size=64, spans_nodes=True, node_count=2, compiled=True
    )  # (32 blocks: 32 + 32 * 1024 > 16 KiB)
    assert plan_call(wide, False, f32, 1024, "sum", "auto").name != "dissemination"
    asked = plan_call(wide, False, f32, 1024, "sum", "dissemination")
    assert (
        asked.name == "dissemination" and asked.signature_text == "carried by dissemination"
    )  # (tails: any length)


def test_the_tuning_table_imports_no_mpi():
    """mpiallreduce.core.tuning is in the core's MPI-free base (docs/architecture.md): importing it
    (``mpiallreduce tune --from-bench``, which measures nothing) must not start MPI. A review found
    an import of the signature's constants that did."""
    import subprocess
    import sys

    code = "import sys, mpiallreduce.core.tuning; print('mpi4py.MPI' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def test_the_plans_cases_are_enums_listed_in_one_place():
    """Issue 59: a plan's route and signature, and where an algorithm carries the signature, are
    enums (mpiallreduce.core.plan_cases): a reader lists the cases, a misspelt one is an error, and
    each prints as the text describe_call and the docs always showed."""
    import importlib

    from mpiallreduce.algorithms import _check_carries
    from mpiallreduce.core import planner
    from mpiallreduce.core.plan_cases import Carries, Memory, PlanCase, Route, Signature
    from mpiallreduce.core.planner import CallFacts, plan_call

    assert [c.value for c in Route] == [
        "plain",
        "reproducible direct",
        "reproducible words",
        "compressed fp16",
        "compressed bf16",
        "bfloat16 bits",
    ]
    assert [c.value for c in Signature] == [
        "none",
        "shared slots",
        "32-byte messages",
        "carried",
        "agreed once",
    ]
    assert [c.value for c in Carries] == ["shared slots", "messages"]
    assert [c.value for c in Memory] == ["host", "device"]
    # (the planner's names are these, not copies)
    assert (planner.Route, planner.Signature, planner.Carries) == (Route, Signature, Carries)
    for case in (*Route, *Signature, *Carries, *Memory):
        assert isinstance(case, PlanCase) and str(case) == f"{case}" == case.value
        assert type(case)(case.value) is case
    # a misspelt case: an error, by name or by value
    with pytest.raises(AttributeError):
        Route.PLIAN  # noqa: B018
    with pytest.raises(AttributeError):
        Signature.AGREED_ONECE  # noqa: B018
    with pytest.raises(ValueError):
        Route("reproducible wrods")
    with pytest.raises(ValueError):
        Signature("carried by dissemination")  # (the algorithm is the plan's, not the case's)
    with pytest.raises(ValueError):
        Carries("shared slot")
    with pytest.raises(ValueError):
        Memory("hots")  # (Execution's kind: given as text, made the case)
    assert Memory.of(np.zeros(2)) is Memory.HOST and Memory.of(memoryview(b"")) is Memory.DEVICE
    # an algorithm that names a misspelt case is refused by the registry (one given by its text
    # becomes the case)
    module = importlib.import_module("mpiallreduce.algorithms.ring")

    class Misspelt:
        carries_signature = "mesages"

    with pytest.raises(ImportError, match="carries_signature 'mesages' is none of"):
        _check_carries(module, Misspelt())
    spelt = Misspelt()
    spelt.carries_signature = "messages"
    _check_carries(module, spelt)
    assert spelt.carries_signature is Carries.MESSAGES
    assert {a.carries_signature for a in REGISTRY.values()} == {None, *Carries}
    # what the planner makes: the cases themselves, printed as before
    f32, f16, u16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.uint16)
    one_node = CallFacts(size=4, shared_slots=True)
    plain = plan_call(one_node, False, f32, 1 << 10, "sum", "auto")
    assert plain.route is Route.PLAIN and plain.signature is Signature.SHARED_SLOTS
    assert "; route:" not in plain.describe() and plain.describe().endswith(
        "; signature: shared slots"
    )
    once = plain.agreed_once()
    assert once.signature is Signature.AGREED_ONCE and not once.compares
    assert once.describe().endswith("; signature: agreed once")
    words = plan_call(CallFacts(size=4), False, f32, 1 << 20, "reproducible_sum", "ring")
    assert words.route is Route.REPRODUCIBLE_WORDS and words.signature is Signature.MESSAGES
    assert "; route: reproducible words; " in words.describe(), words.describe()
    assert words.describe().endswith("; signature: 32-byte messages")
    direct = plan_call(one_node, False, f32, 1 << 10, "reproducible_sum", "auto")
    assert direct.route is Route.REPRODUCIBLE_DIRECT and direct.signature is Signature.CARRIED
    assert direct.carried and direct.compares
    assert direct.describe().endswith(
        "; route: reproducible direct; signature: carried by shared_memory"
    ), direct.describe()
    assert plan_call(one_node, False, u16, 1 << 10, "bfloat16_bits_sum", "auto").route is (
        Route.BFLOAT16_BITS
    )
    for name, route in (("fp16", Route.COMPRESSED_FP16), ("bf16", Route.COMPRESSED_BF16)):
        compressed = plan_call(one_node, False, f32, 1 << 10, f"compressed_{name}", "auto")
        assert compressed.route is route and route.compressed, compressed.describe()
        assert f"; route: compressed {name}; " in compressed.describe()
    assert not any(
        r.compressed for r in Route if r not in (Route.COMPRESSED_FP16, Route.COMPRESSED_BF16)
    )
    alone = plan_call(CallFacts(size=1), False, f16, 1 << 10, "sum", "auto")
    assert alone.signature is Signature.NONE and not alone.compares
    assert alone.describe().endswith("; signature: none")
