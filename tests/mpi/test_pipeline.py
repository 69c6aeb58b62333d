"""One call pipeline (issue: one pipeline, layers in folders): regression tests of the defects found
where calls left it, and a mismatch at every size an error on every rank. Expected values come from
numpy on the gathered inputs (tests/mpi/reference.py)."""

import dataclasses
import time

import numpy as np
import pytest
import stalls
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

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD


def _skip_on_one_rank():
    if WORLD.Get_size() == 1:
        pytest.skip("one rank: no other rank to cross or to differ from")


def test_a_reproducible_async_call_is_numbered_in_program_order_beside_a_plain_call():
    """Defect 1: allreduce_async(reproducible=True) was numbered on the worker thread, so a plain
    allreduce made meanwhile took the number the other rank gave the reproducible call, and two
    ring calls waited in Sendrecv on each other's tags for ever. Here the ranks are skewed both
    ways around the worker's start; both results are right on every rank."""
    _skip_on_one_rank()
    rank = WORLD.Get_rank()
    big = exact_input("float32", 1 << 20, rank, "sum")  # 4 MiB: a GradientSync bucket
    loss = exact_input("float64", 3, rank, "sum")
    want_big = numpy_reference("sum", gather_inputs(WORLD, big))
    want_loss = numpy_reference("sum", gather_inputs(WORLD, loss))
    for slow in range(WORLD.Get_size()):
        handle = mar.allreduce_async(big, algorithm="ring", reproducible=True)
        if rank == slow:
            time.sleep(0.05)  # the worker has started the reproducible call here, not yet elsewhere
        assert values_equal(mar.allreduce(loss, algorithm="ring"), want_loss)
        assert values_equal(handle.wait(timeout=120), want_big)


def test_the_first_use_of_a_communicator_by_a_reproducible_async_call_does_not_cross_the_users_dup():  # noqa: E501
    """Defect 1, first use: the library's Idup of a new communicator was made on the worker, where
    it could cross the user's own Dup() made meanwhile on the caller's thread."""
    _skip_on_one_rank()
    rank = WORLD.Get_rank()
    x = exact_input("float64", 1000, rank, "sum")
    want = numpy_reference("sum", gather_inputs(WORLD, x))
    for _ in range(3):
        fresh = WORLD.Dup()
        handle = mar.allreduce_async(x, comm=fresh, reproducible=True)
        if rank == 0:
            time.sleep(0.02)
        mine = fresh.Dup()  # the user's collective on the same communicator, meanwhile
        assert values_equal(handle.wait(timeout=120), want)
        assert mine.allreduce(rank) == sum(range(WORLD.Get_size()))
        mine.Free()
        fresh.Free()


def test_the_worker_never_makes_a_communicator_or_a_window():
    """Defect 1, its other forms: a timed asynchronous first call made its communicator ready on the
    worker (its node communicator, its shared slots), and an asynchronous shared_memory call whose
    window had to grow made the window there. Either crossed a communicator that the caller's
    thread made meanwhile (the user's Split, the library's duplicate of a new communicator): Open
    MPI gives them ids in one order across threads, and 3 ranks hung. Such calls now run on the
    caller's thread, after the pending ones."""
    _skip_on_one_rank()
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    small = exact_input("float64", 3, rank, "sum")
    want_small = numpy_reference("sum", gather_inputs(WORLD, small))
    for late in (0, size - 1):  # a timed first call, asynchronous, with one rank late
        sub = WORLD.Split(0, size - 1 - rank)
        if rank == late:
            time.sleep(0.3)
        handle = mar.allreduce_async(small, comm=sub, timeout=60)
        if rank == late:
            handle.wait()
        other = WORLD.Split(
            0, rank
        )  # the user's own, meanwhile; then its first use: the library's duplicate
        assert values_equal(mar.allreduce(small, comm=other), want_small)
        assert values_equal(handle.wait(), want_small)
        other.Free()
        sub.Free()
    from mpiallreduce.core.state import state_of

    if state_of(WORLD).make_ready().spans_nodes:
        return  # (shared_memory runs on one node)
    big = exact_input(
        "float64", 1 << 16, rank, "sum"
    )  # 512 KiB: the window made by the first call grows
    want_big = numpy_reference("sum", gather_inputs(WORLD, big))
    for late in (0, size - 1):
        fresh = WORLD.Dup()
        assert values_equal(mar.allreduce(small, comm=fresh, algorithm="shared_memory"), want_small)
        handle = mar.allreduce_async(big, comm=fresh, algorithm="shared_memory")
        if rank != late:
            handle.wait()
        other = WORLD.Split(0, size - 1 - rank)
        assert values_equal(mar.allreduce(small, comm=other), want_small)
        assert values_equal(handle.wait(), want_big)
        other.Free()
        fresh.Free()


