"""Multi-node algorithms on one machine: ranks grouped into pretend nodes
(MPIALLREDUCE_RANKS_PER_NODE)."""

import numpy as np
import pytest
from mpi4py import MPI
from reference import (
    BitsAcrossRanks,
    digests_differ,
    exact_input,
    exact_reference,
    gather_inputs,
    numpy_reference,
    op_applies,
    problems_with,
    values_equal,
)

import mpiallreduce as mar
from mpiallreduce.core.topology import leader_communicator, node_communicator

pytestmark = pytest.mark.mpi


@pytest.fixture(params=[1, 2, 3], ids=lambda k: f"{k}_per_node")
def pretend_nodes(request, use_settings):
    """A fresh Dup of COMM_WORLD whose ranks are grouped k to a node (read at its first use)."""
    use_settings(ranks_per_node=request.param)
    comm = MPI.COMM_WORLD.Dup()
    yield comm, request.param
    comm.Free()  # frees what the library cached on it, nodes and leaders included


def test_pretend_nodes_split_as_asked(pretend_nodes):
    comm, per_node = pretend_nodes
    node = node_communicator(comm)
    first = comm.Get_rank() // per_node * per_node
    assert node.Get_size() == min(per_node, comm.Get_size() - first)
    assert node.allgather(comm.Get_rank()) == list(range(first, first + node.Get_size()))
    leaders = leader_communicator(comm)
    assert (leaders != MPI.COMM_NULL) == (comm.Get_rank() % per_node == 0)


@pytest.mark.one_node("pretend nodes (ranks_per_node) share one real node's memory")
def test_hierarchical_over_pretend_nodes(pretend_nodes):
    comm, _ = pretend_nodes
    rank, size = comm.Get_rank(), comm.Get_size()
    problems, bits = [], BitsAcrossRanks()
    for op in ["sum", "prod", "min", "max", "mean"]:
        for dtype in ["float16", "float64", "int32", "complex128"]:
            if not op_applies(op, dtype):
                continue
            for count in sorted({0, 1, size - 1, size, size + 1, 1009, 100_003}):
                x = exact_input(dtype, count, rank, op)
                result = mar.allreduce(x, op=op, algorithm="hierarchical", comm=comm)
                problems += problems_with(
                    comm,
                    result,
                    exact_reference(op, dtype, count, size),
                    f"{op} {dtype} count={count}",
                    bits,
                )
    problems += bits.problems(comm)
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.one_node("pretend nodes (ranks_per_node) share one real node's memory")
def test_shared_memory_refuses_a_communicator_over_several_nodes_on_every_rank(pretend_nodes):
    comm, per_node = pretend_nodes
    x = np.ones(10)
    if comm.Get_size() <= per_node:
        assert mar.allreduce(x, algorithm="shared_memory", comm=comm)[0] == comm.Get_size()
        return
    with pytest.raises(ValueError, match="needs every rank of the communicator on one node"):
        mar.allreduce(x, algorithm="shared_memory", comm=comm)
    assert mar.allreduce(x, algorithm="ring", comm=comm)[0] == comm.Get_size()


@pytest.mark.one_node("pretend nodes (ranks_per_node) share one real node's memory")
def test_auto_runs_hierarchical_across_nodes_where_the_table_has_nothing_measured_across_nodes(
    pretend_nodes, monkeypatch
):
    from mpiallreduce.algorithms import REGISTRY
    from mpiallreduce.core import tuning

    comm, per_node = pretend_nodes
    ran = []
    original = REGISTRY["hierarchical"].execute
    monkeypatch.setattr(
        REGISTRY["hierarchical"], "execute", lambda *a, **k: ran.append(1) or original(*a, **k)
    )
    tuning.set_tuning_table(
        {"by_ranks": {"1": [{"up_to_bytes": None, "algorithm": "mpi"}]}}
    )  # no by_nodes
    try:
        # (1.2 MB: past overrides.DISSEMINATION_TWO_RANKS_UP_TO, where 2 ranks run dissemination
        # whatever the table says)
        x = exact_input("float32", 300_000, comm.Get_rank(), "sum")
        expected = numpy_reference("sum", gather_inputs(comm, x))
        assert values_equal(mar.allreduce(x, comm=comm), expected)
    finally:
        tuning.set_tuning_table(tuning.DEFAULT_TABLE)
    assert bool(ran) == (comm.Get_size() > per_node), (
        "hierarchical exactly when the ranks span nodes"
    )


@pytest.mark.one_node("pretend nodes (ranks_per_node) share one real node's memory")
def test_auto_never_hands_a_multi_node_communicator_to_shared_memory(pretend_nodes):
    from mpiallreduce.core import tuning

    comm, _ = pretend_nodes
    tuning.set_tuning_table(
        {"by_ranks": {"1": [{"up_to_bytes": None, "algorithm": "shared_memory"}]}}
    )
    try:
        x = exact_input("float64", 1000, comm.Get_rank(), "sum")
        expected = numpy_reference("sum", gather_inputs(comm, x))
        result = mar.allreduce(
            x, comm=comm
        )  # auto: shared_memory where one node, else hierarchical
        assert values_equal(result, expected)
        assert digests_differ(comm, result) is None
    finally:
        tuning.set_tuning_table(tuning.DEFAULT_TABLE)
