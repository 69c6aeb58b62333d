"""Bad arguments and mismatched calls: a clear error on every rank, and the next call still
works."""

import re

import numpy as np
import pytest
from reference import (
    bits_equal,
    exact_input,
    gather_inputs,
    numpy_reference,
    runs_here,
    values_equal,
)

import mpiallreduce as mar

pytestmark = pytest.mark.mpi


def assert_next_call_works(comm, algorithm="auto"):
    x = exact_input("float64", 37, comm.Get_rank(), "sum")
    expected = numpy_reference("sum", gather_inputs(comm, x))
    assert values_equal(mar.allreduce(x, comm=comm, algorithm=algorithm), expected)


def bad_calls():
    """(name, kwargs, exception type, what the message must say), each given to every rank alike."""
    x = np.arange(8, dtype=np.float32)
    read_only = np.zeros(8, dtype=np.float32)
    read_only.flags.writeable = False
    return [
        ("unknown op", dict(x=x, op="average"), ValueError, r"unknown op 'average'.*sum"),
        ("op not a string", dict(x=x, op=3), TypeError, r"op must be a string"),
        (
            "unknown algorithm",
            dict(x=x, algorithm="tree"),
            ValueError,
            r"unknown algorithm 'tree'.*ring",
        ),
        (
            "out of wrong shape",
            dict(x=x, out=np.zeros(9, np.float32)),
            ValueError,
            r"out has shape \(9,\)",
        ),
        (
            "out of wrong dtype",
            dict(x=x, out=np.zeros(8, np.float64)),
            ValueError,
            r"out has dtype float64",
        ),
        ("read-only out", dict(x=x, out=read_only), ValueError, r"out is read-only"),
        (
            "out not an array",
            dict(x=x, out=[0.0] * 8),
            TypeError,
            r"out must be None or an array of the same kind as x \(numpy.ndarray\)",
        ),
        (
            "list input",
            dict(x=[1.0, 2.0]),
            TypeError,
            r"x must be a numpy.ndarray or cupy.ndarray, got builtins.list",
        ),
        ("scalar input", dict(x=np.float32(1)), TypeError, r"x must be a numpy.ndarray"),
        ("object dtype", dict(x=np.array([1, "a"], dtype=object)), TypeError, r"dtype object"),
        ("bool dtype", dict(x=np.ones(3, dtype=bool)), TypeError, r"dtype bool"),
        ("string dtype", dict(x=np.array(["ab"])), TypeError, r"cannot be reduced"),
        ("big-endian", dict(x=np.ones(3, dtype=">f8")), TypeError, r"non-native byte order"),
        (
            "mean of integers",
            dict(x=np.ones(3, dtype=np.int32), op="mean"),
            TypeError,
            r"'mean' needs a floating",
        ),
        (
            "max of complex",
            dict(x=np.ones(3, dtype=np.complex64), op="max"),
            TypeError,
            r"not defined for complex",
        ),
        (
            "comm not a communicator",
            dict(x=x, comm="world"),
            TypeError,
            r"comm must be an mpi4py intracommunicator",
        ),
    ]


@pytest.mark.parametrize("check", [False, True], ids=["unchecked", "checked"])
@pytest.mark.parametrize("algorithm", ["mpi", "ring", "recursive_doubling", "reduce_bcast"])
def test_bad_arguments_raise_everywhere_and_leave_the_communicator_usable(comm, algorithm, check):
    for name, kwargs, exc_type, pattern in bad_calls():
        kwargs = dict(kwargs)
        kwargs.setdefault("comm", comm)
        kwargs.setdefault("algorithm", algorithm)
        with pytest.raises(exc_type) as info:
            mar.allreduce(check=check, **kwargs)
        assert re.search(pattern, str(info.value), re.S), f"{name}: message was {info.value}"
        if kwargs["comm"] is comm:
            assert_next_call_works(comm, algorithm)


