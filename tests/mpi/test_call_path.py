"""The call path: collective order, calls that differ between ranks, settings, failures inside a
call, prepared calls (issue: the call path rebuilt). Every expected value comes from numpy on
gathered inputs."""

import threading
import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI
from reference import (
    exact_input,
    gather_inputs,
    numpy_reference,
    timing_test_at_three_ranks,
    values_equal,
)

import mpiallreduce as mar
from mpiallreduce.algorithms import HOST_ALGORITHMS, REGISTRY
from mpiallreduce.algorithms.base import CallTags
from mpiallreduce.core import state as state_module

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD


def _fresh():
    """A communicator the library has never seen (its first use is the test's)."""
    return WORLD.Dup()


def test_check_beside_queued_async_calls_never_fails_falsely():
    """The call site is taken on the caller's thread: a queued call does not report the worker's."""
    rank = WORLD.Get_rank()
    big = exact_input("float64", 200_000, rank, "sum")
    small = exact_input("float64", 10, rank, "sum")
    want_big, want_small = (numpy_reference("sum", gather_inputs(WORLD, a)) for a in (big, small))
    for _ in range(20):
        handle = mar.allreduce_async(big, algorithm="ring")
        assert values_equal(mar.allreduce(small, check=True), want_small)
        assert values_equal(handle.wait(), want_big)


def test_user_collectives_on_the_same_communicator_while_async_calls_fly():
    """The library's collectives run on its own duplicate: the user's MPI_Allreduce on the same
    communicator, the same algorithm and size, cannot be matched with the library's."""
    comm = WORLD
    rank = comm.Get_rank()
    for i in range(30):
        a = exact_input("float64", 4096, rank + i, "sum")
        b = exact_input("float64", 4096, rank + 7 * i + 1, "sum")
        want_a = numpy_reference("sum", gather_inputs(comm, a))
        want_b = numpy_reference("sum", gather_inputs(comm, b))
        handle = mar.allreduce_async(a, algorithm="mpi", comm=comm)
        mine = np.empty_like(b)
        comm.Allreduce(b, mine)  # the user's own collective, while the library's may be in flight
        assert values_equal(mine, want_b), i
        assert values_equal(handle.wait(), want_a), i


@pytest.mark.parametrize("nbytes", [64 << 10, 1 << 20])
@pytest.mark.parametrize("algorithm", list(HOST_ALGORITHMS) + ["auto"])
def test_calls_that_differ_raise_on_every_rank_without_check(algorithm, nbytes):
    """From 64 KiB on, shape, dtype and op are compared before any data moves: never wrong values,
    never a hang, the same error everywhere; the next call is right."""
    comm = WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    count = nbytes // 4
    last = rank == size - 1
    with pytest.raises(
        ValueError,
        match=(
            rf"shape differs: \({count},\) on ranks? [\d, ]+; "
            rf"\({count + 1},\) on rank {size - 1}"
        ),
    ):
        mar.allreduce(np.ones(count + (1 if last else 0), np.float32), algorithm=algorithm)
    with pytest.raises(ValueError, match="dtype differs: 'float32' on"):
        mar.allreduce(np.ones(count, np.int32 if last else np.float32), algorithm=algorithm)
    with pytest.raises(ValueError, match="op differs"):
        mar.allreduce(np.ones(count, np.float32), op="max" if last else "sum", algorithm=algorithm)
    x = exact_input("float32", count, rank, "sum")
    assert values_equal(
        mar.allreduce(x, algorithm=algorithm), numpy_reference("sum", gather_inputs(comm, x))
    )


@pytest.mark.one_node("shared_memory needs one node")
def test_shared_memory_compares_sizes_below_the_signature_threshold_too():
    """shared_memory waits for the ranks' codes in place of its first barrier, so a call under
    64 KiB whose size differs between ranks is refused everywhere (its size is the code), on the
    general and the short path; the next call is right."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    x = exact_input("float32", 1000, rank, "sum")
    want = numpy_reference("sum", gather_inputs(WORLD, x))
    for _ in range(2):  # the second time on the short path
        with pytest.raises(
            ValueError,
            match=rf"shape differs: \(1000,\) on ranks? [\d, ]+; \(1001,\) on rank {size - 1}",
        ):
            mar.allreduce(np.ones(1000 + (rank == size - 1), np.float32), algorithm="shared_memory")
        assert values_equal(mar.allreduce(x, algorithm="shared_memory"), want)
        assert values_equal(
            mar.allreduce(
                np.ones(1000 + (rank == size - 1), np.float32)[:1000] * 0 + x,
                algorithm="shared_memory",
            ),
            want,
        )


@pytest.mark.one_node("shared_memory needs one node")
def test_shared_memory_refuses_a_rank_that_runs_another_algorithm_or_straddles_the_threshold():
    """shared_memory waits for the codes that another algorithm's check publishes, so ranks that
    ask for different algorithms (from 64 KiB) are refused everywhere; so are calls of which some
    are checked (64 KiB) and others not (smaller): both publish, the codes differ."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    last = rank == size - 1
    count = 1 << 14  # 64 KiB of float32: checked
    with pytest.raises(ValueError, match="algorithm differs"):
        mar.allreduce(np.ones(count, np.float32), algorithm="ring" if last else "shared_memory")
    with pytest.raises(
        ValueError,
        match=(
            rf"shape differs: \({count},\) on ranks? [\d, ]+; "
            rf"\({count - 100},\) on rank {size - 1}"
        ),
    ):
        mar.allreduce(
            np.ones(count - 100 if last else count, np.float32), algorithm="shared_memory"
        )
    x = exact_input("float32", count, rank, "sum")
    assert values_equal(
        mar.allreduce(x, algorithm="shared_memory"), numpy_reference("sum", gather_inputs(WORLD, x))
    )


