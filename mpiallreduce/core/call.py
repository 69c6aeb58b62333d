"""A call: its arguments checked and captured, numbered and bound to its communicator's state on the
caller's thread, in program order; then planned and run by the executor.

    Call.start(...)    caller's thread: arguments checked (locally, unless ``check``), the
                       communicator resolved (mesh axis, groups) and its state made
                       (mpiallreduce.core.state), the call numbered (CommState.number)
    call.in_turn()     in program order: here, or queued behind pending asynchronous calls;
                       one that ``sets_up()`` something collective, here after them (run_here);
                       the order is the communicator's own (mpiallreduce.core.worker)
    call.run()         any thread, in the order calls were started: the rendezvous of a timed
                       call (mpiallreduce.faults.rendezvous), the state made ready, the plan
                       (mpiallreduce.core.planner; with ``check``, agreed on by every rank first),
                       the Execution of that plan (mpiallreduce.core.executor: kept per kind of
                       call, the short path of the next repeat), the flat buffers, the run
    Prepared(call)     ``prepare``: agreed on once, then run many times (mpiallreduce.core.prepared)

Every entry builds a Call: ``allreduce(_async)``, ``prepare``, GradientSync, ``psum`` & co.,
``.torch``.
"""

import numpy as np
from mpi4py import MPI

from ..device.arrays import namespace
from ..faults.errors import AllreduceAborted, call_site
from ..faults.recorder import array_fields, record_call, run_traced
from ..faults.watch import PeerWatch, set_up_or_rank_failure
from . import buffers
from .consistency import agree_on_call, compare, digest, meet
from .executor import Execution, timed_call_raised
from .failures import translated
from .kinds import execution_for, plan_for
from .ops import get_op, name_of
from .plan_cases import Memory
from .planner import check_algorithm_name
from .settings import settings
from .state import state_of
from .symmetric import placement_of_call
from .worker import run_here, run_in_order

__all__ = ["Call", "execution_for", "plan_for", "validate", "check_comm", "WORLD"]

WORLD = MPI.COMM_WORLD


def check_comm(comm):
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(
            f"comm must be an mpi4py intracommunicator (MPI.Intracomm), got {type(comm).__name__}"
        )
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL")
    return comm


def _op_of(op, reproducible):
    """The ReduceOp a call runs: ``op`` itself, or its reproducible sum
    (mpiallreduce.reproducible)."""
    if not reproducible:  # (the general path of every call: no import here)
        return get_op(op)
    from ..reproducible.routes import EXACT_OPS

    return EXACT_OPS[op] if isinstance(op, str) and op in EXACT_OPS else get_op(op)


def validate(x, op, algorithm, out, reproducible=False, size=1):
    """Every check that needs no communication; TypeError/ValueError naming what is wrong."""
    buffers.check_array(x)
    if reproducible:
        from ..reproducible.routes import check_reproducible

        check_reproducible(x, op, size)
    get_op(op).check_dtype(x.dtype)
    check_algorithm_name(algorithm, type(x) is not np.ndarray and namespace(x) is not None)
    buffers.check_out(out, x)


