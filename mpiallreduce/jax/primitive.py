"""One JAX primitive, ``mpiallreduce_allreduce``: an allreduce of one array over MPI processes.

    allreduce_leaf(x, op, comm)
      bind ──> abstract eval: x's shape and dtype, and an ordered effect (MpiEffect)
      lowering (CPU): a custom call of the XLA FFI handler (handler.py, _ffi.cc) taking x and
                      the effect's token, giving the result (aliased to x: in place where XLA
                      can) and the next token; so XLA keeps every rank's calls in program order,
                      never merges, drops or hoists one, and runs it when its result is unused
      eagerly: the same, compiled for the one call (jax's apply_primitive)
      vmap:   the whole batch in one call (an allreduce is elementwise)
      jvp:    sum: the tangent reduced the same way; max, min: JAX's own error, as for lax.pmax
      transpose: sum's is a sum over the processes (as jax.lax.psum's)

Each call carries its signature (a digest of shape, dtype, op and communicator) and a line that
says it; the handler compares the digests across the ranks first and, where they differ, raises
on every rank naming each rank's call (settings: MPIALLREDUCE_SIGNATURE_MIN_BYTES, as for every
call). Calls run on a duplicate of the user's communicator kept for JAX alone.
"""

from functools import partial

import numpy as np
from jax._src import dispatch, effects
from jax._src.interpreters import mlir
from jax._src.lib.mlir.dialects import hlo
from jax.extend.core import Primitive
from jax.interpreters import ad, batching
from mpi4py import MPI

from ..core.comms import cached
from ..core.consistency import digest
from ..core.settings import settings
from ..core.state import state_of
from ..faults.recorder import named_members
from .choice import HANDLER_ALGORITHMS, choose
from .handler import TARGET, loaded, register
from .records import name_communicator, site
from .slots import hand_slots

__all__ = ["allreduce_leaf", "allreduce_p", "OPS"]

#: the ops the handler takes, by its number for them (_ffi.cc: OpOf); "refused": a call this rank
#: cannot make, compared like any other, then raised on every rank with its reason (``given``)
OPS = {"sum": 0, "max": 1, "min": 2, "refused": -1}


class MpiEffect(effects.Effect):
    """Every call's effect: ordered (a token threads them), allowed in control flow, custom
    derivatives and remat."""

    __str__ = lambda _: "mpiallreduce"  # noqa: E731


EFFECT = MpiEffect()
for _kind in (
    effects.lowerable_effects,
    effects.ordered_effects,
    effects.control_flow_allowed_effects,
    effects.custom_derivatives_allowed_effects,
    effects.remat_allowed_effects,
):
    _kind.add_type(MpiEffect)


class Communicator:
    """The call's communicator as a primitive parameter: hashable, compared by handle."""

    __slots__ = ("comm", "handle", "size", "name", "trace_id")

    def __init__(self, kept):
        self.comm, self.handle, self.size = kept.comm, kept.comm.handle, kept.comm.Get_size()
        self.name, self.trace_id = ",".join(map(str, kept.members)), kept.trace_id

    def __hash__(self):
        return self.handle  # (an int: its own hash)

    def __eq__(self, other):
        return isinstance(other, Communicator) and other.handle == self.handle

    def __repr__(self):
        return f"ranks {self.name}"


allreduce_p = Primitive("mpiallreduce_allreduce")
allreduce_p.def_impl(partial(dispatch.apply_primitive, allreduce_p))


def _abstract(x, *, op, comm, given, algorithm, timeout):
    return x, {EFFECT}  # (its weak type kept, as jax.lax.psum's)


allreduce_p.def_effectful_abstract_eval(_abstract)


def allreduce_leaf(x, op, comm, given=None, algorithm="auto", timeout=None):
    """``x`` reduced by ``op`` ("sum", "max", "min") over ``comm``'s ranks (made ready on first
    use: collective, at trace time, on every rank alike), by the handler's algorithm for it
    (mpiallreduce.jax.choice), within ``timeout`` seconds (None: the MPIALLREDUCE_TIMEOUT
    setting; 0 or None there: no deadline)."""
    register()
    # (the library's and the user's calls never cross; kept for the process's life, not freed
    # with ``comm``: a compiled program holds its handle, which MPI would give a later one)
    kept = cached(comm, ("jax",), lambda: _Kept(comm.Dup()))
    given = str(x.dtype) if given is None else given  # (the user's dtype, where widened)
    # (every call, refused or named, makes its communicator's state ready here at its first
    # trace: a collective every rank's first call on it joins, whatever it asks for)
    state_of(kept.comm).make_ready()
    if not kept.handed:  # (then, on one node, its shared regions: collective, at the same turn)
        kept.handed = True
        hand_slots(kept.comm, loaded())
    if op == "refused":  # (compared, then raised: no data moves)
        choice = "mpi"
    else:
        choice = choose(kept.comm, x.dtype, x.size * x.dtype.itemsize, op, algorithm).name
    timeout = settings().timeout if timeout is None else timeout
    return allreduce_p.bind(
        x,
        op=op,
        comm=Communicator(kept),
        given=given,
        algorithm=choice,
        timeout=float(timeout or 0.0),
    )


