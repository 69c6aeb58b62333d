"""Every algorithm x op x dtype x size, in place and not, on COMM_WORLD and (up to 3 ranks) a Split.

Expected values: numpy on every rank's inputs (reference.py), made here once per case: the inputs
are functions of the rank and the index. Bitwise identity across ranks: the sha256 of every rank's
result, compared once per test (BitsAcrossRanks).
"""

import functools

import numpy as np
import pytest
from conftest import communicator
from mpi4py import MPI
from reference import (
    BitsAcrossRanks,
    bits_equal,
    digests_differ,
    every_ranks,
    exact_input,
    exact_reference,
    gather_inputs,
    numpy_reference,
    op_applies,
    problems_with,
    runs_here,
    values_equal,
)

import mpiallreduce as mar

pytestmark = pytest.mark.mpi

DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8", "complex128"]
OPS = ["sum", "prod", "min", "max", "mean"]
ALGORITHMS = list(mar.HOST_ALGORITHMS) + ["auto"]
PRIME = 1009
ABOUT_A_MILLION = (1 << 20) + 3
JUST_OVER_64K = (1 << 16) + 3
#: the gradient dtypes get the million elements, which cross the ring's and the staged path's
#: segment sizes (mpiallreduce.settings) at every rank count tested; the others stop at 64 Ki + 3
#: elements, past the signature threshold (64 KiB) for every item size. (A million of each of the
#: seven dtypes made this file most of the suite's time.)
LARGEST = {"float32": ABOUT_A_MILLION, "float64": ABOUT_A_MILLION}


#: The algorithms' results depend on the rank count and the ranks' order, not on which communicator
#: holds them. So these tests (most of the MPI suite's time) run on COMM_WORLD at every rank count,
#: and up to 3 ranks on the Split too (halves of 1 or 2 ranks, numbered in reverse). A Dup repeats
#: COMM_WORLD (the call path's tests cover communicators of their own), and from 4 ranks on the
#: Split's halves repeat the rank counts the 2- and 3-rank runs cover.
CORRECTNESS_KINDS = ["world"] + (["split"] if 1 < MPI.COMM_WORLD.Get_size() < 4 else [])

#: The ops on COMM_WORLD: every op up to 3 ranks; from 4 on (oversubscribed: most of the suite's
#: time) the three that fold differently, a sum (the million elements), a max (no arithmetic) and a
#: mean (divided by the rank count); prod folds as sum does and min as max. On the Split, whose
#: halves repeat smaller rank counts in another order, the sum and the mean (docs/performance.md,
#: the suite's time).
WORLD_OPS = OPS if MPI.COMM_WORLD.Get_size() <= 3 else ["sum", "max", "mean"]
KINDS_AND_OPS = [
    (kind, op)
    for kind in CORRECTNESS_KINDS
    for op in OPS
    if op in (WORLD_OPS if kind == "world" else ["sum", "mean"])
]


@pytest.fixture(params=CORRECTNESS_KINDS)
def comm(request):
    return communicator(request.param)


def sizes_for(p, dtype, large=True):
    """0, 1, p-1, p, p+1, a prime and a large count (see LARGEST, where ``large``; duplicates
    dropped). The million elements are for the sums: how an algorithm cuts and moves a buffer
    (segments, pipelines, the staged path) does not depend on the op, which every op's 64 Ki + 3
    elements exercise past the signature threshold; a million of every op was most of the suite's
    time."""
    return sorted(
        {
            0,
            1,
            p - 1,
            p,
            p + 1,
            PRIME,
            LARGEST.get(dtype, JUST_OVER_64K) if large else JUST_OVER_64K,
        }
    )


