"""The reproducible sum's float32 conversions compiled with numba (optional).

The words route (contributions reduced by any algorithm, one pass each way):

    exponent_codes_f32   bits -> each element's biased exponent byte
    to_words_f32         x, largest -> round(x * 2^-grid(largest)) as int64    (normal largest only)
    from_words_f32       words, largest -> float32(float64(words) * 2^grid / p)  (normal largest only;
                         p the rank count for a mean, else 1)

The direct route (every contribution of an element in one place, as in shared memory):

    exact_sum_f32        x_0 .. x_(p-1) -> float32(float64(sum_j round(x_j * 2^-grid)) * 2^grid / p)
                         by blocks: pass 1 finds each element's largest exponent byte (and stops
                         at a block holding an inf or NaN largest, for the numpy passes); pass 2
                         converts, sums the p words and converts back, without leaving registers:
                         with p <= 4 and every largest normal the words (integers below 2^51) are
                         summed in float64, exactly; otherwise in int64, a zero or subnormal largest
                         (grid: the subnormal unit, and a count of the contributions that are not
                         -0) handled in the same loop, by selects

The same IEEE operations as mpiallreduce.reproducible's numpy passes (a float32 widened exactly,
a product with a power of two, exact; rounding to the nearest integer, ties to even; int64 to
float64 and float64 to float32, each rounded to nearest even): the same bits, whichever path or
route a rank takes (tests/test_reproducible_paths.py compares them). exact_sum_f32 writes those
operations so that they vectorize on AVX2: the rounding as an addition of 1.5 * 2^52 whose bits
then come off (_as_int64), the powers of two built from their bits (_as_float64), and int64 to
float64 as float64(high 32 bits) * 2^32 + float64(low 32 bits): two exact terms, one rounding.
No fastmath, so LLVM may not reassociate or contract them. ``available()`` is False where numba is
not installed (``pip install 'mpiallreduce[fast]'``) or MPIALLREDUCE_REPRODUCIBLE_KERNELS=numpy; the
numpy passes run then. Compiled functions are cached on disk by numba (``cache=True``).
"""
import os

import numpy as np

__all__ = ["available", "exponent_codes_f32", "to_words_f32", "from_words_f32", "exact_sum_f32", "scale_tables",
           "EXACT_BLOCK", "EXACT_MOST_CONTRIBUTIONS"]

from .exact import KERNELS_ENV

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
_ROUNDING = 1.5 * 2.0 ** 52
_ROUNDING_BITS = int(np.float64(_ROUNDING).view(np.int64))
_FIELD = 40  # (mpiallreduce.reproducible.FIELD: where a tiny element's count of contributions that are not -0 starts)
_HALF_FIELD, _BELOW_FIELD = 1 << (_FIELD - 1), (1 << _FIELD) - 1

if njit is not None:
    from llvmlite import ir

    @intrinsic
    def _as_float64(typingctx, bits):  # pragma: no cover - compiled
        """The float64 whose bits are the int64 ``bits``."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.DoubleType())
        return types.float64(types.int64), codegen

    @intrinsic
    def _as_int64(typingctx, value):  # pragma: no cover - compiled
        """The bits of the float64 ``value``, as int64."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(64))
        return types.int64(types.float64), codegen

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
            base = np.uint64(first)  # (unsigned indices: no negative-index wraparound, so LLVM vectorizes)
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
            if not tiny_any and p <= 4:  # pass 2, every largest normal, at most 4 words: summed in float64
                for i in range(m):  # (integers below 2^51: any 4 add exactly in float64, so no int64 at all)
                    k = base + np.uint64(i)
                    e = np.int64(largest[i])
                    down = _as_float64((np.int64(_DOWN_NORMAL) - e) << 52)
                    exact = 0.0
                    for j in range(p):
                        exact += (np.float64(values[j][k]) * down + _ROUNDING) - _ROUNDING
                    out[k] = np.float32(exact * _as_float64((np.int64(_UP_NORMAL) + e) << 52) / divide_by)
                continue
            if not tiny_any:  # pass 2, every largest normal: to words, their sum, back
                for i in range(m):
                    k = base + np.uint64(i)
                    e = np.int64(largest[i])
                    down = _as_float64((np.int64(_DOWN_NORMAL) - e) << 52)
                    total = np.int64(0)
                    for j in range(p):
                        total += _as_int64(np.float64(values[j][k]) * down + _ROUNDING) - np.int64(_ROUNDING_BITS)
                    high = np.float64(np.int32(total >> 32)) * 4294967296.0
                    low = np.float64(np.int32((total & 0xFFFFFFFF) - 0x80000000)) + 2147483648.0
                    out[k] = np.float32((high + low) * _as_float64((np.int64(_UP_NORMAL) + e) << 52) / divide_by)
                continue
            for i in range(m):  # pass 2 with zero or subnormal largests (no branches: it vectorizes)
                k = base + np.uint64(i)
                e = np.int64(largest[i])
                tiny = np.int64(e == 0)  # 1 where every contribution is zero or subnormal
                down = _as_float64((tiny * np.int64(_DOWN_TINY) + (1 - tiny) * (np.int64(_DOWN_NORMAL) - e)) << 52)
                total = np.int64(0)
                for j in range(p):
                    total += _as_int64(np.float64(values[j][k]) * down + _ROUNDING) - np.int64(_ROUNDING_BITS)
                    # (the words route's count field, where tiny: the contributions that are not -0)
                    total += (tiny & np.int64(bits[j][k] != np.uint32(0x80000000))) << _FIELD
                # where tiny the value is the part below the count field, signed
                below = ((total + _HALF_FIELD) & _BELOW_FIELD) - _HALF_FIELD
                value = tiny * below + (1 - tiny) * total
                high = np.float64(np.int32(value >> 32)) * 4294967296.0
                low = np.float64(np.int32((value & 0xFFFFFFFF) - 0x80000000)) + 2147483648.0
                up = _as_float64((tiny * np.int64(_UP_TINY) + (1 - tiny) * (np.int64(_UP_NORMAL) + e)) << 52)
                result = (high + low) * up / divide_by
                # every contribution -0 (tiny, a zero result, a count of 0): -0
                negative_zero = tiny & np.int64(result == 0.0) & np.int64(total == below)
                out[k] = np.float32(_as_float64(_as_int64(result) | (negative_zero << 63)))
        return n
else:
    exponent_codes_f32 = to_words_f32 = from_words_f32 = exact_sum_f32 = None