def test_a_timed_call_never_waits_for_ever_in_the_shared_slots(use_settings):
    """Defect 3: rank 0's 128 KiB call compared its signature in the shared slots, the others' 1 KiB
    calls (below the size that compared, as once by default) did not: rank 0 spun for ever. With
    the slots' wait bounded by the call's deadline and watching the peers, every rank raises within
    the timeout; with the default (every size compared), every rank raises ValueError at once."""
    timing_test_at_three_ranks()
    _skip_on_one_rank()
    rank = WORLD.Get_rank()
    count = (128 << 10) // 8 if rank == 0 else 128
    use_settings(signature_min_bytes=64 << 10)
    started = time.monotonic()
    with pytest.raises((mar.AllreduceTimeout, mar.AllreduceAborted)):
        mar.allreduce(np.ones(count), algorithm="ring", timeout=1)
    assert time.monotonic() - started < 30
    use_settings(signature_min_bytes=0)
    started = time.monotonic()
    with pytest.raises(ValueError, match="differs between the"):
        mar.allreduce(np.ones(count), algorithm="ring", timeout=3)
    assert time.monotonic() - started < 3
    x = exact_input("float64", 7, rank, "sum")  # and the communicator goes on
    assert values_equal(
        mar.allreduce(x, timeout=30), numpy_reference("sum", gather_inputs(WORLD, x))
    )


@pytest.mark.one_node("shared_memory needs one node")
@pytest.mark.parametrize(
    "algorithm", ["auto"] + [a for a in HOST_ALGORITHMS if not REGISTRY[a].takes_inner_plan]
)
def test_calls_that_differ_below_64_kib_are_an_error_on_every_rank(comm, algorithm):
    """Item 4: 100 against 101 elements (and 0 against 5) used to give wrong values on some ranks
    and MPI_ERR_TRUNCATE or MPI_ERR_IN_STATUS on others; now every rank raises the same ValueError,
    before any data moves, and the communicator goes on."""
    if comm.Get_size() == 1:
        pytest.skip("one rank: nothing to compare")
    rank = comm.Get_rank()
    for counts in ((100, 101), (5, 0), (1, 2)):
        x = np.ones(counts[0] if rank == 0 else counts[1], np.float32)
        with pytest.raises(ValueError, match=r"differs between the .*\n  shape differs"):
            mar.allreduce(x, comm=comm, algorithm=algorithm)
    x = exact_input("int64", 100, rank, "sum")
    assert values_equal(
        mar.allreduce(x, comm=comm, algorithm=algorithm),
        numpy_reference("sum", gather_inputs(comm, x)),
    )


def test_an_op_or_dtype_that_differs_on_the_short_path_is_an_error_on_every_rank(comm):
    """A repeated call (the short path) compares like the first one: rank 0 changes its op."""
    if comm.Get_size() == 1:
        pytest.skip("one rank: nothing to compare")
    x = np.ones(16, np.float64)
    for _ in range(3):
        mar.allreduce(x, comm=comm)  # the short path is made
    with pytest.raises(ValueError, match="op differs"):
        mar.allreduce(x, comm=comm, op="max" if comm.Get_rank() == 0 else "sum")
    with pytest.raises(ValueError, match="dtype differs"):
        mar.allreduce(x.astype(np.float32) if comm.Get_rank() == 0 else x, comm=comm)


