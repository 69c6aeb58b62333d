"""Reproducible sums: the same bits whatever the algorithm, segment size, bucket, rank order, or
ranks that contribute zeros (``allreduce(x, reproducible=True)``).

    step 1  exponents     each element's IEEE biased exponent E (0: zero or subnormal; all ones:
                          inf or NaN; 1 byte for float16, bfloat16, float32, 2 for float64); the
                          largest over the ranks, Emax
    step 2  fixed point   each contribution put on the grid q = 2^(Emax - bias + 1 - K), so that
                          |x| / q < 2^K, rounding x / q to the nearest integer (ties to even):
                          one int64 word (K = 51), or for float64 two words 40 bits apart (K = 81).
                          Where Emax is 0 the grid is the dtype's subnormal unit (exact) and a bit
                          field counts the contributions that are not -0; where Emax is all ones,
                          bit fields count +inf, -inf and NaN
    step 3  integer sum   the sum of the words (integers add exactly, in any order, and zeros add
                          nothing)
    step 4  back          sum * q, rounded once (float64: the two words' sum rounded once), then
                          to the dtype; -0 if every contribution was -0; inf, -inf or NaN as IEEE
                          addition says (+inf with -inf is NaN)

Two routes run these steps, with the same operations, so the same bits (mpiallreduce.core.planner
picks one; op ``EXACT_OPS[op]`` through the ordinary call path; the routes: ``routes``, the steps'
conversions: here):

    direct route  an algorithm in which one rank holds every contribution of an element, what
                  auto runs (shared_memory on one node below 4 MiB, else pairwise_exchange):
                  that rank runs steps 1-4 for its slice straight from the p floats
                  (exact_sum_into; compiled for float32). Bytes moved: an ordinary sum's
    words route   any other algorithm asked for by name: step 1 as a MAX-allreduce of the
                  exponent bytes, step 3 as a SUM-allreduce of the words (sum_by_words). Bytes:
                  1 + 8 per element against a float32 sum's 4 (float64: 2 + 16 against 8)

The result depends only on the multiset of contributions. Accuracy, per element, against the exact
sum S of its contributions, whose largest magnitude is M: each contribution moves by at most q/2
<= 2^-K M, so |result - S| <= p 2^-K M plus one rounding of S (float16, bfloat16 and float32 round
through float64: at most one ulp). With p <= 1024 ranks that is within 2 ulps of max(|S|, M),
whatever the dtype. Contributions within 2^(K-mantissa bits) of M lie on the grid exactly. Device
(CuPy) arrays go through the host.
"""

import functools
import sys

import numpy as np

from .kernel_switch import KERNELS_ENV  # noqa: F401 (its old path: reproducible.exact)

__all__ = [
    "REPRODUCIBLE_DTYPES",
    "MAX_RANKS",
    "FORMATS",
    "exponent_codes",
    "to_words",
    "from_words",
]

#: at most this many ranks: p * 2^51 must stay below 2^63 (and p * 2^41 below 2^53 for float64)
MAX_RANKS = 1024
FIELD = 40  # the bit where a word's count field starts (zero signs, NaN); -inf's count at bit 20
INF_FIELD = 20


class _Format:
    """An IEEE format's layout: bits, exponent position and width, bias, mantissa bits."""

    def __init__(self, bits, exponent_shift, exponent_bits, bias, mantissa_bits, words, k):
        self.bits, self.shift, self.exponent_bits = bits, exponent_shift, exponent_bits
        self.bias, self.mantissa_bits, self.words, self.k = bias, mantissa_bits, words, k
        self.all_ones = (1 << exponent_bits) - 1
        self.code = np.uint8 if exponent_bits <= 8 else np.uint16


FORMATS = {
    "float16": _Format(np.uint16, 10, 5, 15, 10, 1, 51),
    "bfloat16": _Format(np.uint16, 7, 8, 127, 7, 1, 51),
    "float32": _Format(np.uint32, 23, 8, 127, 23, 1, 51),
    "float64": _Format(np.uint64, 52, 11, 1023, 52, 2, 81),
}
REPRODUCIBLE_DTYPES = tuple(FORMATS)


