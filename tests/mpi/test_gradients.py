"""Asynchronous allreduce, gradient buckets, parameter broadcast and replica checks."""

import time

import numpy as np
import pytest
from mpi4py import MPI
from reference import (
    bits_equal,
    exact_input,
    gather_inputs,
    numpy_reference,
    timing_test_at_three_ranks,
    values_equal,
)

import mpiallreduce as mar

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD


def test_several_async_allreduces_in_flight_waited_in_any_order(comm):
    rank = comm.Get_rank()
    inputs = [exact_input("float64", n, rank, "sum") for n in (5, 100_000, 0, 1009, 3)]
    expected = [numpy_reference("sum", gather_inputs(comm, x)) for x in inputs]
    from mpiallreduce.algorithms import REGISTRY
    from mpiallreduce.core.state import state_of

    spans_nodes = (
        state_of(comm).make_ready().spans_nodes
    )  # (across emulated nodes: the one-node ones refuse)
    for algorithm in [
        a for a in mar.HOST_ALGORITHMS if not (spans_nodes and REGISTRY[a].needs_one_node)
    ] + ["auto"]:
        handles = [mar.allreduce_async(x, algorithm=algorithm, comm=comm) for x in inputs]
        for handle, want in reversed(list(zip(handles, expected, strict=True))):
            assert values_equal(handle.wait(timeout=60), want), algorithm
            assert handle.done()


def test_a_synchronous_call_waits_its_turn_behind_pending_async_ones(comm):
    rank = comm.Get_rank()
    a, b = exact_input("float32", 200_000, rank, "sum"), exact_input("int64", 7, rank, "max")
    want_a, want_b = (
        numpy_reference("sum", gather_inputs(comm, a)),
        numpy_reference("max", gather_inputs(comm, b)),
    )
    handle = mar.allreduce_async(a, algorithm="ring", comm=comm)
    assert values_equal(
        mar.allreduce(b, op="max", algorithm="recursive_doubling", comm=comm), want_b
    )
    assert values_equal(handle.wait(), want_a)


@pytest.mark.mpi(min_size=2)
def test_wait_with_a_timeout_gives_up_the_call_on_every_rank_then_the_next_call_works():
    """wait(timeout) brings a timed call's deadline forward: the ranks that came give up (naming the
    missing ones), the latecomers learn it from them, and the communicator stays usable."""
    x = np.ones(4)
    size = WORLD.Get_size()
    # (the communicator and its timed calls' one made first, as earlier tests leave them: the first
    # timed call makes a communicator on the caller's thread, which holds rank 0 until the others
    # come, so that no deadline of wait() would pass; run alone, this test needs it)
    mar.allreduce(x, algorithm="ring", timeout=60)
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        handle = mar.allreduce_async(x, algorithm="ring", timeout=60)
        if size > 1:
            with pytest.raises(
                mar.AllreduceTimeout, match=r"timed out after 0\.\d s: ranks? 1.* had not arrived"
            ):
                handle.wait(timeout=0.3)  # the other ranks start a second later
    else:
        time.sleep(1.0)
        handle = mar.allreduce_async(x, algorithm="ring", timeout=60)
        with pytest.raises(mar.AllreduceTimeout, match="rank 0 gave up waiting for it"):
            handle.wait(timeout=60)
    WORLD.Barrier()
    assert values_equal(
        mar.allreduce_async(x, algorithm="ring").wait(timeout=60), np.full(4, float(size))
    )


def test_async_argument_errors_raise_at_the_call_before_any_communication():
    with pytest.raises(ValueError, match="unknown op 'average'"):
        mar.allreduce_async(np.ones(3), op="average")
    assert values_equal(mar.allreduce_async(np.ones(3)).wait(), np.full(3, float(WORLD.Get_size())))