def test_algorithms_registered():
    assert {"mpi", "reduce_bcast", "ring", "recursive_doubling"} <= set(mar.ALGORITHMS)


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("comm, op", KINDS_AND_OPS, indirect=["comm"])
def test_matches_numpy_on_every_ranks_inputs(comm, algorithm, op, in_place):
    rank, size = comm.Get_rank(), comm.Get_size()
    problems, bits = [], BitsAcrossRanks()
    for dtype in DTYPES:
        if not op_applies(op, dtype):
            continue
        for count in sizes_for(size, dtype, large=op == "sum"):
            x = exact_input(dtype, count, rank, op)
            x_before = x.copy()
            expected = exact_reference(op, dtype, count, size)
            if in_place:
                result = mar.allreduce(x, op=op, algorithm=algorithm, comm=comm, out=x)
                returned_out = result is x
            else:
                result = mar.allreduce(x, op=op, algorithm=algorithm, comm=comm)
                returned_out = result is not x and bits_equal(x, x_before)
            case = f"{dtype} count={count}"
            if not returned_out:
                problems.append(f"{case}: input modified or wrong array returned")
            problems += problems_with(comm, result, expected, case, bits)
    problems += bits.problems(comm)
    assert not problems, f"rank {rank}:\n" + "\n".join(problems[:30])


def inexact_input(dtype, count, rank):
    return np.random.default_rng([rank, count]).uniform(0.5, 1.5, count).astype(dtype)


@functools.cache
def inexact_reference(op, dtype, count, size):
    """numpy's ``op``, in float64, over every rank's inexact_input (made once per case)."""
    inputs = every_ranks(lambda rank: inexact_input(dtype, count, rank), size)
    expected = numpy_reference(op, inputs.astype(np.float64)).astype(dtype)
    expected.flags.writeable = False
    return expected


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(
    "comm, op",
    [(kind, op) for kind, op in KINDS_AND_OPS if op in ("sum", "mean", "prod")],
    indirect=["comm"],
)
def test_inexact_floats_are_identical_on_every_rank(comm, algorithm, op):
    """Random floats (order of summation matters in the last bits): close to numpy, same bits
    everywhere."""
    rank, size = comm.Get_rank(), comm.Get_size()
    problems, bits = [], BitsAcrossRanks()
    for dtype, rtol in [("float16", 1e-2), ("float32", 1e-5), ("float64", 1e-12)]:
        for count in sizes_for(size, dtype, large=op == "sum"):
            x = inexact_input(dtype, count, rank)
            expected = inexact_reference(op, dtype, count, size)
            result = mar.allreduce(x, op=op, algorithm=algorithm, comm=comm)
            if not np.allclose(result, expected, rtol=rtol, atol=0):
                problems.append(
                    f"{dtype} count={count}: max rel err "
                    f"{np.max(np.abs(result / expected - 1)) if count else 0}"
                )
            bits.add(f"{dtype} count={count}", result)
    problems += bits.problems(comm)
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_mean_over_many_segments_divides_every_element_once(comm, algorithm, in_place):
    """A mean of about a million float32 (segments of every rank's slice; the algorithms that divide
    each slice where it was reduced, finishes_slices, do so segment by segment): numpy's sum divided
    once, bit for bit, on every rank."""
    x = exact_input("float32", ABOUT_A_MILLION, comm.Get_rank(), "mean")
    expected = exact_reference("mean", "float32", ABOUT_A_MILLION, comm.Get_size())
    result = mar.allreduce(
        x, op="mean", algorithm=algorithm, comm=comm, out=x if in_place else None
    )
    problems = problems_with(comm, result, expected, f"float32 count={ABOUT_A_MILLION}")
    assert not problems, f"rank {comm.Get_rank()}:\n" + "\n".join(problems[:10])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_shapes_strides_and_out(comm, algorithm):
    """Any shape and memory layout gives the reduction of the logical array."""
    rank = comm.Get_rank()
    base = exact_input("float64", 6 * 35, rank, "sum").reshape(6, 35)

    def check(name, x, **kwargs):
        expected = numpy_reference("sum", gather_inputs(comm, np.array(x, order="C")))
        result = mar.allreduce(x, algorithm=algorithm, comm=comm, **kwargs)
        assert values_equal(result, expected), f"{name}: got {result!r}, expected {expected!r}"
        assert digests_differ(comm, result) is None, name
        return result

    check("2-D C order", base.copy())
    check("Fortran order", np.asfortranarray(base))
    check("strided rows and columns", base[::2, 1::3])
    check("reversed", base[::-1, ::-1])
    check("0-d", np.array(float(rank + 1)))
    check("3-D", base.reshape(2, 3, 35))

    out = np.full((6, 35), -99.0)
    result = check("into out", base, out=out)
    assert result is out

    holder = np.zeros((6, 105))
    strided_out = holder[:, ::3]
    result = check("into strided out", base, out=strided_out)
    assert result is strided_out
    assert np.all(holder[:, 1::3] == 0) and np.all(holder[:, 2::3] == 0), (
        "wrote outside the strided out"
    )

    x = np.asfortranarray(base)
    expected = numpy_reference("sum", gather_inputs(comm, np.array(x, order="C")))
    result = mar.allreduce(x, algorithm=algorithm, comm=comm, out=x)
    assert result is x and values_equal(x, expected), "in place on a Fortran-ordered array"

    strided = base.copy()[:, ::2]
    expected = numpy_reference("sum", gather_inputs(comm, np.array(strided, order="C")))
    result = mar.allreduce(strided, algorithm=algorithm, comm=comm, out=strided)
    assert result is strided and values_equal(strided, expected), "in place on a strided view"

    flat = exact_input("float64", 50, rank, "sum")
    buffer = np.concatenate([flat, [0.0]])
    expected = numpy_reference("sum", gather_inputs(comm, flat))
    result = mar.allreduce(buffer[:-1], algorithm=algorithm, comm=comm, out=buffer[1:])
    assert values_equal(result, expected), "out overlapping x, shifted by one element"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_default_communicator_is_world(algorithm):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    x = exact_input("int64", 10, world.Get_rank(), "sum")
    expected = numpy_reference("sum", gather_inputs(world, x))
    assert values_equal(mar.allreduce(x, algorithm=algorithm), expected)