class Call:
    """One call's arguments, captured by the entry point on the caller's thread."""

    __slots__ = (
        "x",
        "op",
        "reduce_op",
        "algorithm",
        "out",
        "check",
        "timeout",
        "site",
        "state",
        "sequence",
        "meeting",
        "reproducible",
        "entry",
        "execution",
        "rejected",
    )

    @classmethod
    def start(
        cls,
        x,
        op,
        algorithm,
        comm,
        out,
        check,
        axis,
        mesh,
        groups,
        timeout,
        site=None,
        reproducible=False,
    ):
        """Resolve the communicator, make its state and number the call: on the caller's thread."""
        call, rejected = cls(), None
        call.rejected, call.execution = False, None
        if not isinstance(check, bool):
            rejected, check = (
                TypeError(f"check must be True or False, got {type(check).__name__} {check!r}"),
                False,
            )
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
        ):
            rejected = rejected or ValueError(
                f"timeout must be a number of seconds > 0 (or None), got {timeout!r}"
            )
            timeout = None
        if axis is not None or mesh is not None or groups is not None:
            from .mesh import resolve_communicator

            comm = resolve_communicator(comm, axis, mesh, groups)
        comm = check_comm(WORLD if comm is None else comm)
        current = settings()
        op = name_of(op)  # (op=MPI.SUM: "sum")
        call.x, call.op, call.algorithm, call.out = x, op, algorithm, out
        call.reproducible = bool(reproducible)
        call.check = check or current.check
        call.timeout = current.timeout if timeout is None else timeout
        call.site = (
            site
            if site is not None
            else call_site()
            if (call.check or call.timeout is not None)
            else ""
        )
        call.meeting = None
        call.state = state = set_up_or_rank_failure(
            comm, lambda: state_of(comm, blocking=call.timeout is None)
        )
        if not call.check and rejected is None:  # a bad argument raises here, before any data moves
            try:
                validate(x, op, algorithm, out, call.reproducible, state.size)
            except (TypeError, ValueError) as error:
                rejected = error
        if rejected is not None and (state.size == 1 or current.signature_min_bytes != 0):
            raise rejected  # (the other ranks may not compare this call: raised here alone)
        ahead = (
            state.given_up_ahead
        )  # (a peer gave this call up, learnt by a first use: state.make_ready)
        if ahead is not None and ahead.sequence == state.sequence + 1:
            state.number()  # (raises that, the number taken)
        if state.settings is not current or (not state.ready and call.timeout is None):
            # settings replaced (tests: agreed on again), or the communicator's first untimed call:
            # its collectives (the settings, the node layout and the communicators made from it)
            # here, in program order, after the pending asynchronous calls, never on the worker
            try:
                run_here(state, lambda: _renew_and_ready(state, current, call.timeout is None))
            except (
                AllreduceAborted
            ) as aborted:  # (a peer gave up its timed call, this one: its number taken)
                state.number()
                if rejected is not None:
                    # (this rank's own error, as where the set-up was done)
                    raise rejected from aborted
                raise
        call.reduce_op = call.execution = None
        call.sequence = state.number()
        call.entry = record_call(
            state, call.sequence, call
        )  # (the flight recorder's, queued until it runs)
        if rejected is not None:
            run_here(
                state, lambda: run_traced(call.entry, lambda: call._agree_on_rejection(rejected))
            )
        return call

    def _agree_on_rejection(self, error, met=False):
        """A bad argument on this rank: the others' call of this number compares its signature first
        (every call does, by default), so this rank does too, with a code of its own, then raises
        ``error``; they raise SignatureMismatch naming it. Raised here alone, this rank's next call
        would pair with this one elsewhere, and the values of two calls would mix."""
        if not met:
            self._meet()
        state, sequence, text = self.state, self.sequence, f"{type(error).__name__}: {error}"
        self.rejected = True  # (its peers raise SignatureMismatch: no communicator is retired)
        try:
            compare(
                state,
                digest(("rejected", text)),
                lambda: {"rejected": text},
                lambda: PeerWatch(state, sequence, None, "signature"),
                sequence,
            )
        except (
            Exception
        ) as other:  # (a mismatch, or the others gave a timed call up): this rank's own error
            raise error from other
        raise error

    def sets_up(self):
        """Whether running this call first makes something collective: the communicator's first
        call (a timed one is made ready when it runs, after its rendezvous) or a shared window that
        must grow. Such a call never runs on the worker (mpiallreduce.core.worker)."""
        state = self.state
        if not state.ready or (self.timeout is not None and state.timed_collectives is None):
            return True  # (the timed calls' communicator too: faults.bounded)
        execution = self._planned()
        # (None: an argument that check=True validates on every rank: raised when it runs)
        return execution is None or execution.needs_set_up()

    def _planned(self):
        """This call's Execution as planned now, not kept (the worker may change the facts), or None
        where this rank refuses it."""
        try:
            return execution_for(
                self.state,
                self.x,
                self.op,
                _op_of(self.op, self.reproducible),
                self.algorithm,
                self.reproducible,
                False,
                self.out is self.x,
                placement_of_call(self.state, self.x, self.out),
                timed=self.timeout is not None,
            )
        except Exception:
            return None

    def in_turn(self):
        """Run this call in program order (see the module's docstring); its result."""
        state = self.state
        if state.worker.busy() and self.sets_up():
            return run_here(state, self.run)
        return run_in_order(state, self.run)

    def _meet(self):
        """A timed call's rendezvous (the same on every rank: it is collective), then the state
        ready."""
        state = self.state
        if (
            self.timeout is not None
        ):  # (allreduce_async's meeting: wait(timeout) may bring the deadline forward)
            meet(
                state,
                self.sequence,
                self.timeout,
                self.site,
                rendezvous=None
                if self.meeting is None
                else self.meeting(state, self.sequence, self.site),
            )
        state.make_ready(self.sequence, timed=self.timeout)

    def signature(self):
        """What must be equal on every rank, for ``check`` (everything, call number and site
        too)."""
        x = self.x
        names = {
            "op": _plain(self.op),
            "algorithm": _plain(self.algorithm),
            "reproducible": self.reproducible,
            "call_number": self.sequence,
            "call_site": self.site,
        }
        if isinstance(x, np.ndarray) or namespace(x) is not None:
            return {
                "memory": (Memory.HOST if isinstance(x, np.ndarray) else Memory.DEVICE).value,
                "shape": tuple(x.shape),
                "dtype": str(x.dtype),
                **names,
            }
        return {"x": type(x).__name__, **names}

    def agreed_execution(self):
        """Validate on every rank and compare everything (one allgather; ``check`` and ``prepare``);
        the Execution of the agreed plan, which then compares nothing more. First one code for every
        checked call, where unchecked calls compare theirs: a rank without ``check`` sees a
        mismatch."""
        state = self.state
        if _compared(state):
            sequence = self.sequence
            translated(
                state,
                sequence,
                lambda: compare(
                    state,
                    _CHECKED,
                    lambda: {"check": True},
                    lambda: PeerWatch(state, sequence, None, "signature"),
                    sequence,
                ),
            )

        placement = placement_of_call(state, self.x, self.out)  # (None but for symmetric arrays)

        def prepare():
            validate(self.x, self.op, self.algorithm, self.out, self.reproducible, state.size)
            reduce_op = _op_of(self.op, self.reproducible)
            return reduce_op, plan_for(
                state,
                self.x,
                reduce_op,
                self.algorithm,
                self.out is self.x,
                placement,
                once=True,
                timed=self.timeout is not None,
            )

        reduce_op, plan = translated(
            state,
            self.sequence,
            lambda: agree_on_call(
                state.library,
                prepare,
                self.signature(),
                resolve=lambda p: {
                    "runs": p[1].describe(),
                    "symmetric at": placement is not None and placement.signature(),
                },
            ),
        )
        return Execution(
            state,
            plan.agreed_once(),
            reduce_op,
            self.x.shape,
            self.x.dtype,
            Memory.of(self.x),
            placement,
        )

    def trace_fields(
        self,
    ):  # (what the flight recorder's dump says of it: mpiallreduce.faults.recorder)
        return array_fields(
            self.x,
            kind="allreduce",
            site=self.site,
            op=_plain(self.op),
            timeout=self.timeout,
            in_place=self.out is self.x,
            algorithm=_plain(self.algorithm)
            if self.execution is None
            else self.execution.plan.name,
        )

    holds_arrays = (
        True  # (the recorder snapshots the description of a finished call: faults.recorder)
    )

    def run(self):
        return run_traced(self.entry, self._run)

    def _run(self):
        if self.timeout is None:
            self._meet()
            return self._run_met()
        try:
            self._meet()
            return self._run_met()
        except BaseException as error:  # (faults.bounded: where every rank retires it)
            bounded = self._bounds_collectives()
            timed_call_raised(self.state, self.sequence, error, bounded, self.rejected)
            raise

    def _bounds_collectives(self):
        """Whether this call's plan ran MPI's collectives on the timed calls' communicator."""
        execution = self.execution or self._planned()  # (None: refused here, the peers differ)
        return execution is not None and execution.bounds_collectives

    def _run_met(self):
        state, x = self.state, self.x
        if self.check:
            execution = self.agreed_execution()
        else:
            try:
                execution = execution_for(
                    state,
                    x,
                    self.op,
                    _op_of(self.op, self.reproducible),
                    self.algorithm,
                    self.reproducible,
                    keep=self.timeout is None,
                    in_place=self.out is x,
                    placement=placement_of_call(state, x, self.out),
                    timed=self.timeout is not None,
                )
            except (
                TypeError,
                ValueError,
            ) as error:  # (refused by the planner: an algorithm that cannot run here)
                if _compared(state):
                    self._agree_on_rejection(error, met=True)
                raise
        execution = execution.as_run(self.timeout)  # (what runs: the recorder names it)
        flat, self.execution = buffers.flat_buffers(x, self.out), execution
        xp = None if type(x) is np.ndarray else namespace(x)
        execution.run(flat.send, flat.recv, self.sequence, self.timeout, xp)
        return flat.finish()


_CHECKED = digest(
    ("check=True",)
)  # (the code every checked call compares first: Call.agreed_execution)


def _compared(state):  # (every call on this communicator compares its signature before data moves)
    return state.size > 1 and state.settings.signature_min_bytes == 0


def _renew_and_ready(state, current, untimed):
    if state.settings is not current:
        state.renew_settings(current)
    if untimed:  # (a timed call is made ready after its rendezvous: Call.sets_up)
        state.make_ready(state.sequence + 1)


def _plain(value):  # (an op or algorithm as the signature names it)
    return value if isinstance(value, str) else repr(value)