class _Kept:
    """A communicator held for good (not a communicator to core.comms.cached, which frees those
    with the one they were made for); every one made, listed, so none is collected either."""

    made: list[MPI.Intracomm] = []

    def __init__(self, comm):
        self.comm, self.handed = comm, False
        self.members, self.trace_id = named_members(comm)  # (the recorder's names)
        self.trace_id = f"jax {self.trace_id}"
        name_communicator(self.trace_id, self.members, comm.Get_rank())
        _Kept.made.append(comm)


def _lowering(ctx, x, *, op, comm, given, algorithm, timeout):
    (aval,) = ctx.avals_in
    token = ctx.tokens_in.get(EFFECT)
    described = (
        given
        if op == "refused"
        else f"{op} of {tuple(aval.shape)} {given} over {comm} by {algorithm}"
        + (" timed" if timeout > 0 else "")
    )
    code = digest(("jax", described))
    site(
        code,
        shape=list(aval.shape),
        dtype=given if op != "refused" else str(aval.dtype),
        op=op,
        in_place=True,
        what=described,
    )
    layout = tuple(range(len(aval.shape) - 1, -1, -1))
    call = mlir.custom_call(
        TARGET,
        result_types=[mlir.aval_to_ir_type(ctx.module_context, aval), hlo.TokenType.get()],
        operands=[x, token],
        backend_config={
            "comm": mlir.ir_attribute(np.int64(comm.handle)),
            "op": mlir.ir_attribute(np.int64(OPS[op])),
            "code": mlir.ir_attribute(np.int64(code)),
            # (by the setting alone, not the size: ranks whose sizes differ must all compare; a
            # refused call always, so that its peers learn of it)
            "compare": mlir.ir_attribute(
                bool(op == "refused" or settings().signature_min_bytes >= 0)
            ),
            "describe": mlir.ir_attribute(described),
            "algorithm": mlir.ir_attribute(np.int64(HANDLER_ALGORITHMS[algorithm])),
            "timeout": mlir.ir_attribute(np.float64(timeout)),
            "comm_name": mlir.ir_attribute(comm.trace_id),
        },
        has_side_effect=True,
        api_version=4,
        operand_layouts=[layout, ()],
        result_layouts=[layout, ()],
        operand_output_aliases={0: 0},
    )
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({EFFECT: call.results[1]})))
    return [call.results[0]]


mlir.register_lowering(allreduce_p, _lowering, platform="cpu")


def _on_a_gpu(ctx, x, **params):
    raise NotImplementedError(
        "mpiallreduce.jax reduces host (CPU) arrays inside jit; this call was lowered for a GPU, "
        "which it has no handler for yet (docs/jax.md, 'Not yet'): place the arrays on the CPU "
        "(jax.device_put(x, jax.devices('cpu')[0])), or call mpiallreduce.jax eagerly (outside "
        "jit) on device arrays: they go to CuPy through DLPack"
    )


for _platform in ("cuda", "rocm"):
    mlir.register_lowering(allreduce_p, _on_a_gpu, platform=_platform)


def _batched(args, dims, **params):
    (x,), (dim,) = args, dims
    return allreduce_p.bind(x, **params), dim  # (elementwise: the batch rides along)


batching.primitive_batchers[allreduce_p] = _batched


def _jvp(primals, tangents, **params):
    op = params["op"]
    # (a refused call is differentiated as a sum would be, its tangent refused too: it makes the
    # calls its peers make, and is raised on every rank when it runs, not here on one rank)
    if op not in ("sum", "refused"):  # (JAX's collectives have none for pmax, pmin: nor this)
        raise NotImplementedError(
            f"Differentiation rule for '{allreduce_p.name}' (op={op}) not implemented"
        )
    (x,), (t,) = primals, tangents
    value = allreduce_p.bind(x, **params)
    if type(t) is ad.Zero:
        return value, t
    return value, allreduce_p.bind(t, **params)


def _transpose(cotangent, x, **params):
    if type(cotangent) is ad.Zero:
        return [cotangent]
    return [allreduce_p.bind(cotangent, **params)]  # (a sum's transpose: a sum)


ad.primitive_jvps[allreduce_p] = _jvp
ad.primitive_transposes[allreduce_p] = _transpose
