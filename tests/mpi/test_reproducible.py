"""reproducible=True on every rank: one set of bits whatever the algorithm, segment, bucket, rank
order or zero ranks, within the stated bound of the exact sum."""

import hashlib
from fractions import Fraction

import numpy as np
import pytest
from mpi4py import MPI
from reference import runs_here

import mpiallreduce as mar

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD
ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = ["float16", "bfloat16", "float32", "float64"]


def as_dtype(values, name):
    return values.astype(ml_dtypes.bfloat16 if name == "bfloat16" else name)


def contribution(rank, name, count=2000):
    """Magnitudes over 6 decades, both signs: rank- and index-dependent."""
    rng = np.random.default_rng([rank, count])
    return as_dtype(rng.standard_normal(count) * 10.0 ** rng.integers(-3, 3, count), name)


def digest(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def same_everywhere(comm, value):
    everyone = comm.allgather(value)
    return all(v == everyone[0] for v in everyone)


@pytest.mark.parametrize("name", DTYPES)
def test_every_algorithm_in_place_or_not_gives_one_set_of_bits(comm, name):
    """The direct route (pairwise_exchange, shared_memory, auto) and the words route (every
    other)."""
    x = contribution(comm.Get_rank(), name)
    digests = set()
    for algorithm in [a for a in list(mar.HOST_ALGORITHMS) + ["auto"] if runs_here(a, comm)]:
        digests.add(digest(mar.allreduce(x, algorithm=algorithm, comm=comm, reproducible=True)))
        in_place = x.copy()
        mar.allreduce(in_place, algorithm=algorithm, comm=comm, out=in_place, reproducible=True)
        digests.add(digest(in_place))
    digests.add(digest(mar.allreduce_async(x, comm=comm, reproducible=True).wait()))
    assert len(digests) == 1, digests
    assert same_everywhere(comm, digests.pop())


@pytest.mark.one_node("single copy needs one node")
@pytest.mark.parametrize("name", DTYPES)
def test_on_symmetric_buffers_single_copy_gives_the_same_bits(comm, name):
    """Symmetric buffers (mpiallreduce.empty): from 64 KiB auto runs single_copy, each rank summing
    its slice exactly straight from its peers' inputs; by name as well, in place and not, prepared
    and not, sum and mean: the bits of the ordinary arrays' algorithms (the direct and the words
    route)."""
    count = 40_000  # (80 KiB of float16 and bfloat16: from 64 KiB for every dtype)
    x = contribution(comm.Get_rank(), name, count)
    x[7::97] = 0  # (zeros: the elements whose largest is 0)
    dtype = x.dtype
    buffer = mar.empty(2 * count, dtype, comm=comm)
    send, out = buffer[:count], buffer[count:]
    for op in ("sum", "mean"):
        digests = set()
        for algorithm in ("pairwise_exchange", "ring"):
            digests.add(
                digest(mar.allreduce(x, op=op, algorithm=algorithm, comm=comm, reproducible=True))
            )
        for algorithm in ("auto", "single_copy"):
            send[...] = x
            if comm.Get_size() > 1:
                plan = mar.describe_call(
                    send, op=op, algorithm=algorithm, comm=comm, out=out, reproducible=True
                )
                assert "single_copy" in plan and "reproducible direct" in plan, plan
            assert (
                mar.allreduce(
                    send, op=op, algorithm=algorithm, comm=comm, out=out, reproducible=True
                )
                is out
            )
            assert np.array_equal(send.view(np.uint8), x.view(np.uint8))  # (the input untouched)
            digests.add(digest(out))
            out[...] = 0
            prepared = mar.prepare(
                send, op=op, algorithm=algorithm, comm=comm, out=out, reproducible=True
            )
            for _ in range(2):  # (a prepared call, run twice: the same bits)
                assert prepared() is out
                digests.add(digest(out))
            mar.allreduce(send, op=op, algorithm=algorithm, comm=comm, out=send, reproducible=True)
            digests.add(digest(send))
        digests.add(
            digest(mar.prepare(x, op=op, comm=comm, reproducible=True)())
        )  # (numpy arrays: not single_copy)
        assert len(digests) == 1, (op, digests)
        assert same_everywhere(comm, digests.pop())


def test_segment_sizes_do_not_change_the_bits(comm, use_settings):
    x = contribution(comm.Get_rank(), "float32", 300_000)
    digests = set()
    for segment in (4096, 65536, 1 << 20):
        use_settings(ring_segment_bytes=segment)
        for algorithm in (
            "ring_pipelined",
            "pairwise_exchange",
        ):  # (the words route; the direct route)
            digests.add(digest(mar.allreduce(x, algorithm=algorithm, comm=comm, reproducible=True)))
    assert len(digests) == 1


def test_bucket_sizes_and_fusion_do_not_change_the_bits(comm):
    rank = comm.Get_rank()
    shapes = [
        (3000,),
        (7,),
        (40, 30),
        (1,),
        (140_000,),
        (5, 5),
    ]  # one of them large enough to go in place
    digests = set()
    for bucket_bytes in (100, 4096, 1 << 20, 25 << 20):
        grads = {
            f"g{i}": contribution(rank + 10 * i, "float32", int(np.prod(s))).reshape(s)
            for i, s in enumerate(shapes)
        }
        sync = mar.GradientSync(
            comm=comm, parameters=grads, bucket_bytes=bucket_bytes, op="mean", reproducible=True
        )
        for name in reversed(list(grads)):
            sync.ready(grads[name], name=name)
        sync.wait()
        digests.add(digest(np.concatenate([g.reshape(-1) for g in grads.values()])))
    assert len(digests) == 1


def test_a_permuted_communicator_gives_the_same_bits(comm):
    """The same contributions held by other ranks (a Split with the ranks' order reversed)."""
    reversed_comm = comm.Split(0, key=-comm.Get_rank())
    try:
        x = contribution(comm.Get_rank(), "float32")
        assert np.array_equal(
            mar.allreduce(x, comm=comm, reproducible=True).view(np.uint32),
            mar.allreduce(x, comm=reversed_comm, reproducible=True).view(np.uint32),
        )
    finally:
        reversed_comm.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("name", DTYPES)
def test_two_ranks_equal_four_ranks_of_which_two_add_zeros(name):
    rank = WORLD.Get_rank()
    pair = WORLD.Split(0 if rank < 2 else MPI.UNDEFINED, key=rank)
    four = WORLD.Split(0 if rank < 4 else MPI.UNDEFINED, key=rank)
    x = contribution(rank, name) if rank < 2 else as_dtype(np.zeros(2000), name)
    results = {}
    if pair != MPI.COMM_NULL:
        results["pair"] = digest(mar.allreduce(x, comm=pair, reproducible=True))
    if four != MPI.COMM_NULL:
        results["four"] = digest(mar.allreduce(x, comm=four, reproducible=True, algorithm="ring"))
    if rank < 2:
        assert results["pair"] == results["four"]
    for c in (pair, four):
        if c != MPI.COMM_NULL:
            c.Free()


def adversarial(rank, size, name):
    """Columns built to break naive summation (each a different hazard), then random values."""
    big = float(np.finfo(np.float32 if name != "float64" else np.float64).max) / 4
    tiny = float(np.finfo(np.float32 if name != "float64" else np.float64).smallest_subnormal)
    first = rank == 0
    last = rank == size - 1
    columns = [
        1e30 if first else (-1e30 if last else 1.0),  # huge cancellation
        2.0**30 if first else 2.0**-30,  # values 2^60 apart
        tiny * (rank + 1),  # subnormals
        -tiny if first else tiny,  # subnormals cancelling
        np.inf if first else 1.0,  # inf
        np.inf if first else (-np.inf if last else 0.0),  # inf - inf = NaN (p > 1)
        np.nan if last else 1.0,  # NaN
        -0.0,  # -0 everywhere: -0
        0.0 if last else -0.0,  # one +0: +0
        big,  # overflows (p > 4... or not)
        1.0 + 2.0**-23 * rank,  # ties in float32
    ]
    rng = np.random.default_rng([rank, 99])
    values = np.concatenate(
        [np.array(columns), rng.standard_normal(200) * 10.0 ** rng.integers(-20, 20, 200)]
    )
    with np.errstate(over="ignore"):
        return as_dtype(values, name)


def exact_sum(values):
    """IEEE addition's answer for specials, else the exact rational sum."""
    if any(np.isnan(values)) or (np.inf in values and -np.inf in values):
        return "nan"
    if np.inf in values or -np.inf in values:
        return float(np.inf if np.inf in values else -np.inf)
    if all(v == 0 for v in values):
        return -0.0 if all(np.signbit(values)) else 0.0
    return sum(Fraction(float(v)) for v in values)


@pytest.mark.parametrize("algorithm", ["auto", "ring"])  # (the direct route; the words route)
@pytest.mark.parametrize("name", DTYPES)
def test_adversarial_inputs_are_within_two_ulps_of_the_exact_sum_per_element(comm, name, algorithm):
    size = comm.Get_size()
    x = adversarial(comm.Get_rank(), size, name)
    with np.errstate(over="ignore", invalid="ignore"):
        result = mar.allreduce(x, comm=comm, reproducible=True, algorithm=algorithm).astype(
            np.float64
        )
    gathered = np.array(comm.allgather(x.astype(np.float64)))
    finfo = (
        np.finfo(np.float16)
        if name == "float16"
        else np.finfo(np.float32)
        if name != "float64"
        else np.finfo(np.float64)
    )
    bits = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}[name]
    for i in range(x.size):
        want = exact_sum(gathered[:, i])
        got = result[i]
        if want == "nan":
            assert np.isnan(got), i
            continue
        if isinstance(want, float) and (np.isinf(want) or want == 0):
            assert got == want and np.signbit(got) == np.signbit(want), (i, got, want)
            continue
        if abs(want) > Fraction(float(finfo.max)):
            continue  # the exact sum is past the largest finite: rounds to the largest or to inf
        scale = max(abs(want), max(Fraction(abs(float(v))) for v in gathered[:, i]))
        exponent = max(int(np.floor(np.log2(float(scale)))) if scale else 0, int(finfo.minexp))
        ulp = Fraction(2) ** (exponent - bits + 1)
        assert abs(Fraction(float(got)) - want) <= 2 * ulp, (i, got, float(want), gathered[:, i])


