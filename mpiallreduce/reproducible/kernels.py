"""The reproducible sum's float32 conversions compiled with numba (optional).

The words route (contributions reduced by any algorithm, one pass each way):

    exponent_codes_f32   bits -> each element's biased exponent byte
    to_words_f32         x, largest -> round(x * 2^-grid(largest)) as int64    (normal largest only)
    from_words_f32       words, largest -> float32(float64(words) * 2^grid / p)  (normal largest
                         only; p the rank count for a mean, else 1)

The direct route (every contribution of an element in one place, as in shared memory):

    pair_sum_f32         x_0 + x_1: two contributions, a sum, is IEEE float32 addition (NaN made
                         canonical): numpy's time for the same addition
    fused_sum_f32        x_0 .. x_(p-1) -> float32(sum_j round(x_j, grid) / p), p <= 4: one pass,
                         each contribution rounded onto its element's grid in float64, their sum
                         exact, every kind of element (zero, subnormal, inf, NaN) by selects:
                         1.1-1.3x numpy's time for the same additions where memory bounds both, 2x
                         in cache
    exact_sum_f32        the same for 5 to 8 contributions, by blocks: pass 1 finds each element's
                         largest exponent byte (and stops at a block holding an inf or NaN largest,
                         for the numpy passes); pass 2 converts, sums the p words in int64 and
                         converts back, a zero or subnormal largest (grid: the subnormal unit, and a
                         count of the contributions that are not -0) in the same loop, by selects

The same IEEE operations as mpiallreduce.reproducible's numpy passes (a float32 widened exactly,
a product with a power of two, exact; rounding to the nearest integer, ties to even; int64 to
float64 and float64 to float32, each rounded to nearest even): the same bits, whichever path or
route a rank takes (tests/test_reproducible_paths.py compares them). The kernels write those
operations so that they vectorize on AVX2: the rounding as an addition of 1.5 * 2^52 whose bits
then come off (_as_int64), the powers of two built from their bits (_as_float64), and int64 to
float64 as float64(high 32 bits) * 2^32 + float64(low 32 bits): two exact terms, one rounding.
No fastmath, so LLVM may not reassociate or contract them. ``available()`` is False where numba is
not installed (``pip install 'mpiallreduce[fast]'``) or MPIALLREDUCE_REPRODUCIBLE_KERNELS=numpy; the
numpy passes run then. Compiled functions are cached on disk by numba (``cache=True``).
"""

import os

import numpy as np

__all__ = [
    "available",
    "exponent_codes_f32",
    "to_words_f32",
    "from_words_f32",
    "exact_sum_f32",
    "scale_tables",
    "EXACT_BLOCK",
    "EXACT_MOST_CONTRIBUTIONS",
    "fused_sum_f32",
    "pair_sum_f32",
    "FUSED_MOST_CONTRIBUTIONS",
]

from .kernel_switch import KERNELS_ENV

try:
    if os.environ.get(KERNELS_ENV, "").strip().lower() == "numpy":
        raise ImportError(f"{KERNELS_ENV}=numpy")
    from numba import njit, types
    from numba.extending import intrinsic
except ImportError:
    njit = None

#: elements per block of exact_sum_f32 (its largest exponents stay in L1 between the two passes)
EXACT_BLOCK = 2048
#: exact_sum_f32 takes at most this many contributions: numba compiles one loop per count (about a
#: second each, kept on disk), unrolled; past 8 its tuple indexing makes it slower than the numpy
#: passes over the compiled one-array kernels (16 contributions: 12 ms against 8 for 4M values here)
EXACT_MOST_CONTRIBUTIONS = 8
#: fused_sum_f32 takes at most this many contributions (float64 holds the sum of 4 words exactly)
FUSED_MOST_CONTRIBUTIONS = 4


def available():
    return njit is not None


def scale_tables(bias, k):
    """(2^-grid, 2^grid) for every exponent byte 0..255 (entries for 0 and 255 unused here)."""
    codes = np.arange(256, dtype=np.int64)
    grid = np.clip(codes - bias + 1 - k, -1000, 1000)
    return np.ldexp(1.0, -grid), np.ldexp(1.0, grid)


