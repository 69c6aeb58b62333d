"""mpiallreduce.jax on every rank, each result against JAX itself: one process running JAX's own
pmap over as many host devices as there are ranks (jax_num_cpu_devices), fed every rank's input
(made here from the rank alone). Eagerly and inside jit, scan, cond, vmap and grad; the examples
of docs/jax.md (normalization, groups, nested axes, a sharded dot product, a data-parallel loop);
and the errors every rank must see alike."""

import numpy as np
import pytest
from mpi4py import MPI

jax = pytest.importorskip("jax")
WORLD = MPI.COMM_WORLD
SIZE, RANK = WORLD.Get_size(), WORLD.Get_rank()
jax.config.update("jax_num_cpu_devices", SIZE)  # (before JAX's backend starts: the reference's)

import jax.numpy as jnp  # noqa: E402

import mpiallreduce as mar  # noqa: E402
import mpiallreduce.jax as mj  # noqa: E402

pytestmark = pytest.mark.mpi


def inputs(make):
    """(this rank's input, every rank's stacked): ``make(rank)`` depends on the rank and index."""
    return make(RANK), jax.tree_util.tree_map(
        lambda *leaves: jnp.stack(leaves), *[make(r) for r in range(SIZE)]
    )


def ours_and_pmap(ours, theirs, make):
    """Our function on this rank's input, and JAX's pmap of ``theirs`` (axis "i") on every rank's,
    this rank's row."""
    mine, every = inputs(make)
    reference = jax.pmap(theirs, axis_name="i", devices=jax.devices()[:SIZE])(every)
    return ours(mine), jax.tree_util.tree_map(lambda r: r[RANK], reference)


def data(rank, n=7, dtype=jnp.float32):
    return ((jnp.arange(n) * 7 + rank * 13) % 11 - 5).astype(dtype)


@pytest.mark.parametrize("name", ["psum", "pmean", "pmax", "pmin"])
@pytest.mark.parametrize("dtype", ["float32", "int32", "bfloat16"])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_each_reduction_matches_jax_pmap(name, dtype, jitted):
    if name == "pmean" and dtype == "int32":
        pytest.skip("an integer mean: an error (test_bad_input_is_an_error_on_every_rank)")
    ours = getattr(mj, name)
    f = jax.jit(lambda v: ours(v)) if jitted else ours
    got, want = ours_and_pmap(
        f, lambda v: getattr(jax.lax, name)(v, "i"), lambda r: data(r, dtype=jnp.dtype(dtype))
    )
    assert got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want)), (
        got,
        want,
    )


def test_a_pytree_reduces_leaf_by_leaf():
    tree = lambda r: {"w": data(r), "b": (data(r, 3) * 2, data(r, 2, jnp.int32))}  # noqa: E731
    got, want = ours_and_pmap(mj.psum, lambda t: jax.lax.psum(t, "i"), tree)
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda a, b: np.array_equal(a, b), got, want)
    )