def test_hierarchical_runs_its_leaders_plan_on_the_calls_tags_and_peer_watch(
    use_settings, monkeypatch
):
    """Also seen: across nodes, hierarchical and two_level ran their inner algorithm on the leaders'
    communicator directly, without the call's tag offset and peer watch. The plan now says so
    (inner_on_tags) and the executor wraps the leaders' communicator."""
    from mpiallreduce.core.executor import Execution
    from mpiallreduce.core.ops import get_op
    from mpiallreduce.core.planner import CallFacts, plan_call
    from mpiallreduce.core.state import state_of

    if WORLD.Get_size() < 3:
        pytest.skip("needs two emulated nodes of which one has two ranks")
    comm = WORLD.Dup()
    try:
        use_settings(ranks_per_node=2)
        state = state_of(comm).make_ready()
        x = exact_input("float64", 1000, comm.Get_rank(), "sum")
        for outer in ("hierarchical", "two_level"):
            if outer == "two_level" and not state.facts.equal_nodes:
                continue
            plan = plan_call(state.facts, False, x.dtype, x.nbytes, "sum", outer)
            leaders = CallFacts(
                size=state.node_count,
                spans_nodes=True,
                node_count=state.node_count,
                signature_min_bytes=-1,
            )
            plan = dataclasses.replace(
                plan, inner=plan_call(leaders, False, x.dtype, x.nbytes, "sum", "ring")
            )
            assert (
                plan.inner_on_tags and "on the call's tags, watching the peers" in plan.describe()
            )
            seen = []
            original = REGISTRY["ring"].execute
            monkeypatch.setattr(
                REGISTRY["ring"],
                "execute",
                # (undone below, within this iteration)
                lambda p, c, *a, **k: seen.append(c) or original(p, c, *a, **k),  # noqa: B023
            )
            execution = Execution(state, plan, get_op("sum"), x.shape, x.dtype, "host")
            result = x.copy()
            sequence = state.number()
            execution.run(None, result, sequence)
            monkeypatch.undo()
            assert values_equal(result, numpy_reference("sum", gather_inputs(comm, x)))
            for talked_on in seen:
                assert isinstance(talked_on, CallTags) and talked_on.watch is not None
                assert talked_on.offset == (sequence % CallTags.calls_apart) * CallTags.slot
    finally:
        comm.Free()


def test_with_a_timeout_setting_every_repeated_call_meets_the_others_first(
    use_settings, monkeypatch
):
    """MPIALLREDUCE_TIMEOUT times every call: a repeated call must not take the short path (which
    has no rendezvous) just because its own ``timeout`` argument is None."""
    from mpiallreduce.faults import rendezvous

    _skip_on_one_rank()
    use_settings(timeout=60.0)
    met = []
    original = rendezvous.Rendezvous.run
    monkeypatch.setattr(
        rendezvous.Rendezvous, "run", lambda self: met.append(self.sequence) or original(self)
    )
    x = exact_input("float64", 10, WORLD.Get_rank(), "sum")
    want = numpy_reference("sum", gather_inputs(WORLD, x))
    for _ in range(3):
        assert values_equal(mar.allreduce(x), want)
    assert len(met) == 3 and len(set(met)) == 3, met


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the stall warnings of every skewed call)
@pytest.mark.parametrize(
    "algorithm, compared",
    [("auto", True), ("ring", True), ("dissemination", False), ("recursive_doubling", False)],
)
def test_timed_calls_under_skew_end_alike_on_every_rank_and_never_hang(
    use_settings, algorithm, compared
):
    """Review finding: a rank that timed out waiting for the others' signatures (after the
    rendezvous had committed every rank) left its slot published, and a peer went on into
    MPI_Allreduce for ever. Issue 54, item 3: where the plan talks in messages, a timed call's ranks
    agree on how it ends (faults.outcome), signature compared or not: every rank counts the same
    results and the same timeouts (before, with the signature off, 5 to 11 calls of 150 ended apart
    by name)."""
    _skip_on_one_rank()
    if not compared:
        use_settings(signature_min_bytes=-1)
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    rng = np.random.default_rng([rank, 24])
    outcomes = []
    for i in range(150):
        if rng.random() < 0.2:
            time.sleep(rng.random() * 0.006)
        x = np.full(16, float(rank + 1 + i), np.float32)
        try:
            result = mar.allreduce(x, algorithm=algorithm, timeout=0.003)
            outcomes.append("ok" if np.all(result == size * (size + 1) / 2 + size * i) else "wrong")
        except (mar.AllreduceTimeout, mar.AllreduceAborted):
            outcomes.append("gave up")
    assert "wrong" not in outcomes
    everyone = WORLD.allgather(outcomes)
    assert all(theirs == everyone[0] for theirs in everyone), "the ranks' calls ended differently"