def test_mean_is_the_reproducible_sum_divided_and_arguments_are_checked(comm):
    x = contribution(comm.Get_rank(), "float32")
    total = mar.allreduce(x, comm=comm, reproducible=True)
    mean = mar.allreduce(x, op="mean", comm=comm, reproducible=True)
    assert np.allclose(mean, total / comm.Get_size(), rtol=2e-7, atol=0)
    with pytest.raises(TypeError, match="float16, bfloat16, float32 and float64"):
        mar.allreduce(np.ones(3, np.int32), reproducible=True)
    with pytest.raises(ValueError, match="'sum' and 'mean'"):
        mar.allreduce(np.ones(3), op="max", reproducible=True)


def test_with_check_a_call_refused_on_one_rank_is_refused_on_every_rank(comm):
    last = comm.Get_rank() == comm.Get_size() - 1
    x = np.ones(8, np.int32) if last else np.ones(8, np.float32)
    with pytest.raises(
        TypeError, match=rf"(?s)rejected on rank {comm.Get_size() - 1} .*float16, bfloat16, float32"
    ):
        mar.allreduce(x, comm=comm, reproducible=True, check=True)
    assert np.all(
        mar.allreduce(np.ones(8, np.float32), comm=comm, reproducible=True, check=True)
        == comm.Get_size()
    )


