"""Fixtures for tests that run on every rank under mpiexec."""

import pytest
from mpi4py import MPI

_communicators = {}


def _spans_nodes():
    """Whether COMM_WORLD's ranks are on several nodes (emulated ones too), from MPI itself."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size() != MPI.COMM_WORLD.Get_size()
    finally:
        node.Free()


#: made once, collectively, as every rank imports this file
SPANS_NODES = _spans_nodes()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "one_node(reason): a test of what runs on one node only (shared memory, single copy, "
        "device to device, symmetric arrays, the shared slots); skipped, saying why, across nodes",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Across nodes: skip what the one_node marker names, and every case of a one-node algorithm
    (a test's ``algorithm`` parameter: the planner refuses it there, as test_emulated_nodes
    tests)."""
    if not SPANS_NODES:
        return
    marker = item.get_closest_marker("one_node")
    if marker is not None:
        pytest.skip(f"one node only: {marker.args[0] if marker.args else 'it runs on one node'}")
    from mpiallreduce.algorithms import REGISTRY

    algorithm = getattr(item, "callspec", None) and item.callspec.params.get("algorithm")
    if isinstance(algorithm, str) and algorithm in REGISTRY and REGISTRY[algorithm].needs_one_node:
        pytest.skip(f"one node only: {algorithm} needs every rank on one node")


def _make(kind):
    world = MPI.COMM_WORLD
    if kind == "world":
        return world
    if kind == "split":
        # two halves, ranks numbered in reverse: sizes and orders unlike COMM_WORLD's
        return world.Split(color=world.Get_rank() % 2, key=-world.Get_rank())
    if kind == "dup":
        return world.Dup()
    raise ValueError(kind)


# What each kind adds: "split" (two halves, ranks reversed) a communicator unlike COMM_WORLD in size
# and order, its halves running at once; "dup" COMM_WORLD's ranks in COMM_WORLD's order on a
# communicator of its own (not COMM_WORLD's short path). Only where it adds something: the Dup at 2
# ranks (where the Split's halves have one rank each), the Split at 4 ranks (two 2-rank halves at
# once, ranks reversed; at 3 its halves, 2 ranks and 1, repeated the 4-rank run's half and the
# 1-rank run, 12 s of the 3-rank launch; at 5 its halves, 3 and 2 ranks, repeat the runs at 3 and
# 2). On one rank all three are the same one-rank communicator: world alone. (Cut repetition, not
# coverage: docs/performance.md.)
_SIZE = MPI.COMM_WORLD.Get_size()
KINDS = (
    ["world"]
    if _SIZE == 1
    else ["world", "split", "dup"]
    if _SIZE == 2
    else ["world", "split"]
    if _SIZE == 4
    else ["world"]
)


def communicator(kind):
    """The communicator of ``kind`` ("world", "split", "dup"), made once, collectively."""
    if kind not in _communicators:
        _communicators[kind] = _make(kind)
    return _communicators[kind]


@pytest.fixture(params=KINDS)
def comm(request):
    """Each test runs on COMM_WORLD, and on a Dup of it at 2 ranks and a Split of it at 4
    (KINDS)."""
    return communicator(request.param)


def pytest_sessionfinish(session):
    for kind, c in _communicators.items():
        if kind != "world" and not MPI.Is_finalized():
            c.Free()
    _communicators.clear()


@pytest.fixture
def use_settings():
    """``use_settings(cuda_aware=True, ...)``: run the test with these settings
    (mpiallreduce.settings, normally read once from the environment), every rank alike; the old ones
    come back after."""
    import dataclasses

    from mpiallreduce.core import settings as settings_module

    original = settings_module.settings()

    def apply(**changes):
        settings_module.reset_settings(dataclasses.replace(settings_module.settings(), **changes))

    yield apply
    settings_module.reset_settings(original)
