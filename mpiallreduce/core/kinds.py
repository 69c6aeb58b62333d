"""The plan and the Execution of a kind of call: the planner's cache asked with a call's arguments,
and the Executions kept for the short path of repeated calls (CommState.fast_calls)."""

import numpy as np

from ..device.arrays import namespace
from .executor import Execution
from .planner import plan_call

__all__ = ["plan_for", "execution_for"]


def plan_for(state, x, op, algorithm, in_place=False, placement=None, once=False):
    """The plan of a call of ``x`` (``in_place``: out=x) with ReduceOp ``op`` on a ready state (the
    one plan cache: mpiallreduce.core.planner.plan_call); ``placement``: x and out are symmetric;
    ``once``: the call is compared once, when made (a prepared call)."""
    on_device = type(x) is not np.ndarray and namespace(x) is not None
    return plan_call(
        state.facts,
        on_device,
        x.dtype,
        x.nbytes,
        op.name,
        algorithm,
        in_place,
        placement is not None,
        once,
    )


def execution_for(
    state, x, op, reduce_op, algorithm, reproducible, keep, in_place=False, placement=None
):
    """The Execution of this kind of call, made once and kept on the state when ``keep`` (an
    untimed call: the key the short path finds it by says nothing of a timeout). Symmetric arrays
    (``placement``) are kept by where their twins lie too (the short path never finds them)."""
    if placement is not None:
        key = ("symmetric", x.shape, x.dtype, op, algorithm, in_place, placement.signature())
        execution = state.fast_calls.get(
            key
        )  # (allocation numbers are never reused on a communicator)
        if execution is None:
            plan = plan_for(state, x, reduce_op, algorithm, in_place, placement)
            execution = Execution(state, plan, reduce_op, x.shape, x.dtype, "host", placement)
            if keep and isinstance(algorithm, str) and isinstance(op, str):
                state.keep(key, execution)
        return execution
    key = (
        (x.shape, x.dtype, op, algorithm, in_place)
        if type(x) is np.ndarray and not reproducible  # (the short
        else (x.shape, x.dtype, op, algorithm, in_place, reproducible, type(x))
    )  # path's key)
    execution = state.fast_calls.get(key)
    if execution is None:
        plan = plan_for(state, x, reduce_op, algorithm, in_place)
        execution = Execution(
            state, plan, reduce_op, x.shape, x.dtype, "host" if type(x) is np.ndarray else "device"
        )
        if keep and isinstance(algorithm, str) and isinstance(op, str):
            state.keep(key, execution)
    return execution