MESSAGES_ONLY = ["ring", "dissemination", "recursive_doubling"]


def _inject_on(rank, algorithm, monkeypatch, what):
    """On ``rank``, ``what()`` runs in place of the call's first reduction (then the original)."""
    from mpiallreduce.algorithms import dissemination

    owner, name = (
        (dissemination, "reduce_in_order")
        if algorithm == "dissemination"
        else (type(mar.OPS["sum"]), "reduce_local")
    )
    if WORLD.Get_rank() == rank:
        original = getattr(owner, name)

        def once(*args, **kwargs):
            monkeypatch.setattr(owner, name, original)
            what()
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, once)


MPI_COLLECTIVES = ["mpi", "reduce_bcast", "hierarchical", "two_level", "shared_memory"]


def _inject(rank, algorithm, monkeypatch, what):
    """``what()`` on ``rank``: at the first reduction where the plan talks in messages, once the
    signature was compared (before the first collective) where it runs MPI's collectives."""
    if algorithm in MESSAGES_ONLY:
        _inject_on(rank, algorithm, monkeypatch, what)
    else:
        stalls.before_the_data_moves(monkeypatch, rank, what)


def _pairs_up_after(algorithm, x):
    """The next calls, timed and untimed, are right on every rank (the collectives left behind
    by the call given up stay on the retired communicator)."""
    want = numpy_reference("sum", gather_inputs(WORLD, x))
    assert values_equal(mar.allreduce(x, algorithm=algorithm, timeout=30), want)
    assert values_equal(mar.allreduce(x, algorithm=algorithm), want)
    assert values_equal(mar.allreduce(x, algorithm=algorithm, timeout=30), want)


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("algorithm", [*MESSAGES_ONLY, *MPI_COLLECTIVES])
def test_a_rank_interrupted_in_a_timed_call_makes_every_peer_raise(
    monkeypatch, use_settings, algorithm, in_place
):
    """Issue 54, item 3: the last rank leaves a timed call by KeyboardInterrupt at its first
    reduction where the plan talks in messages, after the comparison where it runs MPI's
    collectives. Every peer raises AllreduceAborted naming it, those whose part was done too
    (before, they returned the sum: dissemination on 2 ranks; or waited inside MPI_Allreduce, or
    the node's MPI_Reduce, for ever), and no rank's array is written; the next calls pair up."""
    _skip_on_one_rank()
    use_settings(compiled=False)  # (the Python rounds, where the interrupt is injected)
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x = exact_input("float64", 5000, rank, "sum")
    out = x if in_place else np.full_like(x, -7.0)
    mar.allreduce(x.copy(), algorithm=algorithm, timeout=30)  # (first use: the control channel)
    before = out.copy()

    def interrupt():
        raise KeyboardInterrupt

    for _ in range(2):  # (the second on the communicator the first retired: a review)
        _inject(size - 1, algorithm, monkeypatch, interrupt)
        try:
            mar.allreduce(x, algorithm=algorithm, out=out, timeout=30)
            outcome = "returned"
        except KeyboardInterrupt:
            outcome = "interrupted"
        except mar.AllreduceAborted as aborted:
            outcome = f"aborted by {aborted.failed_rank}"
        everyone = WORLD.allgather(outcome)
        assert everyone == [f"aborted by {size - 1}"] * (size - 1) + ["interrupted"], everyone
        assert np.array_equal(out, before), f"rank {rank}: written by a call that raised"
    time.sleep(0.2)  # (the left call's messages arrive)
    _pairs_up_after(algorithm, exact_input("float64", 5000, rank + 1, "sum"))


