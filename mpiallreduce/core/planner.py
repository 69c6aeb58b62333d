"""The one place that decides what an allreduce runs.

    (communicator facts, memory kind, dtype, bytes, op, algorithm asked)
        ->  CallPlan (frozen, cached)

A CallPlan names the algorithm (what ``auto`` resolved to, on one node or across nodes), how device
memory travels (mpiallreduce.transports), the dtype the reduction accumulates in, the plan of the
node leaders for ``hierarchical``, and whether the ranks compare the call's signature first.
Executing a plan (mpiallreduce.core.executor) decides nothing; ``plan.describe()`` and
``mpiallreduce info`` say what a call will run and why.

Rules, in order:
- one rank, or nothing to reduce: a local copy (``mpi`` is named, nothing is sent);
- an algorithm asked for by name runs as asked, unless it cannot: one that needs every rank on one
  node (shared_memory, device_to_device) is refused, on every rank, when the ranks span nodes;
- symmetric buffers (``mpiallreduce.empty``, mpiallreduce.core.symmetric), one node, an ordinary op,
  not float16/bfloat16: ``auto`` runs ``single_copy`` from SINGLE_COPY_FROM (each rank reads its
  peers' inputs where they lie and writes every output once); asked for on other arrays, refused;
- ``auto``, numpy arrays, one node: the tuning table (mpiallreduce.tuning) for this rank count, its
  in-place rules for an in-place call (``out=x``), but a mean's out-of-place one where it divides as
  it reduces;
- ``auto``, numpy arrays, several nodes: the table's by_nodes rules (a mean from 4 MiB: one that
  divides as it reduces, mpiallreduce.core.overrides), else ``hierarchical`` (its leaders: the
  table's choice);
- ``auto``, device arrays: the tuning table's device section, by size on one node (``mpi`` below
  64 KiB, ``device_to_device`` from there on), by CUDA-awareness across nodes (``ring`` through a
  CUDA-aware MPI, else ``staged_ring``). Until a GPU run measures them these are guesses, and the
  plan's reason says "unmeasured guess". ``device_to_device`` maps the peers' memory (CUDA IPC):
  where the communicator's probe found that refused, ``auto`` runs the table's choice across nodes
  instead and a call asking for it by name is refused; until the first call that would run it has
  probed (the executor does, after the signature check), the plan carries ``ipc_probe``;
- reproducible sums (op ``reproducible_sum``/``reproducible_mean``, mpiallreduce.reproducible),
  numpy arrays: ``auto`` runs an algorithm that sums each element from every contribution at once,
  straight from the floats (the direct route): ``shared_memory`` on one node below 4 MiB,
  ``pairwise_exchange`` from there and across nodes; any other algorithm asked for reduces their
  exponent bytes, then their fixed-point words (the words route); they accumulate in nothing
  wider: the same bits either way;
- float16 and bfloat16 accumulate in float32 in every hand-written algorithm (and in ``mpi`` on
  device arrays, and for bfloat16, which MPI has no type for, in ``mpi`` too); ``mpi`` on numpy
  float16 arrays keeps the library's own float16 arithmetic; max and min of float16 are not widened
  (they are exact, and numpy's float16 loops break ties unlike its float32 ones);
- every call on more than one rank compares its signature (shape, dtype, op, algorithm, route)
  across the ranks before moving data, from ``signature_min_bytes`` on (0 by default: every size):
  in the communicator's shared slots on one node (a few loads and stores), else in 32-byte
  messages; shared_memory carries it in place of its first barrier, dissemination in its messages
  (``auto``'s choice where a plain call's goes in messages, where overrides.dissemination_pays
  says); a prepared call is compared once, when made (``Signature.AGREED_ONCE``);
- a prepared call of MPI's own: a persistent request where the table's persistent rules say (one
  node, or across nodes; ``persistent``: mpiallreduce.core.tuning.choose_persistent), else blocking.
- a timed call (``timeout``) runs only what a timeout bounds and an agreement on its end can take
  back (mpiallreduce.faults.outcome): never ``single_copy`` (``shared_memory`` instead) nor
  ``device_to_device`` (the table's choice across nodes instead), by name or by ``auto``
  (``timed_instead``); MPI's own collectives on device arrays go through host memory, not a
  CUDA-aware MPI (they are posted in nonblocking forms: mpiallreduce.faults.bounded).

``plan_call`` applies the rules in that order; each decision sits in a module of its own, which
this one imports (and gives its public names): what a plan is made from and says
(mpiallreduce.core.call_plan: CallFacts, CallPlan), the algorithm, by name or auto's choice
(mpiallreduce.core.algorithm_choice), what a timed call runs instead (mpiallreduce.core.timed_plans:
timed_instead; without_set_up, which plans again, is here), how device memory travels
(mpiallreduce.core.device_paths); the route, the accumulation dtype, the signature and the
persistent request are decided here.

A plan is a pure function of its inputs and of CallFacts, which hold only what every rank of the
communicator agreed on (mpiallreduce.core.state.CommState.make_ready: node layout, CUDA-awareness,
the settings); so it is the same on every rank. ``plan_call`` is the one plan cache.
"""