def test_wait_with_a_timeout_on_an_untimed_call_says_it_goes_on():
    """An untimed call's ranks do not meet first (no messages): wait(timeout) cannot give it up on
    every rank, so it says so and the call completes."""
    if WORLD.Get_size() == 1:
        pytest.skip("one rank does not wait")
    x = np.ones(4)
    if WORLD.Get_rank() == 0:
        handle = mar.allreduce_async(x, algorithm="ring")
        with pytest.raises(mar.AllreduceTimeout, match="it goes on"):
            handle.wait(timeout=0.2)
        assert values_equal(handle.wait(), np.full(4, float(WORLD.Get_size())))
    else:
        time.sleep(0.6)
        assert values_equal(
            mar.allreduce_async(x, algorithm="ring").wait(), np.full(4, float(WORLD.Get_size()))
        )


def gradient_set(rank, big):
    """One gradient larger than most buckets, many tiny ones, mixed float dtypes; exact values."""
    shapes = [(big,), (3,), (1,), (2, 5), (0,), (7, 7), (1,), (4, 1, 3), (257,)] + [(2,)] * 20
    dtypes = ["float32", "float16", "float64"]
    return [
        exact_input(dtypes[i % 3], int(np.prod(s)), rank + i, "sum").reshape(s)
        for i, s in enumerate(shapes)
    ]


@pytest.mark.parametrize("bucket_bytes", [1, 100, 4096, 1 << 20, 25 << 20])
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_buckets_give_what_one_allreduce_per_tensor_gives(comm, bucket_bytes, op):
    rank = comm.Get_rank()
    grads = gradient_set(rank, 50_000)
    reference = []
    for g in grads:  # one allreduce per tensor, accumulated in float32 for float16, as documented
        wide = g.astype(np.float32) if g.dtype == np.float16 else g
        reference.append(numpy_reference(op, gather_inputs(comm, wide)).astype(g.dtype))
    mar.GradientSync(comm=comm, bucket_bytes=bucket_bytes, op=op).synchronize(grads)
    for i, (g, want) in enumerate(zip(grads, reference, strict=True)):
        assert values_equal(g, want), f"gradient {i} {g.shape} {g.dtype}"


def test_prescale_and_postscale(comm):
    x = exact_input("float64", 1000, comm.Get_rank(), "sum")
    want = numpy_reference("sum", gather_inputs(comm, x)) * 3.0
    sync = mar.GradientSync(comm=comm, op="sum", prescale=0.5, postscale=6.0)
    sync.ready(x)
    sync.wait()
    assert values_equal(x, want)


def test_gradients_that_are_not_writeable_float_arrays_are_refused_at_wait_on_every_rank(comm):
    """ready() records what is wrong and every rank's wait() raises: a rank that raised alone in
    ready() would leave the others in the next bucket's allreduce."""
    last = comm.Get_rank() == comm.Get_size() - 1
    bad = np.ones(3, dtype=np.int32) if last else np.ones(3)
    sync = mar.GradientSync(comm=comm)
    sync.ready(bad)
    with pytest.raises(
        TypeError,
        match=rf"rank {comm.Get_size() - 1}: '#0' \(3,\) int32: gradients must be floating",
    ):
        sync.wait()
    read_only = np.ones(5)
    read_only.flags.writeable = not last
    declared = mar.GradientSync(comm=comm, parameters={"w": np.ones(5)})
    declared.ready(read_only, name="w")
    with pytest.raises(
        ValueError,
        match=r"'w' \(5,\) float64.*given 'w' \(5,\) float64 \(a read-only numpy array\)",
    ):
        declared.wait()
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        mar.GradientSync(op="max")


