"""The compiled hot paths (mpiallreduce/core/_compiled.c) against the Python ones they stand in for:
the same results (from numpy on the gathered inputs), the same numbers, the same errors, and the
Python path wherever the compiled one hands a call back. Each case runs both ways."""

import numpy as np
import pytest
from mpi4py import MPI
from reference import exact_input, gather_inputs, numpy_reference, values_equal

import mpiallreduce as mar
from mpiallreduce.api import prepare_at
from mpiallreduce.core import compiled
from mpiallreduce.core.state import state_of

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(
        not compiled.built(),
        reason="_compiled.c was not built here (tests/test_layers.py says where it must be)",
    ),
]

WORLD = MPI.COMM_WORLD
BOTH = pytest.mark.parametrize("use_compiled", [True, False], ids=["compiled", "python"])


def short_of(comm, x, op="sum", algorithm="auto", in_place=False):
    return state_of(comm).fast_calls[(x.shape, x.dtype, op, algorithm, in_place)].short


def prepared_and_plain(comm, count):
    """x (float64, rank-dependent), its sum from numpy, a prepared call of MPI's allreduce on it,
    and the communicator's state once a plain call of x has been made."""
    x = exact_input("float64", count, comm.Get_rank(), "sum")
    want = numpy_reference("sum", gather_inputs(comm, x))
    prepared = mar.prepare(x, comm=comm, algorithm="mpi")
    mar.allreduce(x, comm=comm)
    return x, want, prepared, state_of(comm)


def is_compiled(function):
    return type(getattr(function, "__self__", None)).__name__ == "ShortPath"


@BOTH
@pytest.mark.parametrize("signature", ["compared", "unchecked"])
def test_plain_calls_of_mpis_allreduce_give_numpys_values_every_way_in(
    comm, use_settings, use_compiled, signature
):
    """4 B to 8 KB, sum, mean and max, float64, float32, int32 and complex128: into a new array, in
    place, into another array; then the arrays the compiled path hands back (a read-only out, an
    out overlapping x, an out of another dtype, a strided x), which the general path takes."""
    use_settings(compiled=use_compiled, signature_min_bytes=0 if signature == "compared" else -1)
    rank, size = comm.Get_rank(), comm.Get_size()
    for count in (1, 1000):
        for dtype, op in (
            ("float64", "sum"),
            ("float32", "mean"),
            ("int32", "max"),
            ("complex128", "sum"),
        ):
            x = exact_input(dtype, count, rank, op) * (rank + 1)
            kept = x.copy()
            want = numpy_reference(op, gather_inputs(comm, x))
            other, y = np.empty_like(x), x.copy()
            for repeat in range(3):  # (the first plans; the repeats take the short path)
                assert values_equal(mar.allreduce(x, op=op, comm=comm), want), (dtype, op, repeat)
                assert values_equal(
                    mar.allreduce(x, op=op, comm=comm, out=other), want
                ) and values_equal(other, want)
                y[...] = x
                assert mar.allreduce(y, op=op, comm=comm, out=y) is y and values_equal(y, want)
                assert values_equal(x, kept)
            # (a mean of one rank is local; of int32 in numpy, float; across nodes a compared call
            # is dissemination's, whose compiled path takes a sum of float64 but not a max or
            # complex128)
            if (
                size > 1
                and op != "mean"
                and not (signature == "compared" and state_of(comm).make_ready().spans_nodes)
            ):
                assert is_compiled(short_of(comm, x, op)) == (
                    use_compiled and state_of(comm).recorder is None
                )
    x = exact_input("float64", 64, rank, "sum")
    want = numpy_reference("sum", gather_inputs(comm, x))
    frozen = np.empty_like(x)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        mar.allreduce(x, comm=comm, out=frozen)
    wide = np.arange(128.0) * (rank + 1)
    want_wide = numpy_reference("sum", gather_inputs(comm, wide[:64]))
    assert values_equal(mar.allreduce(x, comm=comm), want)  # (its short path made)
    assert (
        short_of(comm, x)(wide[:64], wide[32:96]) is None
    )  # (overlapping: handed back, no MPI on any rank)
    assert values_equal(mar.allreduce(wide[:64], comm=comm, out=wide[32:96]), want_wide)
    with pytest.raises(ValueError):
        mar.allreduce(x, comm=comm, out=np.empty(64, np.float32))
    strided = np.repeat(x, 2)[::2]
    assert values_equal(mar.allreduce(strided, comm=comm), want)
    assert values_equal(mar.allreduce(x, comm=comm), want)  # (and the short path still right after)