import functools
from dataclasses import replace

import numpy as np

from ..algorithms import REGISTRY, check_algorithm_name
from .algorithm_choice import algorithm_for, carried_by_dissemination
from .call_plan import CallFacts, CallPlan
from .device_paths import device_path_for
from .plan_cases import COMPRESSED_ROUTES, Carries, Route, Signature
from .timed_plans import timed_instead
from .tuning import choose_name, choose_persistent

__all__ = [
    "CallFacts",
    "CallPlan",
    "Route",
    "Signature",
    "Carries",
    "plan_call",
    "choose_algorithm",
    "timed_instead",
    "without_set_up",
    "check_algorithm_name",
    "NOT_ACROSS_NODES",
]

#: algorithms that cannot run among ranks of different nodes
NOT_ACROSS_NODES = frozenset(name for name, a in REGISTRY.items() if a.needs_one_node) | {
    name for name, a in REGISTRY.items() if a.takes_inner_plan
}
_LOW_PRECISION = ("float16", "bfloat16")


@functools.lru_cache(maxsize=4096)
def plan_call(
    facts,
    on_device,
    dtype,
    nbytes,
    op_name,
    algorithm,
    in_place=False,
    symmetric=False,
    once=False,
    timed=False,
):
    """The CallPlan for one call (cached). ``dtype`` a numpy dtype, ``algorithm`` "auto" or a name,
    ``in_place``: ``out=x`` (the tuning table has rules of its own for it), ``symmetric``: the
    call's arrays are symmetric buffers of one allocation
    (mpiallreduce.core.symmetric.placement_of), ``once``: compared once, when made (a prepared call,
    ``check=True``), not in each run, ``timed``: the call has a timeout (it runs no algorithm a
    timeout cannot bound: timed_instead).

    Raises ValueError (the same on every rank, since the facts are) for an algorithm that cannot run
    on this communicator.
    """
    reproducible = op_name.startswith("reproducible_")
    compressed = op_name.startswith("compressed_")
    if (
        reproducible and on_device
    ):  # reproducible sums of device arrays run on the host (a round trip)
        if algorithm != "auto" and REGISTRY[algorithm].memory == "device":
            algorithm = "auto"
        plan = plan_call(facts, False, dtype, nbytes, op_name, algorithm, in_place, timed=timed)
        return replace(plan, device_path="host round trip")
    check_algorithm_name(algorithm, on_device)
    auto = algorithm == "auto"
    bits = op_name.startswith(
        "bfloat16_bits_"
    )  # (bfloat16 words in uint16: mpiallreduce.core.ops.Bfloat16Bits)
    low_precision = bits or dtype.itemsize == 2 and dtype.name in _LOW_PRECISION
    compared = facts.size > 1 and 0 <= facts.signature_min_bytes <= nbytes
    signature = (
        Signature.NONE
        if not compared
        else Signature.SHARED_SLOTS
        if facts.shared_slots
        else Signature.MESSAGES
    )
    if compressed:  # (on one rank too: each value rounded to 16 bits, as with more)
        return CallPlan(
            REGISTRY["mpi"],
            auto,
            "16-bit values through MPI_Alltoall, summed in float32 by "
            "each slice's owner, then MPI_Allgather (mpiallreduce.training.compression)",
            "host round trip" if on_device else None,
            None,
            False,
            compared,
            route=COMPRESSED_ROUTES[op_name],
            signature=signature,
            in_place=in_place,
        )
    if facts.size == 1 or nbytes == 0:
        return CallPlan(
            REGISTRY["mpi"],
            auto,
            "one rank or an empty buffer: a local copy",
            None,
            None,
            True,
            compared,
            signature=signature,
            in_place=in_place,
        )
    inner = None
    chosen, reason = algorithm_for(
        facts,
        on_device,
        nbytes,
        op_name,
        algorithm,
        in_place,
        symmetric,
        reproducible,
        low_precision,
    )
    instead_of = None
    if timed and chosen.unbounded_when_timed:
        instead_of = chosen.name
        chosen, reason = timed_instead(chosen, facts, nbytes, reason)
    chosen, reason = carried_by_dissemination(
        chosen,
        reason,
        facts,
        nbytes,
        in_place,
        compared and not once and auto and not (on_device or reproducible or low_precision),
    )
    if (
        chosen.takes_inner_plan and facts.node_count > 1
    ):  # (hierarchical's leaders, two_level's rails)
        leader_choice = choose_name(nbytes, facts.node_count, REGISTRY)
        inner = plan_call(
            CallFacts(
                size=facts.node_count,
                spans_nodes=True,
                node_count=facts.node_count,
                signature_min_bytes=-1,
            ),
            False,
            dtype,
            nbytes,
            op_name,
            "ring" if leader_choice in NOT_ACROSS_NODES else leader_choice,
        )
    path = None
    if on_device:
        path, reason = device_path_for(chosen, facts, timed, reason)
    route = Route.PLAIN
    if reproducible:
        route = (
            Route.REPRODUCIBLE_DIRECT
            if chosen.sees_every_contribution
            else Route.REPRODUCIBLE_WORDS
        )
        if route is Route.REPRODUCIBLE_WORDS:
            reason += (
                "; a reproducible sum: its exponent bytes, then its fixed-point words, "
                "reduced by it"
            )
    accumulate = None
    if bits:
        route = Route.BFLOAT16_BITS
    exact_anyway = (
        op_name in ("max", "min") and not bits
    )  # (max and min of float16 are exact: numpy's rules kept)
    if (
        low_precision
        and (chosen.name != "mpi" or on_device or dtype.name == "bfloat16" or bits)
        and not reproducible
        and not exact_anyway
    ):
        accumulate = np.dtype(np.float32)
    working = nbytes if accumulate is None else nbytes // dtype.itemsize * accumulate.itemsize
    # (where the comparison goes anyway: the shared slots, else messages)
    carrier = Carries.SHARED_SLOTS if facts.shared_slots else Carries.MESSAGES
    if (
        compared
        and not on_device
        and (route is Route.PLAIN or facts.shared_slots)
        and chosen.carries_signature is carrier
        and chosen.can_carry(facts.size, working)
    ):
        signature = Signature.CARRIED  # (by the plan's algorithm)
    probe = (
        (on_device, dtype, nbytes, op_name, algorithm, in_place)
        if chosen.needs_cuda_ipc and facts.cuda_ipc == "untested"
        else None
    )
    persistent = (
        choose_persistent(
            working, facts.size, in_place, facts.node_count if facts.spans_nodes else 1
        )
        if (
            chosen.name == "mpi"
            and not on_device
            and facts.persistent_collectives
            and route is Route.PLAIN
            and accumulate is None
        )
        else None
    )
    return CallPlan(
        chosen,
        auto,
        reason,
        path,
        accumulate,
        False,
        compared,
        inner,
        route,
        signature,
        working,
        probe,
        in_place,
        persistent,
        instead_of,
    )


