"""The reproducible sum's two conversion paths give the same integers and the same results.

Blocks whose largest exponents are all normal take the fast path (a rounding constant instead of
np.rint, the result rounded straight into the dtype); blocks holding a zero, subnormal, inf or NaN
largest take the general one. Which path an element takes depends on its neighbours (its block),
so a different bucket or fusion could move it from one to the other: their bits must agree."""

import numpy as np
import pytest

from mpiallreduce.reproducible import exact as reproducible
from mpiallreduce.reproducible import routes


def contributions(dtype, count, ranks, seed):
    """Values spread over many binades, with exact ties on the grid (1.5 and 2.5 grid steps below a
    contribution of 1.0 at every 4th element), and both signs."""
    fmt = reproducible.FORMATS[np.dtype(dtype).name]
    rng = np.random.default_rng(seed)
    spread = 12 if dtype == "float16" else 40
    rows = []
    for r in range(ranks):
        values = rng.standard_normal(count) * np.exp2(rng.integers(-spread, spread, count))
        if r == 0:
            values[::4] = 1.0
        else:
            step = 2.0 ** (1 - fmt.k)  # the grid under a largest of 1.0
            ties = rng.choice([1.5, 2.5, -1.5, -2.5, 3.5], values[::4].size) * step
            values[::4] = ties if dtype != "float16" else 0.25  # (float16 cannot hold 2^-50)
        rows.append(values.astype(dtype))
    return rows


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fast_and_general_paths_give_the_same_words_and_sums(dtype):
    fmt = reproducible.FORMATS[dtype]
    rows = contributions(dtype, 5000, 3, seed=1)
    largest = np.maximum.reduce([reproducible.exponent_codes(row, fmt) for row in rows])
    assert reproducible._all_normal(largest, fmt)
    words = []
    for row in rows:
        fast = np.empty(row.size, np.int64)
        scratch = (np.empty(row.size, np.int64), np.empty(row.size, np.float64))
        reproducible._to_words_normal_block(row, largest, fmt, scratch, fast)
        general = reproducible._to_words_block(row, largest, fmt)
        assert np.array_equal(fast, general)
        assert np.array_equal(reproducible.to_words(row, largest, fmt), general)
        words.append(fast)
    summed = np.sum(words, axis=0)
    bits = np.uint16 if dtype == "float16" else np.uint32
    for divide_by in (1, 3):  # (a sum, and a mean of 3 ranks)
        fast_result = reproducible.from_words(
            summed, largest, fmt, divide_by, dtype=np.dtype(dtype)
        )
        general_result = reproducible._from_words_block(summed, largest, fmt, divide_by).astype(
            dtype
        )
        assert np.array_equal(fast_result.view(bits), general_result.view(bits)), divide_by


def test_a_zero_in_the_block_changes_the_path_not_the_bits():
    """The same elements converted in a block of their own and in a block that also holds an
    all-zero element (so the general path): the same words for them, the same results."""
    fmt = reproducible.FORMATS["float32"]
    rows = contributions("float32", 3000, 2, seed=2)
    with_zero = [np.concatenate([row, np.zeros(1, np.float32)]) for row in rows]
    largest = np.maximum.reduce([reproducible.exponent_codes(row, fmt) for row in with_zero])
    assert not reproducible._all_normal(largest, fmt)
    alone = [reproducible.to_words(row, largest[:-1], fmt) for row in rows]
    mixed = [reproducible.to_words(row, largest, fmt) for row in with_zero]
    for a, m in zip(alone, mixed, strict=True):
        assert np.array_equal(a, m[:-1])
    summed_alone, summed_mixed = np.sum(alone, axis=0), np.sum(mixed, axis=0)
    assert np.array_equal(
        reproducible.from_words(summed_alone, largest[:-1], fmt, dtype=np.float32),
        reproducible.from_words(summed_mixed, largest, fmt, dtype=np.float32)[:-1],
    )


