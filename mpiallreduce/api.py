"""The entries: ``allreduce``, ``allreduce_async``, ``prepare``, ``describe_call``, ``psum`` & co.

Every entry goes through the same pipeline (docs/architecture.md):

    entry (here)        a Call: arguments checked, communicator resolved, state made, the call
                        numbered, on the caller's thread, in program order (mpiallreduce.core.call)
    plan                mpiallreduce.core.planner: what runs and how (algorithm, route, device path,
                        signature, inner plan), the same on every rank, decided once per kind of
                        call
    executor            mpiallreduce.core.executor: the signature compared
                        (mpiallreduce.core.consistency), the plan run, MPI errors translated, float
                        errors masked

A call that repeats one already made (same communicator, dtype, shape, op, algorithm, no check,
no timeout, contiguous numpy arrays) finds its Execution again (the short path); a prepared call
holds one, with its buffers bound.
"""

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI
from numpy.typing import DTypeLike

from .core.annotations import Array, AxisName, Groups, Op, Timeout
from .core.call import WORLD, Call, check_comm, validate
from .core.gather import symmetric_array
from .core.prepared import Prepared
from .core.settings import settings
from .core.startup import check_world_matches_slurm
from .core.state import WORLD_FAST_CALLS, known_state, state_of
from .core.worker import (
    AllreduceHandle,
    Meeting,
    check_thread_level,
    run_here,
    submit,
    submit_prepared,
)
from .faults.errors import call_site
from .faults.recorder import run_traced

if TYPE_CHECKING:  # (core.mesh is imported by the calls that name an axis)
    from .core.mesh import Mesh

__all__ = [
    "allreduce",
    "allreduce_async",
    "prepare",
    "PreparedAllreduce",
    "describe_call",
    "empty",
    "zeros",
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "CHECK_ENV",
]

check_world_matches_slurm()  # the silent-singleton trap, before anything is reduced

#: environment variable that turns ``check`` on for every call (read once:
#: mpiallreduce.core.settings)
CHECK_ENV = "MPIALLREDUCE_CHECK"
_COMMUNICATOR_TYPES = (MPI.Intracomm, MPI.Cartcomm, MPI.Graphcomm, MPI.Distgraphcomm)
#: (no Execution is kept for a communicator not used yet: core.executor.Execution, by call key)
_NO_CALLS: dict[tuple[Any, ...], Any] = {}


