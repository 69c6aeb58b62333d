"""Inputs that depend on rank and index, and the expected results computed independently.

Expected values come from numpy applied to every rank's inputs, never from mpiallreduce: gathered
from the ranks (MPI_Allgather of the raw bytes), or, where the inputs are a function of the rank
(the heavy tests), made here for every rank and cached per case (exact_reference). Exact inputs are
small integers (in every dtype), so any order of summation gives the same bits and results can be
compared bitwise.
"""

import functools
import hashlib
import os

import numpy as np
import pytest
from mpi4py import MPI

NUMPY_REDUCTIONS = {
    "sum": np.add,
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    "mean": np.add,
}
PROD_VALUES = np.array([1, 2, -1, -2, 1, -1, 2])  # |product over 5 ranks| <= 32: exact everywhere


def exact_input(dtype, count, rank, op):
    """Small integer values, different on every rank and index, exact in every dtype tested."""
    dtype = np.dtype(dtype)
    index = np.arange(count, dtype=np.int64)
    if op == "prod":
        values = PROD_VALUES[(index * 3 + rank * 5) % len(PROD_VALUES)]
    else:
        values = (index * 7 + rank * 13 + 3) % 9 - 4  # -4 .. 4
    if dtype.kind == "u":
        values = np.abs(values)
    if dtype.kind == "c":
        return (values + 1j * ((values * 3 + rank) % 5 - 2)).astype(dtype)
    return values.astype(dtype)


def runs_here(algorithm, comm=MPI.COMM_WORLD):
    """Whether ``algorithm`` (a name, or "auto") can run on ``comm``: an algorithm that needs every
    rank on one node (the registry's ``needs_one_node``) cannot across nodes, where the planner
    refuses it on every rank (tests/test_emulated_nodes.py tests that refusal)."""
    from mpiallreduce.algorithms import REGISTRY

    if algorithm not in REGISTRY or not REGISTRY[algorithm].needs_one_node:
        return True
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size() == comm.Get_size()
    finally:
        node.Free()


def op_applies(op, dtype):
    dtype = np.dtype(dtype)
    if op == "mean" and dtype.kind in "iu":
        return False
    return not (op in ("min", "max") and dtype.kind == "c")