def test_ranks_whose_gradient_sync_options_differ_are_refused_on_every_rank(comm):
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    last = comm.Get_rank() == comm.Get_size() - 1
    with pytest.raises(
        ValueError,
        match=r"options differ:\n  bucket_bytes differs: 1000 on ranks? 0.*; 2000 on rank",
    ):
        mar.GradientSync(comm=comm, parameters=[np.zeros(4)], bucket_bytes=2000 if last else 1000)
    # (reproducible buckets are prepared calls on symmetric buffers too: refused before either is
    # made)
    with pytest.raises(
        ValueError,
        match=r"options differ:\n  reproducible differs: False on ranks? 0.*; True on rank",
    ):
        mar.GradientSync(comm=comm, parameters=[np.zeros(20_000, np.float32)], reproducible=last)
    # (results handed over as views on some ranks, written back on others: a fused call of another
    # op)
    with pytest.raises(
        ValueError,
        match=r"options differ:\n  write_back differs: True on ranks? 0.*; False on rank",
    ):
        mar.GradientSync(comm=comm, parameters=[np.zeros(4)], write_back=not last)
    sync = mar.GradientSync(comm=comm, parameters=[np.zeros(20_000, np.float32)], reproducible=True)
    grad = np.full(20_000, comm.Get_rank() + 1.0, np.float32)
    sync.synchronize([grad])
    assert (
        grad == (comm.Get_size() + 1) / 2
    ).all()  # (the mean of 1 .. size; and nothing left in flight)


def test_broadcast_parameters_and_check_replicas(comm):
    rank = comm.Get_rank()
    params = {
        "w": np.full((3, 4), float(rank)),
        "b": np.arange(5, dtype=np.float32) + rank,
        "strided": np.full((4, 6), float(rank))[:, ::2],
    }
    if comm.Get_size() > 1:
        with pytest.raises(ValueError, match="replicas differ: array 'b'"):
            mar.check_replicas(params, comm=comm)
    mar.broadcast_parameters(params, root=0, comm=comm)
    assert (
        np.all(params["w"] == 0.0)
        and np.all(params["b"] == np.arange(5))
        and np.all(params["strided"] == 0)
    )
    mar.check_replicas(params, comm=comm)
    mar.check_replicas([params["w"], params["b"]], comm=comm)


def test_mismatched_parameters_raise_on_every_rank(comm):
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks in this communicator")
    last = comm.Get_rank() == comm.Get_size() - 1
    params = [np.zeros(4 if last else 3)]
    with pytest.raises(
        ValueError, match=r"(?s)the ranks hold different arrays:.*differs: \(\(3,\), 'float64'\)"
    ):
        mar.broadcast_parameters(params, comm=comm)
    with pytest.raises(ValueError, match="names differs"):
        mar.check_replicas({"a" if last else "b": np.zeros(3)}, comm=comm)


def test_bfloat16_gradients_are_summed_in_float32_and_rounded_once(comm):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rank, size = comm.Get_rank(), comm.Get_size()
    # 1 + rank * 2^-7: exact in bfloat16; their sum is not (8 bits of mantissa), so a sum in
    # bfloat16 would round at every step, one in float32 only once, at the end
    grad = (np.full(6, 1.0, np.float32) + np.float32(rank) * np.float32(2.0**-7)).astype(
        ml_dtypes.bfloat16
    )
    contributions = gather_inputs(comm, grad.astype(np.float32))
    expected = (contributions.sum(axis=0) / size).astype(ml_dtypes.bfloat16)
    mar.GradientSync(comm=comm, op="mean").synchronize([grad])
    assert grad.dtype == ml_dtypes.bfloat16
    assert np.array_equal(grad.astype(np.float32), expected.astype(np.float32)), (grad, expected)


#: float64 elements of a gradient over GradientSync's DIRECT_MIN_BYTES (1 MiB): reduced on its own,
#: not fused in a bucket's buffer
LARGE = 200_000


def scaled_reference(comm, grad, op, prescale, postscale):
    """numpy on every rank's ``grad``, times prescale and postscale (powers of two: exact in any
    order)."""
    return numpy_reference(op, gather_inputs(comm, grad)) * (prescale * postscale)