# float32's grid (mpiallreduce.reproducible: bias 127, K 51, 23 mantissa bits) as float64 exponent
# fields: 2^-grid = 2^(177 - E) for a normal largest E, 2^149 for a zero or subnormal one; 2^grid
# the other way round
_DOWN_NORMAL, _DOWN_TINY = 1023 + 127 - 1 + 51, 1023 + 127 - 1 + 23
_UP_NORMAL, _UP_TINY = 1023 - 127 + 1 - 51, 1023 - 127 + 1 - 23
_ROUNDING = 1.5 * 2.0**52
_ROUNDING_BITS = int(np.float64(_ROUNDING).view(np.int64))
# (mpiallreduce.reproducible.FIELD: where a tiny element's count of contributions that are not -0
# starts)
_FIELD = 40
_HALF_FIELD, _BELOW_FIELD = 1 << (_FIELD - 1), (1 << _FIELD) - 1
_CANONICAL_NAN = int(np.float32(np.nan).view(np.uint32))  # (0x7FC00000: the numpy passes' NaN)
# 1.5 * 2^52 * 2^(E - 177) for the largest exponent byte E: exponent field E + 1023 + 52 - 177, and
# the mantissa's top bit (the .5): fused_sum_f32's rounding constant, its bits less E's
_GRID_ROUNDING_BITS = ((1023 + 52 - 177) << 52) | (1 << 51)