def gather_inputs(comm, x):
    """Every rank's ``x``, stacked: shape (comm.size,) + x.shape, gathered with MPI_Allgather on
    bytes."""
    x = np.array(x, order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
    gathered = np.empty((comm.Get_size(),) + x.shape, dtype=x.dtype)
    comm.Allgather(
        [x.reshape(-1).view(np.uint8), MPI.BYTE], [gathered.reshape(-1).view(np.uint8), MPI.BYTE]
    )
    return gathered


def every_ranks(make, size):
    """``make(rank)`` for each of ``size`` ranks, stacked like gather_inputs: the inputs of a test
    whose inputs are a function of the rank (exact_input, a generator seeded by the rank), made here
    with no message, so that a test of many cases sends only its allreduces (and one
    BitsAcrossRanks)."""
    return np.stack([np.asarray(make(rank)) for rank in range(size)])


@functools.cache
def exact_reference(op, dtype, count, size):
    """numpy's ``op`` over the exact_input of each of ``size`` ranks (read-only): made once per
    case, not once per algorithm and per rank's message."""
    expected = numpy_reference(
        op, every_ranks(lambda rank: exact_input(dtype, count, rank, op), size)
    )
    expected.flags.writeable = False
    return expected


def numpy_reference(op, gathered):
    """What the allreduce must return, from numpy alone."""
    size = gathered.shape[0]
    result = NUMPY_REDUCTIONS[op].reduce(gathered, axis=0)
    if op == "mean":
        result = np.divide(result, size).astype(gathered.dtype)
    return result.astype(gathered.dtype)


def significant_bytes(result):
    """The bytes that carry the value: x86's 80-bit long double sits in 16 bytes, 6 of them padding
    that a store leaves as it found them; those may differ between ranks and mean nothing."""
    a = np.ascontiguousarray(result)
    if (
        a.dtype.char in "gG"
        and np.finfo(np.longdouble).nmant == 63
        and np.dtype(np.longdouble).itemsize == 16
    ):
        return a.reshape(-1).view(np.longdouble).view(np.uint8).reshape(-1, 16)[:, :10].tobytes()
    return a.tobytes()


def _digest(result):
    return hashlib.sha256(significant_bytes(result)).hexdigest()


def _who_differs(digests):
    """None if every rank's digest (``digests[rank]``) is the same, else a message naming the ranks
    whose bits differ."""
    groups = {}
    for rank, d in enumerate(digests):
        groups.setdefault(d, []).append(rank)
    if len(groups) == 1:
        return None
    return "results differ between ranks: " + "; ".join(
        f"{d[:12]} on ranks {r}" for d, r in groups.items()
    )


def digests_differ(comm, result):
    """None if every rank holds the same bits, else a message naming the ranks whose bits differ."""
    return _who_differs(comm.allgather(_digest(result)))


class BitsAcrossRanks:
    """The digests of many results, compared across the ranks in one allgather at the end (what
    digests_differ does for one result): ``add`` each, then ``problems(comm)``, collective."""

    def __init__(self):
        self.cases, self.digests = [], []

    def add(self, case, result):
        self.cases.append(case)
        self.digests.append(_digest(result))

    def problems(self, comm):
        everyone = comm.allgather(self.digests)
        if len({len(digests) for digests in everyone}) > 1:
            return [f"ranks checked different numbers of results: {[len(d) for d in everyone]}"]
        differing = (
            (case, _who_differs([digests[i] for digests in everyone]))
            for i, case in enumerate(self.cases)
        )
        return [f"{case}: {message}" for case, message in differing if message]


def values_equal(a, b):
    """Same shape, dtype and values (-0.0 == +0.0: complex products differ in the zero's sign by
    order of evaluation). Identity across ranks is checked on the bits, by digests_differ."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))


def bits_equal(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def problems_with(comm, result, expected, case, bits=None):
    """What is wrong with ``result`` (values against numpy's ``expected``, bits across ``comm``),
    as lines naming ``case``; empty when nothing is. With ``bits`` (a BitsAcrossRanks), the bits
    are compared later, with the others' (no message here)."""
    problems = []
    if not values_equal(result, expected):
        problems.append(
            f"{case}: got {result.reshape(-1)[:4]}, expected {expected.reshape(-1)[:4]}"
        )
    if bits is not None:
        bits.add(case, result)
        return problems
    differ = digests_differ(comm, result)
    if differ:
        problems.append(f"{case}: {differ}")
    return problems


#: set by benchmarks/gpu/device_check.sh on the GPU machine: there a CuPy or torch-CUDA test that
#: finds no CuPy or no device fails instead of skipping (a broken install must not read as "ok")
REQUIRE_GPU = os.environ.get("MPIALLREDUCE_REQUIRE_GPU") == "1"


def no_gpu(reason):
    """Skip a GPU test for ``reason``; under MPIALLREDUCE_REQUIRE_GPU=1, fail it."""
    if REQUIRE_GPU:
        pytest.fail(f"MPIALLREDUCE_REQUIRE_GPU=1 and {reason}", pytrace=False)
    pytest.skip(reason)


def timing_test_at_three_ranks():
    """Skip, except at 3 ranks, a fault test that sleeps on purpose (a straggler, a timeout): at 3
    one rank is late among several, which covers what 2 would show (make test runs the suite at 1 to
    5 ranks; make check, at 2, leaves them to it: docs/performance.md, the suite's time)."""
    if MPI.COMM_WORLD.Get_size() != 3:
        pytest.skip("a timing test (sleeps on purpose): run at 3 ranks only")
