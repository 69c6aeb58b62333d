"""Symmetric buffers (mpiallreduce.empty/zeros) and the single_copy algorithm that reads and writes
the peers' twins of them (issue #28, item 2). Every expected value comes from numpy on inputs
gathered with mpi4py's own allgather."""

import time

import numpy as np
import pytest
import stalls
from mpi4py import MPI
from reference import exact_input, gather_inputs, numpy_reference, problems_with

import mpiallreduce as mar

pytestmark = [pytest.mark.mpi, pytest.mark.one_node("symmetric arrays share memory on one node")]

WORLD = MPI.COMM_WORLD
CASES = [
    ("sum", "float32"),
    ("sum", "int64"),
    ("max", "float64"),
    ("mean", "float64"),
    ("prod", "complex128"),
    ("sum", "float16"),
]


def _twins(count, dtype, apart=8):
    """Input and output views of one symmetric allocation, at the same offsets on every rank."""
    buffer = mar.empty(2 * count + apart, dtype)
    return buffer[:count], buffer[count + apart : 2 * count + apart]


def _runs_single_copy(x, out, op):
    """Whether the planner must give this call single_copy (independently of the code under test:
    the rule as docs/algorithms.md states it)."""
    return (
        WORLD.Get_size() > 1
        and x.nbytes >= 64 << 10
        and x.dtype.name != "float16"
        and op in ("sum", "max", "mean", "prod")
    )


@pytest.mark.parametrize("mode", ["out_of_place", "in_place", "prepared", "async"])
def test_symmetric_arrays_match_numpy(mode):
    comm, rank = WORLD, WORLD.Get_rank()
    problems = []
    for op, dtype in CASES:
        for count in sorted({1, comm.Get_size() + 1, 1009, (1 << 15) + 3}):
            host = exact_input(dtype, count, rank, op)
            expected = numpy_reference(op, gather_inputs(comm, host))
            x, out = _twins(count, dtype)
            x[...] = host
            if mode == "in_place":
                out[...] = host
                result = mar.allreduce(out, op=op, out=out)
            elif mode == "prepared":
                prepared = mar.prepare(x, op=op, out=out)
                result = prepared()
                plan = repr(prepared)
                if _runs_single_copy(x, out, op) != ("single_copy" in plan):
                    problems.append(f"{op} {dtype} {count}: {plan}")
                x[...] = 0  # (the next run reduces x's contents then)
                x[...] = host
                result = prepared()
            elif mode == "async":
                result = mar.allreduce_async(x, op=op, out=out).wait()
            else:
                result = mar.allreduce(x, op=op, out=out)
            case = f"{mode} {op} {dtype} count={count}"
            if result is not out:
                problems.append(f"{case}: the result is not out")
            problems += problems_with(comm, np.asarray(result), expected, case)
            if mode != "in_place" and not np.array_equal(x, host):
                problems.append(f"{case}: input modified")
    assert not problems, f"rank {rank}:\n" + "\n".join(problems[:20])


