"""Reproducible sums: the same bits whatever the algorithm, segment size, bucket, rank order (see
``exact``; the float32 conversions compiled with numba in ``kernels``)."""
from .exact import *  # noqa: F401,F403
from .exact import KERNELS_ENV, __all__  # noqa: F401
