"""The reproducible sum's float32 conversions compiled with numba, one pass each way (optional).

    exponent_codes_f32   bits -> each element's biased exponent byte
    to_words_f32         x, largest -> round(x * 2^-grid(largest)) as int64    (normal largest only)
    from_words_f32       words, largest -> float32(float64(words) * 2^grid / p)  (normal largest only;
                         p the rank count for a mean, else 1)

The same IEEE operations as mpiallreduce.reproducible's numpy passes (a float32 widened exactly,
a product with a power of two, exact; rounding to the nearest integer, ties to even; int64 to
float64 and float64 to float32, each rounded to nearest even), in one loop: the same bits,
whichever path a rank takes (tests/test_reproducible_paths.py compares them). No fastmath, so
LLVM may not reassociate or contract them. ``available()`` is False where numba is not installed
(``pip install 'mpiallreduce[fast]'``) or MPIALLREDUCE_REPRODUCIBLE_KERNELS=numpy; the numpy passes
run then. Compiled functions are cached on disk by numba (``cache=True``).
"""
import os

import numpy as np

__all__ = ["available", "exponent_codes_f32", "to_words_f32", "from_words_f32", "scale_tables"]

from .reproducible import KERNELS_ENV

try:
    if os.environ.get(KERNELS_ENV, "").strip().lower() == "numpy":
        raise ImportError(f"{KERNELS_ENV}=numpy")
    from numba import njit
except ImportError:
    njit = None


def available():
    return njit is not None


def scale_tables(bias, k):
    """(2^-grid, 2^grid) for every exponent byte 0..255 (entries for 0 and 255 unused here)."""
    codes = np.arange(256, dtype=np.int64)
    grid = np.clip(codes - bias + 1 - k, -1000, 1000)
    return np.ldexp(1.0, -grid), np.ldexp(1.0, grid)


if njit is not None:
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
else:
    exponent_codes_f32 = to_words_f32 = from_words_f32 = None