def test_describe_call_and_repeated_calls_on_symmetric_arrays():
    """describe_call(x, out=out) says what the call runs; repeated plain calls (their Execution kept
    by placement) stay right as the contents change, and a view elsewhere plans anew."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, out = _twins(1 << 15, np.float32)
    text = mar.describe_call(x, out=out)
    assert ("single_copy" in text) == (size > 1), text
    for i in range(3):
        x[...] = rank + i
        assert (mar.allreduce(x, out=out) == size * (size - 1) // 2 + size * i).all()
    shorter, short_out = x[:100], out[:100]
    assert (mar.allreduce(shorter, out=short_out) == size * (size - 1) // 2 + size * 2).all()
    assert "single_copy" not in mar.describe_call(
        shorter, out=short_out
    )  # (below 64 KiB: the table's)


def test_shapes_and_zeros():
    rank = WORLD.Get_rank()
    zeros = mar.zeros((3, 5000), np.float64)
    assert zeros.shape == (3, 5000) and zeros.dtype == np.float64 and not zeros.any()
    host = exact_input("float64", zeros.size, rank, "sum").reshape(zeros.shape)
    expected = numpy_reference("sum", gather_inputs(WORLD, host))
    zeros[...] = host
    assert not problems_with(WORLD, mar.allreduce(zeros, out=zeros), expected, "2-D in place")


def test_a_placement_that_differs_raises_everywhere_and_writes_nothing():
    """Twins at different offsets would read the wrong elements: the ranks compare the placement."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    count = 1 << 15
    buffer = mar.empty(2 * count + 16, np.float32)
    shift = 4 if rank == size - 1 else 0
    x, out = buffer[shift : shift + count], buffer[count + 8 : 2 * count + 8]
    x[...], out[...] = rank + 1, -1
    with pytest.raises(ValueError, match="not the same call on every rank|differ"):
        mar.allreduce(x, out=out)
    assert (out == -1).all()  # (no peer wrote into it)
    x = buffer[:count]
    x[...] = rank + 1
    assert (mar.allreduce(x, out=out) == size * (size + 1) // 2).all()


@pytest.mark.parametrize("timeout", [None, 60])
def test_prepared_single_copies_on_different_arrays_raise_everywhere_and_write_nothing(timeout):
    """Issue 54, defect 1: ``pa = prepare(A, out=A)`` and ``pb = prepare(B, out=B)``; rank 0 runs
    ``pa()``, the others ``pb()``. Prepared calls compare nothing per run, and single_copy's arrival
    was a bare barrier: every rank returned, A and B half reduced on every rank, rank 1's A written
    though rank 1 never called on it. Now the arrival compares where the arrays lie, timed or not:
    SignatureMismatch on every rank, nothing written; then each call runs right on every rank."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    count = 1 << 16
    a, b = mar.zeros(count, np.float32), mar.zeros(count, np.float32)
    a_in, b_in = (
        exact_input("float32", count, rank, "sum"),
        exact_input("float32", count, rank, "sum") + 100,
    )
    a[...], b[...] = a_in, b_in
    pa, pb = mar.prepare(a, out=a, timeout=timeout), mar.prepare(b, out=b, timeout=timeout)
    # (timed: shared_memory in place of single_copy, still comparing where the arrays lie)
    assert ("single_copy" if timeout is None else "timed: shared_memory") in repr(pa), repr(pa)
    with pytest.raises(mar.SignatureMismatch, match="symmetric"):  # (timed: at the rendezvous)
        (pa if rank == 0 else pb)()
    assert np.array_equal(a, a_in) and np.array_equal(b, b_in), (
        f"rank {rank}: a peer wrote into A or B"
    )
    want_a, want_b = (numpy_reference("sum", gather_inputs(WORLD, v)) for v in (a_in, b_in))
    assert np.array_equal(pa(), want_a) and np.array_equal(pb(), want_b)


def test_a_timed_call_on_symmetric_arrays_never_writes_a_peers_array_when_a_peer_stalls(
    monkeypatch,
):
    """Issue 54, item 3: single copy writes straight into every peer's array, and its last barrier
    waited without a deadline; a timed call cannot take such writes back. So a timed call on
    symmetric arrays runs shared_memory (planner.timed_instead), auto and by name, and says so.
    The last rank stalls past the timeout and its grace, before the data moves: every rank raises
    within timeout + grace, no rank's output is written (its own or a peer's, the stalled one's
    once it woke too), and the next calls, timed and untimed, are right. Before, every rank
    waited in the single copy's arrival for the stalled rank, then returned the sum."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size != 3:
        pytest.skip("a timing test (sleeps on purpose): at 3 ranks")
    count = 1 << 15  # (256 KiB of float64: auto's single copy, untimed)
    x, out = _twins(count, np.float64)
    x[...] = exact_input("float64", count, rank, "sum")
    out[...] = -7.0
    for algorithm in ("auto", "single_copy"):
        untimed = mar.describe_call(x, out=out, algorithm=algorithm)
        timed = mar.describe_call(x, out=out, algorithm=algorithm, timeout=0.5)
        assert untimed.startswith("single_copy"), untimed
        assert timed.startswith("shared_memory") and "timed: shared_memory instead" in timed, timed
    mar.allreduce(np.ones(4), timeout=30)  # (first use: the control channel)
    stalls.shorten_the_grace(monkeypatch)
    stalls.before_the_data_moves(monkeypatch, size - 1, stalls.stall)
    stalls.ended_alike_within_the_bound(lambda: mar.allreduce(x, out=out, timeout=stalls.TIMEOUT))
    WORLD.Barrier()  # (the stalled rank woke and raised: nothing of it may come later)
    time.sleep(0.2)
    assert (out == -7.0).all(), f"rank {rank}: its output written by a call that raised"
    want = numpy_reference("sum", gather_inputs(WORLD, x))
    for timed_out in (30, None, 30):
        out[...] = -7.0
        result = mar.allreduce(x, out=out, timeout=timed_out)
        assert np.array_equal(result, want), f"rank {rank}: timeout={timed_out}"


