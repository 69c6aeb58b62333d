"""GradientSync's fixed buckets on every rank: any ready order, unused gradients, no_sync,
compression."""

import threading

import numpy as np
import pytest
from mpi4py import MPI
from reference import exact_input, gather_inputs, numpy_reference, values_equal

import mpiallreduce as mar

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD


#: fused in a bucket's buffer (twice), then reduced on its own (DIRECT_MIN_BYTES: where it lies
#: where no rank overlaps and no timeout, else in a buffer of its own)
SIZES = [250, 20_000, (1 << 20) // 8 + 3]


def two_gradients(rank, count=250):
    """Two gradients of one shape (so that a swap cannot show in a shape), rank- and
    index-dependent."""
    return {
        "a": exact_input("float64", count, rank, "sum"),
        "b": exact_input("float64", count, rank + 7, "sum"),
    }


def expected_means(comm, grads):
    return {name: numpy_reference("mean", gather_inputs(comm, g)) for name, g in grads.items()}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at_wait"])
@pytest.mark.parametrize("count", SIZES)
def test_declared_buckets_give_the_right_means_whatever_order_each_rank_marks_them(
    comm, count, overlap
):
    rank = comm.Get_rank()
    grads = two_gradients(rank, count)
    want = expected_means(comm, grads)
    sync = mar.GradientSync(
        comm=comm, parameters=grads, bucket_bytes=1000, overlap=overlap
    )  # one gradient a bucket
    assert sync.buckets == [["b"], ["a"]]  # reverse order, as backward produces them
    for step in range(3):
        order = ["a", "b"] if (rank + step) % 2 == 0 else ["b", "a"]
        fresh = {name: g.copy() for name, g in grads.items()}  # new arrays each step: named
        for name in order:
            sync.ready(fresh[name], name=name)
        # with overlap, bucket 0 ("b") starts in the background once "b" is ready; at_wait: nothing
        # before wait()
        assert len(sync._in_flight) == (1 if overlap else 0), (order, sync._in_flight)
        assert sync.wait() == {}
        for name in grads:
            assert values_equal(fresh[name], want[name]), (step, name)


def test_overlap_by_default_only_where_a_rank_has_two_cores_to_itself(comm):
    """The communicator's ranks on one machine, unbound (the launcher's --bind-to none), share its
    cores (emulated nodes too: one kernel, one boot id)."""
    import os

    grads = two_gradients(comm.Get_rank())
    with open("/proc/sys/kernel/random/boot_id") as f:
        machine = f.read()
    cores = len(os.sched_getaffinity(0)) / comm.allgather(machine).count(machine)
    sync = mar.GradientSync(comm=comm, parameters=grads)
    assert sync.overlap is (cores >= 2), cores
    assert mar.GradientSync(comm=comm, parameters=grads, overlap=not sync.overlap).overlap is (
        not sync.overlap
    )
    # ranks may choose differently: rank 0 by hand, the others by their cores (all meet at the first
    # plan)
    mixed = mar.GradientSync(
        comm=comm,
        parameters=grads,
        bucket_bytes=1000,
        timeout=60,
        overlap=True if comm.Get_rank() == 0 else None,
    )
    want = expected_means(comm, grads)
    for name in ("b", "a"):
        mixed.ready(grads[name], name=name)
    mixed.wait()
    assert all(values_equal(grads[name], want[name]) for name in grads)
    # the step is agreed on before any write, and large gradients reduced in place, only where no
    # rank overlaps
    assert mixed._agree_first is False  # (rank 0 overlaps)
    assert sync._agree_first is (not sync.overlap)  # (every rank has the same cores here)


def test_without_parameters_gradients_are_known_by_name_and_unnamed_ones_of_one_shape_are_refused(
    comm,
):
    """GradientSync(bucket_bytes=1000), two float64 gradients of one shape marked ready [a, b] on
    even ranks and [b, a] on odd ones, nothing declared: unnamed, every rank raises at the first
    step (a swap could not be seen) and nothing changes; named, the means are right, step after
    step. A later step that drops "b" on every rank and gives "a" unnamed raises too: the plan's
    "#0" had a twin, so ranks that dropped different twins would look alike. Named once, the step
    without "b" is planned anew, and "a", twinless there, may then go unnamed; both given unnamed
    again raise."""
    rank = comm.Get_rank()
    grads = two_gradients(rank)
    before = {name: g.copy() for name, g in grads.items()}
    order = ("a", "b") if rank % 2 == 0 else ("b", "a")
    sync = mar.GradientSync(comm=comm, bucket_bytes=1000)
    for name in order:
        sync.ready(grads[name])
    with pytest.raises(
        ValueError,
        match=(
            r"#0, #1 of a step that plans the buckets .* without a name .* "
            r"Pass ready\(grad, name=\.\.\.\)"
        ),
    ):
        sync.wait()
    assert all(np.array_equal(grads[name], before[name]) for name in grads)  # nothing was changed
    for step in range(2):
        want = expected_means(comm, grads)
        for name in order if step == 0 else order[::-1]:
            sync.ready(grads[name], name=name)
        assert sync.wait() == {}
        assert all(values_equal(grads[name], want[name]) for name in grads), step
    kept = {name: g.copy() for name, g in grads.items()}
    sync.ready(grads["a"])  # ("b" dropped; unnamed, "#0" could be "a" here and "b" elsewhere)
    with pytest.raises(
        ValueError, match=r"on every rank, 'a' .* was given '#0' .*unnamed, and another gradient"
    ):
        sync.wait()
    assert np.array_equal(grads["a"], kept["a"])
    for step in range(2):
        want = expected_means(comm, {"a": grads["a"]})["a"]
        sync.ready(grads["a"], name="a" if step == 0 else None)
        assert sync.wait() == {}
        assert values_equal(grads["a"], want), step
    kept = {name: g.copy() for name, g in grads.items()}
    for name in order:
        sync.ready(grads[name])
    with pytest.raises(
        ValueError, match=r"#0, #1 of a step that plans the buckets .* without a name"
    ):
        sync.wait()
    assert (
        all(np.array_equal(grads[name], kept[name]) for name in grads) and sync.buckets == []
    )  # (the plan dropped)
    if comm.Get_size() == 1:
        return
    mixed = mar.GradientSync(comm=comm)  # unnamed on rank 0, named by place (synchronize) elsewhere
    with pytest.raises(
        ValueError, match=r"hold different gradients(?s:.*)'#0' \(250,\) float64 on rank 0"
    ):
        if rank == 0:
            mixed.ready(grads["a"])
            mixed.ready(grads["b"])
            mixed.wait()
        else:
            mixed.synchronize([grads["a"], grads["b"]])


def test_a_name_given_to_two_gradients_is_refused_on_every_rank(comm):
    """Nothing declared, one name given to two gradients: every rank raises at the first step (each
    step would otherwise find it marked twice and plan anew, for ever) and nothing changes; with a
    name each, the means are right."""
    rank = comm.Get_rank()
    grads = {
        "a": exact_input("float64", 4, rank, "sum"),
        "b": exact_input("float64", 3, rank + 1, "sum"),
    }
    kept = {name: g.copy() for name, g in grads.items()}
    sync = mar.GradientSync(comm=comm, bucket_bytes=1000)
    sync.ready(grads["a"], name="a")
    sync.ready(grads["b"], name="a")
    with pytest.raises(ValueError, match=r"name\(s\) \['a'\] given to more than one gradient"):
        sync.wait()
    assert (
        all(np.array_equal(grads[name], kept[name]) for name in grads) and sync.buckets == []
    )  # (no plan)
    want = expected_means(comm, grads)
    for name in grads:
        sync.ready(grads[name], name=name)
    assert sync.wait() == {}
    assert all(values_equal(grads[name], want[name]) for name in grads)


@pytest.mark.parametrize("count", SIZES)
def test_a_gradient_missing_on_one_rank_is_an_error_everywhere_or_zeros_with_find_unused(
    comm, count
):
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    rank, size = comm.Get_rank(), comm.Get_size()
    grads = two_gradients(rank, count)
    skipper = size - 1  # this rank never uses "a"
    for find_unused in (False, True):
        sync = mar.GradientSync(
            comm=comm, parameters=grads, bucket_bytes=100, find_unused=find_unused
        )
        given = {
            name: g.copy() for name, g in grads.items() if not (rank == skipper and name == "a")
        }
        contributions = gather_inputs(comm, given.get("a", np.zeros(count)))
        for name, g in given.items():
            sync.ready(g, name=name)
        if not find_unused:
            with pytest.raises(
                ValueError,
                match=rf"(?s)'a' \({count},\) float64 differs: ready on .*; not marked "
                rf"ready on rank {skipper}.*find_unused=True",
            ):
                sync.wait()
            continue
        unused = sync.wait()
        want_a = contributions.sum(axis=0) / size  # zeros from the rank that did not use it
        if rank == skipper:
            assert list(unused) == ["a"] and values_equal(unused["a"], want_a)
        else:
            assert unused == {} and values_equal(given["a"], want_a)
        assert values_equal(given["b"], expected_means(comm, {"b": grads["b"]})["b"])


def test_marking_a_gradient_that_was_not_declared_is_an_error_on_every_rank(comm):
    rank = comm.Get_rank()
    grads = two_gradients(rank)
    sync = mar.GradientSync(comm=comm, parameters=grads)
    for name in ("b", "a"):
        sync.ready(grads[name], name=name)
    if rank == 0:
        sync.ready(np.ones(3), name="c")
    match = (
        "not declared were marked ready"
        if comm.Get_size() == 1
        else "gradients marked ready that were not expected"
    )
    with pytest.raises(ValueError, match=match):
        sync.wait()


def test_declared_parameters_that_differ_between_ranks_are_refused_on_every_rank(comm):
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    last = comm.Get_rank() == comm.Get_size() - 1
    with pytest.raises(
        ValueError,
        match=r"gradient #1 differs: 'b' \(3,\) float64 on ranks? 0.*; 'b' \(4,\) float64 on rank",
    ):
        mar.GradientSync(comm=comm, parameters={"a": np.zeros(2), "b": np.zeros(4 if last else 3)})


def test_buckets_are_rebuilt_in_the_order_every_rank_marked_them(comm):
    grads = {name: np.full(10, float(comm.Get_rank())) for name in "abcd"}
    sync = mar.GradientSync(comm=comm, parameters=grads, bucket_bytes=150)  # two gradients a bucket
    assert sync.buckets == [["d", "c"], ["b", "a"]]
    for _ in range(2):
        for name in "adbc":  # not backward's order, the same on every rank
            sync.ready(grads[name], name=name)
        sync.wait()
    assert sync.buckets == [["a", "d"], ["b", "c"]]
    want = (comm.Get_size() - 1) / 2
    assert all(np.all(g == want) for g in grads.values())


def test_no_sync_over_four_micro_batches_equals_one_step_on_the_whole_batch(comm):
    """Linear least squares: the gradient of the summed loss over 4 micro-batches, accumulated under
    no_sync and reduced once, equals that of one step on the concatenated batch."""
    rank = comm.Get_rank()
    weights = np.linspace(-1, 1, 6)
    rng = np.random.default_rng(rank)
    x, y = rng.standard_normal((32, 6)), rng.standard_normal(32)

    def gradient(xb, yb):
        return 2 * xb.T @ (xb @ weights - yb) / len(x)

    sync = mar.GradientSync(comm=comm, parameters={"w": weights})
    accumulated = np.zeros(6)
    with sync.no_sync():
        for micro in range(3):
            accumulated += gradient(x[micro * 8 : (micro + 1) * 8], y[micro * 8 : (micro + 1) * 8])
            sync.ready(accumulated, name="w")
            assert sync.wait() == {}
    assert np.array_equal(
        accumulated, sum(gradient(x[m * 8 : (m + 1) * 8], y[m * 8 : (m + 1) * 8]) for m in range(3))
    )
    accumulated += gradient(x[24:], y[24:])
    sync.ready(accumulated, name="w")
    sync.wait()
    whole = np.mean(comm.allgather(gradient(x, y)), axis=0)
    assert np.allclose(accumulated, whole, rtol=1e-12, atol=1e-12), (accumulated, whole)


@pytest.mark.parametrize("compression, bits", [("fp16", 11), ("bf16", 8)])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_compression_is_within_one_rounding_of_the_mean_and_the_same_bits_on_every_rank(
    comm, compression, bits, dtype
):
    rank = comm.Get_rank()
    rng = np.random.default_rng([rank, 5])
    # magnitudes over 6 decades, and values whose sum overflows float16 (a sum in float16 would be
    # inf)
    grads = {
        "small": (rng.standard_normal(3001) * 10.0 ** rng.integers(-2, 4, 3001)).astype(dtype),
        "large": np.full(17, 40000.0 + rank, dtype),
    }
    gathered = {name: np.array(comm.allgather(g.astype(np.float64))) for name, g in grads.items()}
    sync = mar.GradientSync(comm=comm, parameters=grads, bucket_bytes=2000, compression=compression)
    for name, g in grads.items():
        sync.ready(g, name=name)
    sync.wait()
    for name, g in grads.items():
        result, exact = g.astype(np.float64), gathered[name].mean(axis=0)
        # each contribution rounded once to `bits`, the mean rounded once: per element, within one
        # rounding of the contributions' mean magnitude and one of the result (fp16's subnormals:
        # 6e-8)
        bound = 2.0**-bits * (np.abs(gathered[name]).mean(axis=0) + np.abs(exact)) + 1e-7
        assert np.all(np.abs(result - exact) <= bound), (
            name,
            np.max(np.abs(result - exact) / bound),
        )
        assert np.isfinite(result).all()
        everyone = comm.allgather(g.tobytes())
        assert all(b == everyone[0] for b in everyone), f"{name}: not the same bits on every rank"


def test_device_gradients_are_ordered_on_streams_without_a_host_synchronization_per_gradient(
    comm, monkeypatch
):
    """With the CuPy stand-in: ready() queues the fusing copies on the current stream and never
    waits for it; the worker waits for an event; wait() gives the right means."""
    import mpiallreduce.testing.fake_cupy as fake_cupy

    rank = comm.Get_rank()
    host = {f"g{i}": exact_input("float32", 300 + i, rank + i, "sum") for i in range(6)}
    want = expected_means(comm, host)
    grads = {name: fake_cupy.asarray(g) for name, g in host.items()}
    sync = mar.GradientSync(comm=comm, parameters=grads, bucket_bytes=2500)
    sync.synchronize(
        [grads[name] for name in reversed(list(grads))]
    )  # the first step prepares (collective)
    for name, g in grads.items():
        fake_cupy.copyto(g, fake_cupy.asarray(host[name]))
    fake_cupy.synchronize_all()
    waits, caller = [], threading.current_thread()
    original = fake_cupy.Stream.synchronize

    def counted(stream):
        if threading.current_thread() is caller:  # (the worker thread may wait: it is not backward)
            waits.append(stream)
        original(stream)

    monkeypatch.setattr(fake_cupy.Stream, "synchronize", counted)
    for name in reversed(list(grads)):
        sync.ready(grads[name], name=name)
    assert waits == [], "a host synchronization while gradients were marked ready"
    sync.wait()
    monkeypatch.undo()
    for name, g in grads.items():
        assert values_equal(fake_cupy.asnumpy(g), want[name]), name


def test_where_no_rank_overlaps_one_array_given_for_two_names_is_reduced_once(comm):
    """Large gradients go in place once the ranks agreed on the step, but not one that shares its
    memory with another gradient of the step: each name's mean, written twice, is still the mean."""
    shared = exact_input("float64", (1 << 20) // 8 + 3, comm.Get_rank(), "sum")
    want = numpy_reference("mean", gather_inputs(comm, shared))
    small = np.full(5, float(comm.Get_rank()))
    sync = mar.GradientSync(
        comm=comm,
        parameters={"a": shared, "b": shared, "c": small},
        bucket_bytes=1000,
        overlap=False,
        postscale=3.0,
    )
    for name in ("c", "b", "a"):
        sync.ready(shared if name != "c" else small, name=name)
    sync.wait()
    assert values_equal(shared, want * 3.0)


def test_with_a_timeout_a_rank_late_after_the_ranks_agreed_changes_no_gradient():
    """Where no rank overlaps, the step's digest is agreed first; with a timeout the large gradients
    are then still reduced out of place, so a rank that stalls past it leaves every gradient as it
    was. (COMM_WORLD only: the communicator's kind changes nothing here, and each run waits a
    timeout.)"""
    import time

    comm = WORLD
    rank = comm.Get_rank()
    grads = {
        "b": np.full(7, rank + 1.0),
        "a": exact_input("float64", (1 << 20) // 8 + 3, rank, "sum"),
        "c": np.full(3, rank + 2.0),
    }
    sync = mar.GradientSync(
        comm=comm,
        parameters={k: np.zeros_like(v) for k, v in grads.items()},
        bucket_bytes=1000,
        overlap=False,
        timeout=0.5,
        prescale=2.0,
    )
    assert sync._agree_first and sync.buckets == [
        ["c", "a"],
        ["b"],
    ]  # ("b", with the digest, goes first)
    reduce = sync._reduce

    def stall(buckets, since=0, **how):  # (rank 1, between the digest's bucket and the others)
        if since and rank == 1:
            time.sleep(1.5)
        return reduce(buckets, since, **how)

    sync._reduce = stall
    before = {name: g.copy() for name, g in grads.items()}
    if comm.Get_size() == 1:
        pytest.skip("needs a second rank to be late")
    with pytest.raises(mar.AllreduceTimeout):
        for name in ("c", "a", "b"):
            sync.ready(grads[name], name=name)
        sync.wait()
    assert all(np.array_equal(grads[name], before[name]) for name in grads)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("strided_first", [False, True])
def test_a_strided_large_gradient_over_the_memory_of_another_is_reduced_once(
    comm, op, strided_first
):
    """a (contiguous) and b (every other element of the same memory) are both large: neither is
    reduced where it lies, whichever comes first, and every element gets one sum (or mean)."""
    rank, n = comm.Get_rank(), 1 << 15
    big = exact_input("float32", 2 * n, rank, "sum")
    a, b = big[:n], big[::2]
    grads = {"b": b, "a": a} if strided_first else {"a": a, "b": b}
    everyone = gather_inputs(comm, big)
    want = numpy_reference(op, everyone)
    covered = np.zeros(2 * n, bool)
    covered[:n] = covered[::2] = True
    want = np.where(covered, want, big)  # (memory in no gradient keeps this rank's values)
    sync = mar.GradientSync(comm=comm, op=op, parameters={k: v.copy() for k, v in grads.items()})
    for name, g in grads.items():
        sync.ready(g, name=name)
    sync.wait()
    assert values_equal(big, want)


def test_with_a_timeout_in_the_settings_large_gradients_are_not_reduced_where_they_lie(
    comm, monkeypatch
):
    """MPIALLREDUCE_TIMEOUT times GradientSync's calls as timeout= does: so a gradient of 1 MiB or
    more (reduced on its own, DIRECT_MIN_BYTES) goes through a buffer of its own (a timed call may
    give up after the ranks agreed); without it, where it lies, once the ranks agreed. Smaller ones
    are fused either way. The means are right both ways."""
    from mpiallreduce.core import settings as settings_module
    from mpiallreduce.training.overlap import untimed
    from mpiallreduce.training.reduction import BucketReducer

    rank, count = comm.Get_rank(), (1 << 20) // 8 + 3
    where_they_lie = []
    start = BucketReducer.start

    def spy(self, bucket, filled, copied, digest, xp, here=False, in_place=(), part="all"):
        where_they_lie.extend(filled[i] for i in in_place)
        return start(self, bucket, filled, copied, digest, xp, here, in_place, part)

    monkeypatch.setattr(BucketReducer, "start", spy)
    for timeout in (None, 30.0):
        monkeypatch.setattr(
            settings_module,
            "settings",
            # (current: the settings before this patch, read once, here)
            lambda current=settings_module.settings(), timeout=timeout: (  # noqa: B008
                __import__("dataclasses").replace(current, timeout=timeout)
            ),
        )
        assert untimed(None) == (timeout is None)
        sync = mar.GradientSync(
            comm=comm, overlap=False, parameters={"g": np.zeros(count), "s": np.zeros(20_000)}
        )
        assert [len(b.direct) for b in sync._buckets] == [1]  # (g on its own, s fused)
        grads = {
            "g": exact_input("float64", count, rank, "sum"),
            "s": exact_input("float64", 20_000, rank + 3, "sum"),
        }
        want = expected_means(comm, grads)
        where_they_lie.clear()
        for name, g in grads.items():
            sync.ready(g, name=name)
        sync.wait()
        assert all(values_equal(grads[name], want[name]) for name in grads)
        lie = [g is grads["g"] for g in where_they_lie]
        assert lie == ([True] if timeout is None else []), (timeout, lie)