def allreduce(
    x: Array,
    op: Op = "sum",
    algorithm: str = "auto",
    comm: MPI.Intracomm | None = None,
    out: Array | None = None,
    check: bool = False,
    *,
    axis: AxisName = None,
    mesh: "Mesh | None" = None,
    groups: Groups = None,
    timeout: Timeout = None,
    reproducible: bool = False,
) -> Array:
    """Reduce ``x`` elementwise over every rank of ``comm``; every rank gets the same bits.

    Args:
        x: numpy or CuPy array, any shape, contiguous or strided, of an integer, float or complex
            dtype (float16 and bfloat16 included: the hand-written algorithms sum those in float32
            and round once). A CuPy array's result is a CuPy array on the same device, ordered on
            CuPy's current stream; see mpiallreduce.transports for how device memory travels.
            A jax array (eagerly or inside ``jax.jit``) is handed to ``mpiallreduce.jax.allreduce``
            (docs/jax.md), its result a new jax array.
        op: "sum", "prod", "min", "max" or "mean" (sum, then divided by the number of ranks;
            floating and complex dtypes only).
        algorithm: "auto" or one of ``mpiallreduce.ALGORITHMS``.
        comm: an mpi4py intracommunicator; ``MPI.COMM_WORLD`` if None.
        out: None for a new array, or an array of x's shape and dtype to write into; ``out=x``
            reduces in place. Otherwise ``x`` is not modified.
        check: True (or MPIALLREDUCE_CHECK=1) to have the ranks first agree that their arguments
            are valid and that shape, dtype, op, the algorithm ``auto`` resolved to, the call's
            number on ``comm`` and its call site (file:line) match; otherwise every rank raises the
            same ValueError/TypeError naming the ranks and what differs. Without it, calls of
            every size still compare shape, dtype, op, algorithm and route before any
            data moves (MPIALLREDUCE_SIGNATURE_MIN_BYTES raises that size), so that a mismatch is
            the same ValueError on every rank, never wrong values.
        axis: a mesh axis name or tuple of names: reduce over the ranks along it, of ``mesh`` or of
            the mesh made current with ``with mesh:`` (instead of ``comm``).
        mesh: a :class:`mpiallreduce.Mesh`; without ``axis``, all its ranks.
        groups: a partition of the ranks (of the axis, or of the communicator) into lists; each
            rank reduces with its own group only (``mean`` divides by that group's size).
        timeout: seconds (> 0) to wait for the other ranks to reach this call (default
            MPIALLREDUCE_TIMEOUT; None there: wait for ever); see mpiallreduce.faults.
        reproducible: True (op "sum" or "mean"; float16, bfloat16, float32, float64): the same bits
            whatever the algorithm, segment size, rank order, or ranks that add zeros: exact
            fixed-point accumulation (mpiallreduce.reproducible, which states the error bound);
            ``auto`` moves the bytes of an ordinary sum (the direct route).

    Returns:
        the result: ``out`` if given, else a new C-contiguous array shaped like ``x``.

    Raises:
        TypeError, ValueError: bad arguments, raised before any data moves on the rank given them,
            while every other rank raises a ValueError naming that rank and its error (the ranks
            compare the call first; with MPIALLREDUCE_SIGNATURE_MIN_BYTES set above 0, only on the
            rank given them, unless ``check``); ValueError on every rank when the ranks' calls
            differ, or their settings do (mpiallreduce.core.settings).
        AllreduceTimeout: not every rank reached this call within ``timeout``, on every rank that
            did.
        RankFailure: a rank died during the call (under ULFM), on every survivor.
    """
    if (
        check is False
        and timeout is None
        and axis is None
        and mesh is None
        and groups is None
        and type(x) is np.ndarray
    ):  # the short path of a repeated call
        try:
            execution = (WORLD_FAST_CALLS if comm is None else _fast_calls(comm)).get(
                (x.shape, x.dtype, op, algorithm, out is x)
                if reproducible is False
                # (the keys
                else (x.shape, x.dtype, op, algorithm, out is x, bool(reproducible), np.ndarray)
            )  # execution_for keeps)
        except (
            TypeError
        ):  # (an unhashable op, MPI.SUM say: the general path takes it, or names the choices)
            execution = None
        if (
            execution is not None and not execution.state.worker.pending
        ):  # (none queued on its communicator)
            result = execution.short(x, out)
            if result is not None:
                return result
    if _is_jax(x):  # (``check``: a jax call's signature is always compared)
        return _through_jax(x, op, algorithm, comm, out, axis, mesh, groups, timeout, reproducible)
    call = Call.start(
        x, op, algorithm, comm, out, check, axis, mesh, groups, timeout, reproducible=reproducible
    )
    return call.in_turn()  # (after the pending asynchronous calls, if there are any)


def _is_jax(x: object) -> bool:
    return type(x).__module__.split(".")[0] in ("jax", "jaxlib")