def test_a_repeated_reproducible_call_takes_the_short_path_with_the_same_bits(comm):
    """The second call of the same shape and dtype runs the short path of the direct route (no
    checks, no plan made again): the bits of the first call, and of the words route."""
    from mpiallreduce.core.state import state_of

    x = contribution(comm.Get_rank(), "float32", 70_000)
    first = digest(mar.allreduce(x, comm=comm, reproducible=True))
    again = [digest(mar.allreduce(x, comm=comm, reproducible=True)) for _ in range(2)]
    in_place = x.copy()
    mar.allreduce(in_place, comm=comm, out=in_place, reproducible=True)
    words = digest(mar.allreduce(x, comm=comm, reproducible=True, algorithm="ring"))
    assert {first, words, digest(in_place)} | set(again) == {first}
    if comm.Get_size() > 1:
        kept = state_of(comm).fast_calls
        assert (
            kept[(x.shape, x.dtype, "sum", "auto", False, True, np.ndarray)].plan.route
            == "reproducible direct"
        )
        assert (
            kept[(x.shape, x.dtype, "sum", "ring", False, True, np.ndarray)].plan.route
            == "reproducible words"
        )


def test_a_reproducible_sum_on_some_ranks_only_is_an_error_on_every_rank(comm):
    """Rank 0 asks for a reproducible sum, the others for an ordinary one (from 64 KiB the calls'
    signatures are compared): every rank raises naming the op, first call and repeated call."""
    if comm.Get_size() == 1:
        pytest.skip("one rank: nothing to compare")
    x = contribution(comm.Get_rank(), "float32", 70_000)
    for _ in range(2):
        with pytest.raises(ValueError, match="reproducible_sum"):
            mar.allreduce(x, comm=comm, reproducible=comm.Get_rank() == 0)
    assert digest(mar.allreduce(x, comm=comm, reproducible=True)) == digest(
        mar.allreduce(x, comm=comm, reproducible=True, algorithm="ring")
    )
