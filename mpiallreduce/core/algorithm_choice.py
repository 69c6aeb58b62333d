"""Which algorithm a call runs: one asked for by name, refused (on every rank, since the facts
are the same) where it cannot run here, or ``auto``'s choice (mpiallreduce.core.planner's rules):
symmetric buffers on one node, a reproducible sum, device arrays, numpy arrays across nodes or on
one node; and ``auto``'s switch to ``dissemination`` where a plain call's signature goes in
messages, which its rounds carry (mpiallreduce.core.overrides.dissemination_pays). What the plan
adds to the algorithm (its route, accumulation, signature, device path) is the planner's.
"""

from ..algorithms import REGISTRY
from .overrides import (
    MEAN_ACROSS_NODES,
    REPRODUCIBLE_SHARED_MEMORY_BELOW,
    SINGLE_COPY_FROM,
    dissemination_pays,
    mean_across_nodes,
)
from .tuning import choose_across_nodes, choose_name, choose_on_device

__all__ = ["algorithm_for", "carried_by_dissemination"]


def algorithm_for(
    facts, on_device, nbytes, op_name, algorithm, in_place, symmetric, reproducible, low_precision
):
    """(Algorithm, reason): the algorithm named by ``algorithm`` or, for "auto", auto's choice, for
    a call of ``nbytes`` bytes (``symmetric``: its arrays are symmetric buffers of one allocation;
    ``low_precision``: float16/bfloat16, or bfloat16 words). Raises ValueError for an algorithm
    that cannot run on this communicator."""
    auto = algorithm == "auto"
    single_copy = (
        symmetric
        and not facts.spans_nodes
        and not on_device
        and (reproducible or not low_precision)
        and (not auto or nbytes >= SINGLE_COPY_FROM)
    )
    if not auto and REGISTRY[algorithm].needs_symmetric and not single_copy:
        raise ValueError(
            f"the {algorithm} algorithm runs on symmetric buffers only (mpiallreduce.empty or "
            "zeros, input and output at the same place on every rank of one node, a reproducible "
            "sum or an ordinary op on a dtype other than float16/bfloat16); "
            "use 'auto' or another algorithm"
        )
    if not auto:
        chosen, reason = REGISTRY[algorithm], "by name"
        if facts.spans_nodes and REGISTRY[algorithm].needs_one_node:
            raise ValueError(
                f"the {algorithm} algorithm needs every rank of the communicator on one node; "
                f"this one spans {facts.node_count} nodes (use algorithm={chosen.across_nodes!r})"
            )
        if chosen.needs_cuda_ipc and facts.cuda_ipc.startswith("refused"):
            raise ValueError(
                f"the {algorithm} algorithm maps the peers' device memory (CUDA IPC), which "
                f"this machine refused (use algorithm={chosen.across_nodes!r} or 'auto'); the "
                f"probe's {facts.cuda_ipc}"
            )
    elif single_copy:
        chosen = REGISTRY["single_copy"]
        reason = (
            "symmetric buffers on one node: each rank reads its peers' inputs where they lie "
            "(single copy)"
        )
    elif reproducible:
        shared = not facts.spans_nodes and nbytes < REPRODUCIBLE_SHARED_MEMORY_BELOW
        chosen = REGISTRY["shared_memory" if shared else "pairwise_exchange"]
        where = (
            "across nodes"
            if facts.spans_nodes
            else (
                f"{'below' if shared else 'from'} {REPRODUCIBLE_SHARED_MEMORY_BELOW >> 20} MiB "
                "on one node"
            )
        )
        reason = (
            "a reproducible sum: every contribution of an element on one rank, summed exactly from "
            f"the floats themselves ({where})"
        )
    elif on_device:
        name, measured = choose_on_device(nbytes, facts.spans_nodes, facts.cuda_aware, REGISTRY)
        where = f"across {facts.node_count} nodes" if facts.spans_nodes else "on one node"
        reason = (
            f"the device table for device arrays {where}, {nbytes} bytes"
            + (
                f", MPI {'is' if facts.cuda_aware else 'is not'} CUDA-aware"
                if facts.spans_nodes
                else ""
            )
            + ("" if measured else " (unmeasured guess)")
        )
        if REGISTRY[name].needs_cuda_ipc and facts.cuda_ipc.startswith("refused"):
            # (the table's choice across nodes: the ranks' own messages, staged or CUDA-aware)
            refused, (name, _) = name, choose_on_device(nbytes, True, facts.cuda_aware, REGISTRY)
            reason += (
                f"; not {refused}, which needs CUDA IPC, {' '.join(facts.cuda_ipc.split())}; "
                "the table's choice across nodes instead (MPI "
                f"{'is' if facts.cuda_aware else 'is not'} CUDA-aware)"
            )
        chosen = REGISTRY[name]
    elif facts.spans_nodes:
        measured = choose_across_nodes(nbytes, facts.node_count, facts.size, REGISTRY, in_place)
        if measured is not None and (facts.equal_nodes or not REGISTRY[measured].needs_equal_nodes):
            chosen = REGISTRY[measured]
            reason = (
                f"the tuning table for {facts.node_count} nodes, {facts.size} ranks, "
                f"at {nbytes} bytes" + (" in place" if in_place else "")
            )
            if not low_precision and mean_across_nodes(
                op_name, nbytes, chosen.finishes_slices
            ):  # (a pass less)
                chosen, reason = (
                    REGISTRY[MEAN_ACROSS_NODES],
                    reason + f" ({measured}); a mean: {MEAN_ACROSS_NODES}",
                )
        else:
            chosen = REGISTRY["hierarchical"]
            reason = f"numpy arrays across {facts.node_count} nodes" + (
                "" if measured is None else f" ({measured}, the table's choice, needs equal nodes)"
            )
    else:
        name, elsewhere = (
            choose_name(nbytes, facts.size, REGISTRY, in_place),
            choose_name(nbytes, facts.size, REGISTRY),
        )
        reason = f"the tuning table for {facts.size} ranks at {nbytes} bytes" + (
            " in place" if in_place else ""
        )
        if (
            op_name == "mean"
            and not low_precision
            and not REGISTRY[name].finishes_slices  # (its division: a pass)
            and REGISTRY[elsewhere].finishes_slices
        ):
            name, reason = (
                elsewhere,
                reason + "; a mean: the out-of-place rule's, which divides slices as it reduces",
            )
        chosen = REGISTRY[name]
    return chosen, reason


def carried_by_dissemination(chosen, reason, facts, nbytes, in_place, eligible):
    """(Algorithm, reason): ``dissemination`` in place of ``chosen`` (``mpi``, or any on 2 ranks)
    where the call's signature goes in messages (no shared slots), the compiled paths run and
    dissemination's rounds, which carry it, pay (overrides.dissemination_pays); ``eligible``: an
    ``auto`` call of numpy arrays, plain, not float16/bfloat16, compared in each run."""
    if (
        eligible
        and (chosen.name == "mpi" or facts.size == 2)
        and not facts.shared_slots
        and facts.compiled
        and dissemination_pays(
            facts.size,
            nbytes,
            REGISTRY["dissemination"].plan(facts.size, 0, 0).largest_message(nbytes),
            in_place,
        )
    ):
        return (
            REGISTRY["dissemination"],
            reason + "; its signature goes in messages: dissemination carries it",
        )
    return chosen, reason
