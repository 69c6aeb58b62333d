"""The short path of a repeated call in Python: ``short(x, out)`` on contiguous numpy arrays, the
result, or None when these arrays need the general path (Execution.short, where the compiled one,
mpiallreduce.core.compiled.short_path, is not built): numbered on the caller's thread, the
signature compared in the shared slots, MPI_Allreduce itself, a mean's division.
"""

import numpy as np
from mpi4py import MPI

from ..faults.recorder import DONE, ENDED, RUNNING, STATE, WITHDRAWN, clock, run_traced
from ..faults.watch import PeerWatch
from .consistency import compare
from .failures import raise_failed
from .symmetric import touches

__all__ = ["python_short_path"]


def python_short_path(execution):
    """``short(x, out)``, the short path of a repeated call on contiguous numpy arrays: the
    result, or None when these arrays need the general path (strided, views, another kind of
    out, a read-only out). Numbered on the caller's thread (the entry point checked that no
    asynchronous call is pending). A closure over what it reads: each call is ~0.1 us of Python
    in all."""
    state, shape, dtype, strides, mpi_op = (
        execution.state,
        execution.shape,
        execution.dtype,
        execution.strides,
        execution.mpi_op,
    )
    raw_unchecked, raw_direct, code, describe = (
        execution.raw_unchecked,
        execution.raw and execution.direct,
        execution.code,
        execution.describe,
    )
    empty, ndarray, may_share_memory, in_place = (
        np.empty,
        np.ndarray,
        np.may_share_memory,
        MPI.IN_PLACE,
    )
    allreduce, number, divides, divide = (
        state.library.Allreduce,
        state.number,
        execution.divides,
        execution.divide,
    )  # (the state's for its life: freed, it is forgotten)
    recorder, execution = (
        state.recorder,
        execution,
    )  # (the flight recorder's; a new one comes with new short paths)

    def short(x, out):
        if x.strides != strides or touches(
            x
        ):  # (symmetric arrays may run single_copy: the general path)
            return None
        if out is None:
            result, send = empty(shape, dtype), x
        elif out is x:
            result, send = x, in_place
        elif (
            type(out) is ndarray
            and out.dtype is dtype
            and out.shape == shape
            and out.strides == strides
            and ((out.base is None and x.base is None) or not may_share_memory(x, out))
        ):
            result, send = out, x  # (they do not overlap)
        else:
            return None
        if raw_unchecked:  # MPI_Allreduce itexecution, on the arrays as they are (any shape)
            # (recorded before it runs, under the number it will take: a rank stuck in it says
            # so)
            entry = (
                None
                if recorder is None
                else recorder.record(state, state.sequence + 1, execution, RUNNING)
            )
            try:
                allreduce(send, result, mpi_op)
                if divides:
                    divide(result)
            except (
                BufferError
            ):  # (a read-only out, refused by mpi4py before MPI: the general path says so)
                if entry is not None:
                    entry[STATE] = WITHDRAWN
                return None
            except BaseException as error:
                raise_failed(error, state, number(), None, entry)
            # (the same count as numbering first: this call talks on no tag of its number)
            number()
            if entry is not None:
                entry[STATE], entry[ENDED] = DONE, clock()
            return result
        if out is not None and not result.flags.writeable:
            return None  # (refused before any communication, by the general path)
        sequence = state.number()
        entry = None if recorder is None else recorder.record(state, sequence, execution)
        if raw_direct:
            try:
                slots = state.signature_slots
                if slots is None or not slots.agree(code, sequence):
                    compare(
                        state,
                        code,
                        describe,
                        lambda: PeerWatch(state, sequence, None, "signature"),
                        sequence,
                        published=slots is not None,
                    )
                state.library.Allreduce(send, result, mpi_op)
                if divides:
                    divide(result)
            except BaseException as error:
                raise_failed(error, state, sequence, None, entry)
        else:
            run_traced(
                entry,
                lambda: execution.run(
                    None if send is in_place else send.reshape(-1), result.reshape(-1), sequence
                ),
            )
            return result
        if entry is not None:
            entry[STATE], entry[ENDED] = DONE, clock()
        return result

    return short