@pytest.mark.mpi(min_size=2)
def test_bad_argument_on_one_rank_raises_on_every_rank_when_checked(comm):
    rank = comm.Get_rank()
    x = np.ones(5, dtype=np.float32)
    out = np.zeros(6 if rank == 0 else 5, dtype=np.float32)
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks in this communicator")
    with pytest.raises(ValueError) as info:
        mar.allreduce(x, out=out, comm=comm, check=True)
    message = str(info.value)
    assert f"rejected on rank 0 of {comm.Get_size()}" in message, message
    assert "out has shape (6,)" in message, message
    assert_next_call_works(comm)

    odd = np.ones(3, dtype=np.int32)
    with pytest.raises(TypeError) as info:
        mar.allreduce(
            odd, op="mean" if rank == comm.Get_size() - 1 else "sum", comm=comm, check=True
        )
    assert f"rank {comm.Get_size() - 1}: TypeError" in str(info.value)
    assert_next_call_works(comm)


@pytest.mark.parametrize("field", ["shape", "dtype", "op", "algorithm"])
def test_mismatched_calls_raise_on_every_rank_when_checked(comm, field):
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        pytest.skip("needs two ranks in this communicator")
    odd_one = size - 1
    is_odd = rank == odd_one
    kwargs = dict(x=np.ones(4, dtype=np.float64), op="sum", algorithm="ring")
    if field == "shape":
        kwargs["x"] = np.ones(5 if is_odd else 4, dtype=np.float64)
        expect = [r"shape differs: \(4,\) on rank", rf"\(5,\) on rank {odd_one}"]
    elif field == "dtype":
        kwargs["x"] = np.ones(4, dtype=np.float32 if is_odd else np.float64)
        expect = [r"dtype differs: 'float64' on rank", rf"'float32' on rank {odd_one}"]
    elif field == "op":
        kwargs["op"] = "max" if is_odd else "sum"
        expect = [r"op differs: 'sum' on rank", rf"'max' on rank {odd_one}"]
    else:
        kwargs["algorithm"] = "mpi" if is_odd else "ring"
        expect = [r"algorithm differs: 'ring' on rank", rf"'mpi' on rank {odd_one}"]
    with pytest.raises(ValueError) as info:
        mar.allreduce(comm=comm, check=True, **kwargs)
    for pattern in expect:
        assert re.search(pattern, str(info.value)), str(info.value)
    assert_next_call_works(comm)


def test_matching_checked_calls_succeed(comm):
    for algorithm in [a for a in list(mar.HOST_ALGORITHMS) + ["auto"] if runs_here(a, comm)]:
        x = exact_input("float32", 100, comm.Get_rank(), "sum")
        expected = numpy_reference("mean", gather_inputs(comm, x))
        assert values_equal(
            mar.allreduce(x, op="mean", algorithm=algorithm, comm=comm, check=True), expected
        )