if njit is not None:
    from llvmlite import ir

    def _bitcast(result, argument, ir_type):
        """An intrinsic: the ``result`` whose bits are those of the ``argument`` (a numba type
        each)."""

        @intrinsic
        def bitcast(typingctx, value):  # pragma: no cover - compiled
            def codegen(context, builder, signature, args):
                return builder.bitcast(args[0], ir_type)

            return result(argument), codegen

        return bitcast

    _as_float64 = _bitcast(types.float64, types.int64, ir.DoubleType())
    _as_int64 = _bitcast(types.int64, types.float64, ir.IntType(64))
    _float32_bits = _bitcast(types.uint32, types.float32, ir.IntType(32))

    @njit(cache=True, nogil=True)
    def exponent_codes_f32(bits, codes):  # pragma: no cover - compiled
        for i in range(bits.size):
            codes[i] = (bits[i] >> 23) & 0xFF

    @njit(cache=True, nogil=True)
    def to_words_f32(values, largest, down, words):  # pragma: no cover - compiled
        for i in range(values.size):
            words[i] = np.int64(np.rint(np.float64(values[i]) * down[largest[i]]))

    @njit(cache=True, nogil=True)
    def from_words_f32(words, largest, up, divide_by, result):  # pragma: no cover - compiled
        for i in range(words.size):
            result[i] = np.float32(np.float64(words[i]) * up[largest[i]] / divide_by)

    @njit(cache=True, nogil=True)
    def exact_sum_f32(values, bits, divide_by, out, start, largest):  # pragma: no cover - compiled
        """values, bits: tuples of the p contributions (float32, and the same as uint32); from
        ``start`` (a multiple of EXACT_BLOCK) on, the reproducible sum / divide_by into ``out``;
        ``largest``: EXACT_BLOCK uint32 of scratch. Returns the start of the first block that holds
        an inf or NaN largest (left to the numpy passes), or out.size."""
        p = len(values)
        n = out.size
        block = EXACT_BLOCK
        for first in range(start, n, block):
            m = min(block, n - first)
            special = tiny_any = np.uint32(0)
            base = np.uint64(
                first
            )  # (unsigned indices: no negative-index wraparound, so LLVM vectorizes)
            for i in range(m):  # pass 1: the largest exponent byte of each element
                k = base + np.uint64(i)
                magnitude = np.uint32(0)  # (the largest magnitude's bits hold the largest exponent)
                for j in range(p):
                    magnitude = max(magnitude, bits[j][k] & np.uint32(0x7FFFFFFF))
                e = magnitude >> np.uint32(23)
                largest[i] = e
                special |= np.uint32(e == np.uint32(255))
                tiny_any |= np.uint32(e == np.uint32(0))
            if special:
                return first
            if not tiny_any:  # pass 2, every largest normal: to words, their sum, back
                for i in range(m):
                    k = base + np.uint64(i)
                    e = np.int64(largest[i])
                    down = _as_float64((np.int64(_DOWN_NORMAL) - e) << 52)
                    total = np.int64(0)
                    for j in range(p):
                        total += _as_int64(np.float64(values[j][k]) * down + _ROUNDING) - np.int64(
                            _ROUNDING_BITS
                        )
                    high = np.float64(np.int32(total >> 32)) * 4294967296.0
                    low = np.float64(np.int32((total & 0xFFFFFFFF) - 0x80000000)) + 2147483648.0
                    out[k] = np.float32(
                        (high + low) * _as_float64((np.int64(_UP_NORMAL) + e) << 52) / divide_by
                    )
                continue
            for i in range(
                m
            ):  # pass 2 with zero or subnormal largests (no branches: it vectorizes)
                k = base + np.uint64(i)
                e = np.int64(largest[i])
                tiny = np.int64(e == 0)  # 1 where every contribution is zero or subnormal
                down = _as_float64(
                    (tiny * np.int64(_DOWN_TINY) + (1 - tiny) * (np.int64(_DOWN_NORMAL) - e)) << 52
                )
                total = np.int64(0)
                for j in range(p):
                    total += _as_int64(np.float64(values[j][k]) * down + _ROUNDING) - np.int64(
                        _ROUNDING_BITS
                    )
                    # (the words route's count field, where tiny: the contributions that are not -0)
                    total += (tiny & np.int64(bits[j][k] != np.uint32(0x80000000))) << _FIELD
                # where tiny the value is the part below the count field, signed
                below = ((total + _HALF_FIELD) & _BELOW_FIELD) - _HALF_FIELD
                value = tiny * below + (1 - tiny) * total
                high = np.float64(np.int32(value >> 32)) * 4294967296.0
                low = np.float64(np.int32((value & 0xFFFFFFFF) - 0x80000000)) + 2147483648.0
                up = _as_float64(
                    (tiny * np.int64(_UP_TINY) + (1 - tiny) * (np.int64(_UP_NORMAL) + e)) << 52
                )
                result = (high + low) * up / divide_by
                # every contribution -0 (tiny, a zero result, a count of 0): -0
                negative_zero = tiny & np.int64(result == 0.0) & np.int64(total == below)
                out[k] = np.float32(_as_float64(_as_int64(result) | (negative_zero << 63)))
        return n

    @njit(cache=True, nogil=True)
    def fused_sum_f32(
        values, bits, divide_by, power_of_two, out_bits
    ):  # pragma: no cover - compiled
        """values, bits: tuples of p <= FUSED_MOST_CONTRIBUTIONS contributions (float32, and the
        same as uint32); the reproducible sum / divide_by into ``out_bits`` (the output's uint32
        view) in one pass, every kind of element by selects, no branch:
        - each element's largest exponent E sets its grid q = 2^(E - 177), the words route's for a
          normal E; E = 0 (every contribution zero or subnormal) gives 2^-177, on which every
          subnormal lies exactly, so the sum below is the words route's on the subnormal unit;
        - each contribution rounded onto the grid as (x + c) - c with c = 1.5 * 2^52 * q (ties to
          even, as the words route's rint of x / q), their sum in float64: multiples of q below
          2^51 q, so any 4 add exactly;
        - divided by divide_by (multiplied by its inverse, exact, where ``power_of_two``), rounded
          once to float32;
        - -0 where every contribution is -0 (their magnitudes all 0, their signs all set);
        - an inf or NaN largest: E = 255 puts every finite contribution on a finite grid and leaves
          inf and NaN as they are, so IEEE addition gives the words route's inf, -inf or NaN (+inf
          with -inf is NaN); a NaN becomes the canonical one (the numpy passes' 0x7FC00000)."""
        p = len(values)
        inverse = 1.0 / divide_by
        for k in range(
            np.uint64(out_bits.size)
        ):  # (unsigned indices: no negative-index wraparound, so LLVM vectorizes)
            magnitude = np.uint32(0)  # (the largest magnitude's bits hold the largest exponent)
            signs = np.uint32(0xFFFFFFFF)
            for j in range(p):
                magnitude = max(magnitude, bits[j][k] & np.uint32(0x7FFFFFFF))
                signs &= bits[j][k]
            c = _as_float64(
                (np.int64(magnitude >> np.uint32(23)) << 52) + np.int64(_GRID_ROUNDING_BITS)
            )
            exact = (np.float64(values[0][k]) + c) - c
            for j in range(1, p):
                exact += (np.float64(values[j][k]) + c) - c
            result = np.float32(exact * inverse) if power_of_two else np.float32(exact / divide_by)
            negative_zero = (
                signs & (magnitude - np.uint32(1)) & np.uint32(0x80000000)
            )  # (magnitude 0: all ones)
            result_bits = _float32_bits(result) | negative_zero
            out_bits[k] = np.uint32(_CANONICAL_NAN) if result != result else result_bits

    @njit(cache=True, nogil=True)
    def pair_sum_f32(a, b, out_bits):  # pragma: no cover - compiled
        """Two contributions, a sum (no division): IEEE float32 addition, a NaN made canonical. The
        words route's bits: a + b is the exact sum rounded once, as is the words route's, whose
        grid is exact for both unless their exponents lie 28 or more apart; then the smaller is
        below a 16th of the larger's ulp either way, and both round to the larger."""
        for k in range(np.uint64(out_bits.size)):
            result = a[k] + b[k]
            out_bits[k] = np.uint32(_CANONICAL_NAN) if result != result else _float32_bits(result)

else:
    exponent_codes_f32 = to_words_f32 = from_words_f32 = exact_sum_f32 = fused_sum_f32 = (
        pair_sum_f32
    ) = None
