"""A prepared call: agreed on and planned once, its buffers bound for good; each run is numbered
on the caller's thread, then executed (``prepare``, GradientSync's buckets).

    Prepared(call)     the Call agreed on (every rank), its Execution made and set up, the flat
                       buffers bound (Execution.bound: a persistent request where the plan says)
    prepared()         numbered, run in its turn: here, or behind pending asynchronous calls
                       (compiled where mpiallreduce.core.compiled says so: the same steps)
    .start(submit)     numbered here, run by the worker
"""

import numpy as np

from ..device.arrays import namespace
from ..faults.recorder import (
    DONE,
    ENDED,
    QUEUED,
    STATE,
    Described,
    array_fields,
    clock,
    finish,
    record_call,
    run_traced,
)
from . import buffers
from .compiled import PreparedBase, division_of
from .compiled import used as compiled_used
from .consistency import SignatureMismatch, digest, meet
from .executor import timed_call_raised
from .failures import translated
from .worker import run_in_order

__all__ = ["Prepared"]


class Prepared(PreparedBase):
    """A call agreed on and planned once, its buffers bound once: ``prepared()`` numbers a run and
    runs it in its turn, ``start(submit)`` hands it to the worker, ``run_numbered(n)`` runs call #n.
    Its runs on a persistent request are compiled where mpiallreduce.core.compiled says so (the
    compiled __call__ does what ``_call`` does, and hands anything else to it)."""

    def __init__(self, call, persistent=True):
        call._meet()
        self.state, self.timeout, self.site, self.x = call.state, call.timeout, call.site, call.x
        self.execution = call.agreed_execution()
        translated(
            self.state, call.sequence, self.execution.set_up
        )  # (agreed: every rank makes it now, not a run)
        self.plan, self.op = self.execution.plan, self.execution.op
        self.described = Described(
            array_fields(
                self.x,
                kind="prepared",
                site=self.site,
                op=self.op.name,
                timeout=self.timeout,
                algorithm=self.plan.name,
                in_place=self.plan.in_place,
            )
        )
        self.xp = None if type(call.x) is np.ndarray else namespace(call.x)
        self.flat = flat = buffers.flat_buffers(call.x, call.out)
        #: the flat input is x itself (a view), or a copy to refresh before each run
        self.input_is_x = (
            flat.send is None
            and flat.write_back is None
            or (flat.send is not None and buffers.views(flat.send, call.x))
        )
        self.execute = self.execution.bound(
            flat.send, flat.recv, self.timeout, self.xp, kept=persistent
        )
        self.persistent = getattr(self.execute, "persistent", False)
        self.result = flat.result
        self.fast = self.input_is_x and flat.write_back is None and self.timeout is None
        # (the Execution's code names the symmetric arrays' place: two prepared single copies
        # differ)
        self.code = digest(("prepared", self.execution.code, self.plan.describe())) | 1
        #: the user's numpy arrays whose memory the bound buffers are views of, and their shapes
        #: then
        self.watched = tuple(
            a for a in {id(a): a for a in (call.x, call.out)}.values() if type(a) is np.ndarray
        )
        self.shapes = tuple(a.shape for a in self.watched)
        self.addresses = tuple(a.ctypes.data for a in self.watched)
        plain = getattr(self.execute, "plain", None)  # (MPI_Allreduce itself, no request)
        if self.fast and (self.persistent or plain is not None) and compiled_used():
            if self.persistent:
                request, then, failed = self.execute.compiled
                bound, handle = (), request.handle
            else:
                (arguments, then, failed), handle = plain, 0
                bound = (arguments,)
            self._bind_compiled(
                handle,
                vars(self.state),
                vars(self.state.worker),
                self.result,
                then,
                failed,
                self.execute,
                self.state.library,
                division_of(self.execution, self.flat.recv),
                self.flat.recv,
                self.watched,
                *bound,
            )

    def _moved(self):
        """The ValueError to raise where one of the user's arrays changed shape since prepare
        (numpy's ``resize(refcheck=False)`` moves its memory; a shape set in place): the bound
        request or views point at the memory it had then. None where none did."""
        for name, a, shape, address in zip(
            ("x", "out"), self.watched, self.shapes, self.addresses, strict=False
        ):
            if (
                a.shape != shape or a.ctypes.data != address
            ):  # (resized and back: moved all the same)
                return ValueError(
                    f"rank {self.state.rank}: this prepared call's {name} changed since it was "
                    f"prepared ({shape} -> {a.shape}, resized in place, or its shape set); its "
                    "buffers still point at the memory it had, so nothing ran on this rank; "
                    "prepare the call again (untimed, the other ranks are not told: they wait in "
                    "this call, which the flight recorder names; with a timeout they raise "
                    "SignatureMismatch)"
                )
        return None

    def _call(self, *, _elsewhere=None):
        """Reduce x's contents now, numbered here, in turn: the result (``_elsewhere``: api's
        _run_on)."""
        state, elsewhere = self.state, _elsewhere
        if state.library is None:
            self._freed()
        sequence = state.number()
        entry = (
            None
            if state.recorder is None
            else state.recorder.record(state, sequence, self.described)
        )
        if self.fast and not state.worker.pending and (not self.watched or self._moved() is None):
            try:
                self.execute(sequence) if elsewhere is None else elsewhere[0](sequence)
            except BaseException as error:
                finish(entry, error)
                raise
            if entry is not None:
                entry[STATE], entry[ENDED] = DONE, clock()
            return self.result if elsewhere is None else elsewhere[1]
        if entry is not None:  # (behind asynchronous calls)
            entry[STATE] = QUEUED
        return run_in_order(
            state, lambda: run_traced(entry, lambda: self.run_numbered(sequence, elsewhere))
        )

    if PreparedBase is object:  # (not compiled: the call is _call itself, no frame more)
        __call__ = _call

    def run(self):
        """The same as calling it."""
        return self()

    def start(self, submit, elsewhere=None):
        """Number this run here and hand it to ``submit`` (the worker's): an AllreduceHandle."""
        if self.state.library is None:
            self._freed()
        sequence = self.state.number()
        entry = record_call(self.state, sequence, self.described)
        return submit(lambda: run_traced(entry, lambda: self.run_numbered(sequence, elsewhere)))

    def _freed(self):
        """Raise for a run after the communicator was freed (every rank frees it: every rank
        raises), before its request meets the freed communicator."""
        raise ValueError(
            f"rank {self.state.rank}: this prepared call's communicator was freed; prepare the "
            "call again on a live communicator"
        )

    def run_numbered(self, sequence, elsewhere=None):
        moved = None if elsewhere is not None else self._moved()
        if self.timeout is not None:  # (its code: a plain call, or another prepared one, raises)
            differ = False  # (the ranks' calls differ: no rank posted anything on T)
            try:
                try:  # (a moved array: a code no call has, so the peers raise too)
                    meet(
                        self.state,
                        sequence,
                        self.timeout,
                        self.site,
                        self.code if moved is None else 2,
                    )
                except SignatureMismatch as mismatch:
                    differ = True
                    if moved is not None:
                        raise moved from mismatch
                    raise
                return self._run_met(sequence, elsewhere, moved)
            except BaseException as error:  # (faults.bounded: where every rank retires it)
                bounded = self.execution.bounds_collectives
                timed_call_raised(self.state, sequence, error, bounded, differ)
                raise
        return self._run_met(sequence, elsewhere, moved)

    def _run_met(self, sequence, elsewhere, moved):
        if moved is not None:
            raise moved
        if elsewhere is not None:  # (bound run, array): on other memory
            elsewhere[0](sequence)
            return elsewhere[1]
        flat = self.flat
        if not self.input_is_x:  # a strided or overlapping x: refresh the contiguous copy
            buffers.copy_into(
                (flat.recv if flat.send is None else flat.send).reshape(self.x.shape), self.x
            )
        self.execute(sequence)
        return flat.finish()