@pytest.fixture
def compared_by_messages():
    """A duplicate of COMM_WORLD whose calls compare their signatures in messages, as across nodes
    and under ULFM (its shared slots set aside: mpiallreduce.core.consistency), freed after."""
    import dataclasses

    from mpi4py import MPI

    from mpiallreduce.core.state import state_of

    comm = MPI.COMM_WORLD.Dup()
    state = state_of(comm).make_ready()
    slots, facts = state.signature_slots, state.facts
    state.signature_slots, state.facts = None, dataclasses.replace(facts, shared_slots=False)
    yield comm
    state.signature_slots, state.facts = slots, facts
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("spin", [10.0, 0.0], ids=["compiled-rounds", "rounds-handed-to-python"])
def test_calls_compared_in_messages_find_a_mismatch_on_any_one_rank(
    compared_by_messages, monkeypatch, spin
):
    """The codes' maximum by dissemination reaches every rank whichever rank differs, at every rank
    count (5: three rounds, ranks counted twice); a matching call then gives numpy's sum. A repeated
    call runs the rounds in C where built (its short path: none in Python while the C waits), and
    hands them to the Python's from a wait that lasts (``spin`` 0: the last rank comes late, and
    every other rank's wait goes back); the odd rank's new call takes the Python's from the
    start."""
    import time

    from mpiallreduce.core import signature_messages
    from mpiallreduce.core.compiled import used

    comm = compared_by_messages
    size, rank = comm.Get_size(), comm.Get_rank()
    x = exact_input("float64", 100, rank, "sum")
    assert "signature: 32-byte messages" in mar.describe_call(x, comm=comm, algorithm="mpi")
    monkeypatch.setattr(signature_messages, "SPIN_SECONDS", spin)
    monkeypatch.setattr(
        signature_messages,
        "SPIN_SECONDS_PER_BYTE",
        spin and signature_messages.SPIN_SECONDS_PER_BYTE,
    )
    expected = numpy_reference("mean", gather_inputs(comm, x))
    for _ in range(2):  # (the first call plans; the next ones take the short path)
        assert values_equal(mar.allreduce(x, op="mean", comm=comm, algorithm="mpi"), expected)
    rounds_in_python, python_rounds = [], signature_messages.codes_by_messages
    monkeypatch.setattr(
        signature_messages,
        "codes_by_messages",
        lambda *args, **kwargs: rounds_in_python.append(1) or python_rounds(*args, **kwargs),
    )
    for _ in range(3):
        if spin == 0.0 and rank == size - 1:
            time.sleep(0.05)
        assert values_equal(mar.allreduce(x, op="mean", comm=comm, algorithm="mpi"), expected)
    if used():
        if spin == 0.0:
            assert len(rounds_in_python) == (3 if rank != size - 1 else len(rounds_in_python)), (
                rounds_in_python
            )
        else:
            assert rounds_in_python == [], rounds_in_python
    for odd_one in range(size):
        count = 101 if rank == odd_one else 100
        with pytest.raises(ValueError) as info:
            mar.allreduce(exact_input("float64", count, rank, "sum"), comm=comm, algorithm="mpi")
        message = str(info.value)
        assert "shape differs: " in message and f"(101,) on rank {odd_one};" in message + ";", (
            message
        )
        assert "(100,) on rank" in message and "nothing was reduced" in message, message
        expected = numpy_reference("sum", gather_inputs(comm, x))
        assert values_equal(mar.allreduce(x, comm=comm, algorithm="mpi"), expected)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("spin", [None, 0.0], ids=["compiled-rounds", "rounds-handed-to-python"])
def test_dissemination_carrying_the_check_finds_a_mismatch_on_every_rank(
    compared_by_messages, monkeypatch, spin
):
    """A small plain call whose signature goes in messages runs dissemination, its rounds carrying
    the check (compiled; with ``spin`` 0 every wait goes back to the Python at once): a rank whose
    call differs, by a size that dissemination carries too or one that makes it compare first
    (MPI's own), or by its dtype, is named on every rank; a matching call then gives numpy's sum."""
    from mpiallreduce.core import signature_messages
    from mpiallreduce.core.compiled import used
    from mpiallreduce.core.consistency import SignatureMismatch

    comm = compared_by_messages
    size, rank = comm.Get_size(), comm.Get_rank()
    x = exact_input("float64", 100, rank, "sum")
    if not used():
        pytest.skip("the compiled paths are not built here: auto keeps MPI's own and the check")
    assert "signature: carried by dissemination" in mar.describe_call(x, comm=comm)
    if spin is not None:
        monkeypatch.setattr(signature_messages, "SPIN_SECONDS", spin)
        monkeypatch.setattr(signature_messages, "SPIN_SECONDS_PER_BYTE", spin)
    expected = numpy_reference("sum", gather_inputs(comm, x))
    for odd_one in range(size):
        for theirs, field in [
            (exact_input("float64", 101, rank, "sum"), "shape"),
            (exact_input("float64", 5000, rank, "sum"), "shape"),
            (exact_input("float32", 100, rank, "sum"), "dtype"),
        ]:
            with pytest.raises(SignatureMismatch) as info:
                mar.allreduce(theirs if rank == odd_one else x, comm=comm)
            message = str(info.value)
            assert f"{field} differs: " in message and f"on rank {odd_one};" in message + ";", (
                message
            )
            assert "nothing was reduced" in message, message
            assert values_equal(mar.allreduce(x, comm=comm), expected)
    out = np.full_like(x, -1.0)
    assert mar.allreduce(x, comm=comm, out=out) is out and values_equal(out, expected)
    assert values_equal(
        mar.allreduce(x, op="mean", comm=comm), numpy_reference("mean", gather_inputs(comm, x))
    )
    # past one head (60 KiB) a message's blocks go on in its tail (auto's choice on 2 ranks; asked
    # for here at every rank count): tails of other lengths, a tail against none, another dtype's,
    # each way
    big = exact_input("float64", 9000, rank, "sum")
    expected = numpy_reference("sum", gather_inputs(comm, big))
    assert "signature: carried by dissemination" in mar.describe_call(
        big, comm=comm, algorithm="dissemination"
    )
    for odd_one in (0, size - 1):
        for mine, theirs, field in [
            (big, exact_input("float64", 8000, rank, "sum"), "shape"),
            (big, x, "shape"),
            (x, big, "shape"),
            (big, exact_input("float32", 9000, rank, "sum"), "dtype"),
        ]:
            with pytest.raises(SignatureMismatch) as info:
                mar.allreduce(
                    theirs if rank == odd_one else mine, comm=comm, algorithm="dissemination"
                )
            message = str(info.value)
            assert f"{field} differs: " in message and f"on rank {odd_one};" in message + ";", (
                message
            )
            assert values_equal(mar.allreduce(big, comm=comm, algorithm="dissemination"), expected)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count", [777, 20000], ids=["a-head", "with-tails"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
