"""The two routes of a reproducible sum, and its op (mpiallreduce.reproducible.exact has the steps).

    direct route  one rank holds every contribution of an element (shared_memory,
                  pairwise_exchange: ``sees_every_contribution``) and calls the op's
                  ``reduce_all_into``: exact_sum_into, steps 1-4 straight from the p floats
    words route   any other algorithm: sum_by_words, run by the executor, reduces the exponent
                  codes (MAX) then the fixed-point words (SUM) with the algorithm

``EXACT_OPS[op]`` is the op a reproducible call runs (mpiallreduce.core.call); the planner names
the route from the algorithm it chose.
"""

import math

import numpy as np

from ..core.ops import ReduceOp
from .exact import BLOCK, FORMATS, MAX_RANKS, compiled_kernels, exponent_codes, from_words, to_words

__all__ = ["EXACT_OPS", "ExactSumOp", "check_reproducible", "exact_sum_into", "sum_by_words"]


def check_reproducible(x, op, comm_size):
    """TypeError/ValueError (no communication) unless ``reproducible=True`` applies to this call."""
    name = np.dtype(x.dtype).name
    if name not in FORMATS:
        raise TypeError(
            f"reproducible=True sums float16, bfloat16, float32 and float64; got dtype {name}"
        )
    if op not in ("sum", "mean"):
        raise ValueError(
            f"reproducible=True applies to op 'sum' and 'mean' (min, max and prod of floats are "
            f"reproducible already), got {op!r}"
        )
    if comm_size > MAX_RANKS:
        raise ValueError(
            f"reproducible=True supports up to {MAX_RANKS} ranks, this communicator has {comm_size}"
        )


_FORMAT_OF = {
    np.dtype(name): FORMATS[name] for name in ("float16", "float32", "float64")
}  # (bfloat16: by name)


def exact_sum_into(contributions, out, divide_by=1):
    """The direct route: ``out`` = the reproducible sum of the p ``contributions`` (1-D arrays of
    one dtype and length; ``out`` may be one of them), divided by ``divide_by``, per element.

    The words route's operations on one rank that holds every contribution (shared_memory,
    pairwise_exchange): each element's largest exponent from its p contributions, their words
    summed here, converted back: the same bits as the words route. Float32 runs compiled where
    numba is (mpiallreduce.reproducible.kernels): a sum of two as their IEEE sum (pair_sum_f32), up
    to 4 contributions in one pass (fused_sum_f32), up to 8 in blocks of two passes (exact_sum_f32;
    a block holding an inf or NaN to the numpy passes). More contributions, other dtypes, or no
    numba: the words route's passes (numpy, and numba's one-array kernels where they apply), by
    block."""
    fmt = _FORMAT_OF.get(out.dtype) or FORMATS[out.dtype.name]
    kernels = compiled_kernels(fmt)
    if (
        kernels is not None
        and len(contributions) <= kernels.EXACT_MOST_CONTRIBUTIONS
        and out.flags.c_contiguous
        and all(c.flags.c_contiguous for c in contributions)
    ):
        if len(contributions) == 2 and divide_by == 1:
            kernels.pair_sum_f32(contributions[0], contributions[1], out.view(np.uint32))
            return out
        if not all(
            c.flags.writeable for c in contributions
        ):  # (numba indexes a tuple of one array type only)
            contributions = [_read_only(c) for c in contributions]
        values = tuple(contributions)
        bits = tuple(c.view(np.uint32) for c in contributions)
        if len(values) <= kernels.FUSED_MOST_CONTRIBUTIONS:
            power_of_two = (
                math.frexp(divide_by)[0] == 0.5
            )  # (then dividing is multiplying by the inverse, exact)
            kernels.fused_sum_f32(values, bits, float(divide_by), power_of_two, out.view(np.uint32))
            return out
        from ..core.buffers import scratch

        count, start = out.size, 0
        largest = scratch("reproducible.exact_largest", kernels.EXACT_BLOCK, np.uint32)
        while (
            start < count
        ):  # compiled up to a block holding an inf or NaN largest, which the numpy passes take
            start = kernels.exact_sum_f32(values, bits, float(divide_by), out, start, largest)
            stop = min(start + kernels.EXACT_BLOCK, count)
            if start < stop:
                _exact_sum_block(
                    [c[start:stop] for c in contributions], out[start:stop], fmt, divide_by
                )
            start = stop
        return out
    for start in range(0, out.size, BLOCK):
        stop = min(start + BLOCK, out.size)
        _exact_sum_block([c[start:stop] for c in contributions], out[start:stop], fmt, divide_by)
    return out


