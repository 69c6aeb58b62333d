"""The executor: one Plan bound to one kind of call, run on the call's buffers.

    Execution(state, plan, op, shape, dtype, kind)       made once per kind of call and kept (the
                                                         short path of a repeat; a prepared call
                                                         holds one)
    .run(send, recv, n, timeout, xp)   1. compare call #n's signature
                                          (mpiallreduce.core.consistency), unless the plan says it
                                          was agreed once or the algorithm carries it
                                       2. (a plan with ipc_probe: CUDA IPC probed, planned again)
                                       3. the route: MPI_Allreduce itself, or the algorithm on the
                                          library's communicator (CallTags + PeerWatch for messages
                                          only, and hierarchical's and two_level's inner plan), via
                                          the device path, widened to the accumulation dtype, or
                                          the reproducible sum's words route, or the runs an
                                          algorithm bound once (bind_runs: dissemination's compiled
                                          rounds); then a mean's division (by each slice's owner, if
                                          it finishes_slices)

Its parts, each a module of its own below this one: how the data moves once compared
(mpiallreduce.core.run_paths: RunPaths, which Execution inherits), the short path of a repeated
call in Python (mpiallreduce.core.short_path), and a timed call that raised
(mpiallreduce.core.timed_runs: timed_call_raised, given here too).

The only place that runs a plan and masks floating-point errors (np.errstate, as MPI's own
reductions do); what a failed run raises is core.failures' (a dead rank becomes RankFailure, a
truncated message a ValueError). It decides nothing: every choice is the plan's.
"""

import numpy as np
from mpi4py import MPI

from ..faults.outcome import end_alike
from ..faults.watch import PeerWatch
from . import buffers
from .compiled import short_path
from .consistency import agree_on_call, compare, digest
from .failures import raise_failed
from .ops import ignore_float_errors, restore_float_errors
from .persistent import bind_persistent
from .plan_cases import Memory, Route
from .run_paths import RunPaths
from .short_path import python_short_path
from .timed_runs import timed_call_raised

__all__ = ["Execution", "timed_call_raised"]