def test_dissemination_carrying_the_check_reduces_in_rank_order_bit_for_bit(
    compared_by_messages, dtype, count
):
    """The compiled short path runs the rounds and reduces the blocks itself (MPI_Reduce_local):
    sums and means of values whose float sum depends on the order must have the bits of numpy's
    left-to-right sum over the ranks' inputs, in place and out of place, on every rank; with tails
    too (on 2 ranks sent from the input where it lies, rank 1's in-place result made in its peer's
    block)."""
    from functools import reduce

    comm = compared_by_messages
    rank = comm.Get_rank()
    x = (np.random.default_rng(rank).standard_normal(count) * 10**rank).astype(dtype)
    inputs = comm.allgather(x)
    algorithm = (
        "dissemination" if count > 1000 else "auto"
    )  # (past auto's bound on more than 2 ranks)
    for op in ("sum", "mean"):
        if op == "mean" and dtype == "int64":
            continue
        assert "signature: carried by dissemination" in mar.describe_call(
            x, comm=comm, op=op, algorithm=algorithm
        )
        want = reduce(np.add, inputs[1:], inputs[0].copy())
        if op == "mean":
            want = (want / np.array(comm.Get_size(), dtype)).astype(dtype)
        for _ in range(3):  # (the short path binds at the first call)
            got = mar.allreduce(x, comm=comm, op=op, algorithm=algorithm)
            assert got.tobytes() == want.tobytes(), (op, dtype)
        for _ in range(2):
            y = x.copy()
            assert mar.allreduce(y, comm=comm, op=op, out=y, algorithm=algorithm) is y, (op, dtype)
            assert y.tobytes() == want.tobytes(), (op, dtype)
        assert x.tobytes() == inputs[rank].tobytes()