@pytest.mark.one_node("shared_memory needs one node")
@pytest.mark.parametrize("nbytes", [4000, 1 << 18])
def test_prepared_and_plain_shared_memory_calls_interleave_right(nbytes):
    """A prepared shared_memory call waits on the same shared slots as plain ones (checked or not):
    calls of both kinds, interleaved, stay in step and are right."""
    rank = WORLD.Get_rank()
    x = exact_input("float64", nbytes // 8, rank, "sum")
    y = exact_input("float64", nbytes // 8 + 1, rank + 1, "sum")
    want_x = numpy_reference("sum", gather_inputs(WORLD, x))
    want_y = numpy_reference("sum", gather_inputs(WORLD, y))
    prepared = mar.prepare(x, algorithm="shared_memory")
    for i in range(3):
        assert values_equal(prepared(), want_x), i
        assert values_equal(mar.allreduce(y, algorithm="shared_memory"), want_y), i


def test_a_repeated_call_that_differs_is_caught_on_the_short_path():
    """The same call made again takes the short path; a rank that then differs is still caught."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    x = np.ones(1 << 15, np.float32)
    for _ in range(3):
        assert mar.allreduce(x)[0] == size
    with pytest.raises(ValueError, match="shape differs"):
        mar.allreduce(np.ones((1 << 15) + (rank == 0), np.float32))
    assert mar.allreduce(x)[0] == size


def test_a_segment_size_that_differs_between_ranks_is_refused_on_every_rank(use_settings):
    comm = _fresh()
    try:
        use_settings(ring_segment_bytes=(1 << 20) + (1 << 10) * comm.Get_rank())
        if comm.Get_size() > 1:
            with pytest.raises(
                ValueError,
                match=r"ring_segment_bytes differs: 1048576 on rank 0; 1049600 on rank 1",
            ):
                mar.allreduce(np.ones(10), algorithm="ring_pipelined", comm=comm)
            with pytest.raises(
                ValueError, match="ring_segment_bytes differs"
            ):  # and again: not a hang
                mar.allreduce(np.ones(10), comm=comm)
        use_settings(ring_segment_bytes=1 << 20)
        assert (
            mar.allreduce(np.ones(10), algorithm="ring_pipelined", comm=comm)[0] == comm.Get_size()
        )
    finally:
        comm.Free()


def test_an_exception_in_round_1_of_the_rendezvous_ends_the_call_on_every_rank():
    """Rank 0 turns the stall warning into an error (-W error) while the last rank is late: rank 0
    raises it, the others learn that rank 0 gave up; nobody hangs and the next call works."""
    timing_test_at_three_ranks()
    comm = _fresh()
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        mar.allreduce(np.ones(4), comm=comm)  # first use: the control channel is set up
        if size == 1:
            return
        started = time.monotonic()
        if rank == size - 1:
            time.sleep(2.5)  # past the stall warning (half the timeout), before the timeout
        with warnings.catch_warnings():
            if rank == 0:
                warnings.simplefilter("error", mar.AllreduceStallWarning)
                with pytest.raises(mar.AllreduceStallWarning):
                    mar.allreduce(np.ones(4), comm=comm, timeout=4.0)
            else:
                warnings.simplefilter("ignore", mar.AllreduceStallWarning)
                with pytest.raises(mar.AllreduceTimeout, match="rank 0 gave up waiting for it"):
                    mar.allreduce(np.ones(4), comm=comm, timeout=4.0)
        assert time.monotonic() - started < 3.9, "every rank ended before the timeout"
        assert mar.allreduce(np.ones(4), comm=comm, timeout=30)[0] == size
    finally:
        comm.Free()


def test_a_failure_midway_through_an_algorithm_leaves_no_message_for_the_next_call(
    monkeypatch, use_settings
):
    """The ranks of a pipelined ring fail at different reductions (rank 0 at its first, the others
    at their second, unless told of rank 0's failure first), with segments posted ahead: messages
    are left unreceived and receives left posted. The next calls use other tags, so neither can
    meet them: they are right."""
    comm = _fresh()
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        use_settings(ring_segment_bytes=4096)
        x = exact_input("float64", 40_000, rank, "sum")
        want = numpy_reference("sum", gather_inputs(comm, x))
        mar.allreduce(x, algorithm="ring_pipelined", comm=comm)  # first use
        if size == 1:
            return
        op_type = type(mar.OPS["sum"])
        original = op_type.reduce_local
        reductions = []

        def fail_midway(self, a, b, out):
            reductions.append(1)
            if len(reductions) == (1 if rank == 0 else 2):
                monkeypatch.setattr(op_type, "reduce_local", original)
                raise RuntimeError("injected failure in the middle of the algorithm")
            return original(self, a, b, out)

        monkeypatch.setattr(op_type, "reduce_local", fail_midway)
        # its own failure, or told of another rank's before it reached its own (faults.watch)
        with pytest.raises(
            (RuntimeError, mar.AllreduceAborted), match="injected failure|failed in the middle"
        ):
            mar.allreduce(x, algorithm="ring_pipelined", comm=comm)
        monkeypatch.setattr(op_type, "reduce_local", original)
        time.sleep(0.2)  # the messages of the failed call arrive
        for step in range(3):
            y = exact_input("float64", 40_000, rank + 5 + step, "sum")
            assert values_equal(
                mar.allreduce(y, algorithm="ring_pipelined", comm=comm),
                numpy_reference("sum", gather_inputs(comm, y)),
            ), step
        assert values_equal(mar.allreduce(x, algorithm="ring_pipelined", comm=comm), want)
    finally:
        comm.Barrier()
        comm.Free()


MESSAGES_ONLY = [name for name in HOST_ALGORITHMS if REGISTRY[name].messages_only]


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["untimed", "timed"])
@pytest.mark.parametrize("algorithm", MESSAGES_ONLY)
def test_one_rank_failing_midway_ends_the_call_on_every_rank_at_once(
    monkeypatch, use_settings, algorithm, timeout
):
    """Only the last rank fails, at its first reduction. The others are told (not left blocked in a
    receive): each raises AllreduceAborted naming it, or had already finished with the right values
    when its part needed nothing more from that rank; at once, not after the timeout. The next calls
    are right."""
    comm = _fresh()
    rank, size = comm.Get_rank(), comm.Get_size()
    failing = size - 1
    try:
        # (the Python rounds: across nodes dissemination's compiled ones reduce in C, where the
        # failure below is not injected)
        use_settings(ring_segment_bytes=4096, compiled=False)
        x = exact_input("float64", 40_000, rank, "sum")
        want = numpy_reference("sum", gather_inputs(comm, x))
        assert values_equal(mar.allreduce(x, algorithm=algorithm, comm=comm), want)  # first use
        if size == 1:
            return
        # (the op's reduction; dissemination reduces a sum by MPI_Reduce_local, in reduce_in_order)
        from mpiallreduce.algorithms import dissemination

        owner, name = (
            (dissemination, "reduce_in_order")
            if algorithm == "dissemination"
            else (type(mar.OPS["sum"]), "reduce_local")
        )
        if rank == failing:
            original = getattr(owner, name)

            def fail_once(*args, **kwargs):
                monkeypatch.setattr(owner, name, original)
                raise MemoryError("injected failure in the middle of the algorithm")

            monkeypatch.setattr(owner, name, fail_once)
        started = time.monotonic()
        outcome = None
        try:
            outcome = mar.allreduce(x, algorithm=algorithm, comm=comm, timeout=timeout)
        except MemoryError:
            outcome = "raised its own"
        except mar.AllreduceAborted as aborted:
            assert aborted.failed_rank == failing and f"rank {failing} failed in the middle" in str(
                aborted
            )
            outcome = "aborted"
        took = time.monotonic() - started
        outcomes = comm.allgather(
            outcome if isinstance(outcome, str) else bool(values_equal(outcome, want))
        )
        assert outcomes[failing] == "raised its own", outcomes
        assert all(o in ("aborted", True) for o in outcomes[:failing]), outcomes
        if algorithm.startswith(
            "ring"
        ):  # every rank needs the failing rank's chunk in the allgather
            assert outcomes[:failing] == ["aborted"] * failing, outcomes
        assert took < 10, f"rank {rank} took {took:.1f} s to learn of the failure"
        for step in range(3):
            y = exact_input("float64", 40_000, rank + 5 + step, "sum")
            assert values_equal(
                mar.allreduce(y, algorithm=algorithm, comm=comm, timeout=timeout),
                numpy_reference("sum", gather_inputs(comm, y)),
            ), step
    finally:
        comm.Barrier()
        comm.Free()


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_a_call_timed_on_one_rank_only_ends_with_an_error_on_every_rank(algorithm):
    """Rank 0 gives a timeout, the others do not: rank 0's rendezvous times out and gives up, and
    the others, waiting in the algorithm for rank 0, learn it (faults.watch). The next calls agree
    and are right. (On a communicator's very first call this is not so: see the README.)"""
    timing_test_at_three_ranks()
    comm = _fresh()
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        x = exact_input("float64", 5000, rank, "sum")
        want = numpy_reference("sum", gather_inputs(comm, x))
        assert values_equal(mar.allreduce(x, algorithm=algorithm, comm=comm), want)  # first use
        if size == 1:
            return
        if rank == 0:
            with pytest.raises(mar.AllreduceTimeout):
                mar.allreduce(x, algorithm=algorithm, comm=comm, timeout=2.0)
        else:
            with pytest.raises(
                mar.AllreduceAborted, match="rank 0 gave it up .its timeout ran out"
            ):
                mar.allreduce(x, algorithm=algorithm, comm=comm)
        for _ in range(2):
            assert values_equal(mar.allreduce(x, algorithm=algorithm, comm=comm, timeout=30), want)
    finally:
        comm.Barrier()
        comm.Free()


def test_float16_overflow_under_seterr_raise_gives_inf_not_an_exception():
    size = WORLD.Get_size()
    x = np.full(1000, 60000, np.float16)
    with np.errstate(all="raise"):
        for algorithm in ("ring", "recursive_doubling", "mpi"):
            result = mar.allreduce(x, algorithm=algorithm)
            assert np.all(np.isinf(result)) == (size > 1), algorithm


def test_call_numbers_far_apart_never_confuse_tags_or_control_messages():
    """Tags wrap around after CallTags.calls_apart calls; control messages carry the whole call
    number. Jump every rank's numbering across the wrap, with a given-up call behind: still
    right."""
    timing_test_at_three_ranks()
    comm = _fresh()
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        mar.allreduce(np.ones(3), comm=comm)
        state = state_module.state_of(comm)
        if size > 1:  # a given-up call leaves its late messages behind
            if rank == size - 1:
                time.sleep(1.2)
            with pytest.raises(mar.AllreduceTimeout):
                mar.allreduce(np.ones(3), comm=comm, timeout=0.5)
            comm.Barrier()
        apart = CallTags(comm, 0).calls_apart
        highest_algorithm_tag = CallTags(comm, apart - 1).offset + CallTags.slot - 1
        assert highest_algorithm_tag < comm.Get_attr(MPI.TAG_UB), (
            "the control messages' tag is TAG_UB"
        )
        for jump in (
            10_000,
            (apart - 2) - (state.sequence + 10_000) % apart,
        ):  # then 2 calls before the wrap
            state.sequence += jump
            for _ in range(4):
                x = exact_input("float64", 5000, rank, "sum")
                assert values_equal(
                    mar.allreduce(x, algorithm="ring", comm=comm, timeout=30),
                    numpy_reference("sum", gather_inputs(comm, x)),
                )
    finally:
        comm.Free()


@pytest.mark.parametrize("first_use", [False, True], ids=["used_before", "first_use"])
def test_a_straggler_on_the_first_timed_call_is_diagnosed_and_no_later_call_is_blamed(first_use):
    timing_test_at_three_ranks()
    comm = _fresh()
    rank, size = comm.Get_rank(), comm.Get_size()
    late = size - 1
    timeout = 1.0  # (3 ranks on 2 cores: timing_test_at_three_ranks)
    try:
        if not first_use:
            mar.allreduce(np.ones(3), comm=comm)  # an untimed call: the control channel is ready
        if size == 1:
            return
        if rank == late:
            time.sleep(2 * timeout)
        with pytest.raises(mar.AllreduceTimeout) as raised:
            mar.allreduce(np.ones(3), comm=comm, timeout=timeout)
        if rank == late:
            assert "gave up waiting for it" in str(raised.value)
        elif first_use:
            assert "the first call on this communicator" in str(raised.value)
        else:
            assert raised.value.missing_ranks == (late,), str(raised.value)
        # the next call: no rank is blamed for a skipped call, the numbers are in step
        result = mar.allreduce(np.ones(3), comm=comm, timeout=10 * timeout)
        assert result[0] == size
        assert mar.allreduce(np.ones(3), comm=comm, timeout=10 * timeout)[0] == size
    finally:
        comm.Free()


def test_concurrent_first_use_from_two_threads_makes_one_state():
    comm = _fresh()
    try:
        found = []
        barrier = threading.Barrier(2)

        def first_use():
            barrier.wait()
            found.append(state_module.state_of(comm))

        threads = [threading.Thread(target=first_use) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert found[0] is found[1]
        assert mar.allreduce(np.ones(3), comm=comm)[0] == comm.Get_size()
    finally:
        comm.Free()


def test_bad_timeout_and_check_values_are_refused_before_any_communication():
    for bad in (-1, 0, float("nan"), "5"):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            mar.allreduce(np.ones(2), timeout=bad)
    with pytest.raises(TypeError, match="check must be True or False"):
        mar.allreduce(np.ones(2), check="yes")
    assert mar.allreduce(np.ones(2))[0] == WORLD.Get_size()


class _CountingComm:
    """Counts every method called on the library's communicator."""

    def __init__(self, comm):
        self.comm, self.calls = comm, []

    def __getattr__(self, name):
        attribute = getattr(self.comm, name)
        if callable(attribute):
            self.calls.append(name)
        return attribute


@pytest.mark.one_node("the shared slots compare signatures on one node (across nodes, messages do)")
def test_no_check_and_no_timeout_add_no_collective_and_no_message():
    """An unchecked, untimed call makes its one MPI_Allreduce and nothing else on the library's
    communicator: its signature is compared in the shared slots (loads and stores, one node), and
    a slow peer is watched for (the control channel's receives), but no message is sent."""
    comm = _fresh()
    try:
        x = np.ones(1000)
        mar.allreduce(x, comm=comm, algorithm="mpi")
        state = state_module.state_of(comm)
        counting = state.library = _CountingComm(state.library)
        for _ in range(10):
            assert mar.allreduce(x, comm=comm, algorithm="mpi")[0] == comm.Get_size()
        assert counting.calls == (
            ["Allreduce"] * 10 if comm.Get_size() > 1 else []
        )  # one rank: a local copy
        assert state.channel is None or not state.channel.sends, "no control message was sent"
        state.library = counting.comm
    finally:
        comm.Free()


@pytest.mark.parametrize("algorithm", ["auto", "mpi", "ring", "recursive_doubling", "rabenseifner"])
@pytest.mark.parametrize("where", ["new", "out", "in_place", "strided"])
def test_prepared_calls_reduce_the_current_contents_each_run(comm, algorithm, where):
    rank = comm.Get_rank()
    base = np.zeros(2 * 3001) if where == "strided" else np.zeros(3001)
    x = base[::2] if where == "strided" else base
    out = {"new": None, "out": np.empty(3001), "in_place": x, "strided": None}[where]
    prepared = mar.prepare(x, op="sum", algorithm=algorithm, comm=comm, out=out)
    assert algorithm == "auto" or prepared.plan.name == algorithm or comm.Get_size() == 1
    for step in range(3):
        x[...] = exact_input("float64", 3001, rank + step, "sum")
        want = numpy_reference("sum", gather_inputs(comm, x))
        result = prepared()
        assert values_equal(result, want), step
        if out is not None:
            assert result is out


def test_prepared_calls_are_agreed_once_and_refuse_a_mismatch_everywhere():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    with pytest.raises(ValueError, match="shape differs"):
        mar.prepare(np.ones(10 + (rank == size - 1)))
    prepared = mar.prepare(np.ones(10), op="mean")
    handle = prepared.start()
    assert values_equal(handle.wait(), np.ones(10))


@pytest.mark.parametrize("other", ["plain", "prepared elsewhere", "plain async"])
def test_a_timed_prepared_call_run_on_some_ranks_only_raises_on_every_rank(other):
    """Review finding: a timed prepared call (which compares nothing after its rendezvous) on rank 0
    against a plain timed call (which compares its signature after it) elsewhere left the plain
    ranks waiting for ever for rank 0's signature. Now the rendezvous carries the kind of call: a
    SignatureMismatch on every rank, well within the timeout, and the next call is right."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    x = np.arange(6, dtype=np.float64) + rank
    prepared, another = mar.prepare(x, timeout=30), mar.prepare(np.ones(7), timeout=30)
    started = time.monotonic()
    with pytest.raises(
        ValueError, match=r"is not the same call on every rank: a prepared call on rank 0, "
    ):
        if rank == 0:
            prepared()
        elif other == "prepared elsewhere":
            another()
        elif other == "plain async":
            mar.allreduce_async(x, timeout=30).wait()
        else:
            mar.allreduce(x, timeout=30)
    assert time.monotonic() - started < 20
    want = np.arange(6, dtype=np.float64) * size + size * (size - 1) / 2
    assert values_equal(prepared(), want) and values_equal(mar.allreduce(x, timeout=30), want)


def test_a_timed_gather_of_the_librarys_against_a_plain_call_raises_on_every_rank():
    """Review finding: the library's own timed gather (GradientSync's agreement) brought the plain
    call's kind to the rendezvous; against a timed plain call both then waited for ever."""
    from mpiallreduce.core.gather import gather_from_ranks

    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    started = time.monotonic()
    with pytest.raises(
        ValueError, match=r"a gather of the library's own .* on rank 0, a plain allreduce on rank"
    ):
        if rank == 0:
            gather_from_ranks(WORLD, rank, timeout=30)
        else:
            mar.allreduce(np.ones(3), timeout=30)
    assert time.monotonic() - started < 20
    assert gather_from_ranks(WORLD, rank, timeout=30) == list(range(size))


@pytest.mark.one_node("the shipped table's one-node rules (persistent calls, auto's choice)")
@pytest.mark.parametrize("algorithm", ["auto", "mpi", "ring"])
def test_a_prepared_call_runs_in_place_on_another_array_for_gradient_sync(comm, algorithm):
    """GradientSync's: a call prepared in place and not persistent, run in place on another array
    like x (``_run_on``, ``_start_on``); x keeps what it held; an array unlike x, or a call not
    prepared so, is refused before anything moves (on every rank alike here)."""
    from mpiallreduce.api import prepare_at

    rank = comm.Get_rank()
    x = exact_input("float32", 20_000, rank, "sum")
    kept = x.copy()
    prepared = prepare_at("", x, algorithm=algorithm, comm=comm, out=x, persistent=False)
    for step, run in enumerate((prepared._run_on, lambda y: prepared._start_on(y).wait())):
        y = exact_input("float32", 20_000, rank + step + 1, "sum")
        want = numpy_reference("sum", gather_inputs(comm, y))
        assert run(y) is y and values_equal(y, want), step
    assert np.array_equal(x, kept)
    for wrong in (
        np.zeros(20_001, np.float32),
        np.zeros(20_000),
        np.zeros(40_000, np.float32)[::2],
    ):
        with pytest.raises(ValueError, match="writeable C-contiguous numpy array of x's shape"):
            prepared._run_on(wrong)
    with pytest.raises(ValueError, match="prepared in place, not persistent and not single_copy"):
        mar.prepare(x, comm=comm)._run_on(np.zeros_like(x))  # (prepared out of place)
    if comm.Get_size() > 1:  # (on one rank, a local copy: never persistent)
        small = np.ones(4, np.float32)
        persistent = mar.prepare(small, algorithm="mpi", comm=comm, out=small)
        assert persistent.persistent and "persistent (MPI_Allreduce_init)" in repr(persistent)
        assert "persistent" not in repr(prepared)  # (run on other memory: never)
        with pytest.raises(
            ValueError, match="prepared in place, not persistent and not single_copy"
        ):
            persistent._run_on(np.zeros_like(small))
    want = numpy_reference("sum", gather_inputs(comm, x))
    assert values_equal(prepared(), want)  # (the ranks still in step)


@pytest.mark.one_node("the shipped table's one-node rules (persistent calls, auto's choice)")
def test_a_small_prepared_call_of_mpi_is_a_persistent_request_freed_with_it(comm):
    """Where the table says (the shipped one: up to 2 KiB on 2 ranks, in place or not) a prepared
    call of MPI's allreduce binds MPI_Allreduce_init once and starts it each run (in place or not,
    in the background too); collected, its request is freed."""
    import gc
    import weakref

    rank = comm.Get_rank()
    for in_place in (False, True):
        x = exact_input("float64", 300, rank, "sum")
        prepared = mar.prepare(x, algorithm="mpi", comm=comm, out=x if in_place else None)
        assert prepared.plan.persistent == (comm.Get_size() > 1) or prepared.plan.local_only
        for step in range(3):
            x[...] = exact_input("float64", 300, rank + step, "sum")
            want = numpy_reference("sum", gather_inputs(comm, x))
            assert values_equal(prepared() if step != 1 else prepared.start().wait(), want), (
                in_place,
                step,
            )
    prepared = mar.prepare(
        x, algorithm="mpi", comm=comm
    )  # (not started in the background: the worker
    prepared()  # may hold its last job a while)
    alive = weakref.ref(prepared.execute)
    del prepared
    gc.collect()
    assert (
        alive() is None
    )  # (and with it, its request: weakref.finalize in mpiallreduce.core.persistent)


@pytest.mark.one_node("the shipped table's one-node rules (persistent calls, auto's choice)")
def test_a_rank_given_other_persistent_rules_after_start_up_is_refused_on_every_rank(comm):
    """A rank whose table changes after start-up (set_tuning_table on it alone), were its persistent
    rules all that differ, would bind MPI_Allreduce_init where the others run the blocking call: the
    communicator agrees on the table's digest again first, and every rank raises; on a new
    communicator with the same table again, calls run."""
    from mpiallreduce.core import tuning
    from mpiallreduce.core.state import SettingsMismatch

    if comm.Get_size() == 1:
        return
    shipped, dup, x = tuning.tuning_table(), comm.Dup(), np.ones(8, np.float32)
    try:
        try:
            if comm.Get_rank() == 1:
                tuning.set_tuning_table(
                    dict(shipped, persistent_by_ranks={}, persistent_by_ranks_in_place={})
                )
            with pytest.raises(SettingsMismatch, match="tuning_table differs"):
                mar.prepare(x, algorithm="mpi", comm=dup)
        finally:
            tuning.set_tuning_table(shipped)
    finally:
        dup.Free()  # (a communicator that met a mismatch stays refused; a new one agrees again)
    again = comm.Dup()
    try:
        prepared = mar.prepare(x, algorithm="mpi", comm=again)
        assert prepared.persistent and values_equal(
            prepared(), numpy_reference("sum", gather_inputs(comm, x))
        )
        del prepared
    finally:
        again.Free()


def test_tunes_prepared_calls_are_persistent_always_or_never_as_asked_whatever_the_table_says(comm):
    """tune's contenders mpi:persistent and mpi:blocking (prepare_at's persistent="always" and
    False): MPI's own as a persistent request at any size, or never; right either way, in place or
    not; an algorithm that is not MPI's own is never one."""
    from mpiallreduce.api import prepare_at

    rank, many = comm.Get_rank(), comm.Get_size() > 1
    for count in (4, 100_000):  # (16 B, 400 KB: the table's blocking size)
        for in_place in (False, True):
            x = exact_input("float32", count, rank, "sum")
            always = prepare_at(
                "", x, algorithm="mpi", comm=comm, out=x if in_place else None, persistent="always"
            )
            never = prepare_at(
                "", x, algorithm="mpi", comm=comm, out=x if in_place else None, persistent=False
            )
            assert always.persistent == many and not never.persistent, (count, in_place)
            for step, prepared in enumerate((always, never, always)):
                x[...] = exact_input("float32", count, rank + step, "sum")
                want = numpy_reference("sum", gather_inputs(comm, x))
                assert values_equal(prepared(), want), (count, in_place, step)
    assert not prepare_at("", x, algorithm="ring", comm=comm, persistent="always").persistent


@pytest.mark.parametrize(
    "compared, count", [(True, 20_000), (False, 4)], ids=["compared", "unchecked"]
)
def test_a_mean_through_mpis_own_allreduce_is_divided_on_every_way_in(
    comm, use_settings, compared, count
):
    """A mean of algorithm "mpi" runs MPI_Allreduce itself and divides after (Execution.direct): on
    the first call and on a repeat's short path (its signature compared, or not: the setting off),
    in place, into another array, timed, in the background, prepared (persistent or not) and run
    on another array; numpy's sum divided (sums that 3 does not divide: a division, not a
    multiplication by 1/3), under seterr(all="raise") too (a subnormal mean underflows: masked, as
    everywhere)."""
    from mpiallreduce.api import prepare_at

    if not compared:  # (a communicator of its own: the setting is read when its state is made)
        use_settings(signature_min_bytes=-1)
        comm = comm.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    for dtype in ("float64", "float32", "complex128"):
        x = exact_input(dtype, count, rank, "mean") * (
            rank + 1
        )  # (exact sums, not all multiples of 3)
        kept = x.copy()
        want = numpy_reference("mean", gather_inputs(comm, x))
        y, z, other = x.copy(), x.copy(), np.empty_like(x)
        prepared_in_place = mar.prepare(y, op="mean", algorithm="mpi", comm=comm, out=y)
        on_other = prepare_at("", z, op="mean", algorithm="mpi", comm=comm, out=z, persistent=False)
        assert prepared_in_place.execution.direct == (size > 1) and on_other.execution.divides == (
            size > 1
        )
        runs = {
            "first": lambda x=x: mar.allreduce(x, op="mean", algorithm="mpi", comm=comm),
            "repeat": lambda x=x: mar.allreduce(x, op="mean", algorithm="mpi", comm=comm),
            "in place": lambda y=y: mar.allreduce(y, op="mean", algorithm="mpi", comm=comm, out=y),
            "into another array": lambda x=x, other=other: mar.allreduce(
                x, op="mean", algorithm="mpi", comm=comm, out=other
            ),
            "timed": lambda x=x: mar.allreduce(
                x, op="mean", algorithm="mpi", comm=comm, timeout=30
            ),
            "async": lambda x=x: mar.allreduce_async(
                x, op="mean", algorithm="mpi", comm=comm
            ).wait(),
            "prepared": lambda x=x: mar.prepare(x, op="mean", algorithm="mpi", comm=comm)(),
            "prepared in place": prepared_in_place,
            "on another array": lambda on_other=on_other, y=y: on_other._run_on(y),
        }
        for name, run in runs.items():
            y[...] = x
            result = run()
            assert values_equal(result, want), (dtype, name)
            assert values_equal(x, kept), (dtype, name)
    tiny = np.full(count, 5e-324 if rank == 0 else 0.0)  # (its mean underflows)
    with np.errstate(all="ignore"):
        want = numpy_reference("mean", gather_inputs(comm, tiny))
    with np.errstate(all="raise"):
        assert values_equal(mar.allreduce(tiny, op="mean", algorithm="mpi", comm=comm), want)
        assert values_equal(
            mar.allreduce(tiny, op="mean", algorithm="mpi", comm=comm), want
        )  # (short path)
    if size > 1:
        execution = state_module.state_of(comm).fast_calls[
            ((count,), np.dtype(np.float64), "mean", "mpi", False)
        ]
        assert execution.direct and execution.raw_unchecked == (not compared)
    if (
        compared and size > 1
    ):  # (a mean on rank 0 against sums: both MPI_SUM underneath, yet refused)
        x = exact_input("float64", count, rank, "sum")
        with pytest.raises(
            ValueError, match=r"op differs: 'mean' on rank 0; 'sum' on ranks? [\d, ]+"
        ):
            mar.allreduce(x, op="mean" if rank == 0 else "sum", algorithm="mpi", comm=comm)
        assert values_equal(
            mar.allreduce(x, algorithm="mpi", comm=comm),
            numpy_reference("sum", gather_inputs(comm, x)),
        )
    if not compared:
        comm.Free()


def test_past_256_kinds_of_calls_the_oldest_lose_their_short_path_not_the_newest(comm):
    """bench's sizes x algorithms x modes pass 256 kinds: the newest kinds keep a short path."""
    from mpiallreduce.core.state import state_of

    rank = comm.Get_rank()
    for count in range(1, 301):
        x = exact_input("float32", count, rank, "sum")
        want = numpy_reference("sum", gather_inputs(comm, x)) if count in (1, 300) else None
        result = mar.allreduce(x, comm=comm, out=x)
        assert want is None or values_equal(result, want)
    kept = state_of(comm).fast_calls
    assert len(kept) == 256 and ((300,), np.dtype(np.float32), "sum", "auto", True) in kept
    assert ((1,), np.dtype(np.float32), "sum", "auto", True) not in kept


@pytest.mark.mpi(min_size=2)
def test_a_call_in_place_on_some_ranks_only_is_refused_on_every_rank():
    """``out=x`` is part of the signature (as MPI_IN_PLACE must be given by every rank): in-place
    calls have plans of their own, and ranks that differ would run different ones."""
    rank = WORLD.Get_rank()
    for count in (10, 50_000):
        x = exact_input("float32", count, rank, "sum")
        with pytest.raises(ValueError, match="in place"):
            mar.allreduce(x, out=x if rank == 0 else None)
    want = numpy_reference("sum", gather_inputs(WORLD, x))
    assert values_equal(mar.allreduce(x, out=x), want)


@pytest.mark.one_node("the shipped table's one-node rules (persistent calls, auto's choice)")
def test_describe_call_says_what_auto_then_runs(monkeypatch):
    """describe_call names an algorithm; that algorithm (and no other) is the one the call
    executes."""
    x = np.ones(1 << 18, np.float32)  # 1 MiB: the signature is compared
    text = mar.describe_call(x)
    size = WORLD.Get_size()
    if size == 1:
        assert "local copy" in text
        return
    named = text.split(" ")[0]
    assert (
        named in mar.ALGORITHMS
        and "auto: the tuning table" in text
        and ("signature: shared slots" in text or "signature: carried by shared_memory" in text)
    )
    ran = []
    for name, algorithm in REGISTRY.items():
        monkeypatch.setattr(
            algorithm,
            "execute",
            (lambda original, n: lambda *a, **k: ran.append(n) or original(*a, **k))(
                algorithm.execute, name
            ),
        )
    assert mar.allreduce(x)[0] == size
    # (MPI's own allreduce is called by the executor itself, not through the mpi module's execute)
    assert ran == ([] if named == "mpi" else [named]), (text, ran)
    assert "asked for: by name" in mar.describe_call(np.ones(10), algorithm="ring")


@pytest.mark.one_node("pretend nodes (ranks_per_node) share one real node's memory")
def test_hierarchical_gets_its_leaders_plan_from_the_planner(use_settings):
    comm = _fresh()
    try:
        use_settings(ranks_per_node=2)
        x = exact_input("float64", 1000, comm.Get_rank(), "sum")
        text = mar.describe_call(x, comm=comm, algorithm="hierarchical")
        if comm.Get_size() > 2:
            assert "hierarchical" in text and "node leaders run" in text, text
        assert values_equal(
            mar.allreduce(x, comm=comm, algorithm="hierarchical"),
            numpy_reference("sum", gather_inputs(comm, x)),
        )
    finally:
        comm.Free()


def test_an_input_changed_before_the_reduction_ends_is_caught_with_check_on_every_rank():
    """allreduce_async's rule (x untouched until wait() returns), checked with check=True: rank 0
    writes into x while the call is queued (behind a gate on the worker); every rank's wait()
    raises, naming rank 0; unchecked, nothing is compared."""
    import threading

    from mpiallreduce.core.state import state_of

    rank = WORLD.Get_rank()
    x = exact_input("float64", 1000, rank, "sum")
    gate = threading.Event()
    state_of(WORLD).worker.submit(gate.wait)  # the worker starts the call only once x has changed
    handle = mar.allreduce_async(x, check=True)
    if rank == 0:
        x[7] += 1.0
    gate.set()
    with pytest.raises(
        RuntimeError,
        match=r"on every rank\) failed on rank 0 of "
        rf"{WORLD.Get_size()}:\n  rank 0: RuntimeError: x changed between",
    ):
        handle.wait(timeout=60)
    y = exact_input("float64", 1000, rank, "sum")
    handle = mar.allreduce_async(y)
    if rank == 0:
        y[7] += 1.0
    handle.wait(timeout=60)
    z = exact_input("float64", 1000, rank, "sum")
    assert values_equal(
        mar.allreduce_async(z, check=True).wait(timeout=60),
        numpy_reference("sum", gather_inputs(WORLD, z)),
    )