def test_unchecked_single_copies_on_different_arrays_raise_everywhere(use_settings):
    """With the per-call signature off (MPIALLREDUCE_SIGNATURE_MIN_BYTES above the size), a single
    copy still compares where the arrays lie on arrival: never a write into an array that a peer's
    call does not own."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    use_settings(signature_min_bytes=1 << 30)
    count = 1 << 16
    a, b = mar.zeros(count, np.float32), mar.zeros(count, np.float32)
    a[...], b[...] = rank + 1, rank + 100
    with pytest.raises(mar.SignatureMismatch, match="symmetric"):
        mar.allreduce(a if rank == 0 else b, out=a if rank == 0 else b, algorithm="single_copy")
    assert (a == rank + 1).all() and (b == rank + 100).all(), (
        f"rank {rank}: a peer wrote into A or B"
    )


def test_symmetric_on_some_ranks_only_raises_everywhere_and_writes_nothing():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    count = 1 << 15
    x, out = _twins(count, np.float32)
    if rank == 0:
        x, out = np.empty(count, np.float32), np.empty(count, np.float32)
    x[...], out[...] = rank + 1, -1
    with pytest.raises(ValueError, match="not the same call on every rank|differ"):
        mar.allreduce(x, out=out)
    assert (out == -1).all()


def test_single_copy_by_name_needs_symmetric_arrays_on_every_rank():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank reduces nothing")
    with pytest.raises(ValueError, match="symmetric buffers only"):
        mar.allreduce(np.ones(10), algorithm="single_copy")
    x, out = _twins(10, np.float64)  # by name, below the size auto would pick it from
    x[...] = rank
    assert (mar.allreduce(x, algorithm="single_copy", out=out) == size * (size - 1) // 2).all()


def test_allocations_that_differ_raise_everywhere():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    with pytest.raises(ValueError, match="not the same call on every rank|differ"):
        mar.empty(10 + (rank == size - 1), np.float32)
    with pytest.raises(ValueError):
        mar.empty(-1 if rank == 0 else 5, np.float32)
    assert mar.zeros(4, np.int32).sum() == 0  # (the next allocation pairs up again)


def test_an_allocation_against_an_allreduce_elsewhere_raises_everywhere():
    """mar.empty is numbered and compared like a call: against another call it is an error on every
    rank (never a window allocated with some ranks in an allreduce), and the next call is right."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    with pytest.raises(ValueError, match="not the same call on every rank|differ"):
        if rank == 0:
            mar.empty(1 << 15, np.float32)
        else:
            mar.allreduce(np.ones(1 << 15, np.float32))
    assert (mar.allreduce(np.full(7, rank, np.int64)) == size * (size - 1) // 2).all()


def test_a_timed_call_on_symmetric_arrays():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, out = _twins(1 << 15, np.float64)
    x[...] = np.arange(x.size) + rank
    expected = size * np.arange(x.size) + size * (size - 1) // 2
    assert np.array_equal(mar.allreduce(x, out=out, timeout=30), expected)


def test_gradient_sync_buckets_are_symmetric_and_a_replan_frees_them():
    """On one node GradientSync's fused buffers are symmetric; each replan (here: the gradients
    change every other step) frees the old ones on every rank, so they do not pile up."""
    from mpiallreduce.core.state import state_of

    rank, size = WORLD.Get_rank(), WORLD.Get_size()

    def live_allocations():
        return sum(a.window is not None for a in state_of(WORLD).symmetric)

    before = live_allocations()  # (the other tests' arrays)
    sync = mar.GradientSync(bucket_bytes=1 << 16)
    live = []
    for step in range(6):
        names = [f"g{i}" for i in range(5 if step % 2 else 4)]
        grads = {
            n: np.full(5000 + i, rank + 10 * i + step, np.float32) for i, n in enumerate(names)
        }
        for n in reversed(names):
            sync.ready(grads[n], name=n)
        sync.wait()
        for i, n in enumerate(names):  # the mean of rank + 10 i + step over the ranks
            assert (grads[n] == (size - 1) / 2 + 10 * i + step).all(), (step, n)
        live.append(live_allocations() - before)
    assert min(live) >= 1 and max(live) <= len(sync.buckets) + 1, (
        live
    )  # (a plan's buckets, not every plan's)
