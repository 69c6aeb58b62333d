"""The cases a CallPlan names (mpiallreduce.core.planner), each an enum: a misspelt case is an error
(``Route.PLIAN``: AttributeError; ``Route("plian")``: ValueError), and ``list(Route)`` lists them.

    Route       what the call computes (CallPlan.route)
    Signature   how the ranks compare the call before data moves (CallPlan.signature)
    Carries     where an algorithm carries that comparison in place of a step of its own
                (Algorithm.carries_signature)
    Memory      where a call's arrays lie (the executor's Execution: its ``kind``)

Each case is a ``str`` too, its value the text that describe_call, the docs and the signature's
fields print (``str(Route.PLAIN) == f"{Route.PLAIN}" == "plain"``), so output stays as it was. The
library compares them by identity (``plan.route is Route.PLAIN``). In the core's base: the planner,
the executor and the algorithms all name them, and it imports nothing of the package.
"""

from enum import Enum

import numpy as np

__all__ = ["PlanCase", "Route", "Signature", "Carries", "Memory"]


class PlanCase(str, Enum):
    """A case whose value is its printed text (``str`` and ``format`` give the value, on every
    Python the package supports)."""

    def __str__(self):
        return self.value

    def __format__(self, spec):
        return format(self.value, spec)


class Route(PlanCase):
    """What the call computes (the executor's route: Execution._route)."""

    #: the op itself, by the plan's algorithm
    PLAIN = "plain"
    #: a reproducible sum, exact straight from the floats (an algorithm that sees every
    #: contribution of an element at once: mpiallreduce.reproducible.routes.exact_sum_into)
    REPRODUCIBLE_DIRECT = "reproducible direct"
    #: a reproducible sum by any other algorithm: exponent bytes, then fixed-point words
    #: (mpiallreduce.reproducible.routes.sum_by_words)
    REPRODUCIBLE_WORDS = "reproducible words"
    #: 16-bit values through MPI_Alltoall and MPI_Allgather (mpiallreduce.training.compression)
    COMPRESSED_FP16 = "compressed fp16"
    COMPRESSED_BF16 = "compressed bf16"
    #: bfloat16 words held as uint16, widened to float32 (mpiallreduce.core.ops.Bfloat16Bits)
    BFLOAT16_BITS = "bfloat16 bits"

    @property
    def compressed(self):
        """Whether the op runs on its own, on the whole buffer (ReduceOp.reduce_whole)."""
        return self in _COMPRESSED


_COMPRESSED = frozenset((Route.COMPRESSED_FP16, Route.COMPRESSED_BF16))

#: the route of each compressed op (by its name: mpiallreduce.training.compression)
COMPRESSED_ROUTES = {
    "compressed_fp16": Route.COMPRESSED_FP16,
    "compressed_bf16": Route.COMPRESSED_BF16,
}


class Signature(PlanCase):
    """How the ranks compare a call's signature before data moves."""

    #: not compared (one rank, or below ``signature_min_bytes``)
    NONE = "none"
    #: in the communicator's shared slots (one node, not under ULFM: mpiallreduce.core.slots)
    SHARED_SLOTS = "shared slots"
    #: in 32-byte messages (mpiallreduce.core.signature_messages)
    MESSAGES = "32-byte messages"
    #: carried by the plan's algorithm (Algorithm.carries_signature: in its first barrier, or in
    #: its messages); printed with the algorithm's name, "carried by <algorithm>"
    #: (CallPlan.signature_text)
    CARRIED = "carried"
    #: a prepared call: compared once, when made, then run unchecked
    AGREED_ONCE = "agreed once"

    @property
    def compares(self):
        """Whether each run compares the signature (before or inside the algorithm)."""
        return self not in (Signature.NONE, Signature.AGREED_ONCE)

    @property
    def carried(self):
        return self is Signature.CARRIED


class Carries(PlanCase):
    """Where an algorithm carries the call's signature (Algorithm.carries_signature), in place of a
    step of its own; the planner lets it where the comparison would go there anyway."""

    #: in the shared slots, on one node, in place of a barrier (shared_memory, single_copy)
    SHARED_SLOTS = "shared slots"
    #: in its rounds' messages, across nodes (dissemination)
    MESSAGES = "messages"


class Memory(PlanCase):
    """Where a call's arrays lie (Execution's ``kind``, a field of the signature the ranks compare:
    "memory")."""

    #: numpy arrays
    HOST = "host"
    #: device arrays (CuPy, or a framework's through DLPack: mpiallreduce.device.arrays)
    DEVICE = "device"

    @classmethod
    def of(cls, x):
        """The memory of array ``x`` (a numpy array: HOST; anything else the call takes: DEVICE)."""
        return cls.HOST if type(x) is np.ndarray else cls.DEVICE