def _compiled(fmt):
    """mpiallreduce.reproducible.kernels (numba, float32) where it applies, else None."""
    return _kernels() if fmt.bits is np.uint32 else None


def compiled_kernels(fmt):  # (``_compiled``, looked up at each call: tests replace it)
    return _compiled(fmt)


@functools.cache
def _kernels():  # (imported once, on first use: numba's import takes a while)
    import mpiallreduce.reproducible.kernels as kernels  # (the module, not the package's names)

    return kernels if kernels.available() else None


@functools.cache
def _scale_tables(bias, k):
    from .kernels import scale_tables

    return scale_tables(bias, k)


def exponent_codes(values, fmt, out=None):
    """Each element's biased exponent (0..all ones), as fmt.code (into ``out`` if given)."""
    kernels = _compiled(fmt)
    if kernels is not None and values.flags.c_contiguous:
        codes = np.empty(values.shape, np.uint8) if out is None else out
        kernels.exponent_codes_f32(values.reshape(-1).view(np.uint32), codes.reshape(-1))
        return codes
    if fmt.bits is np.uint32 and values.flags.c_contiguous and sys.byteorder == "little":
        # float32: the high 16 bits hold sign and exponent; shifted right by 7 the exponent is the
        # low byte, which the cast to uint8 keeps (two passes over half the bytes)
        high = values.reshape(-1).view(np.uint16)[1::2]
        codes = np.right_shift(high, 7).astype(np.uint8).reshape(values.shape)
    else:
        codes = ((values.view(fmt.bits) >> fmt.shift) & fmt.all_ones).astype(fmt.code)
    if out is None:
        return codes
    np.copyto(out.reshape(codes.shape), codes)
    return out


def _grid_exponents(largest, fmt):
    """log2 of each element's grid q, from the largest exponent code (as int64)."""
    largest = largest.astype(np.int64)
    subnormal_unit = 1 - fmt.bias - fmt.mantissa_bits
    return np.where(largest == 0, subnormal_unit, largest - fmt.bias + 1 - fmt.k)


#: elements converted at a time (to stay in cache across the several passes a block takes)
BLOCK = 1 << 16


def _power_of_two(exponents):
    """2.0 ** exponents (int64, within float64's normal range), built from the bits."""
    return ((exponents + 1023) << 52).view(np.float64)


def to_words(values, largest, fmt, out=None):
    """The contributions as integers on the grid (see the module's diagram): an int64 array of
    fmt.words words per element (float64: high word, then low word); ``out`` if given."""
    flat, largest = values.reshape(-1), largest.reshape(-1)
    words = np.empty(flat.size * fmt.words, np.int64) if out is None else out
    normal = fmt.words == 1 and _all_normal(largest, fmt)
    kernels = _compiled(
        fmt
    )  # (one compiled pass over normal stretches; else numpy passes by block)
    down = None if kernels is None else _scale_tables(fmt.bias, fmt.k)[0]
    if normal and kernels is not None:
        kernels.to_words_f32(flat, largest, down, words)
        return words
    scratch = (
        np.empty(min(BLOCK, flat.size), np.int64),
        np.empty(min(BLOCK, flat.size), np.float64),
    )
    for start in range(0, flat.size, BLOCK):
        stop = min(start + BLOCK, flat.size)
        block, codes, target = (
            flat[start:stop],
            largest[start:stop],
            words[start * fmt.words : stop * fmt.words],
        )
        if not (normal or (fmt.words == 1 and _all_normal(codes, fmt))):
            target[...] = _to_words_block(block, codes, fmt)
        elif kernels is not None:
            kernels.to_words_f32(block, codes, down, target)
        else:
            _to_words_normal_block(block, codes, fmt, [a[: stop - start] for a in scratch], target)
    return words


def _all_normal(codes, fmt):
    """Whether no largest exponent is 0 (zeros, subnormals) or all ones (inf, NaN)."""
    return codes.size == 0 or (int(codes.min()) > 0 and int(codes.max()) < fmt.all_ones)


