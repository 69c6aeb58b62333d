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

A plan is a pure function of its inputs and of CallFacts, which hold only what every rank of the
communicator agreed on (mpiallreduce.core.state.CommState.make_ready: node layout, CUDA-awareness,
the settings); so it is the same on every rank. ``plan_call`` is the one plan cache.
"""

import functools
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from ..algorithms import REGISTRY, Algorithm, check_algorithm_name
from .overrides import (
    MEAN_ACROSS_NODES,
    REPRODUCIBLE_SHARED_MEMORY_BELOW,
    SINGLE_COPY_FROM,
    dissemination_pays,
    mean_across_nodes,
)
from .plan_cases import COMPRESSED_ROUTES, Carries, Route, Signature
from .tuning import choose_across_nodes, choose_name, choose_on_device, choose_persistent

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


@dataclass(frozen=True)
class CallFacts:
    """What the planner needs to know of the communicator, the same on every rank."""

    size: int
    spans_nodes: bool = False
    node_count: int = 1
    cuda_aware: bool = False
    signature_min_bytes: int = 0
    #: every node has the same rank count (two_level needs it)
    equal_nodes: bool = True
    #: the communicator has shared signature slots (one node, not under ULFM)
    shared_slots: bool = False
    #: CUDA IPC among its ranks: "untested" (until a call that would use it probes it:
    #: CommState.learn_cuda_ipc), "works", or "refused: why"
    cuda_ipc: str = "untested"
    #: prepared calls may use persistent requests (not under ULFM: how they meet a dead rank is
    #: untested)
    persistent_collectives: bool = True
    compiled: bool = False  # every rank runs the compiled paths (dissemination's rounds among them)


@dataclass(frozen=True)
class CallPlan:
    algorithm: Algorithm
    #: whether "auto" chose it
    auto: bool
    #: why this algorithm (one line)
    reason: str
    #: how device arrays travel (a name from mpiallreduce.transports), None for numpy arrays
    device_path: str | None
    #: the dtype the reduction runs in: float32 for float16/bfloat16 in the hand-written algorithms
    accumulate: np.dtype
    #: nothing to send (one rank or an empty buffer): a local copy
    local_only: bool
    #: compare shape, dtype and op across ranks before moving data
    check_signature: bool
    #: hierarchical: the node leaders' plan
    inner: Optional["CallPlan"] = None
    #: what the call computes (mpiallreduce.core.plan_cases.Route): PLAIN (the op itself),
    #: REPRODUCIBLE_DIRECT (an exact sum straight from the floats), REPRODUCIBLE_WORDS (exponent
    #: bytes, then fixed-point words, reduced by the algorithm), COMPRESSED_FP16/COMPRESSED_BF16
    #: (mpiallreduce.training.compression), BFLOAT16_BITS (bfloat16 words held as uint16, widened
    #: to float32: mpiallreduce.core.ops)
    route: Route = Route.PLAIN
    #: how the ranks compare the call before data moves (plan_cases.Signature): NONE, SHARED_SLOTS,
    #: MESSAGES (32-byte messages), CARRIED by the plan's algorithm (in its first barrier, or in its
    #: messages), AGREED_ONCE (a prepared call); ``signature_text`` prints it
    signature: Signature = Signature.NONE
    #: the bytes the algorithm reduces on each rank (the call's, widened to ``accumulate``): what a
    #: set-up it needs is sized by (shared_memory's window:
    #: mpiallreduce.algorithms.base.needs_set_up)
    working_bytes: int = 0
    #: an algorithm that needs CUDA IPC on a communicator that has not probed it yet: plan_call's
    #: arguments, to plan again with once the executor has probed it (the verdict in the facts)
    ipc_probe: tuple | None = None
    #: planned for an in-place call (``out=x``): part of the signature the ranks compare
    in_place: bool = False
    #: a prepared call of this plan runs MPI_Allreduce itself: True, bound as a persistent request
    #: (the table's persistent rules: tuning.choose_persistent); False, the blocking call each run;
    #: None: it cannot be one
    persistent: bool | None = None
    #: what a timed call's plan runs in place of (planner.timed_instead), None where nothing was
    #: replaced: in place of single_copy, the call still compares where its symmetric arrays lie
    instead_of: str | None = None

    @property
    def name(self):
        return self.algorithm.name

    @property
    def compares(self):
        """Whether each run compares the signature (before or inside the algorithm)."""
        return self.signature.compares

    @property
    def carried(self):
        return self.signature.carried

    @property
    def signature_text(self):
        """The signature as describe() prints it: "carried by <algorithm>" where carried."""
        if self.signature is Signature.CARRIED:
            return f"carried by {self.name}"
        return self.signature.value

    @property
    def inner_on_tags(self):
        """Whether the inner plan talks through CallTags and the call's PeerWatch (its messages
        offset by the call's number, its waits bounded and watching the peers)."""
        return self.inner is not None and self.inner.algorithm.messages_only

    def agreed_once(self):
        """This plan for a prepared call: compared when made, then run unchecked."""
        return replace(self, signature=Signature.AGREED_ONCE if self.compares else self.signature)

    def describe(self):
        """What the call will run and why, in a line or two."""
        text = f"{self.name} ({'auto: ' if self.auto else 'asked for: '}{self.reason})"
        if self.route is not Route.PLAIN:
            text += f"; route: {self.route.value}"
        if self.device_path:
            text += f"; device memory travels by {self.device_path}"
        if self.accumulate is not None:
            text += f"; accumulates in {self.accumulate}"
        if self.inner is not None:
            text += f"; node leaders run {self.inner.name}" + (
                " (on the call's tags, watching the peers)" if self.inner_on_tags else ""
            )
        text += f"; signature: {self.signature_text}"
        if self.ipc_probe is not None:
            text += (
                "; CUDA IPC not yet probed: the first call probes it, and plans again if it is "
                "refused"
            )
        return text


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
    instead_of = None
    if timed and chosen.unbounded_when_timed:
        instead_of = chosen.name
        chosen, reason = timed_instead(chosen, facts, nbytes, reason)
    if (
        compared
        and not once
        and auto
        and (chosen.name == "mpi" or facts.size == 2)
        and not facts.shared_slots
        and not (on_device or reproducible or low_precision)
        and facts.compiled
        and dissemination_pays(
            facts.size,
            nbytes,
            REGISTRY["dissemination"].plan(facts.size, 0, 0).largest_message(nbytes),
            in_place,
        )
    ):
        chosen, reason = (
            REGISTRY["dissemination"],
            reason + "; its signature goes in messages: dissemination carries it",
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
        from ..device.transports import device_path

        path = device_path(chosen, facts.cuda_aware)
        if timed and path == "cuda-aware" and chosen.bounded_collectives:
            # (a timed call posts MPI's collectives in their nonblocking forms, faults.bounded,
            # which Open MPI does not take on device buffers: a round trip through host memory)
            path = "host round trip"
            reason += "; timed: MPI's nonblocking collectives on host memory (a round trip)"
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


def timed_instead(chosen, facts, nbytes, reason):
    """(algorithm, reason) a timed call runs in place of ``chosen``, one whose end no timeout can
    bound and no agreement can take back (``Algorithm.unbounded_when_timed``): single_copy writes
    straight into every peer's array, so a peer that gave up would find its array written after
    it raised; device_to_device maps the peers' memory, which a peer that gave up may free. A
    timed call keeps its result from the user's array until every rank's part is done
    (mpiallreduce.faults.outcome), so it runs ``shared_memory`` on symmetric arrays (the same bits:
    each slice reduced in rank order) and, on device arrays, the table's choice across nodes
    (messages through the call's watch)."""
    if chosen.memory == "host":
        name = "shared_memory"
        why = "single_copy writes into the peers' arrays before the ranks agree on the call's end"
    else:
        name, _ = choose_on_device(nbytes, True, facts.cuda_aware, REGISTRY)
        why = f"{chosen.name} maps the peers' memory, which a rank that gave up may free"
    return REGISTRY[name], f"{reason}; timed: {name} instead, since {why}"


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
