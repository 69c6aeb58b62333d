"""What a plan is made from and what it says: CallFacts, what the planner knows of the communicator
(agreed on by every rank: mpiallreduce.core.state.CommState.make_ready), and CallPlan, what one call
runs (made by mpiallreduce.core.planner.plan_call, run by mpiallreduce.core.executor; ``describe()``
prints it).
"""

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from ..algorithms import Algorithm
from .plan_cases import Route, Signature

__all__ = ["CallFacts", "CallPlan"]


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