#: 1.5 * 2^52: v + ROUNDING lies in [2^52, 2^53), where float64's spacing is 1, for |v| < 2^51, so
#: the addition rounds v to the nearest integer (ties to even), and the sum's bits minus ROUNDING's
#: are it
ROUNDING = np.float64(1.5 * 2.0**52)
ROUNDING_BITS = ROUNDING.view(np.int64)


def _scale_into(scale, largest, fmt, direction):
    """scale (int64 scratch, then viewed as float64) = 2^-grid (direction +1) or 2^grid (-1)."""
    constant = fmt.bias - 1 + fmt.k  # -grid = constant - largest
    if direction > 0:
        np.subtract(1023 + constant, largest, out=scale, dtype=np.int64)
    else:
        np.add(largest, 1023 - constant, out=scale, dtype=np.int64)
    np.left_shift(scale, 52, out=scale)
    return scale.view(np.float64)


def _to_words_normal_block(values, largest, fmt, scratch, target):
    """One word per element, no zero, subnormal, inf or NaN largest: x * 2^-grid (exact: a power of
    two), rounded to the nearest integer by adding ROUNDING, whose bits then come off: six passes
    over a block in cache, the same integers as np.rint."""
    scale, wide = scratch
    np.copyto(wide, values)
    np.multiply(wide, _scale_into(scale, largest, fmt, +1), out=wide)
    np.add(wide, ROUNDING, out=wide)
    np.subtract(wide.view(np.int64), ROUNDING_BITS, out=target)


def _to_words_block(values, largest, fmt):
    wide = values.astype(np.float64)
    tiny_any, special_any = bool((largest == 0).any()), bool((largest == fmt.all_ones).any())
    grid = _grid_exponents(largest, fmt) if tiny_any or fmt.words == 2 else None
    with np.errstate(invalid="ignore", over="ignore"):
        if special_any:
            special = largest == fmt.all_ones
            wide = np.where(special, 0.0, wide)
        if (
            fmt.words == 1
        ):  # |x| / q < 2^51: scale by a power of two built from the bits, round, convert
            np.multiply(
                wide,
                _power_of_two(-grid)
                if tiny_any
                else _scale_into(np.empty(largest.shape, np.int64), largest, fmt, +1),
                out=wide,
            )
            high = np.rint(wide, out=wide).astype(np.int64)
            low = None
        else:  # float64: 2^-grid may leave float64's range, ldexp does not
            scaled = np.ldexp(wide, -grid)
            high_part = np.floor(np.ldexp(scaled, -FIELD))
            low = np.rint(scaled - np.ldexp(high_part, FIELD)).astype(
                np.int64
            )  # exact: 0 <= . <= 2^40
            high = high_part.astype(np.int64)
    if tiny_any:
        original = values.astype(np.float64)
        not_negative_zero = ~((original == 0) & np.signbit(original))
        high += np.where((largest == 0) & not_negative_zero, np.int64(1) << FIELD, 0)
    if special_any:
        original = values.astype(np.float64)
        counts = (
            np.where(original == np.inf, 1, 0)
            + np.where(original == -np.inf, np.int64(1) << INF_FIELD, 0)
            + np.where(np.isnan(original), np.int64(1) << FIELD, 0)
        ).astype(np.int64)
        high = np.where(special, counts, high)
        if low is not None:
            low = np.where(special, 0, low)
    if low is None:
        return high
    return np.stack([high, low], axis=1).reshape(-1)


def _split_field(word):
    """(the value below FIELD, signed; the count above it) of summed words."""
    half = np.int64(1) << (FIELD - 1)
    below = ((word + half) & ((np.int64(1) << FIELD) - 1)) - half
    return below, (word - below) >> FIELD