@BOTH
@pytest.mark.parametrize("signature", ["compared", "unchecked"])
def test_calls_are_numbered_alike_on_every_rank_whichever_path_takes_them(
    use_settings, use_compiled, signature
):
    """Plain calls on the compiled short path (its signature compared in the slots, or not: then
    numbered after MPI), the general path and prepared calls interleaved: each call advances the
    communicator's number by one, and every rank's number is the same."""
    use_settings(compiled=use_compiled, signature_min_bytes=0 if signature == "compared" else -1)
    comm = WORLD.Dup()
    x, want, prepared, state = prepared_and_plain(comm, 8)
    before = state.sequence
    for _ in range(10):
        assert values_equal(mar.allreduce(x, comm=comm), want)
        assert values_equal(
            mar.allreduce(x[::-1].copy()[::-1], comm=comm), want
        )  # (a copy's view: general)
        assert values_equal(prepared(), want)
        assert values_equal(prepared.run(), want)
    assert state.sequence == before + 40
    numbers = comm.allgather(state.sequence)
    assert len(set(numbers)) == 1, numbers
    if comm.Get_size() > 1:  # (bound: a persistent request, or MPI_Allreduce itself in C)
        assert prepared._compiled_bound() == use_compiled
    comm.Free()


@BOTH
def test_a_call_that_differs_below_the_threshold_raises_the_same_error_everywhere(
    use_settings, use_compiled
):
    """4 bytes against 8 on the last rank (the shared slots compare them): a ValueError naming the
    shapes on every rank, from the compiled short path too, and the next call is right."""
    comm = WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    use_settings(compiled=use_compiled)
    x = exact_input("float32", 1, rank, "sum")
    want = numpy_reference("sum", gather_inputs(comm, x))
    for _ in range(2):  # (the second time on the short path)
        assert values_equal(mar.allreduce(x), want)
    odd = exact_input("float32", 2 if rank == size - 1 else 1, rank, "sum")
    with pytest.raises(
        ValueError, match=rf"shape differs: \(1,\) on ranks? [\d, ]+; \(2,\) on rank {size - 1}"
    ):
        mar.allreduce(odd)
    assert values_equal(mar.allreduce(x), want)


@BOTH
def test_prepared_calls_on_persistent_requests_behind_async_calls_and_with_a_mean(
    comm, use_settings, use_compiled
):
    """A prepared call of MPI's own allreduce (a persistent request, or MPI_Allreduce itself):
    right each run, its mean divided, in order behind an asynchronous call still pending (which
    the compiled call hands to the Python path), and started in the background."""
    use_settings(compiled=use_compiled)
    rank = comm.Get_rank()
    x = exact_input("float64", 16, rank, "mean") * (rank + 1)
    big = exact_input("float64", 1 << 16, rank, "sum")
    want_big = numpy_reference("sum", gather_inputs(comm, big))
    for op, persistent in (("sum", True), ("mean", True), ("sum", False), ("mean", False)):
        # (persistent=False: MPI_Allreduce itself, bound in C where compiled)
        prepared = prepare_at("", x, op=op, comm=comm, algorithm="mpi", persistent=persistent)
        for step in range(3):
            x[...] = exact_input("float64", 16, rank + step, "mean") * (rank + 1)
            want = numpy_reference(op, gather_inputs(comm, x))
            assert values_equal(prepared(), want), (op, step)
            pending = mar.allreduce_async(big, comm=comm, algorithm="ring")
            assert values_equal(prepared(), want), (op, step)
            assert pending.done(), (
                op,
                step,
            )  # (run in order: after the pending call, not beside it)
            assert values_equal(pending.wait(), want_big)
            assert values_equal(prepared.start().wait(), want), (op, step)


@BOTH
def test_with_the_flight_recorder_on_every_call_is_recorded(comm, use_settings, use_compiled):
    """A recorder sends plain and prepared calls to the Python paths, which record them: one entry
    per call, with its number."""
    use_settings(compiled=use_compiled, trace_entries=512)
    x, want, prepared, state = prepared_and_plain(comm, 4)
    before = len(state.recorder.last())
    for _ in range(3):
        assert values_equal(prepared(), want) and values_equal(mar.allreduce(x, comm=comm), want)
    numbers = [entry[1] for entry in state.recorder.last()[before:] if entry[0] is state]
    assert numbers == list(range(state.sequence - 5, state.sequence + 1)), numbers
    assert not (
        comm.Get_size() > 1 and prepared._compiled_bound() and is_compiled(short_of(comm, x))
    )


@BOTH
def test_a_prepared_call_run_after_its_communicator_was_freed_raises_on_every_rank(
    use_settings, use_compiled
):
    """Its persistent request would meet the freed communicator (a crash in MPI_Start): every rank
    raises instead, from the call, from start(), and on another array (GradientSync's _run_on)."""
    use_settings(compiled=use_compiled)
    from mpiallreduce.api import prepare_at

    dup = WORLD.Dup()
    x, want, prepared, state = prepared_and_plain(dup, 4)
    y = x.copy()
    on_others = prepare_at(
        "", y, algorithm="mpi", comm=dup, out=y, persistent=False
    )  # (GradientSync's kind)
    assert values_equal(prepared(), want) and values_equal(on_others._run_on(x.copy()), want)
    dup.Free()
    for run in (
        prepared,
        prepared.run,
        lambda: prepared.start().wait(),
        lambda: on_others._run_on(x.copy()),
        lambda: on_others._start_on(x.copy()).wait(),
    ):
        with pytest.raises(
            ValueError,
            match=f"rank {WORLD.Get_rank()}: this prepared call's communicator was freed",
        ):
            run()