def _through_jax(
    x: Array,
    op: Op,
    algorithm: str,
    comm: MPI.Intracomm | None,
    out: Array | None,
    axis: AxisName,
    mesh: "Mesh | None",
    groups: Groups,
    timeout: Timeout,
    reproducible: bool,
) -> Array:
    """A jax array (or a tracer, inside jax.jit): mpiallreduce.jax.allreduce, the same call
    compiled (a new jax array: they are immutable). What it does not take is said here."""
    refused = [
        name
        for name, given in (
            ("out", out),
            ("axis", axis),
            ("mesh", mesh),
            ("groups", groups),
            ("reproducible", reproducible or None),
        )
        if given is not None
    ]
    if refused:
        raise TypeError(
            f"x is a jax array: mpiallreduce.allreduce passes it to mpiallreduce.jax.allreduce, "
            f"which takes no {', '.join(refused)} (jax arrays are immutable; for axes, use "
            "mpiallreduce.jax.psum(x, axis_name) under `with mpiallreduce.Mesh(...)`)"
        )
    from . import jax as mj

    if isinstance(op, MPI.Op):  # (MPI's names for them: mpi4py's ops are not hashable)
        op = next((n for o, n in ((MPI.SUM, "sum"), (MPI.MAX, "max"), (MPI.MIN, "min")) if op == o),
                  op)  # fmt: skip
    if not isinstance(op, str) or op not in ("sum", "mean", "max", "min"):
        raise ValueError(
            f"x is a jax array: mpiallreduce.jax reduces by sum, mean, max or min, got {op!r}"
        )
    return mj.allreduce(x, op=op, comm=comm, algorithm=algorithm, timeout=timeout)


def _fast_calls(comm: MPI.Intracomm) -> dict[tuple[Any, ...], Any]:
    """The Executions kept for ``comm``'s repeated calls (none before its first call)."""
    if type(comm) not in _COMMUNICATOR_TYPES:
        return _NO_CALLS
    state = known_state(comm)
    return _NO_CALLS if state is None else state.fast_calls


def allreduce_async(
    x: Array,
    op: Op = "sum",
    algorithm: str = "auto",
    comm: MPI.Intracomm | None = None,
    out: Array | None = None,
    check: bool = False,
    **kwargs: Any,
) -> AllreduceHandle:
    """Start ``allreduce(x, ...)`` (same arguments) in the background; returns an AllreduceHandle.

    The communicator, its library state, the call's number and call site are taken here, on the
    calling thread, in program order; the worker thread only runs the call, on the library's own
    communicators. ``x`` (and ``out``) must not change until ``wait()`` returns: the worker reads
    and writes them meanwhile, and a change makes the result wrong on every rank (Horovod has the
    same rule). With ``check=True`` (or MPIALLREDUCE_DEBUG_INPUTS=1) the input is checksummed here
    and again when the reduction has finished, and the ranks agree: if it changed on any rank, every
    rank's ``wait()`` raises RuntimeError naming the ranks.
    """
    check_thread_level()
    unknown = set(kwargs) - {"axis", "mesh", "groups", "timeout", "reproducible"}
    if unknown:
        raise TypeError(f"allreduce_async got unexpected keyword arguments {sorted(unknown)}")
    reproducible = kwargs.get("reproducible", False)
    call = Call.start(
        x,
        op,
        algorithm,
        comm,
        out,
        check,
        kwargs.get("axis"),
        kwargs.get("mesh"),
        kwargs.get("groups"),
        kwargs.get("timeout"),
        reproducible=reproducible,
    )
    meeting = call.meeting = Meeting(call.timeout, call.site)
    description = (
        f"{'reproducible ' if reproducible else ''}allreduce of {getattr(x, 'shape', '?')} "
        f"{getattr(x, 'dtype', type(x).__name__)} op={op}"
    )
    checked = call.check or settings().debug_inputs
    return submit(
        call.state,
        call.run,
        x,
        description,
        meeting,
        checksum_comm=call.state.library if checked else None,
        here=call.sets_up(),
    )


def prepare(
    x: Array,
    op: Op = "sum",
    algorithm: str = "auto",
    comm: MPI.Intracomm | None = None,
    out: Array | None = None,
    *,
    axis: AxisName = None,
    mesh: "Mesh | None" = None,
    groups: Groups = None,
    timeout: Timeout = None,
    reproducible: bool = False,
) -> "PreparedAllreduce":
    """Collective: the ranks compare the call once (as ``check=True``) and it is planned once; a
    PreparedAllreduce, whose runs then reduce x's current contents with no check and no decision.
    Every rank must run it at the same point (timed: SignatureMismatch everywhere where another
    kind of call meets it; untimed: as MPI's persistent collectives, a mismatch waits for ever).
    ``reproducible``: as ``allreduce``'s, each run's sum exact (mpiallreduce.reproducible)."""
    return prepare_at(
        call_site(2),
        x,
        op,
        algorithm,
        comm,
        out,
        axis=axis,
        mesh=mesh,
        groups=groups,
        timeout=timeout,
        reproducible=reproducible,
    )