@pytest.mark.parametrize(
    "algorithm", [*MESSAGES_ONLY, "mpi", "hierarchical", "two_level", "shared_memory"]
)
def test_a_peer_stalled_in_a_timed_call_is_bounded_and_every_rank_raises(
    monkeypatch, use_settings, algorithm
):
    """Issue 54, item 3: the last rank stalls (alive, not dead) for longer than the timeout and its
    grace: at its first reduction where the plan talks in messages, after the comparison where it
    runs MPI's collectives (mpi, hierarchical's and two_level's steps within a node, and
    shared_memory, whose comparison in shared slots waited without a deadline: a review). Every
    wait is bounded: each rank raises within timeout + grace (and the stalled one once it wakes),
    none returns, no array is written, and the next calls pair up. Before, dissemination's waits
    after the rendezvous had no deadline, a peer whose part was done returned the sum, and the
    others waited inside MPI_Allreduce (or the node's MPI_Reduce) until the stalled rank came. At
    3 ranks on one node, and at 2 across nodes."""
    from conftest import SPANS_NODES

    if not (WORLD.Get_size() == 3 or (SPANS_NODES and WORLD.Get_size() == 2)):
        pytest.skip("a timing test (sleeps on purpose): at 3 ranks, and at 2 across nodes")
    use_settings(compiled=False)
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x = exact_input("float64", 5000, rank, "sum")
    out = np.full_like(x, -7.0)
    mar.allreduce(x, algorithm=algorithm)  # (first use: the channel; shared_memory's window grown)
    stalls.shorten_the_grace(monkeypatch)
    _inject(size - 1, algorithm, monkeypatch, stalls.stall)
    stalls.ended_alike_within_the_bound(
        lambda: mar.allreduce(x, algorithm=algorithm, out=out, timeout=stalls.TIMEOUT)
    )
    assert (out == -7.0).all(), f"rank {rank}: written by a call that raised"
    time.sleep(0.2)
    _pairs_up_after(algorithm, x)


def test_a_timed_call_that_would_grow_a_shared_window_is_bounded_when_a_peer_stalls(monkeypatch):
    """A review finding: shared_memory grows its window inside the call (MPI_Win_allocate_shared,
    which has no nonblocking form); in a timed call a peer that stalled past the timeout then
    walked into it alone, after the others had raised, and waited there for ever. A timed call
    whose window would have to grow runs the ring instead (planner.without_set_up), so every rank
    raises within timeout + grace; an untimed call grows the window, and timed calls then run
    shared_memory itself. At 3 ranks (one node), on a communicator of its own (no window yet)."""
    if WORLD.Get_size() != 3:
        pytest.skip("a timing test (sleeps on purpose): at 3 ranks")
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    comm = WORLD.Dup()
    try:
        x = exact_input("float64", 20000, rank, "sum")
        want = numpy_reference("sum", gather_inputs(WORLD, x))
        assert values_equal(
            mar.allreduce(np.ones(2), comm=comm, timeout=30), np.full(2, float(size))
        )
        out = np.full_like(x, -7.0)
        said = mar.describe_call(x, comm=comm, algorithm="shared_memory", timeout=30)
        assert said.startswith("ring") and "no timeout bounds: ring instead" in said, said
        stalls.shorten_the_grace(monkeypatch)
        stalls.before_the_data_moves(monkeypatch, size - 1, stalls.stall)
        stalls.ended_alike_within_the_bound(
            lambda: mar.allreduce(
                x, out=out, comm=comm, algorithm="shared_memory", timeout=stalls.TIMEOUT
            )
        )
        assert (out == -7.0).all(), f"rank {rank}: written by a call that raised"
        time.sleep(0.2)
        checked = mar.allreduce(x, comm=comm, algorithm="shared_memory", check=True, timeout=30)
        assert values_equal(
            checked, want
        )  # (compared once, with check=True: not again in the ring)
        for timeout in (30, None, 30):  # (the untimed call grows the window)
            result = mar.allreduce(x, comm=comm, algorithm="shared_memory", timeout=timeout)
            assert values_equal(result, want), timeout
        said = mar.describe_call(x, comm=comm, algorithm="shared_memory", timeout=30)
        assert said.startswith("shared_memory"), said  # (the window grown: itself, timed too)
    finally:
        comm.Free()