@pytest.mark.parametrize("change", ["extra gradient", "changed shape"])
@pytest.mark.parametrize(
    "op, prescale, postscale, bucket_bytes",
    [
        ("sum", 1.0, 1.0, 25 << 20),
        ("mean", 1.0, 1.0, 1000),
        ("sum", 0.5, 4.0, 1000),
        ("mean", 2.0, 0.25, 25 << 20),
    ],
)
def test_gradients_changed_alike_on_every_rank_are_replanned_and_each_reduced_once(
    comm, change, op, prescale, postscale, bucket_bytes
):
    """Without parameters, a step whose gradients differ from the first step's alike on every rank
    is planned anew and replayed: a large gradient is not summed twice, nor prescaled twice."""
    rank = comm.Get_rank()
    sync = mar.GradientSync(
        comm=comm, op=op, prescale=prescale, postscale=postscale, bucket_bytes=bucket_bytes
    )
    counts = [
        {"A": LARGE, "B": 10},
        {"A": LARGE, "B": 10, "C": 7} if change == "extra gradient" else {"A": LARGE, "B": 12},
    ]
    for step, layout in enumerate(
        counts + counts[1:]
    ):  # the first step, the changed one, the same again
        grads = {
            name: exact_input("float64", count, rank + 3 * step + i, "sum")
            for i, (name, count) in enumerate(layout.items())
        }
        want = {
            name: scaled_reference(comm, g, op, prescale, postscale) for name, g in grads.items()
        }
        for name, g in grads.items():
            sync.ready(g, name=name)
        assert sync.wait() == {}
        for name, g in grads.items():
            assert values_equal(g, want[name]), (step, name, g[:4], want[name][:4])
    assert sync.buckets and sorted(n for b in sync.buckets for n in b) == sorted(counts[1])


@pytest.mark.parametrize("prescale", [1.0, 2.0])
def test_a_declared_gradient_not_marked_ready_is_refused_with_no_gradient_changed(comm, prescale):
    """find_unused=False, every rank marks only the large gradient A ready: every rank raises, and A
    (reduced out of place) is bitwise what this rank gave; the next complete step works."""
    rank = comm.Get_rank()
    declared = {"A": np.zeros(LARGE), "B": np.zeros(10)}
    sync = mar.GradientSync(comm=comm, parameters=declared, prescale=prescale, op="sum")
    a = exact_input("float64", LARGE, rank, "sum")
    before = a.copy()
    sync.ready(a, name="A")
    with pytest.raises(ValueError, match=r"not marked ready: \['B'\].*no gradient was changed"):
        sync.wait()
    assert bits_equal(a, before)
    b = exact_input("float64", 10, rank + 1, "sum")
    want = {
        "A": scaled_reference(comm, a, "sum", prescale, 1.0),
        "B": scaled_reference(comm, b, "sum", prescale, 1.0),
    }
    sync.ready(b, name="B")
    sync.ready(a, name="A")
    assert sync.wait() == {}
    assert values_equal(a, want["A"]) and values_equal(b, want["B"])


@pytest.mark.parametrize("declared", [True, False])
@pytest.mark.parametrize("large, overlap", [(LARGE, None), (20_000, False), (20_000, True)])
def test_a_digest_mismatch_with_a_large_gradient_present_changes_no_gradient(
    comm, declared, large, overlap
):
    """The last rank gives B of another shape: every rank raises the same ValueError, and neither
    the large gradient A (of 1 MiB or more; or of 160 KB: reduced where it lies where no rank
    overlaps, else fused) nor B has changed anywhere."""
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    rank, last = comm.Get_rank(), comm.Get_rank() == comm.Get_size() - 1
    parameters = {"A": np.zeros(large), "B": np.zeros(10)} if declared else None
    sync = mar.GradientSync(
        comm=comm, parameters=parameters, prescale=2.0, bucket_bytes=1000, overlap=overlap
    )
    if not declared:  # the first step declares A and B, alike on every rank
        sync.ready(exact_input("float64", large, rank, "sum"), name="A")
        sync.ready(exact_input("float64", 10, rank, "sum"), name="B")
        sync.wait()
    grads = {
        "A": exact_input("float64", large, rank + 1, "sum"),
        "B": exact_input("float64", 11 if last else 10, rank + 2, "sum"),
    }
    before = {name: g.copy() for name, g in grads.items()}
    for name, g in grads.items():
        sync.ready(g, name=name)
    with pytest.raises(
        ValueError,
        match=r"(?s)gradients differ.*no gradient was changed.*'B' \(10,\) float64 differs",
    ):
        sync.wait()
    for name, g in grads.items():
        assert bits_equal(g, before[name]), name