def test_many_calls_in_a_row_stay_in_step(comm):
    """Back-to-back calls of every algorithm and size on one communicator, no barrier between
    them."""
    rank = comm.Get_rank()
    inputs = [exact_input("float32", n, rank, "sum") for n in (3, 1000, 17, 0, 4096)]
    expected = [numpy_reference("sum", gather_inputs(comm, x)) for x in inputs]
    for _ in range(3):
        for algorithm in [a for a in ALGORITHMS if runs_here(a, comm)]:
            for x, want in zip(inputs, expected, strict=True):
                assert values_equal(mar.allreduce(x, algorithm=algorithm, comm=comm), want), (
                    algorithm,
                    x.size,
                )


def test_auto_is_right_on_both_sides_of_every_switch_in_the_table(comm):
    """Sizes at which the tuning table hands over from one algorithm to the next."""
    from mpiallreduce.core.planner import choose_algorithm
    from mpiallreduce.core.tuning import _rules_for

    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("one rank: auto is a local copy at every size, no switch applies")
    chosen, problems, bits = set(), [], BitsAcrossRanks()
    for rule in _rules_for(size):
        if rule["up_to_bytes"] is None:
            continue
        for nbytes in (rule["up_to_bytes"], rule["up_to_bytes"] + 4):
            count = nbytes // 4
            chosen.add(choose_algorithm(count * 4, size).name)
            x = exact_input("float32", count, rank, "sum")
            expected = numpy_reference(
                "sum", gather_inputs(comm, x)
            )  # (up to 32 MiB, once: not cached)
            result = mar.allreduce(x, comm=comm)
            problems += problems_with(
                comm,
                result,
                expected,
                f"{nbytes} B ({choose_algorithm(count * 4, size).name})",
                bits,
            )
    problems += bits.problems(comm)
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)
    if size > 1 and _rules_for(size) and len(_rules_for(size)) > 1:
        assert len(chosen) > 1, "the table switches algorithms, so auto must have run more than one"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_other_numeric_dtype(comm, algorithm):
    """The dtypes outside the main matrix: other integer widths, long double, complex64/256."""
    rank, size = comm.Get_rank(), comm.Get_size()
    problems, bits = [], BitsAcrossRanks()
    for dtype in [
        "int8",
        "int16",
        "uint16",
        "uint32",
        "uint64",
        "longdouble",
        "complex64",
        "clongdouble",
    ]:
        for op in OPS:
            if not op_applies(op, dtype):
                continue
            for count in (size + 1, PRIME):
                x = exact_input(dtype, count, rank, op)
                result = mar.allreduce(x, op=op, algorithm=algorithm, comm=comm)
                problems += problems_with(
                    comm,
                    result,
                    exact_reference(op, dtype, count, size),
                    f"{dtype} {op} count={count}",
                    bits,
                )
    problems += bits.problems(comm)
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)