@BOTH
@pytest.mark.parametrize("out", ["in_place", "another_out"])
def test_a_prepared_call_whose_array_was_resized_raises_and_touches_nothing(
    use_settings, use_compiled, out
):
    """Issue 54, item 5: numpy's ``resize(refcheck=False)`` moves x's (or out's) memory while the
    prepared call's request points at the old: each run would write into freed memory. Every rank
    resizes here (untimed, nothing is compared: a rank alone would leave its peers waiting, as
    test_trace.py shows); each raises a ValueError naming its array, nothing is written, and the
    next call pairs up on every rank."""
    use_settings(compiled=use_compiled)
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x = exact_input("float64", 4, rank, "sum")
    target = x if out == "in_place" else np.zeros(4)
    want = numpy_reference("sum", gather_inputs(WORLD, x))
    prepared = mar.prepare(x, out=target, algorithm="mpi")
    assert values_equal(prepared(), want)
    # (bound in C alike, on a persistent request or a plain MPI_Allreduce: each checks the arrays;
    # one rank copies, in Python)
    assert prepared._compiled_bound() == (use_compiled and size > 1)
    name = "x" if out == "in_place" else "out"
    bound = target.ctypes.data
    for back in (False, True):  # (resized, then resized back to its shape: moved all the same)
        target.resize(1 << 16, refcheck=False)  # (a new block: the old is freed, or reused)
        if back:
            target.resize(4, refcheck=False)
        # (back to its shape, malloc may hand it its first block again: then nothing moved and
        # the call is right to run; the ranks run this case only where every one's has moved)
        if back and not WORLD.allreduce(target.ctypes.data != bound, op=MPI.LAND):
            continue
        before = target.copy()
        with pytest.raises(ValueError, match=rf"rank {rank}: this prepared call's {name} changed"):
            prepared()
        assert np.array_equal(target, before), f"rank {rank}: written after the resize"
    assert mar.allreduce(np.array([rank + 1.0]))[0] == size * (size + 1) / 2


def test_a_timed_prepared_call_resized_on_one_rank_raises_on_every_rank(use_settings):
    """The same on the last rank only, with a timeout: the rendezvous carries a code that no call
    has, so every other rank raises SignatureMismatch, that rank its ValueError; nothing written."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank: no peer to tell")
    x = exact_input("float64", 4, rank, "sum")
    prepared = mar.prepare(x, out=x, timeout=60)
    if rank == size - 1:
        x.resize(1 << 16, refcheck=False)
    before = x.copy()
    with pytest.raises(ValueError) as raised:
        prepared()
    if rank == size - 1:
        assert "this prepared call's x changed" in str(raised.value)
    else:
        assert isinstance(raised.value, mar.SignatureMismatch), raised.value
    assert np.array_equal(x, before), f"rank {rank}: written"
    assert mar.allreduce(np.array([rank + 1.0]))[0] == size * (size + 1) / 2


@BOTH
def test_a_symmetric_input_is_handed_back_and_an_ordinary_view_is_not(
    comm, use_settings, use_compiled
):
    """With symmetric arrays made (mar.empty, as GradientSync's one-node bucket is), the short path
    hands an input that lies in one back to the general path (which may run single_copy on it) and
    reduces an ordinary view itself."""
    use_settings(compiled=use_compiled)
    x, want, prepared, state = prepared_and_plain(comm, 4)
    symmetric = mar.empty(4, np.float64, comm=comm)
    symmetric[...] = x
    view = np.zeros(8)[2:6]
    view[...] = x
    short = short_of(comm, x)
    assert short(symmetric, None) is None
    assert values_equal(short(view, None), want)
    assert values_equal(mar.allreduce(symmetric, comm=comm), want) and values_equal(
        mar.allreduce(view, comm=comm), want
    )


def test_ranks_with_the_compiled_paths_on_and_off_agree(comm, use_settings):
    """MPIALLREDUCE_COMPILED is not agreed across ranks (both paths do the same): with it off on the
    odd ranks only, plain calls (sum and mean, new array and in place), prepared calls and a call
    that differs on the last rank give numpy's values or the same error everywhere, numbered
    alike."""
    rank, size = comm.Get_rank(), comm.Get_size()
    use_settings(compiled=rank % 2 == 0)
    x, want, prepared, state = prepared_and_plain(comm, 4)
    mean = numpy_reference("mean", gather_inputs(comm, x))
    for _ in range(3):
        y = x.copy()
        assert values_equal(mar.allreduce(x, comm=comm), want) and values_equal(prepared(), want)
        assert values_equal(mar.allreduce(x, op="mean", comm=comm), mean)
        assert values_equal(mar.allreduce(y, comm=comm, out=y), want)
    if size > 1:
        odd = exact_input("float64", 5 if rank == size - 1 else 4, rank, "sum")
        with pytest.raises(ValueError, match=r"shape differs"):
            mar.allreduce(odd, comm=comm)
    assert values_equal(mar.allreduce(x, comm=comm), want)
    numbers = comm.allgather(state.sequence)
    assert len(set(numbers)) == 1, numbers