class Execution(RunPaths):
    """What every run of one plan needs, bound once (see the module's docstring)."""

    __slots__ = (
        "state",
        "plan",
        "op",
        "shape",
        "dtype",
        "datatype",
        "code",
        "describe",
        "compares_first",
        "direct",
        "divides",
        "divides_host",
        "mpi_op",
        "strides",
        "watched",
        "options",
        "carried",
        "raw",
        "raw_unchecked",
        "short",
        "after_probe",
        "runs",
        "bounds_collectives",
        "placement",
        "compares_placement",
        "kind",
        "after_set_up",
    )

    def __init__(
        self, state, plan, op, shape, dtype, kind, placement=None, compares_placement=None
    ):
        """``kind``: a Memory, or its text ("host"/"device": a misspelt one is a ValueError), the
        arrays'; ``op`` a ReduceOp; ``placement``: the
        symmetric arrays' (single_copy's); ``compares_placement``: the signature names it (default:
        where single_copy runs, or a timed call's plan in its place)."""
        self.state, self.plan, self.op, self.shape, self.dtype = (
            state,
            plan,
            op,
            tuple(shape),
            np.dtype(dtype),
        )
        self.datatype = buffers.mpi_datatype(self.dtype)
        kind = Memory(kind)
        host = kind is Memory.HOST
        signature = {
            "memory": kind.value,
            "shape": self.shape,
            "dtype": str(self.dtype),
            "op": op.name,
            "algorithm": plan.name,
            "route": plan.route.value,  # (its text: the digest and a mismatch's message)
            "in place (out=x)": plan.in_place,
        }
        if compares_placement is None:  # (the twins must lie at the same place on every rank)
            compares_placement = plan.algorithm.needs_symmetric or plan.instead_of == "single_copy"
        self.placement, self.compares_placement = placement, compares_placement
        if placement is not None and compares_placement:
            signature["symmetric (allocation, input, output)"] = placement.signature()
        #: the call's signature code: what every rank's must equal (the planner's name for what runs
        #: is in it, so ranks whose plans differ never run different algorithms together)
        self.code = digest(tuple(signature.items()))
        self.describe = lambda: signature
        self.compares_first = plan.compares and not plan.carried
        self.carried = plan.carried
        self.direct = (
            plan.name == "mpi"
            and plan.route is Route.PLAIN
            and plan.accumulate is None
            and not plan.local_only
            and plan.device_path is None
        )
        #: a mean: the direct path divides after (host arrays: bound once, ~0.4 us less per call)
        self.divides = op.divide_by_size and state.size != 1
        self.divides_host = (
            op.host_finish(self.dtype, state.size) if self.divides and host else None
        )
        self.mpi_op = op.mpi_op(self.dtype) if self.direct else None
        #: mpi4py finds a predefined datatype from the numpy array itself: no [buffer, datatype] to
        #: make
        self.raw = self.datatype.is_predefined and self.dtype.char in "bhilqBHILQefdgFDG?" and host
        self.raw_unchecked = self.raw and self.direct and not self.compares_first
        self.strides = np.empty(self.shape, self.dtype).strides if host else None
        self.watched = plan.algorithm.messages_only or plan.inner_on_tags
        #: a timed call runs MPI's collectives of this plan on the timed calls' own communicator,
        #: each wait bounded (faults.bounded): mpi, reduce_bcast, shared_memory, and hierarchical's
        #: and two_level's steps within a node; on device arrays too, through a CUDA-aware MPI
        #: (device buffers) or a round trip through host memory
        self.bounds_collectives = (
            plan.algorithm.bounded_collectives and not plan.local_only and not plan.route.compressed
        )
        self.options = (
            {"peers": placement}
            if plan.algorithm.needs_symmetric
            else {}
            if plan.inner is None
            else {"inner": plan.inner}
        )
        self.runs = (
            plan.algorithm.bind_runs(self) if host and not plan.local_only else None
        )  # (its own, bound once)
        self.short = (
            (short_path(self) or self._short_path()) if host else None
        )  # (compiled where it can)
        self.after_probe = None
        self.kind, self.after_set_up = kind, None

    def trace_fields(self):  # (what the flight recorder's dump says of a call that ran this)
        return {
            "kind": "allreduce",
            "site": "",
            "op": self.op.name,
            "algorithm": self.plan.name,
            "shape": list(self.shape),
            "dtype": str(self.dtype),
            "bytes": int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize,
            "in_place": self.plan.in_place,
        }

    def as_run(self, timeout):
        """What a call with ``timeout`` runs: this Execution, or, where a timed call would first
        grow a shared window (which no timeout bounds), planner.without_set_up's plan's."""
        if timeout is not None and self.bounds_collectives and self.needs_set_up():
            return self._without_set_up()
        return self

    def _without_set_up(self):
        """The Execution of planner.without_set_up's plan for this one (made once)."""
        if self.after_set_up is None:
            from .planner import without_set_up

            plan = without_set_up(
                self.plan,
                self.state.facts,
                self.kind is Memory.DEVICE,
                self.dtype,
                int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize,
                self.op.name,
            )
            self.after_set_up = Execution(
                self.state,
                plan,
                self.op,
                self.shape,
                self.dtype,
                self.kind,
                self.placement,
                self.compares_placement,
            )
        return self.after_set_up

    def _probed(self, xp):
        """The plan ``ipc_probe`` asks for: CUDA IPC probed (collective, once per communicator, in
        this call's turn, past its signature check), then planned again and compared (one allgather:
        one rank may have asked for device_to_device by name, now refused, and another for
        "auto")."""
        if self.after_probe is None:
            from .planner import plan_call

            state = self.state
            state.learn_cuda_ipc(xp)
            # (the one comparison of arguments and plans: a plan refused on some ranks is raised on
            # all)
            after = agree_on_call(
                state.library,
                lambda: Execution(
                    state,
                    plan_call(state.facts, *self.plan.ipc_probe),
                    self.op,
                    self.shape,
                    self.dtype,
                    Memory.DEVICE,
                ),
                {},
                resolve=lambda execution: {
                    "plan once CUDA IPC was probed": execution.plan.describe()
                },
            )
            self.after_probe = after
        return self.after_probe

    def run(self, send, recv, sequence, timeout=None, xp=None, compared=False):
        """Reduce ``send`` (flat, or None when ``recv`` holds this rank's input) into ``recv``
        (flat) as call #``sequence``; ``xp``: CuPy for device arrays, else None. ``compared``: the
        signature was compared already (by the plan this one replaced once CUDA IPC was probed)."""
        state = self.state
        if timeout is not None:  # (untimed calls skip the method call: the hot path)
            runs = self.as_run(timeout)
            if runs is not self:  # (a window to grow inside the call: planner.without_set_up)
                return runs.run(send, recv, sequence, timeout, xp, compared)
        # A timed call whose plan talks in messages, or runs MPI's collectives (faults.bounded),
        # ends alike on every rank (faults.outcome): every wait bounded by the timeout, the result
        # kept from the user's array until every rank's part is done. A timed call runs no other
        # (single_copy, device_to_device: planner.timed_instead).
        timed = timeout is not None and state.size > 1
        bounded = timed and self.bounds_collectives
        alike = timed and (self.plan.algorithm.messages_only or bounded)
        watch = (
            PeerWatch(state, sequence, timeout, self.plan.name) if self.watched or bounded else None
        )
        probed, final = None, None
        if alike:  # (the user's array gets the result once agreed: no stale tail on failure)
            final, recv = recv, buffers.empty_like(recv)
            if send is None:
                buffers.copy_into(recv, final)
        try:
            if self.compares_first and not compared:
                compare(
                    state,
                    self.code,
                    self.describe,
                    lambda: PeerWatch(state, sequence, timeout if alike else None, "signature"),
                    sequence,
                )
            if self.plan.ipc_probe is not None:
                probed = self._probed(xp)
            elif self.direct and not bounded:
                if self.raw:
                    state.library.Allreduce(
                        MPI.IN_PLACE if send is None else send, recv, self.mpi_op
                    )
                else:
                    state.library.Allreduce(
                        MPI.IN_PLACE if send is None else [send, self.datatype],
                        [recv, self.datatype],
                        self.mpi_op,
                    )
                if self.divides:
                    self.divide(recv)
                return recv
            else:
                ignoring = ignore_float_errors()
                try:
                    self._reduce(send, recv, sequence, timeout, xp, watch, bounded)
                finally:
                    restore_float_errors(ignoring)
                if alike:
                    end_alike(state, sequence, timeout, self.plan.name)
                    buffers.copy_into(final, recv)
                    recv = final
        except BaseException as error:
            raise_failed(error, state, sequence, watch)
        if probed is not None:
            return probed.run(send, recv, sequence, timeout, xp, compared=True)
        return recv

    def needs_set_up(self):
        """Whether a run must first make something collective (a larger shared window): then it runs
        on the caller's thread, after the pending asynchronous calls (mpiallreduce.core.call)."""
        plan = self.plan
        return not plan.local_only and plan.algorithm.needs_set_up(
            self.state.library, plan.working_bytes
        )

    def set_up(self):
        """Make it (collective: every rank, after the call was agreed on; a prepared call, once)."""
        plan = self.plan
        if not plan.local_only:
            plan.algorithm.set_up(self.state.library, plan.working_bytes)

    def bound(self, send, recv, timeout, xp, kept=False):
        """``run`` with its buffers bound for good (a prepared call): a function of the call's
        number. The plain MPI_Allreduce of an unchecked, untimed host call is bound with its
        arguments; for good (``kept``: a prepared call's own buffers) as a persistent request where
        the plan says (``kept="always"``: wherever the plan can be one, as tune measures it)."""
        if self.direct and not self.compares_first and timeout is None and xp is None:
            state, allreduce, mpi_op, divide = (
                self.state,
                self.state.library.Allreduce,
                self.mpi_op,
                self.divides,
            )
            # ([buffer, datatype] made once: mpi4py then skips reading the array's format, ~0.1 us)
            source, target = (
                MPI.IN_PLACE if send is None else [send, self.datatype],
                [recv, self.datatype],
            )
            persistent = (
                kept
                and (self.plan.persistent is not None if kept == "always" else self.plan.persistent)
                and bind_persistent(
                    state.library,
                    source,
                    target,
                    mpi_op,
                    lambda error, sequence: raise_failed(error, state, sequence, None),
                    then=(lambda: self.divide(recv)) if divide else None,
                )
            )
            if persistent:
                return persistent

            def run_bound(sequence):
                try:
                    allreduce(source, target, mpi_op)
                    if divide:
                        self.divide(recv)
                except BaseException as error:
                    raise_failed(error, state, sequence, None)

            #: what the compiled run binds (mpiallreduce.core.compiled: a prepared call's plain
            #: MPI_Allreduce in C): the buffers' addresses, the count, the handles; then, failed
            count = recv.nbytes // self.datatype.extent  # (as mpi4py counts [recv, datatype])
            run_bound.plain = (
                (0 if send is None else send.ctypes.data, recv.ctypes.data, count)
                + (self.datatype.handle, mpi_op.handle, state.library.handle),
                (lambda: self.divide(recv)) if divide else None,
                lambda error, sequence: raise_failed(
                    MPI.Exception(error) if isinstance(error, int) else error,
                    state,
                    sequence,
                    None,
                ),
            )
            if count > 2**31 - 1:  # (one C int: larger counts stay with mpi4py's large-count call)
                run_bound.plain = None
            return run_bound
        return lambda sequence: self.run(send, recv, sequence, timeout, xp)

    def _short_path(self):
        """``short(x, out)``, the short path of a repeated call in Python
        (mpiallreduce.core.short_path)."""
        return python_short_path(self)