def prepare_at(
    site: str,
    x: Array,
    op: Op = "sum",
    algorithm: str = "auto",
    comm: MPI.Intracomm | None = None,
    out: Array | None = None,
    *,
    axis: AxisName = None,
    mesh: "Mesh | None" = None,
    groups: Groups = None,
    timeout: Timeout = None,
    persistent: bool | str = True,
    reproducible: bool = False,
) -> "PreparedAllreduce":
    """``prepare`` with the call site to compare given (the library's own prepared calls,
    GradientSync's buckets, give "": they are compared by what they reduce, not by where the user's
    code was); ``persistent=False``: never a persistent request (a call also run on other memory);
    ``"always"``: one wherever MPI's own persistent allreduce can run, whatever the table says (what
    ``tune`` measures against the blocking call: mpiallreduce.tools.persistent_rules)."""
    call = Call.start(
        x, op, algorithm, comm, out, True, axis, mesh, groups, timeout, site, reproducible
    )
    # (it makes its shared window, if it needs one; the flight recorder's entry is the agreement's)
    return run_here(
        call.state, lambda: run_traced(call.entry, lambda: PreparedAllreduce(call, persistent))
    )


class PreparedAllreduce(Prepared):
    """An allreduce agreed on and planned once (see ``prepare``): call it (or ``.run()``) for the
    result, the same array every run; ``.start()`` runs it in the background (an
    AllreduceHandle)."""

    def __init__(self, call: Call, persistent: bool | str = True) -> None:
        super().__init__(call, persistent)
        self.result = self.flat.result

    # (its own signature: Prepared.start is the pipeline's, given the worker's submit function)
    def start(self, here: bool = False) -> AllreduceHandle:  # type: ignore[override]
        """Run in the background (allreduce_async's worker); an AllreduceHandle. ``here``: run it
        now, on this thread (after the pending asynchronous calls), the handle holding its
        outcome."""
        return super().start(lambda run: submit_prepared(self, run, here))

    # GradientSync's (mpiallreduce.training.reduction): the call as agreed, run in place on another
    # numpy array like x (None: on x), prepared in place and not persistent. Not checked across the
    # ranks, so not public: there, the step's digest has agreed the gradients on every rank first.
    def _run_on(self, array: np.ndarray | None = None) -> Array:
        return Prepared._call(self, _elsewhere=None if array is None else self._elsewhere(array))

    def _start_on(self, array: np.ndarray | None = None) -> AllreduceHandle:
        return super().start(
            lambda run: submit_prepared(self, run, False),
            None if array is None else self._elsewhere(array),
        )

    def _elsewhere(self, on: np.ndarray) -> tuple[Callable[..., Any], np.ndarray]:
        if self.state.library is None:  # (before binding to the freed communicator)
            self._freed()
        if not (
            not self.plan.algorithm.needs_symmetric
            and self.flat.send is None
            and self.flat.write_back is None
            and not self.persistent
            and type(on) is type(self.x) is np.ndarray
            and on.shape == self.x.shape
            and on.dtype == self.x.dtype
            and on.flags.c_contiguous
            and on.flags.writeable
        ):
            raise ValueError(
                f"a prepared call runs on a writeable C-contiguous numpy array of x's shape and "
                "dtype, prepared in place, not persistent and not single_copy; got "
                f"{getattr(on, 'shape', '?')} {getattr(on, 'dtype', type(on).__name__)}"
            )
        return self.execution.bound(None, on.reshape(-1), self.timeout, self.xp), on

    def __repr__(self) -> str:
        return (
            f"<PreparedAllreduce {self.x.shape} {self.x.dtype} {self.op.name}: "
            f"{self.plan.describe()}"
            + ("; persistent (MPI_Allreduce_init)" if self.persistent else "")
            + ">"
        )