def test_inside_scan_fori_loop_cond_and_vmap():
    def ours(v):
        v = jax.lax.scan(lambda c, _: (mj.pmean(c) + 1.0, None), v, None, length=3)[0]
        v = jax.lax.fori_loop(0, 2, lambda _, c: mj.psum(c) / SIZE, v)
        v = jax.lax.cond(v[0] > -100, mj.psum, lambda c: c, v)
        return jax.vmap(mj.pmax)(jnp.stack([v, -v]))

    def theirs(v):
        v = jax.lax.scan(lambda c, _: (jax.lax.pmean(c, "i") + 1.0, None), v, None, length=3)[0]
        v = jax.lax.fori_loop(0, 2, lambda _, c: jax.lax.psum(c, "i") / SIZE, v)
        v = jax.lax.cond(v[0] > -100, lambda c: jax.lax.psum(c, "i"), lambda c: c, v)
        return jax.vmap(lambda c: jax.lax.pmax(c, "i"))(jnp.stack([v, -v]))

    got, want = ours_and_pmap(jax.jit(ours), theirs, data)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_grad_and_jvp_follow_jax_rules_and_pmax_has_none():
    loss = lambda psum: lambda v: jnp.sum(jnp.sin(psum(v)) * v)  # noqa: E731
    got, want = ours_and_pmap(
        jax.jit(jax.grad(loss(mj.psum))),
        jax.grad(loss(lambda v: jax.lax.psum(v, "i"))),
        data,
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    tangent = jnp.ones(7)
    got, want = ours_and_pmap(
        lambda v: jax.jvp(mj.psum, (v,), (tangent,))[1],
        lambda v: jax.jvp(lambda u: jax.lax.psum(u, "i"), (v,), (tangent,))[1],
        data,
    )
    np.testing.assert_array_equal(got, want)
    with pytest.raises(NotImplementedError, match="Differentiation rule"):
        jax.grad(lambda v: jnp.sum(mj.pmax(v)))(data(RANK))


def test_normalization_by_pmean():
    """docs/jax.md: an array normalized by the mean and variance over every rank's elements."""

    def normalize(pmean):
        def f(v):
            mean = pmean(jnp.mean(v))
            return (v - mean) / jnp.sqrt(pmean(jnp.mean((v - mean) ** 2)))

        return f

    got, want = ours_and_pmap(
        jax.jit(normalize(mj.pmean)), normalize(lambda v: jax.lax.pmean(v, "i")), data
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_grouped_reductions_on_a_mesh_axis():
    """axis_index_groups as in JAX: the even ranks and the odd ones each reduce among themselves
    (groups of one size, as JAX's pmap takes them); groups of unequal sizes (JAX's pmean divides
    by one size for all) against numpy: each rank divides by its own group's size."""
    pairs = [list(range(0, SIZE, 2)), list(range(1, SIZE, 2))]
    groups = pairs if SIZE % 2 == 0 else [list(range(SIZE))]
    with mar.Mesh((SIZE,), ("data",)):
        got, want = ours_and_pmap(
            jax.jit(lambda v: mj.pmean(v, "data", axis_index_groups=groups)),
            lambda v: jax.lax.pmean(v, "i", axis_index_groups=groups),
            data,
        )
        np.testing.assert_allclose(got, want, rtol=1e-6)
        if SIZE > 2 and SIZE % 2:
            mine = pairs[RANK % 2]
            got = jax.jit(lambda v: mj.pmean(v, "data", axis_index_groups=pairs))(data(RANK))
            want = np.mean([np.asarray(data(r)) for r in mine], axis=0)
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_nested_axes_mix_a_vmap_axis_with_the_process_axis():
    """mj.psum(x, ("batch", "data")): the vmap axis by lax.psum, the ranks by MPI, one result."""
    rows = lambda r: jnp.stack([data(r), data(r) * 3 + 1])  # noqa: E731
    with mar.Mesh((SIZE,), ("data",)):
        got, want = ours_and_pmap(
            jax.jit(jax.vmap(lambda v: mj.psum(v, ("batch", "data")), axis_name="batch")),
            jax.vmap(lambda v: jax.lax.psum(v, ("batch", "i")), axis_name="batch"),
            rows,
        )
    np.testing.assert_array_equal(got, want)


def test_a_sharded_dot_product_sums_its_partial_results():
    a = lambda r: jnp.arange(6.0) + 6 * r  # noqa: E731 (each rank: its shard of a and of b)
    b = lambda r: jnp.cos(jnp.arange(6.0) + 6 * r)  # noqa: E731
    ours = jax.jit(lambda r: mj.psum(jnp.dot(a(r), b(r))))(RANK)
    whole = jnp.dot(
        jnp.concatenate([a(r) for r in range(SIZE)]),
        b_all := jnp.concatenate([b(r) for r in range(SIZE)]),
    )
    assert b_all.shape == (6 * SIZE,)
    np.testing.assert_allclose(ours, whole, rtol=1e-5)


def test_a_data_parallel_training_loop_equals_one_process_on_the_whole_batch():
    """Linear regression, 5 steps of SGD: each rank its shard of the batch, the gradients' mean by
    mj.pmean; the parameters equal one process's on the whole batch (within float32 rounding)."""
    key = jax.random.PRNGKey(0)
    xs = jax.random.normal(key, (SIZE * 8, 3))
    ys = xs @ jnp.array([1.5, -2.0, 0.5]) + 0.25

    def loss(params, x, y):
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    @jax.jit
    def step(params, x, y):
        grads = mj.pmean(jax.grad(loss)(params, x, y))
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    ours = whole = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    shard = slice(RANK * 8, RANK * 8 + 8)
    for _ in range(5):
        ours = step(ours, xs[shard], ys[shard])
        whole = jax.tree_util.tree_map(
            lambda p, g: p - 0.1 * g, whole, jax.grad(loss)(whole, xs, ys)
        )
    for name in ("w", "b"):
        np.testing.assert_allclose(ours[name], whole[name], rtol=1e-5, atol=1e-6)


def test_a_call_whose_result_is_unused_still_runs_in_program_order():
    """The ordered effect: XLA keeps both calls (the first's result unused), in program order."""
    f = jax.jit(lambda v: (mj.psum(v * 2), mj.psum(v))[1])
    text = f.lower(data(RANK)).compile().as_text()
    assert text.count('custom_call_target="mpiallreduce_allreduce"') == 2, text
    np.testing.assert_array_equal(f(data(RANK)), sum(data(r) for r in range(SIZE)))


def test_calls_that_differ_raise_on_every_rank_and_the_next_pairs_up():
    if SIZE == 1:
        pytest.skip("one rank cannot differ from itself")
    x = data(RANK, 7 if RANK else 8)
    with pytest.raises(
        Exception, match=r"SignatureMismatch: rank \d+: .*\n  rank 0: sum of \(8,\)"
    ):
        np.asarray(jax.jit(mj.psum)(x))
    np.testing.assert_array_equal(mj.psum(data(RANK)), sum(data(r) for r in range(SIZE)))


def test_bad_input_is_an_error_on_every_rank():
    """A call a rank cannot make (an integer mean) is compared like any other, then raised on every
    rank; given on one rank only, the others' calls differ from it: SignatureMismatch everywhere,
    naming the refusal, never a rank left waiting (before, the one rank raised alone at trace)."""
    with pytest.raises(Exception, match="refused: pmean of int32"):
        np.asarray(jax.jit(mj.pmean)(data(RANK, dtype=jnp.int32)))
    if SIZE > 1:
        x = data(RANK, dtype=jnp.int32 if RANK == SIZE - 1 else jnp.float32)
        with pytest.raises(
            Exception, match=rf"SignatureMismatch(.|\n)*rank {SIZE - 1}: refused: pmean"
        ):
            np.asarray(jax.jit(mj.pmean)(x))
        x = data(RANK, dtype=jnp.float8_e4m3fn if RANK == 0 else jnp.float32)
        with pytest.raises(Exception, match=r"SignatureMismatch(.|\n)*rank 0: refused: .*float8"):
            np.asarray(mj.psum(x))
    np.testing.assert_array_equal(mj.psum(data(RANK)), sum(data(r) for r in range(SIZE)))
    with mar.Mesh((SIZE,), ("data",)):
        with pytest.raises(NameError, match="unknown axis name 'model'"):
            jax.jit(lambda v: mj.psum(v, "model"))(data(RANK))
        with pytest.raises(ValueError, match="group"):
            mj.psum(data(RANK), "data", axis_index_groups=[[0], [0]])


def test_bool_and_16_bit_and_unusual_dtypes_as_jax_has_them():
    """bool: a psum counts (int32), pmax/pmin stay bool; float16 and float32 calls on different
    ranks differ (the 16-bit one is widened, but compared as itself); a dtype the handler does not
    take (float8) is refused on every rank alike."""
    flags = lambda r: (jnp.arange(5) + r) % 3 == 0  # noqa: E731
    for name in ("psum", "pmax", "pmin"):
        got, want = ours_and_pmap(
            jax.jit(getattr(mj, name)), lambda v, n=name: getattr(jax.lax, n)(v, "i"), flags
        )
        assert got.dtype == want.dtype and np.array_equal(got, want), (name, got, want)
    with pytest.raises(Exception, match="refused: .*float8"):
        np.asarray(mj.psum(jnp.ones(3, jnp.float8_e4m3fn)))
    if SIZE > 1:
        x = jnp.ones(3, jnp.float16 if RANK == 0 else jnp.float32)
        with pytest.raises(Exception, match=r"rank 0: sum of \(3,\) float16"):
            np.asarray(jax.jit(mj.psum)(x))


def test_no_axis_reduces_nothing_and_weak_types_stay_weak():
    np.testing.assert_array_equal(mj.psum(data(RANK), ()), data(RANK))
    weak = jax.jit(mj.psum)(2.0)  # (a Python float: weakly typed, as lax.psum keeps it)
    assert weak.weak_type and (weak + jnp.ones(2, jnp.float16)).dtype == jnp.float16


def test_the_signature_is_compared_whatever_the_size_threshold(use_settings):
    """With MPIALLREDUCE_SIGNATURE_MIN_BYTES above one rank's size and below another's, every rank
    still compares (a rank that did not would run its data against the others' comparison)."""
    if SIZE == 1:
        pytest.skip("one rank cannot differ from itself")
    use_settings(signature_min_bytes=64)
    x = data(RANK, 4 if RANK == 0 else 40)
    with pytest.raises(Exception, match="SignatureMismatch"):
        np.asarray(jax.jit(mj.psum)(x))
    use_settings(signature_min_bytes=0)
    np.testing.assert_array_equal(mj.psum(data(RANK)), sum(data(r) for r in range(SIZE)))


def test_a_compiled_call_keeps_its_ranks_after_their_communicator_is_freed():
    """The program holds its communicator's handle: a duplicate freed with the user's
    communicator would hand that handle to the next one made (the ranks alone, here)."""
    comm = WORLD.Dup()
    f = jax.jit(lambda v: mj.allreduce(v, comm=comm))
    want = sum(data(r) for r in range(SIZE))
    np.testing.assert_array_equal(f(data(RANK)), want)
    comm.Free()
    alone = [WORLD.Split(RANK, 0).Dup() for _ in range(3)]  # (new communicators, one rank each)
    np.testing.assert_array_equal(f(data(RANK)), want)
    for c in alone:
        c.Free()


HANDLER = ("mpi", "exchange", "ring", "recursive_doubling", "reduce_bcast", "shared_memory")
#: docs/jax.md's table: what the handler runs for the planner's choice (the rest: mpi)
RUNS = {
    "dissemination": "exchange",
    "ring_pipelined": "ring",
    "rabenseifner": "ring",
    "pairwise_exchange": "ring",
    **{name: name for name in HANDLER},
}


def same_bits_everywhere(result):
    """Every rank's result, gathered: the same bytes on every rank."""
    mine = np.asarray(result).tobytes()
    return all(theirs == mine for theirs in WORLD.allgather(mine))


@pytest.mark.parametrize("algorithm", HANDLER)
def test_each_handler_algorithm_matches_numpy_at_every_size(algorithm):
    """Each algorithm of the handler, named, at sizes that split unevenly over the ranks (and
    none), for each op and kind of dtype: numpy's reduction of every rank's input, the same bits
    on every rank."""
    cases = [("sum", jnp.float32), ("max", jnp.int64), ("min", jnp.float64), ("sum", jnp.complex64)]
    if algorithm == "shared_memory" and SIZE > 1 and not shares_memory():
        with pytest.raises(ValueError, match="needs the ranks on one node"):
            jax.jit(lambda v: mj.allreduce(v, algorithm=algorithm))(data(RANK))
        return
    largest = 30000 if algorithm == "shared_memory" else 40000  # (its regions: 256 KiB a call)
    for n in (0, 1, 5, 1001, largest):
        for op, dtype in cases:
            make = lambda r, n=n, dtype=dtype: data(r, n, dtype)  # noqa: E731
            f = jax.jit(lambda v, op=op: mj.allreduce(v, op=op, algorithm=algorithm))
            got = f(make(RANK))
            every = np.stack([np.asarray(make(r)) for r in range(SIZE)])
            want = {"sum": every.sum(0), "max": every.max(0), "min": every.min(0)}[op]
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{op} {dtype} n={n}")
            assert same_bits_everywhere(got), (algorithm, op, dtype, n)


def shares_memory():
    """Whether this run's ranks compare in shared memory (one node, more than one rank, not under
    ULFM), as core.state decides: then the handler has shared regions."""
    from mpiallreduce.core.state import state_of
    from mpiallreduce.faults.ulfm import fault_tolerant

    one_node = state_of(WORLD).make_ready().facts.node_count == 1
    return one_node and SIZE > 1 and not fault_tolerant()


def test_shared_memory_takes_calls_up_to_its_regions_data():
    """shared_memory holds a call of its regions' data at most (slots.DATA_BYTES) and refuses a
    larger one by name, on every rank alike; the largest it takes is right."""
    if not shares_memory():
        pytest.skip("the ranks share no regions here")
    from mpiallreduce.jax.slots import DATA_BYTES

    n = DATA_BYTES // 4
    f = jax.jit(lambda v: mj.allreduce(v, algorithm="shared_memory"))
    got = f(data(RANK, n))
    np.testing.assert_array_equal(got, sum(np.asarray(data(r, n)) for r in range(SIZE)))
    with pytest.raises(ValueError, match=f"at most {DATA_BYTES} bytes a call"):
        f(data(RANK, n + 1))


def test_calls_that_differ_across_the_headers_room_raise_and_need_no_timeout():
    """An exchange whose input fits the arrival's header on one rank and not on another: every
    rank raises SignatureMismatch at once (on one node both arrive through the shared regions,
    elsewhere both in messages), not a hang nor a timeout; the next call pairs up."""
    if SIZE == 1:
        pytest.skip("one rank has no peer to differ from")
    comm = WORLD.Dup()
    n = 16 if RANK == 0 else 2048  # (64 bytes, inside the header; 8 KiB, past it)
    f = jax.jit(lambda v: mj.allreduce(v, comm=comm, algorithm="exchange"))
    with pytest.raises(Exception, match="SignatureMismatch"):
        np.asarray(f(data(RANK, n)))
    np.testing.assert_array_equal(f(data(RANK, 9)), sum(data(r, 9) for r in range(SIZE)))


def test_calls_that_move_nothing_keep_the_regions_turns_with_the_comparison_off(use_settings):
    """With the comparison off, a call of no elements between two shared_memory calls still
    meets every peer (on one node every call arrives through the regions), so no rank writes a
    half that a slower peer still reads: every result right, on every rank."""
    if not shares_memory():
        pytest.skip("the ranks share no regions here")
    use_settings(signature_min_bytes=-1)
    comm = WORLD.Dup()
    n, steps = 8192, 100

    def body(bad, i):
        x = jnp.full((n,), (i + 1).astype(jnp.float32) * (RANK + 1), jnp.float32)
        y = mj.allreduce(x, comm=comm, algorithm="shared_memory")
        mj.allreduce(jnp.zeros((0,), jnp.float32), comm=comm, algorithm="mpi")
        return bad + jnp.sum(y != (i + 1).astype(jnp.float32) * (SIZE * (SIZE + 1) // 2)), None

    f = jax.jit(lambda: jax.lax.scan(body, jnp.int32(0), jnp.arange(steps))[0])
    assert [int(f()) for _ in range(3)] == [0, 0, 0]


def test_auto_runs_the_planners_choice_mapped_onto_the_handlers(use_settings):
    """A small compared call carries its signature (exchange); one not compared runs MPI's own;
    a large one runs what the planner picks for an in-place numpy call of its size (describe_call),
    mapped as docs/jax.md's table says."""
    if SIZE == 1:
        pytest.skip("one rank runs no algorithm")
    from mpiallreduce.jax.handler import trace_records

    def ran(x):
        before = trace_records()[-1]["call"] if trace_records() else None
        np.asarray(jax.jit(mj.psum)(x))
        last = trace_records()[-1]
        assert last["call"] != before or before is None
        return last["algorithm"]

    assert ran(jnp.ones(1)) == "exchange"
    use_settings(signature_min_bytes=-1)
    assert ran(jnp.ones(2)) == "mpi"
    use_settings(signature_min_bytes=0)
    for n in (1 << 20, 1 << 22):
        x = np.zeros(n, np.float32)
        planned = mar.describe_call(x, out=x).split()[0]
        assert ran(jnp.ones(n)) == RUNS.get(planned, "mpi"), (n, planned)


def test_a_late_rank_is_named_and_every_rank_raises_then_the_communicator_stays_broken():
    """Timed calls end alike: the ranks that came wait the timeout and name the late rank
    (AllreduceTimeout); the late rank learns that they gave up (AllreduceAborted naming them);
    no rank returns a result; later calls on that communicator raise at once everywhere."""
    if SIZE == 1:
        pytest.skip("one rank cannot be late for itself")
    import time

    comm = WORLD.Dup()
    f = jax.jit(lambda v: mj.allreduce(v, comm=comm, timeout=1.0))
    np.testing.assert_array_equal(f(data(RANK)), sum(data(r) for r in range(SIZE)))
    late = SIZE - 1
    if late == RANK:
        time.sleep(2.5)
    with pytest.raises(Exception) as raised:
        np.asarray(f(data(RANK)))
    if late == RANK:
        assert "AllreduceAborted" in str(raised.value), raised.value
        assert f"rank(s) {', '.join(map(str, range(SIZE - 1)))} gave the call up" in str(
            raised.value
        )
    else:
        assert f"AllreduceTimeout: rank {RANK}: rank(s) {late} did not arrive" in str(raised.value)
    WORLD.Barrier()
    with pytest.raises(Exception, match="an earlier mpiallreduce.jax call on this communicator"):
        np.asarray(f(data(RANK)))
    np.testing.assert_array_equal(mj.psum(data(RANK)), sum(data(r) for r in range(SIZE)))


def test_on_one_node_calls_arrive_through_shared_memory_across_nodes_in_messages():
    """The handler's arrival (the codes compared, a small exchange's input) goes through shared
    regions where the ranks share a node and the core compares in shared memory too, else in
    MPI messages; either way the results, a mismatch and a late rank's error are those of the
    tests above (which run on one node and across emulated nodes)."""
    from mpiallreduce.jax import slots

    comm = WORLD.Dup()
    before = len(slots._made)
    f = jax.jit(lambda v: mj.psum(v) + mj.allreduce(v * 2, comm=comm))
    np.testing.assert_array_equal(f(data(RANK)), 3 * sum(data(r) for r in range(SIZE)))
    assert (len(slots._made) > before) == shares_memory(), (len(slots._made), before)
    g = jax.jit(lambda v: mj.allreduce(v, comm=comm))
    if SIZE > 1:  # (one rank has no peer to differ from)
        with pytest.raises(Exception, match="SignatureMismatch"):
            np.asarray(g(jnp.zeros(3 + (RANK == 0))))
    np.testing.assert_array_equal(g(data(RANK, 5000)), sum(data(r, 5000) for r in range(SIZE)))


def test_the_flight_recorder_dumps_the_compiled_calls(use_settings, tmp_path_factory):
    """The handler's records reach the recorder's dump: each compiled call with its shape, dtype,
    op, algorithm and state, and a mismatch as a failed call that ``mpiallreduce trace`` names."""
    use_settings(trace_entries=64)
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("jax-trace")) if RANK == 0 else None)
    np.asarray(jax.jit(mj.pmax)(data(RANK, 9)))
    if SIZE > 1:
        with pytest.raises(Exception, match="SignatureMismatch"):
            np.asarray(jax.jit(mj.psum)(data(RANK, 5 if RANK == 0 else 6)))
    import json

    path = mar.dump_trace(directory=folder)
    with open(path) as dumped:
        entries = [e for e in json.load(dumped)["entries"] if e["comm_id"].startswith("jax ")]
    maxed = [e for e in entries if e.get("op") == "max" and e["shape"] == [9]]
    assert maxed and maxed[-1]["state"] == "done" and maxed[-1]["dtype"] == "float32"
    assert maxed[-1]["algorithm"] in HANDLER and maxed[-1]["comm"] == list(range(SIZE))
    if SIZE > 1:
        failed = entries[-1]
        assert failed["state"] == "failed" and failed["error"]["type"] == "SignatureMismatch"
        WORLD.Barrier()
        if RANK == 0:
            from mpiallreduce.tools.trace import analyze, load_dumps

            report = "\n".join(analyze(load_dumps(folder)).lines)
            assert "different signatures" in report, report


@pytest.mark.parametrize("algorithm", HANDLER)
def test_the_same_bits_everywhere_for_signed_zeros_and_nan_payloads(algorithm):
    """max and min of +0.0 and -0.0, and sums of NaNs whose payloads differ by rank: the order of
    the operands decides the bits, so every rank must reduce in one order (a review found
    recursive_doubling and a 2-rank exchange giving +0.0 on one rank and -0.0 on another)."""
    zeros = jnp.asarray(np.array([0.0 if RANK % 2 == 0 else -0.0] * 3, np.float32))
    nans = jnp.asarray(np.array([0x7FC00001 + RANK] * 3, np.uint32).view(np.float32))
    for op, x in (("max", zeros), ("min", zeros), ("sum", nans)):
        got = jax.jit(lambda v, op=op: mj.allreduce(v, op=op, algorithm=algorithm))(x)
        assert same_bits_everywhere(got), (algorithm, op, np.asarray(got).view(np.uint32))


def test_a_large_mismatch_raises_and_a_refused_first_call_does_not_hang():
    """Sizes that differ above MPI's eager limit (2000 against 2001 floats: exchange's messages
    went past a shorter receive's end, corrupting the heap, before each was probed first); and a
    call refused on one rank as the first call on a fresh communicator (the others' first call
    made its state ready at trace, which the refused one skipped: both hung)."""
    if SIZE == 1:
        pytest.skip("one rank cannot differ from itself")
    with pytest.raises(Exception, match="SignatureMismatch"):
        np.asarray(jax.jit(mj.psum)(jnp.ones(2000 if RANK == 0 else 2001)))
    comm = WORLD.Dup()
    x = jnp.ones(5, jnp.int32 if RANK == 0 else jnp.float32)
    with pytest.raises(Exception, match="SignatureMismatch|refused"):
        np.asarray(jax.jit(lambda v: mj.allreduce(v, op="mean", comm=comm))(x))
    np.testing.assert_array_equal(
        jax.jit(lambda v: mj.allreduce(v, comm=comm))(data(RANK)),
        sum(data(r) for r in range(SIZE)),
    )


def test_mar_allreduce_takes_jax_arrays_as_numpy_arrays_are_taken():
    """mpiallreduce.allreduce hands a jax array to mpiallreduce.jax: MPI's op names too, a bad
    timeout refused as for numpy arrays, what a jax array cannot take said."""
    from mpi4py import MPI as _MPI

    want = sum(data(r) for r in range(SIZE))
    np.testing.assert_array_equal(mar.allreduce(data(RANK)), want)
    np.testing.assert_array_equal(mar.allreduce(data(RANK), op=_MPI.SUM), want)
    np.testing.assert_array_equal(jax.jit(lambda v: mar.allreduce(v, op="max"))(data(RANK)),
                                  np.max([data(r) for r in range(SIZE)], axis=0))  # fmt: skip
    with pytest.raises(ValueError, match="timeout"):
        mar.allreduce(data(RANK), timeout=0)
    with pytest.raises(ValueError, match="sum, mean, max or min"):
        mar.allreduce(data(RANK), op="prod")
    with pytest.raises(TypeError, match="out"):
        mar.allreduce(data(RANK), out=data(RANK))


def test_the_handler_runs_from_the_install_not_a_build_at_first_use(tmp_path, monkeypatch):
    """Issue 55, item 3: the XLA handler is built at install time (setup.py: make installs JAX,
    then the package), marked inside with what it was made from; at first use the install's build
    is the one found, and nothing is compiled into the cache. A build marked for another source
    (or JAX, or MPI) is not taken: then it is built at first use, as where the install had no
    JAX."""
    import mpiallreduce.jax.build as build
    from mpiallreduce.jax import handler

    library = handler.built_library()
    assert library in build.INSTALLED, (
        f"{library}: not the install's build; make test installs JAX, then the package without "
        "build isolation, which builds the handler (setup.py)"
    )
    monkeypatch.setenv("MPIALLREDUCE_CACHE", str(tmp_path))
    assert handler.built_library() == library and not list(tmp_path.iterdir())
    assert not build.is_made_by(library, "0.0.0", handler._mpi_family())
    assert not build.is_made_by(library, jax.__version__, "MPICH 4")


def test_without_the_installs_build_the_handler_is_built_once_at_first_use(tmp_path, monkeypatch):
    """Where the install built no handler (a plain ``pip install '.[jax]'`` builds without JAX),
    or built it for another source or JAX: the first use compiles it into MPIALLREDUCE_CACHE,
    marked as the install's would be, and later uses find it there. (At 1 rank: a compile.)"""
    import mpiallreduce.jax.build as build
    from mpiallreduce.jax import handler

    if SIZE != 1:
        pytest.skip("a compile of the handler: once, at 1 rank")
    monkeypatch.setenv("MPIALLREDUCE_CACHE", str(tmp_path))
    monkeypatch.setattr(handler, "installed", lambda *args: None)
    library = handler.built_library()
    assert library.parent == tmp_path and [p.name for p in tmp_path.iterdir()] == [library.name]
    assert build.is_made_by(library, jax.__version__, handler._mpi_family())
    assert handler.built_library() == library
