"""The plan and the Execution of a kind of call: the planner's cache asked with a call's arguments,
and the Executions kept for the short path of repeated calls (CommState.fast_calls)."""

import numpy as np

from ..device.arrays import namespace
from .executor import Execution
from .plan_cases import Memory
from .planner import plan_call

__all__ = ["plan_for", "execution_for"]


def plan_for(state, x, op, algorithm, in_place=False, placement=None, once=False, timed=False):
    """The plan of a call of ``x`` (``in_place``: out=x) with ReduceOp ``op`` on a ready state (the
    one plan cache: mpiallreduce.core.planner.plan_call); ``placement``: x and out are symmetric;
    ``once``: the call is compared once, when made (a prepared call); ``timed``: it has a
    timeout."""
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
        timed and state.size > 1,
    )


def execution_for(
    state,
    x,
    op,
    reduce_op,
    algorithm,
    reproducible,
    keep,
    in_place=False,
    placement=None,
    timed=False,
):
    """The Execution of this kind of call, made once and kept on the state when ``keep`` (an
    untimed call: the key the short path finds it by says nothing of a timeout). Symmetric arrays
    (``placement``) are kept by where their twins lie too (the short path never finds them). A
    ``timed`` call takes a kept one only where its plan is the same: on symmetric and device
    arrays a timed call's may differ (planner.timed_instead)."""
    if placement is not None:
        key = ("symmetric", x.shape, x.dtype, op, algorithm, in_place, placement.signature())
    elif type(x) is np.ndarray and not reproducible:
        key = (x.shape, x.dtype, op, algorithm, in_place)  # (the short path's key)
    else:
        key = (x.shape, x.dtype, op, algorithm, in_place, reproducible, type(x))
    # (allocation numbers are never reused on a communicator: a symmetric key stays true)
    execution, plan = state.fast_calls.get(key), None
    if execution is not None and timed and (placement is not None or type(x) is not np.ndarray):
        plan = plan_for(state, x, reduce_op, algorithm, in_place, placement, timed=True)
        if execution.plan != plan:
            execution = None
    if execution is None:
        if plan is None:
            plan = plan_for(state, x, reduce_op, algorithm, in_place, placement, timed=timed)
        execution = Execution(state, plan, reduce_op, x.shape, x.dtype, Memory.of(x), placement)
        if keep and isinstance(algorithm, str) and isinstance(op, str):
            state.keep(key, execution)
    return execution