@pytest.mark.mpi(min_size=2)
def test_one_rank_in_place_against_the_others_out_of_place_raises_everywhere(compared_by_messages):
    """In place has a bound of its own (overrides.DISSEMINATION_TWO_RANKS_IN_PLACE_UP_TO): between
    the two, on 2 ranks the out-of-place call runs dissemination (its blocks in the check's
    messages) and the in-place one the check's codes alone, then the table's choice. Either way
    every rank raises SignatureMismatch naming the in-place rank, nothing is written, and the next
    call is right."""
    from mpiallreduce.core.consistency import SignatureMismatch
    from mpiallreduce.core.overrides import (
        DISSEMINATION_TWO_RANKS_IN_PLACE_UP_TO,
        DISSEMINATION_TWO_RANKS_UP_TO,
    )

    comm = compared_by_messages
    rank, size = comm.Get_rank(), comm.Get_size()
    between = (DISSEMINATION_TWO_RANKS_IN_PLACE_UP_TO + DISSEMINATION_TWO_RANKS_UP_TO) // 2 // 8
    for count in (between, 1000):
        x = exact_input("float64", count, rank, "sum")
        kept = x.copy()
        if size == 2 and count == between:
            assert mar.describe_call(x, comm=comm).startswith("dissemination"), mar.describe_call(
                x, comm=comm
            )
            in_place = mar.describe_call(
                x, comm=comm, out=x
            )  # (the table's: MPI's own across nodes)
            assert "dissemination" not in in_place and "32-byte messages" in in_place, in_place
        for odd_one in range(size):
            for _ in range(2):  # (the second on the short paths, compiled where built)
                out = np.full_like(x, -1.0)
                with pytest.raises(SignatureMismatch) as info:
                    mar.allreduce(x, comm=comm, out=x if rank == odd_one else out)
                assert f"on rank {odd_one}" in str(info.value), str(info.value)
                assert bits_equal(x, kept) and (rank == odd_one or (out == -1.0).all())
        assert values_equal(
            mar.allreduce(x, comm=comm), numpy_reference("sum", gather_inputs(comm, x))
        )


@pytest.mark.mpi(min_size=2)
def test_dissemination_has_one_reduction_on_every_path_nan_payloads_included(
    compared_by_messages, monkeypatch
):
    """The compiled short path reduces by MPI_Reduce_local; the Python path (a timed call, or the
    compiled paths off) must give the same bits, even where both operands are NaNs of different
    payloads (numpy's loops keep one operand's, MPI's the other's)."""
    comm = compared_by_messages
    rank = comm.Get_rank()
    payloads = np.array(
        [0x7FC00001 + rank, 0x7FC00100 + 3 * rank, 0x7FC01000 - rank], dtype=np.uint32
    )
    x = np.tile(
        payloads.view(np.float32), 12345
    )  # (SIMD loops and their remainders; the head's and a tail's)
    assert "signature: carried by dissemination" in mar.describe_call(
        x, comm=comm, algorithm="dissemination"
    )
    compiled = [
        mar.allreduce(x, comm=comm, algorithm="dissemination").view(np.uint32) for _ in range(3)
    ]
    timed = mar.allreduce(x, comm=comm, timeout=60, algorithm="dissemination").view(
        np.uint32
    )  # (the Python's)
    for got in compiled[1:] + [timed]:
        assert got.tobytes() == compiled[0].tobytes()
    assert len(set(comm.allgather(compiled[0].tobytes()))) == 1


@pytest.mark.mpi(min_size=2)
def test_dissemination_calls_not_compared_that_differ_in_size_raise(compared_by_messages):
    """Calls not compared (below MPIALLREDUCE_SIGNATURE_MIN_BYTES, here set on this communicator)
    that differ in size: an error on every rank, never values: a ValueError where a rank receives
    another length, AllreduceAborted where a peer's notice came first; with a head alone and with
    tails. A matching call then gives numpy's sum."""
    import dataclasses

    from mpiallreduce.core.state import state_of

    comm = compared_by_messages
    rank, size = comm.Get_rank(), comm.Get_size()
    state = state_of(comm)
    facts = state.facts
    state.facts = dataclasses.replace(facts, signature_min_bytes=1 << 40)
    try:
        for mine, theirs in ((100, 200), (200, 100), (3000, 4000)):
            count = theirs if rank == size - 1 else mine
            x = exact_input("float64", count, rank, "sum")
            assert "signature: none" in mar.describe_call(x, comm=comm, algorithm="dissemination")
            try:
                mar.allreduce(x, comm=comm, algorithm="dissemination")
                raised = ""
            except (
                ValueError,
                mar.AllreduceAborted,
            ) as error:  # (a peer that raised left the call: it says so)
                raised = str(error)
            told = comm.allgather(raised)  # (a rank that receives another length says so, unless a
            assert all(told) and any("differ in size" in t for t in told), (
                told
            )  # peer's notice came first)
            y = exact_input("float64", 100, rank, "sum")
            assert values_equal(
                mar.allreduce(y, comm=comm, algorithm="dissemination"),
                numpy_reference("sum", gather_inputs(comm, y)),
            )
    finally:
        state.facts = facts


