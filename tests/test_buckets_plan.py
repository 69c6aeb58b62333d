"""The bucket plan, the layout digest and the 16-bit wire formats, in one process (no MPI)."""

import itertools

import numpy as np
import pytest

from mpiallreduce.training.buckets import (
    Slot,
    digest_elements,
    digest_of,
    digests_agree,
    plan_buckets,
)
from mpiallreduce.training.compression import from_wire, to_wire


def slots(*specs):
    return [Slot(name, shape, dtype, False) for name, shape, dtype in specs]


def test_buckets_fill_in_the_given_order_one_open_bucket_per_kind_numbered_as_opened():
    layout = slots(
        ("a", (10,), "float32"),
        ("b", (10,), "float64"),
        ("c", (10,), "float16"),
        ("d", (30,), "float32"),
        ("e", (1,), "float64"),
    )
    buckets = plan_buckets(layout, 80, order=[4, 3, 2, 1, 0])
    # e (f8) opens bucket 0; d (f4, 120 B) fills bucket 1; c (f16, summed in f4) opens bucket 2;
    # b joins e (88 B: closed); a joins c
    assert [(b.members, b.dtype.name, b.count) for b in buckets] == [
        ((4, 1), "float64", 11),
        ((3,), "float32", 30),
        ((2, 0), "float32", 20),
    ]
    assert buckets[2].offsets == (0, 10)


def test_the_digest_check_fails_on_every_rank_whenever_any_two_digests_differ():
    """sum(d) = p d and sum(d*d) = p d*d for this rank's d only if every d is the same."""
    digests = [
        digest_of(("ready",)),
        digest_of(("not marked ready",)),
        digest_of(("ready", ("x",))),
    ]
    assert len(set(digests)) == 3
    for p in (1, 2, 3, 5):
        for combination in itertools.product(digests, repeat=p):
            summed = sum(digest_elements(d).astype(np.float32) for d in combination)
            verdicts = [digests_agree(summed, d, p) for d in combination]
            assert all(verdicts) == (len(set(combination)) == 1), combination
            assert len(set(verdicts)) == 1, ("ranks would disagree", combination)


def test_bfloat16_encoding_rounds_as_ml_dtypes_does_specials_included():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.standard_normal(10000).astype(np.float32) * np.float32(1e3),
            np.array(
                [0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, 1.00390625, 1.01171875],
                np.float32,
            ),
            rng.integers(0, 2**32, 10000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        ]
    )
    finite = ~np.isnan(values)
    with np.errstate(invalid="ignore"):
        want = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    got = to_wire(values, "bf16")
    assert np.array_equal(got[finite], want[finite])
    assert np.all(np.isnan(from_wire(got[~finite], "bf16")))
    assert np.array_equal(
        from_wire(want[finite], "bf16"),
        values[finite].astype(ml_dtypes.bfloat16).astype(np.float32),
    )


def test_float16_encoding_is_numpys():
    values = np.array([1.0, 65504.0, 70000.0, 1e-8, -2.5, np.nan], np.float32)
    decoded = from_wire(to_wire(values, "fp16"), "fp16")
    with np.errstate(over="ignore"):
        assert np.array_equal(decoded[:5], values[:5].astype(np.float16).astype(np.float32))
    assert np.isinf(decoded[2]) and np.isnan(decoded[5])


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_torchs_conversions_give_numpys_bits(compression, monkeypatch):
    """The compressed allreduce converts with torch when the program has imported it, else with
    numpy: the same bits either way (NaN payloads aside)."""
    torch = pytest.importorskip("torch")
    from mpiallreduce.training import compression as module

    values = np.random.default_rng(1).standard_normal(5000).astype(np.float32) * np.float32(300)
    encoded = {}
    for name, found in (("torch", torch), ("numpy", None)):
        monkeypatch.setattr(module, "_torch", lambda found=found: found)
        encoded[name] = np.empty(values.size, np.uint16)
        module._encode_into(encoded[name], values, compression)
        total = np.ones(values.size, np.float32)
        module._decode_into(total, encoded[name], compression, accumulate=True)
        assert np.array_equal(total, np.float32(1) + from_wire(encoded[name], compression))
    assert np.array_equal(encoded["torch"], encoded["numpy"])


def test_a_ranks_share_of_cores_counts_the_ranks_of_its_machine_that_may_run_on_them():
    from mpiallreduce.core.machine import share_of_cores

    a, b = frozenset({0, 1}), frozenset({2, 3})
    everyone = [
        ("m1", a),
        ("m1", a),
        ("m1", b),
        ("m2", a),
    ]  # two ranks unbound on 0-1, one on 2-3, one elsewhere
    assert share_of_cores(("m1", a), everyone) == 1.0  # 2 cores, 2 ranks
    assert share_of_cores(("m1", b), everyone) == 2.0  # 2 cores to itself: a core to spare
    assert share_of_cores(("m2", a), everyone) == 2.0  # alone on its machine
    assert share_of_cores(("m1", frozenset({1, 2})), everyone + [("m1", frozenset({1, 2}))]) == 0.5
