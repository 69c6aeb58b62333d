"""Reproducible sums: the same bits whatever the algorithm, segment size, bucket, rank order (the
steps and their conversions: ``exact``; the two routes and the op: ``routes``; the float32
conversions compiled with numba: ``kernels``)."""

from .exact import *  # noqa: F401,F403
from .kernel_switch import KERNELS_ENV  # noqa: F401
from .routes import EXACT_OPS, ExactSumOp, check_reproducible, exact_sum_into, sum_by_words  # noqa: F401