@pytest.mark.mpi(min_size=2)
def test_dissemination_in_messages_widens_float16_and_leaves_a_reproducible_sums_words_uncarried(
    compared_by_messages,
):
    """Only an ordinary route carries the check: float16 still sums in float32 (rounded once), and a
    reproducible sum's words (8 bytes per float) compare first, never past the messages' limit."""
    comm = compared_by_messages
    size, rank = comm.Get_size(), comm.Get_rank()
    x = np.array([2048.0 if rank == 0 else 1.0] * 3, dtype=np.float16)
    want = np.float16(np.float32(2048.0) + (size - 1))  # (float16 pairwise: 2048 from 3 ranks on)
    for timeout in (None, 30):
        assert (
            mar.allreduce(x, comm=comm, algorithm="dissemination", timeout=timeout) == want
        ).all()
    y = exact_input("float32", 3000, rank, "sum")
    assert "signature: 32-byte messages" in mar.describe_call(
        y, comm=comm, algorithm="dissemination", reproducible=True
    )
    assert values_equal(
        mar.allreduce(y, comm=comm, algorithm="dissemination", reproducible=True),
        mar.allreduce(y, comm=comm, algorithm="pairwise_exchange", reproducible=True),
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "count, algorithm",
    [(1000, "dissemination"), (20000, "dissemination"), (1000, "mpi")],
    ids=["8000-bytes", "with-tails", "the-check-alone"],
)
def test_a_given_up_calls_message_is_dropped_when_its_tags_come_round_again(
    compared_by_messages, monkeypatch, count, algorithm
):
    """The last rank's call times out while the others' (untimed) sent it their rounds; calls_apart
    calls later the same tags meet those messages, which carry the old call's number: dropped, and
    their tails with them. 8000 bytes: past shared memory's eager limit, where a send left behind
    reads its buffer when matched, so that buffer is never written again; 160000: the blocks past
    one head in each message's tail, past 64 KiB a rendezvous that ends only when the tail is
    received."""
    from mpiallreduce.algorithms.base import CallTags

    comm = compared_by_messages
    size, rank = comm.Get_size(), comm.Get_rank()
    monkeypatch.setattr(CallTags, "calls_apart", 8)
    for _ in range(
        2
    ):  # (the untimed ranks' call then takes its short path: compiled rounds, where built)
        assert (mar.allreduce(np.full(count, 1.0), comm=comm, algorithm=algorithm) == size).all()
    with pytest.raises((mar.AllreduceTimeout, mar.AllreduceAborted)):
        mar.allreduce(
            np.full(count, 1000.0 + rank),
            comm=comm,
            algorithm=algorithm,
            timeout=1 if rank == size - 1 else None,
        )
    for call in range(20):
        x = exact_input("float64", count, rank, "sum") + call
        assert values_equal(
            mar.allreduce(x, comm=comm, algorithm=algorithm),
            numpy_reference("sum", gather_inputs(comm, x)),
        ), call


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("first", ["allreduce", "gather", "describe_call"])
def test_a_first_call_timed_on_one_rank_alone_raises_everywhere_and_the_next_calls_work(
    use_settings, first
):
    """A fresh communicator's first call (an allreduce, or the library's gather that GradientSync
    makes first), timed (0.3 s) on the last rank and untimed on the others: the timed rank's
    rendezvous, which the others never join, times out; the others, setting the communicator up
    (which a timed call does only after its rendezvous), learn it from the control channel and
    raise AllreduceAborted naming that rank, where they used to wait for ever (a gather numbered
    before its set-up too: a review finding). The calls' numbers stay in step, and the settings,
    replaced alike on every rank since, are agreed on (the untimed ranks' agreement was left
    pending with the old ones: a review finding): the next calls give numpy's sum. The same where
    the untimed ranks use the communicator first in describe_call (print the plan), then make the
    allreduce: describe_call raises (again at once if made again), takes no number, and the
    allreduce (#1) raises the same at once (review findings: it waited in the set-up; numbered in
    describe_call, the calls after it paired with the others' next ones and gave wrong sums; a
    second describe_call waited for ever)."""
    import time
    import warnings

    from mpi4py import MPI

    from mpiallreduce.core.gather import gather_from_ranks
    from mpiallreduce.core.state import state_of

    comm = MPI.COMM_WORLD.Dup()
    try:
        size, rank = comm.Get_size(), comm.Get_rank()
        x = exact_input("float64", 100, rank, "sum")
        started = time.monotonic()

        def make(timeout=None):
            return (
                gather_from_ranks(comm, rank, timeout=timeout)
                if first == "gather"
                else mar.allreduce(x, comm=comm, timeout=timeout)
            )

        if rank == size - 1:
            with pytest.raises(mar.AllreduceTimeout), warnings.catch_warnings():
                warnings.simplefilter("ignore", mar.AllreduceStallWarning)
                make(timeout=0.3)
        else:
            for _ in range(3 if first == "describe_call" else 1):
                with pytest.raises(mar.AllreduceAborted) as info:
                    mar.describe_call(
                        x, comm=comm
                    ) if first == "describe_call" and _ < 2 else make()
                assert f"rank {size - 1} gave it up" in str(info.value), str(info.value)
        assert time.monotonic() - started < 30
        use_settings()  # (the same settings, replaced on every rank: agreed on again)
        assert gather_from_ranks(comm, ("next", rank)) == [("next", r) for r in range(size)]
        expected = numpy_reference("sum", gather_inputs(comm, x))
        assert values_equal(mar.allreduce(x, comm=comm), expected)
        assert values_equal(
            mar.allreduce(x + 1, comm=comm, timeout=30),
            numpy_reference("sum", gather_inputs(comm, x + 1)),
        )
        assert len(set(comm.allgather(state_of(comm).sequence))) == 1
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("other", ["gather", "allreduce"])
def test_a_gather_timed_on_one_rank_alone_raises_everywhere_and_the_next_calls_work(other):
    """On a communicator in use, the library's gather (GradientSync's, hvd.allgather_object's)
    timed (0.3 s) on the last rank alone while the others make an untimed gather, or an untimed
    allreduce: the timed rank's rendezvous times out, and the others, which compare first in a
    watched exchange, raise AllreduceAborted naming it (the untimed gathers waited for ever in a
    blocking allgather: a review finding). Then gathers and allreduces give the right values, with
    the call numbers in step."""
    import warnings

    from mpi4py import MPI

    from mpiallreduce.core.gather import gather_from_ranks
    from mpiallreduce.core.state import state_of

    comm = MPI.COMM_WORLD.Dup()
    try:
        size, rank = comm.Get_size(), comm.Get_rank()
        x = exact_input("float64", 100, rank, "sum")
        assert values_equal(
            mar.allreduce(x, comm=comm), numpy_reference("sum", gather_inputs(comm, x))
        )
        if rank == size - 1:
            with pytest.raises(mar.AllreduceTimeout), warnings.catch_warnings():
                warnings.simplefilter("ignore", mar.AllreduceStallWarning)
                gather_from_ranks(comm, rank, timeout=0.3)
        else:
            with pytest.raises(mar.AllreduceAborted) as info:
                gather_from_ranks(comm, rank) if other == "gather" else mar.allreduce(x, comm=comm)
            assert f"rank {size - 1} gave it up" in str(info.value), str(info.value)
        assert gather_from_ranks(comm, ("next", rank)) == [("next", r) for r in range(size)]
        assert gather_from_ranks(comm, rank, timeout=30) == list(range(size))
        assert values_equal(
            mar.allreduce(x, comm=comm), numpy_reference("sum", gather_inputs(comm, x))
        )
        assert len(set(comm.allgather(state_of(comm).sequence))) == 1
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_gather_against_an_allreduce_raises_signature_mismatch_everywhere():
    """Rank 0 makes the library's gather where the others make an allreduce (untimed): every rank
    raises SignatureMismatch, the gather's compare meeting the allreduce's (it waited for ever in
    a blocking allgather before), and the next calls give the right values."""
    from mpi4py import MPI

    from mpiallreduce.core.consistency import SignatureMismatch
    from mpiallreduce.core.gather import gather_from_ranks

    comm = MPI.COMM_WORLD.Dup()
    try:
        size, rank = comm.Get_size(), comm.Get_rank()
        x = exact_input("float64", 100, rank, "sum")
        expected = numpy_reference("sum", gather_inputs(comm, x))
        with pytest.raises(SignatureMismatch) as info:
            gather_from_ranks(comm, rank) if rank == 0 else mar.allreduce(x, comm=comm)
        assert "a gather of the library's own" in str(info.value), str(info.value)
        assert gather_from_ranks(comm, rank) == list(range(size))
        assert values_equal(mar.allreduce(x, comm=comm), expected)
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["prepared", "plain"])
def test_a_call_given_up_ahead_raises_on_the_compiled_paths_too(kind):
    """What a first use outside a call learnt (a peer gave call #n up: state.given_up_ahead) is
    raised by the call of number #n on every path that numbers: a prepared call and a repeated
    plain call (compiled where built: _compiled.c's next_number, which skipped it: a review
    finding), the number taken once; the next calls give numpy's sum, the numbers in step."""
    from mpi4py import MPI

    from mpiallreduce.core.state import state_of

    comm = MPI.COMM_WORLD.Dup()
    try:
        rank = comm.Get_rank()
        x = exact_input("float64", 100, rank, "sum")
        expected = numpy_reference("sum", gather_inputs(comm, x))
        prepared = mar.prepare(x, comm=comm)

        def call():
            return prepared() if kind == "prepared" else mar.allreduce(x, comm=comm)

        for _ in range(3):  # (the plain call's short path kept)
            assert values_equal(call(), expected)
        state = state_of(comm)
        before = state.sequence
        state.given_up_ahead = mar.AllreduceAborted(
            "given up ahead (this test)", sequence=before + 1
        )
        with pytest.raises(mar.AllreduceAborted, match="given up ahead"):
            call()
        assert state.sequence == before + 1 and state.given_up_ahead is None
        for _ in range(2):
            assert values_equal(call(), expected)
        assert len(set(comm.allgather(state.sequence))) == 1
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_first_calls_timed_on_different_ranks_alone_raise_everywhere_and_the_next_calls_work():
    """A fresh communicator's call #1 timed (0.3 s) on the last rank alone, call #2 on rank 0 alone.
    In call #2 the untimed ranks' settings allreduce meets rank 0's part left pending from call
    #1's set-up, while rank 0 waits in its rendezvous: they used to go on into the set-up's
    blocking collectives and wait there for ever (a review finding). The parts carry their call's
    number: the untimed ranks see a part of call #1, post theirs again, and raise AllreduceAborted
    when rank 0 gives up; every next call (timed first: no set-up before its rendezvous) then
    gives numpy's sum, with the numbers in step."""
    import warnings

    from mpi4py import MPI

    from mpiallreduce.core.state import state_of

    comm = MPI.COMM_WORLD.Dup()
    try:
        size, rank = comm.Get_size(), comm.Get_rank()
        x = exact_input("float64", 100, rank, "sum")
        for timed_rank in (size - 1, 0):
            if rank == timed_rank:
                with pytest.raises(mar.AllreduceTimeout), warnings.catch_warnings():
                    warnings.simplefilter("ignore", mar.AllreduceStallWarning)
                    mar.allreduce(x, comm=comm, timeout=0.3)
            else:
                with pytest.raises(mar.AllreduceAborted) as info:
                    mar.allreduce(x, comm=comm)
                assert f"rank {timed_rank} gave it up" in str(info.value), str(info.value)
        for call in range(3):
            y = x + call
            assert values_equal(
                mar.allreduce(y, comm=comm, timeout=30 if call < 2 else None),
                numpy_reference("sum", gather_inputs(comm, y)),
            ), call
        assert len(set(comm.allgather(state_of(comm).sequence))) == 1
    finally:
        comm.Free()