def _read_only(array):
    view = array.view()
    view.flags.writeable = False
    return view


def _exact_sum_block(contributions, out, fmt, divide_by):
    """exact_sum_into's numpy passes: the words route's own functions, on one block."""
    largest = np.maximum.reduce([exponent_codes(c, fmt) for c in contributions])
    summed = to_words(contributions[0], largest, fmt)
    for c in contributions[1:]:
        summed += to_words(c, largest, fmt)
    with np.errstate(over="ignore", invalid="ignore"):
        from_words(summed, largest, fmt, divide_by=divide_by, dtype=out.dtype, out=out)


def sum_by_words(send, recv, mean, allreduce_in_place):
    """The words route: ``recv`` = the reproducible sum (or mean) over the ranks of ``send`` (or of
    ``recv``'s contents when ``send`` is None), both 1-D contiguous numpy arrays.
    ``allreduce_in_place(array, op_name)``: the allreduce of the two integer steps (the call's
    algorithm, communicator and watch; mpiallreduce.api.execute); it has a ``size``."""
    from ..core.buffers import scratch

    values = recv if send is None else send
    fmt = FORMATS[np.dtype(values.dtype).name]
    # the codes and words in work arrays kept between calls (fresh ones cost page faults), reduced
    # in place
    codes = exponent_codes(values, fmt, out=scratch("reproducible.codes", values.size, fmt.code))
    allreduce_in_place(codes, "max")
    words = to_words(
        values, codes, fmt, out=scratch("reproducible.words", values.size * fmt.words, np.int64)
    )
    allreduce_in_place(words, "sum")  # (values, for in place, is read by now)
    with np.errstate(over="ignore", invalid="ignore"):
        from_words(
            words,
            codes,
            fmt,
            divide_by=allreduce_in_place.size if mean else 1,
            dtype=values.dtype,
            out=recv,
        )


class ExactSumOp(ReduceOp):
    """``op`` for a reproducible sum or mean, through the planner and any algorithm: one that holds
    every contribution of an element in one place (``sees_every_contribution``: shared_memory,
    pairwise_exchange) calls ``reduce_all_into`` (the direct route); any other reduces the exponent
    bytes and then the words (``sum_by_words``, run by mpiallreduce.api.execute). It never reduces
    pairwise."""

    exact = True

    def __init__(self, mean):
        super().__init__("reproducible_mean" if mean else "reproducible_sum", np.add, None)
        object.__setattr__(self, "mean", mean)

    def __repr__(self):
        return self.name

    def check_dtype(self, dtype):
        if dtype.name not in FORMATS:
            check_reproducible(
                np.empty(0, dtype), "mean" if self.mean else "sum", 1
            )  # (raises, saying why)

    def reduce_local(self, a, b, out):
        raise TypeError(
            f"{self.name} sums every contribution at once (reduce_all_into), never two at a time"
        )

    def mpi_op(self, dtype):
        raise TypeError(f"{self.name} is no MPI op: its steps reduce with MPI.MAX and MPI.SUM")

    def reduce_all_into(self, pieces, out):
        exact_sum_into(pieces, out, divide_by=len(pieces) if self.mean else 1)

    def finish(self, result, size):
        """One rank (a local copy): the reproducible sum of its one contribution, as with more ranks
        (a NaN becomes the canonical NaN, a mean divides by 1)."""
        if size == 1:
            exact_sum_into([result], result)


EXACT_OPS = {"sum": ExactSumOp(mean=False), "mean": ExactSumOp(mean=True)}