def test_a_peer_stalled_as_its_call_makes_the_timed_communicator_leaves_no_call_after_it_apart(
    monkeypatch,
):
    """A review finding: after a timed call raised (its communicator of MPI's collectives retired on
    every rank), the next timed call's rendezvous commits and each rank makes another; the last
    rank stalls there past the timeout. Every rank raises (the others at the timeout), and the
    next calls are right: the rank that gave up the duplicate gives it up for good, as the late
    rank's call, which gets it, retires it (before, the two kept different ones, and every later
    timed call failed). At 3 ranks on one node, and at 2 across nodes."""
    from conftest import SPANS_NODES

    import mpiallreduce.faults.rendezvous as rendezvous
    from mpiallreduce.core.executor import Execution

    if not (WORLD.Get_size() == 3 or (SPANS_NODES and WORLD.Get_size() == 2)):
        pytest.skip("a timing test (sleeps on purpose): at 3 ranks, and at 2 across nodes")
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x = exact_input("float64", 1000, rank, "sum")
    mar.allreduce(x, algorithm="mpi", timeout=30)
    outcomes = []
    for stall_where in ("before the data moves", "at the commit"):
        if rank == size - 1 and stall_where == "before the data moves":
            original = Execution._reduce

            # (original and made are each assigned in one iteration only: read late, the same)
            def interrupt(self, *args, **kwargs):
                monkeypatch.setattr(Execution, "_reduce", original)  # noqa: B023
                raise KeyboardInterrupt

            monkeypatch.setattr(Execution, "_reduce", interrupt)
        if rank == size - 1 and stall_where == "at the commit":
            made = rendezvous.made_at_commit

            def stalled(*args, **kwargs):
                monkeypatch.setattr(rendezvous, "made_at_commit", made)  # noqa: B023
                time.sleep(2.5)
                return made(*args, **kwargs)  # noqa: B023

            monkeypatch.setattr(rendezvous, "made_at_commit", stalled)
        try:
            mar.allreduce(x, algorithm="mpi", timeout=0.5)
            outcomes.append("returned")
        except (KeyboardInterrupt, mar.AllreduceTimeout, mar.AllreduceAborted):
            outcomes.append("raised")
    assert outcomes == ["raised", "raised"], outcomes
    _pairs_up_after("mpi", x)


@pytest.mark.parametrize("compared", [True, False])
def test_a_read_only_out_of_a_repeated_call_is_refused_before_any_communication(
    use_settings, compared
):
    """Review finding: the short path took a read-only ``out``, numbered the call and published its
    signature, then failed in MPI (BufferError) while the peers waited. Now every rank that is given
    one raises ValueError before any communication, and the next call is right: compared (the
    short path looks at the flag) or not (mpi4py refuses it before MPI; the call is not
    numbered)."""
    if not compared:
        use_settings(signature_min_bytes=-1)
    x = exact_input("float64", 1024, WORLD.Get_rank(), "sum")
    out = np.empty_like(x)
    for _ in range(3):
        mar.allreduce(x, out=out)  # the short path is made
    frozen = np.empty_like(x)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        mar.allreduce(x, out=frozen)
    assert values_equal(mar.allreduce(x, out=out), numpy_reference("sum", gather_inputs(WORLD, x)))