@pytest.mark.parametrize("divide_by", [1, 3])
def test_compiled_kernels_give_the_numpy_passes_bits(monkeypatch, divide_by):
    """numba's one-pass float32 conversions against the numpy passes, on blocks of every kind:
    normal ones with ties on the grid, and ones holding zeros, subnormals, infinities and NaN."""
    pytest.importorskip("numba")
    from mpiallreduce.reproducible import kernels as reproducible_kernels

    if not reproducible_kernels.available():
        pytest.skip("numba switched off (MPIALLREDUCE_REPRODUCIBLE_KERNELS=numpy)")
    fmt = reproducible.FORMATS["float32"]
    rows = contributions("float32", 3 * reproducible.BLOCK + 77, 3, seed=3)
    specials = np.array([0.0, -0.0, 1e-45, -3e-42, np.inf, -np.inf, np.nan], np.float32)
    for r, row in enumerate(rows):  # the second block gets a few of each special value
        row[reproducible.BLOCK + 5 : reproducible.BLOCK + 5 + specials.size] = np.roll(specials, r)

    def convert():
        codes = [reproducible.exponent_codes(row, fmt) for row in rows]
        largest = np.maximum.reduce(codes)
        words = [reproducible.to_words(row, largest, fmt) for row in rows]
        result = reproducible.from_words(
            np.sum(words, axis=0), largest, fmt, divide_by, dtype=np.float32
        )
        return codes, words, result

    compiled = convert()
    monkeypatch.setattr(reproducible, "_compiled", lambda fmt: None)
    passes = convert()
    for a, b in zip(compiled[0] + compiled[1], passes[0] + passes[1], strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(compiled[2].view(np.uint32), passes[2].view(np.uint32))


def words_route(rows, divide_by, dtype):
    """The words route played on one process: codes, their max, words, their sum, back."""
    fmt = reproducible.FORMATS[np.dtype(dtype).name]
    largest = np.maximum.reduce([reproducible.exponent_codes(row, fmt) for row in rows])
    summed = np.sum([reproducible.to_words(row, largest, fmt) for row in rows], axis=0)
    with np.errstate(over="ignore", invalid="ignore"):
        return reproducible.from_words(summed, largest, fmt, divide_by, dtype=np.dtype(dtype))


def with_specials(rows, tiny_at, special_at):
    """At ``tiny_at``, elements whose contributions are all zero or subnormal (+0, -0, every one -0,
    subnormals cancelling) and one with a normal largest and subnormal others; at ``special_at``
    inf, -inf, inf - inf and NaN."""
    p = len(rows)
    tiny = float(np.finfo(rows[0].dtype).smallest_subnormal)
    tiny_columns = [
        [0.0] * p,
        [-0.0] * p,
        [-0.0] * (p - 1) + [0.0],
        [tiny * (r + 1) * (-1) ** r for r in range(p)],
        [tiny] + [-tiny] * (p - 1),
        [1.0] + [tiny] * (p - 1),
    ]
    special_columns = [
        [np.inf] + [1.0] * (p - 1),
        [-np.inf] * p,
        [np.inf] + [-np.inf] * (p - 1),
        [np.nan] + [1.0] * (p - 1),
    ]
    for at, columns in ((tiny_at, tiny_columns), (special_at, special_columns)):
        for c, column in enumerate(columns):
            for r, row in enumerate(rows):
                row[at + c] = column[r]
    return rows


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
def test_the_direct_route_gives_the_words_route_bits(monkeypatch, dtype, ranks):
    """exact_sum_into (every contribution on one rank: shared memory, pairwise_exchange) against the
    words route played here, compiled and in numpy passes, sum and mean, into a new array and into
    the first contribution (in place). Zero and subnormal largests sit in one block (the compiled
    loop takes them), inf and NaN in another (the numpy passes do); the rest are normal."""
    rows = with_specials(
        contributions(dtype, 2 * reproducible.BLOCK + 77, ranks, seed=ranks),
        40,
        reproducible.BLOCK + 11,
    )
    bits = {"float16": np.uint16, "float32": np.uint32, "float64": np.uint64}[dtype]
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(reproducible, "_compiled", lambda fmt: None)
        for divide_by in (1, ranks):
            want = words_route(rows, divide_by, dtype).view(bits)
            got = routes.exact_sum_into(rows, np.empty_like(rows[0]), divide_by)
            assert np.array_equal(got.view(bits), want), (
                compiled,
                divide_by,
                np.nonzero(got.view(bits) != want),
            )
            in_place = [row.copy() for row in rows]
            routes.exact_sum_into(in_place, in_place[0], divide_by)
            assert np.array_equal(in_place[0].view(bits), want)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_compiled_direct_route_leaves_no_element_to_chance(ranks):
    """The compiled loops: the largest exponent of every element, normal or zero or subnormal, at
    every position, contributions up to 280 binades apart, exact cancellations, sum and mean: random
    values against the words route, over many blocks."""
    pytest.importorskip("numba")
    from mpiallreduce.reproducible import kernels as reproducible_kernels

    if not reproducible_kernels.available():
        pytest.skip("numba switched off (MPIALLREDUCE_REPRODUCIBLE_KERNELS=numpy)")
    rng = np.random.default_rng(11)
    count = 20 * reproducible_kernels.EXACT_BLOCK + 5
    rows = [
        (rng.standard_normal(count) * np.exp2(rng.integers(-160, 120, count))).astype(np.float32)
        for _ in range(ranks)
    ]
    rows[1][::9] = -rows[0][::9]  # exact cancellations
    rows[1][1::9] = rows[0][1::9] * np.float32(
        2.0**-28
    )  # (28 and 29 binades below: the grid rounds)
    rows[1][2::9] = rows[0][2::9] * np.float32(-1.5 * 2.0**-29)
    for row in rows:
        row[::13] = rng.choice(
            [0.0, -0.0, 1e-45, -1e-45, 1e-40], row[::13].size
        )  # zero or subnormal largests
    for divide_by in (1, ranks):
        want = words_route(rows, divide_by, "float32").view(np.uint32)
        got = routes.exact_sum_into(rows, np.empty(count, np.float32), divide_by).view(np.uint32)
        assert np.array_equal(got, want), (divide_by, np.nonzero(got != want))


def test_more_contributions_than_the_compiled_loop_takes_give_the_same_bits():
    """Past EXACT_MOST_CONTRIBUTIONS the direct route takes the words route's passes: 9 and 12
    contributions (zero and subnormal largests included) against the words route."""
    rng = np.random.default_rng(12)
    for p in (9, 12):
        rows = [
            (rng.standard_normal(5000) * np.exp2(rng.integers(-30, 30, 5000))).astype(np.float32)
            for _ in range(p)
        ]
        rows = with_specials(rows, 10, 3000)
        for divide_by in (1, p):
            want = words_route(rows, divide_by, "float32").view(np.uint32)
            got = routes.exact_sum_into(rows, np.empty(5000, np.float32), divide_by).view(np.uint32)
            assert np.array_equal(got, want), (p, divide_by)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_one_pass_loop_leaves_inf_and_nan_whole_for_the_numpy_passes(ranks):
    """The compiled one-pass loop (up to 4 contributions) lists the elements with an inf or NaN
    largest and leaves them as they were: here a third of the elements of 7 blocks (more than its
    room for indices at once), beside sums that overflow to inf from finite contributions, into a
    new array and in place into the first and the second contribution."""
    rng = np.random.default_rng(20 + ranks)
    count = 7 * 2048 + 3
    rows = [
        (rng.standard_normal(count) * np.exp2(rng.integers(-20, 20, count))).astype(np.float32)
        for _ in range(ranks)
    ]
    for r, row in enumerate(rows):
        row[r::3] = rng.choice([np.inf, -np.inf, np.nan], row[r::3].size)
        row[2::7] = np.float32(
            3e38
        )  # (every contribution finite where no inf or NaN fell: a sum of inf)
    for divide_by in (1, ranks):
        want = words_route(rows, divide_by, "float32").view(np.uint32)
        got = routes.exact_sum_into(rows, np.empty(count, np.float32), divide_by).view(np.uint32)
        assert np.array_equal(got, want), np.nonzero(got != want)
        for target in (0, 1):
            in_place = [row.copy() for row in rows]
            routes.exact_sum_into(in_place, in_place[target], divide_by)
            assert np.array_equal(in_place[target].view(np.uint32), want), (target, divide_by)


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_a_read_only_contribution_among_writeable_ones_sums_the_same(ranks):
    """pairwise_exchange hands this rank's own input (read-only where the user's is) beside its
    receive buffers: the compiled loops take the mix (numba indexes a tuple of one array type
    only)."""
    rows = contributions("float32", 3000, ranks, seed=30 + ranks)
    want = words_route(rows, 1, "float32").view(np.uint32)
    mixed = [row.copy() for row in rows]
    mixed[0].flags.writeable = False
    got = routes.exact_sum_into(mixed, np.empty(3000, np.float32)).view(np.uint32)
    assert np.array_equal(got, want)