def from_words(summed, largest, fmt, divide_by=1, dtype=np.float64, out=None):
    """The exact sums (summed words) as float64, rounded once (see the module's diagram), divided
    by ``divide_by`` for a mean, then rounded to ``dtype`` (into ``out``, 1-D, if given)."""
    largest = largest.reshape(-1)
    dtype = np.dtype(dtype)
    if dtype.kind != "f":  # (ml_dtypes' bfloat16: through float64, cast at the end)
        result = from_words(summed, largest, fmt, divide_by).astype(dtype)
        if out is None:
            return result
        np.copyto(out, result)
        return out
    result = np.empty(largest.size, dtype) if out is None else out
    normal = fmt.words == 1 and _all_normal(largest, fmt)
    kernels = (
        _compiled(fmt) if dtype == np.float32 else None
    )  # (one compiled pass; else numpy passes)
    up = None if kernels is None else _scale_tables(fmt.bias, fmt.k)[1]
    if normal and kernels is not None:
        kernels.from_words_f32(summed, largest, up, float(divide_by), result)
        return result
    scale, wide = (
        np.empty(min(BLOCK, largest.size), np.int64),
        np.empty(min(BLOCK, largest.size), np.float64),
    )
    for start in range(0, largest.size, BLOCK):
        stop = min(start + BLOCK, largest.size)
        words, codes = summed[start * fmt.words : stop * fmt.words], largest[start:stop]
        if not (normal or (fmt.words == 1 and _all_normal(codes, fmt))):
            with np.errstate(over="ignore", invalid="ignore"):
                result[start:stop] = _from_words_block(words, codes, fmt, divide_by)
        elif kernels is not None:
            kernels.from_words_f32(words, codes, up, float(divide_by), result[start:stop])
        else:
            # one rounding to float64, times a power of two (exact), a mean's division, then one
            # rounding to dtype: _from_words_block's operations
            block = wide[: stop - start]
            np.copyto(block, words, casting="unsafe")
            np.multiply(block, _scale_into(scale[: stop - start], codes, fmt, -1), out=block)
            if divide_by != 1:
                np.divide(block, divide_by, out=block)
            np.copyto(result[start:stop], block, casting="unsafe")
    return result


def _from_words_block(summed, largest, fmt, divide_by):
    tiny = largest == 0
    tiny_any, special_any = bool(tiny.any()), bool((largest == fmt.all_ones).any())
    grid = _grid_exponents(largest, fmt) if tiny_any or fmt.words == 2 else None
    if fmt.words == 1:
        high, low = summed, None
    else:
        pairs = summed.reshape(-1, 2)
        carry = pairs[:, 1] >> FIELD
        low = pairs[:, 1] & ((np.int64(1) << FIELD) - 1)
        high = pairs[:, 0] + carry
    if tiny_any:
        tiny_value, not_negative_zeros = _split_field(high)
        high = np.where(tiny, tiny_value, high)
    with np.errstate(invalid="ignore", over="ignore"):
        if low is None:  # < 2^62: one rounding, to 53 bits; then a power of two (exact)
            result = high.astype(np.float64)
            np.multiply(
                result,
                _power_of_two(grid)
                if tiny_any
                else _scale_into(np.empty(largest.shape, np.int64), largest, fmt, -1),
                out=result,
            )
        else:
            total = np.ldexp(high.astype(np.float64), FIELD) + low.astype(
                np.float64
            )  # exact terms, one rounding
            result = np.ldexp(total, grid)
        if divide_by != 1:
            result /= divide_by
    if tiny_any:
        result = np.where(tiny & (result == 0) & (not_negative_zeros == 0), -0.0, result)
    if special_any:
        special = largest == fmt.all_ones
        word = np.where(special, summed if fmt.words == 1 else summed.reshape(-1, 2)[:, 0], 0)
        positive = word & ((np.int64(1) << INF_FIELD) - 1)
        negative = (word >> INF_FIELD) & ((np.int64(1) << (FIELD - INF_FIELD)) - 1)
        nan = (word >> FIELD) > 0
        infinity = np.where(positive > 0, np.inf, -np.inf)
        result = np.where(
            special, np.where(nan | ((positive > 0) & (negative > 0)), np.nan, infinity), result
        )
    return result