@pytest.mark.parametrize(
    "entry", ["sync", "async", "timed", "repeated", "bad timeout", "bad check", "checked"]
)
def test_a_bad_argument_on_one_rank_is_an_error_on_every_rank_and_the_calls_stay_in_step(entry):
    """Review finding: a bad argument on one rank raised there alone, before any communication; the
    others' call then paired with that rank's next call, of the same shape: the values of two calls
    mixed, silently, and the ranks hung later. Now the rank takes part in the signature comparison
    with a code of its own: it raises its error, every other rank a ValueError naming it, and the
    next call is right on every rank."""
    _skip_on_one_rank()
    rank = WORLD.Get_rank()
    x = exact_input("float64", 100, rank, "sum")
    y = 2 * x
    want_y = numpy_reference("sum", gather_inputs(WORLD, y))
    out = np.empty_like(x)
    if entry == "repeated":
        for _ in range(2):
            mar.allreduce(x, out=out)  # the short path is made
    if rank == 0 and entry not in ("bad timeout", "bad check"):
        out.flags.writeable = False
    timed = {"timeout": 60} if entry == "timed" else {}
    if rank == 0 and entry in (
        "bad timeout",
        "bad check",
        "checked",
    ):  # (also: check=True here only)
        timed = {
            "bad timeout": {"timeout": -1},
            "bad check": {"check": "yes"},
            "checked": {"check": True},
        }[entry]
    message = {"bad timeout": "timeout must be", "bad check": "check must be"}.get(
        entry, "read-only"
    )
    if (
        entry == "checked"
    ):  # (rank 0's checked call compares a code of its own first: that mismatch is named)
        message = others = "check=True on rank 0"
    else:
        others = "rejected on rank 0"
    with pytest.raises((TypeError, ValueError), match=message if rank == 0 else others):
        if entry == "async":
            mar.allreduce_async(x, out=out).wait()  # (rank 0: raised by allreduce_async itself)
        else:
            mar.allreduce(x, out=out, **timed)
    assert values_equal(mar.allreduce(y), want_y)


def test_repeated_calls_follow_settings_replaced_on_every_rank(use_settings):
    """Review finding: the short path of a repeated call never looked at the settings, so a timeout
    set on every rank (``reset_settings``) did not apply to it: a late rank was waited for."""
    _skip_on_one_rank()
    rank, late = WORLD.Get_rank(), WORLD.Get_rank() == WORLD.Get_size() - 1
    x = exact_input("float64", 1000, rank, "sum")
    for _ in range(2):
        mar.allreduce(x)  # the short path is made
    use_settings(timeout=0.5)
    if late:
        time.sleep(1.5)
    with pytest.raises(mar.AllreduceTimeout):
        mar.allreduce(x)
    WORLD.Barrier()


def test_freeing_a_communicator_waits_for_its_asynchronous_calls():
    """Review finding: freeing a communicator while an asynchronous call on it ran freed the
    library's duplicate and window under the worker (an AttributeError, then a segmentation fault).
    MPI_Comm_free lets pending operations complete; so does the library."""
    _skip_on_one_rank()
    rank = WORLD.Get_rank()
    sub = WORLD.Split(0, rank)
    x = exact_input("float64", 300000, rank, "sum")
    handle = mar.allreduce_async(x, algorithm="ring", comm=sub)
    sub.Free()
    assert values_equal(handle.wait(), numpy_reference("sum", gather_inputs(WORLD, x)))


@pytest.mark.parametrize("renewed", [False, True], ids=["ready", "settings-renewed"])
def test_a_bad_timeout_on_one_rank_against_timed_calls_elsewhere_ends_on_every_rank(
    use_settings, renewed
):
    """The others' timed call meets first and gives up within its timeout; the rank given the bad
    timeout raises its own ValueError (not the others' giving up), and the next call is right.
    ``renewed``: the settings were replaced (every rank alike), so that rank's untimed call agrees
    on them again first, and learns there that the others gave the call up (a review finding: it
    raised AllreduceAborted, not its ValueError, where the suite had renewed them)."""
    _skip_on_one_rank()
    if renewed:
        use_settings()
    rank = WORLD.Get_rank()
    x = exact_input("float64", 100, rank, "sum")
    with (
        pytest.raises(ValueError, match="timeout must be")
        if rank == 0
        else pytest.raises(mar.AllreduceTimeout)
    ):
        mar.allreduce(x, timeout=-1 if rank == 0 else 1)
    assert values_equal(mar.allreduce(x), numpy_reference("sum", gather_inputs(WORLD, x)))