@pytest.mark.mpi(min_size=2)
def test_a_bucket_that_times_out_changes_no_gradient():
    """The last rank comes late to a step: every rank's wait() raises what the buckets' allreduces
    raised, and every gradient, the large one included, is bitwise what that rank gave."""
    timing_test_at_three_ranks()
    rank, last = WORLD.Get_rank(), WORLD.Get_rank() == WORLD.Get_size() - 1
    sync = mar.GradientSync(
        parameters={"A": np.zeros(LARGE), "B": np.zeros(10)}, prescale=2.0, timeout=0.5
    )
    for step in range(
        2
    ):  # the first step on time (each bucket's call is prepared then), the second late
        grads = {
            "A": exact_input("float64", LARGE, rank + step, "sum"),
            "B": exact_input("float64", 10, rank + step + 1, "sum"),
        }
        before = {name: g.copy() for name, g in grads.items()}
        if step == 1 and last:
            time.sleep(1.6)  # past both allreduces' timeouts (the fused bucket's, then A's)
        for name in (
            "B",
            "A",
        ):  # backward's order: the buckets are not rebuilt (nor prepared again)
            sync.ready(grads[name], name=name)
        if step == 0:
            sync.wait()
            continue
        with pytest.raises(mar.AllreduceTimeout):
            sync.wait()
        for name, g in grads.items():
            assert bits_equal(g, before[name]), name
    WORLD.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("declared", [True, False])
def test_a_rank_late_at_the_first_step_fails_that_step_only(declared):
    """Review findings: with declared parameters, the first bucket's prepare (inside ``ready``)
    timed out and escaped from ``ready``, and the next step failed too ("marked ready twice");
    without them, the first ``wait``'s agreement timed out and its gradients stayed in the step, to
    be reduced (and written) with the next one's. Now that step raises AllreduceTimeout at ``wait``
    on every rank with no gradient changed, and the next step is right."""
    timing_test_at_three_ranks()
    rank, late = WORLD.Get_rank(), WORLD.Get_rank() == WORLD.Get_size() - 1
    names = [f"g{i}" for i in range(4)]
    specs = {name: np.zeros(50) for name in names} if declared else None
    sync = mar.GradientSync(parameters=specs, bucket_bytes=800, timeout=0.5)
    for step in range(2):
        grads = {
            name: exact_input("float64", 50, 10 * rank + i + step, "sum")
            for i, name in enumerate(names)
        }
        before = {name: g.copy() for name, g in grads.items()}
        want = {name: numpy_reference("mean", gather_inputs(WORLD, g)) for name, g in grads.items()}
        if step == 0 and late:
            time.sleep(1.2)
        for name in reversed(names):
            sync.ready(grads[name], name=name)
        if step == 0:
            with pytest.raises(mar.AllreduceTimeout):
                sync.wait()
            for name, g in grads.items():
                assert bits_equal(g, before[name]), name
            WORLD.Barrier()
            continue
        sync.wait()
        for name, g in grads.items():
            assert values_equal(g, want[name]), name


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_a_large_gradient_summed_reproducibly_is_reduced_out_of_place_and_written_back_at_wait(
    comm, op
):
    rank = comm.Get_rank()
    sync = mar.GradientSync(comm=comm, op=op, prescale=2.0, postscale=0.5, reproducible=True)
    for step in range(2):
        grads = [
            exact_input("float64", LARGE, rank + step, "sum"),
            exact_input("float32", 9, rank + step + 1, "sum"),
        ]
        want = [scaled_reference(comm, g, op, 2.0, 0.5) for g in grads]
        sync.synchronize(grads)
        for g, w in zip(grads, want, strict=True):
            assert values_equal(g, w), (step, g.dtype)