#: what a timed call runs where its plan would first grow a shared window (without_set_up)
WITHOUT_SET_UP = "ring"


def without_set_up(plan, facts, on_device, dtype, nbytes, op_name):
    """The plan a timed call runs where ``plan`` would first make something collective inside the
    call (shared_memory's window, grown to the call's size): MPI has no nonblocking form of
    MPI_Win_allocate_shared, so a peer that gave up would leave this rank in it for ever, and no
    timeout could bound it. The ring instead, its messages through the call's watch; the ranks
    decide alike (a window grows on every rank of its communicator at once). An untimed call of
    that size, or a prepared one, grows the window; timed calls then run the plan as planned."""
    ring = plan_call(
        facts, on_device, dtype, nbytes, op_name, WITHOUT_SET_UP, plan.in_place, timed=True
    )
    if plan.signature is Signature.AGREED_ONCE:  # (compared already, with check=True: not again)
        ring = ring.agreed_once()
    return replace(
        ring,
        reason=f"{plan.reason}; timed, and {plan.name} would first grow its shared window, which "
        f"no timeout bounds: {WITHOUT_SET_UP} instead",
        instead_of=plan.instead_of,
    )


def choose_algorithm(nbytes, size):
    """The algorithm "auto" runs for numpy arrays of ``nbytes`` bytes on ``size`` ranks of one
    node."""
    return plan_call(
        CallFacts(size=size), False, np.dtype(np.uint8), max(nbytes, 1), "sum", "auto"
    ).algorithm