def test_check_on_one_rank_only_is_an_error_on_every_rank():
    """Review finding: a call with check=True on one rank and without it on the others hung (an
    allgather against the shared slots). The checked call now compares a code of its own first."""
    _skip_on_one_rank()
    rank = WORLD.Get_rank()
    x = exact_input("float64", 100, rank, "sum")
    with pytest.raises(ValueError, match="check=True on rank 0"):
        mar.allreduce(x, check=rank == 0)
    assert values_equal(mar.allreduce(x), numpy_reference("sum", gather_inputs(WORLD, x)))


@pytest.mark.parametrize(
    "op, name", [(MPI.SUM, "sum"), (MPI.PROD, "prod"), (MPI.MIN, "min"), (MPI.MAX, "max")]
)
def test_mpi4py_ops_are_taken_for_their_names(comm, op, name):
    """A new user's finding: ``op=MPI.SUM``, natural to an mpi4py user, gave "unhashable type:
    'mpi4py.MPI.Op'" from the short path's key. mpi4py's predefined ops are now their names' ops,
    repeated calls included; another MPI op is refused with the choices named."""
    x = exact_input("float64", 100, comm.Get_rank(), name)
    want = numpy_reference(name, gather_inputs(comm, x))
    for _ in range(3):  # (the general path, then the short path)
        assert values_equal(mar.allreduce(x, op=op, comm=comm), want)
    assert values_equal(mar.allreduce_async(x, op=op, comm=comm).wait(), want)
    with pytest.raises(TypeError, match="or MPI.SUM"):
        mar.allreduce(x, op=MPI.BAND, comm=comm, check=True)


def test_a_compressed_bucket_is_scaled_once(comm):
    """Review finding: compressed buckets applied ``postscale`` twice (before the rounding and again
    at write-back)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    grads = {"a": np.full(10, 1.0 + rank, np.float32), "c": np.full(3, 1.0 + rank, np.complex64)}
    sync = mar.GradientSync(
        comm=comm, parameters=grads, bucket_bytes=16, compression="fp16", postscale=2.0, op="sum"
    )
    for name, g in grads.items():
        sync.ready(g, name=name)
    sync.wait()
    want = 2.0 * sum(1.0 + r for r in range(size))
    assert np.all(grads["a"] == want) and np.all(grads["c"] == want)


def test_a_wait_ended_by_an_error_leaves_its_requests_behind_with_their_buffers(monkeypatch):
    """A wait through the PeerWatch that an exception ends (a failed request, an interrupt) used to
    drop its requests, and those the algorithm had posted for later steps: receives freed while
    posted that MPI may still write into, once their buffers are gone. Now they are cancelled and
    kept (state.left_behind), as when a peer gives the call up."""
    from mpiallreduce.core.state import state_of
    from mpiallreduce.faults import watch as watch_module

    state = state_of(WORLD).make_ready()

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(
        watch_module, "yield_core", interrupted
    )  # (the first spin: before any look around)
    watch = watch_module.PeerWatch(state, 10**6)
    tags = CallTags(state.library, 10**6, watch, CallTags.SIGNATURE_BASE)
    ahead = tags.Irecv(
        np.zeros(4), WORLD.Get_rank(), 8
    )  # posted for a later step (ring_pipelined's way)
    receive = tags.Irecv(np.zeros(4), WORLD.Get_rank(), 7)  # (from itself, never sent)
    before = list(state.left_behind)  # (earlier calls' may complete, and go, meanwhile)
    with pytest.raises(KeyboardInterrupt):
        watch.wait([receive])
    kept = [r for r in state.left_behind if not any(r is b for b in before)]
    assert [r is receive for r in kept] == [True, False] and kept[1] is ahead, kept
    for request in (receive, ahead):
        status = MPI.Status()
        assert request.Test(status) and status.Is_cancelled()  # (cancelled: it will write nothing)