def test_a_reproducible_mean_has_the_same_bits_in_a_large_gradient_as_in_a_fused_one(comm):
    """Random float32 (sums inexact): a large gradient (reduced on its own) and a small one (fused)
    holding the same leading values end with the same bits, the exact sum rounded to float32, then
    divided by p (float64 sums of three float32 normals are exact: the independent reference)."""
    p, count, small = comm.Get_size(), (1 << 18) + 5, 20_000
    x = np.random.default_rng([comm.Get_rank(), 7]).standard_normal(count).astype(np.float32)
    grads = {"large": x.copy(), "small": x[:small].copy()}
    exact = gather_inputs(comm, x).astype(np.float64).sum(axis=0)
    want = np.divide(exact.astype(np.float32), np.float32(p))
    sync = mar.GradientSync(comm=comm, reproducible=True, parameters=grads)
    assert [len(b.direct) for b in sync._buckets] == [1]
    for name, g in grads.items():
        sync.ready(g, name=name)
    sync.wait()
    assert bits_equal(grads["large"], want) and bits_equal(grads["small"], want[:small])


def test_a_large_device_gradient_is_reduced_out_of_place_and_written_back_at_wait(comm):
    """With the CuPy stand-in: a large gradient and a small one, prescaled, averaged."""
    import mpiallreduce.testing.fake_cupy as fake_cupy

    rank = comm.Get_rank()
    host = {
        "A": exact_input("float64", LARGE, rank, "sum"),
        "B": exact_input("float64", 10, rank + 1, "sum"),
    }
    want = {name: scaled_reference(comm, h, "mean", 2.0, 1.0) for name, h in host.items()}
    grads = {name: fake_cupy.asarray(h) for name, h in host.items()}
    sync = mar.GradientSync(comm=comm, parameters=grads, prescale=2.0)
    for step in range(2):
        for name in ("B", "A"):
            fake_cupy.copyto(grads[name], fake_cupy.asarray(host[name]))
            sync.ready(grads[name], name=name)
        sync.wait()
        for name, g in grads.items():
            assert values_equal(fake_cupy.asnumpy(g), want[name]), (step, name)


def test_device_gradients_that_one_rank_did_not_mark_are_its_zeros_with_find_unused(
    comm, monkeypatch
):
    """With the CuPy stand-in and find_unused: the last rank marks neither the large gradient nor
    the small one; it gets the others' means back (wait()'s dict, device arrays), every rank the
    mean with zeros in its place. (That rank saw no device array: it imports cupy, here the
    stand-in.)"""
    import sys

    import mpiallreduce.testing.fake_cupy as fake_cupy

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    host = {
        "A": exact_input("float64", LARGE, rank, "sum"),
        "B": exact_input("float64", 10, rank + 1, "sum"),
    }
    given = {
        name: h if rank != last or comm.Get_size() == 1 else np.zeros_like(h)
        for name, h in host.items()
    }
    want = {name: numpy_reference("mean", gather_inputs(comm, g)) for name, g in given.items()}
    grads = {name: fake_cupy.asarray(h) for name, h in host.items()}
    sync = mar.GradientSync(comm=comm, parameters=grads, find_unused=True)
    if rank != last or comm.Get_size() == 1:
        for name in ("B", "A"):
            sync.ready(grads[name], name=name)
    unused = sync.wait()
    got = unused if rank == last and comm.Get_size() > 1 else grads
    assert sorted(unused) == (["A", "B"] if rank == last and comm.Get_size() > 1 else [])
    for name in host:
        assert values_equal(fake_cupy.asnumpy(got[name]), want[name]), name