def empty(
    shape: int | Sequence[int], dtype: DTypeLike = np.float64, comm: MPI.Intracomm | None = None
) -> np.ndarray:
    """Collective over ``comm`` (COMM_WORLD if None): a symmetric numpy array, uninitialised. Every
    rank calls it with the same shape and dtype (otherwise SignatureMismatch on every rank); the
    ranks of each node then share the memory of their arrays (MPI_Win_allocate_shared). An
    allreduce whose ``x`` and ``out`` are symmetric (or ``out=x``), at the same place on every rank
    of one node, reads each peer's input where it lies and writes each result once: no staging copy
    (the single_copy algorithm; docs/algorithms.md). Anywhere else it is an ordinary numpy array.
    It lives until ``comm`` is freed (COMM_WORLD's: at exit); using it after that is using freed
    memory. Peers write into it during a single-copy allreduce only, once every rank has arrived."""
    return symmetric_array(comm, shape, dtype, zero=False)


def zeros(
    shape: int | Sequence[int], dtype: DTypeLike = np.float64, comm: MPI.Intracomm | None = None
) -> np.ndarray:
    """``empty``, filled with zeros on every rank before any rank returns."""
    return symmetric_array(comm, shape, dtype, zero=True)


def describe_call(
    x: Array,
    op: Op = "sum",
    algorithm: str = "auto",
    comm: MPI.Intracomm | None = None,
    reproducible: bool = False,
    out: Array | None = None,
    timeout: Timeout = None,
) -> str:
    """What ``allreduce(x, op=op, algorithm=algorithm, comm=comm, out=out, timeout=timeout)`` would
    run, and why: the whole plan (algorithm, route, device path, accumulation, inner plan,
    signature), in a line. A timed call (``timeout``, or MPIALLREDUCE_TIMEOUT) never runs
    single_copy or device_to_device: the plan says what it runs instead.

    Collective the first time a communicator is used (its state is made), then local.
    """
    comm = check_comm(WORLD if comm is None else comm)
    state = state_of(comm)
    state.make_ready()
    validate(x, op, algorithm, out, reproducible, state.size)
    from .core.call import _op_of
    from .core.kinds import execution_for
    from .core.symmetric import placement_of_call

    timeout = settings().timeout if timeout is None else timeout
    placement = placement_of_call(state, x, out)
    execution = execution_for(
        state,
        x,
        op,
        _op_of(op, reproducible),
        algorithm,
        reproducible,
        False,
        out is x,
        placement,
        timed=timeout is not None,
    )
    return execution.as_run(timeout).plan.describe()  # (a window's growth: the ring instead)


# JAX's names and argument order (jax.lax.psum(x, axis_name, *, axis_index_groups=None)).
# axis_name=None: every rank of COMM_WORLD.


def psum(x: Array, axis_name: AxisName = None, *, axis_index_groups: Groups = None) -> Array:
    """Sum over the mesh axis ``axis_name`` (within ``axis_index_groups`` if given)."""
    return allreduce(x, op="sum", axis=axis_name, groups=axis_index_groups)


def pmean(x: Array, axis_name: AxisName = None, *, axis_index_groups: Groups = None) -> Array:
    """Mean over the axis; with groups, each rank divides by the size of its own group."""
    return allreduce(x, op="mean", axis=axis_name, groups=axis_index_groups)


def pmax(x: Array, axis_name: AxisName = None, *, axis_index_groups: Groups = None) -> Array:
    return allreduce(x, op="max", axis=axis_name, groups=axis_index_groups)


def pmin(x: Array, axis_name: AxisName = None, *, axis_index_groups: Groups = None) -> Array:
    return allreduce(x, op="min", axis=axis_name, groups=axis_index_groups)
