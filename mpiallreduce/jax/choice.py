"""Which algorithm the XLA handler runs for a call: the planner's ``auto``, mapped onto the
algorithms the handler has. Decided once per call site, when it is traced (the same on every rank:
the facts are agreed and the call is compared).

    planner's choice     handler runs          why
    mpi                  mpi                   MPI_Allreduce itself
    dissemination        exchange              small calls whose signature rides in the messages:
                                               every rank's input to every peer, one round, each
                                               reducing in rank order (dissemination's result,
                                               its rounds flattened into one), up to
                                               EXCHANGE_INLINE_BYTES; past it, mpi
    recursive_doubling   recursive_doubling
    ring                 ring
    ring_pipelined       ring                  the ring's kin: a reduce-scatter, then an
    rabenseifner         ring                  allgather, each rank sending 2(p-1)/p of the
    pairwise_exchange    ring                  buffer (no pipelining in the handler)
    reduce_bcast         reduce_bcast
    anything else        mpi                   shared_memory, single_copy: XLA's buffers are no
                                               shared window nor symmetric array (the handler's
                                               own shared_memory, which copies into its regions,
                                               runs only by name); hierarchical, two_level: not
                                               in the handler

The planner is asked about an in-place call (XLA aliases the result to the operand) on a
communicator with no shared signature slots (the handler compares in messages).
"""

import dataclasses
from typing import NamedTuple

import numpy as np

from ..core.planner import plan_call
from ..core.settings import settings
from ..core.state import state_of
from .slots import DATA_BYTES, handed

__all__ = [
    "HANDLER_ALGORITHMS",
    "EXCHANGE_MOST_BYTES",
    "EXCHANGE_INLINE_BYTES",
    "Choice",
    "choose",
]

#: the handler's algorithms by its number for them (_ffi.cc: Algorithm)
HANDLER_ALGORITHMS = {
    "mpi": 0,
    "exchange": 1,
    "ring": 2,
    "recursive_doubling": 3,
    "reduce_bcast": 4,
    "shared_memory": 5,
}
#: exchange's message (8 bytes of signature, then the call's) is one MPI count of bytes
EXCHANGE_MOST_BYTES = 2**31 - 1 - 8
#: the input exchange carries in the arrival's header (_ffi_algorithms.h: kHeaderMost less its
#: 16 bytes of code and tail length); a larger one goes as a second message, received once the
#: header has said its length: a round trip more, so auto runs MPI's own past this size
EXCHANGE_INLINE_BYTES = 4096 - 16
_NEAREST = {
    "dissemination": "exchange",
    "ring_pipelined": "ring",
    "rabenseifner": "ring",
    "pairwise_exchange": "ring",
}


class Choice(NamedTuple):
    name: str  # what the handler runs
    planned: str  # what the planner chose
    reason: str  # the planner's reason


def choose(comm, dtype, nbytes, op, algorithm="auto"):
    """The Choice for a call of ``nbytes`` of ``dtype`` reduced by ``op`` over ``comm`` (the JAX
    duplicate: its state is made on first use, collectively); ``algorithm``: "auto" or one of
    HANDLER_ALGORITHMS, run as named (a ValueError for another name)."""
    if algorithm != "auto":
        if algorithm not in HANDLER_ALGORITHMS:
            raise ValueError(
                f"algorithm must be 'auto' or one of {sorted(HANDLER_ALGORITHMS)} inside "
                f"mpiallreduce.jax, got {algorithm!r}"
            )
        if (
            algorithm == "shared_memory"
            and comm.Get_size() > 1  # (one rank: nothing to share, its input is its result)
            and not (handed(comm) and nbytes <= DATA_BYTES)
        ):
            raise ValueError(
                f"algorithm 'shared_memory' needs the ranks on one node (not under ULFM) and at "
                f"most {DATA_BYTES} bytes a call, got {nbytes} on {comm.Get_size()} rank(s)"
                + ("" if handed(comm) else " that share no memory here")
            )
        if algorithm == "exchange" and nbytes > EXCHANGE_MOST_BYTES:
            raise ValueError(
                f"algorithm 'exchange' sends a call's bytes in one message: at most "
                f"{EXCHANGE_MOST_BYTES}, got {nbytes}"
            )
        return Choice(algorithm, algorithm, "named by the caller")
    facts = dataclasses.replace(
        state_of(comm).make_ready().facts,
        shared_slots=False,
        compiled=True,
        signature_min_bytes=settings().signature_min_bytes,
    )
    plan = plan_call(facts, False, np.dtype(dtype), max(int(nbytes), 1), op, "auto", in_place=True)
    planned = plan.algorithm.name
    name = planned if planned in HANDLER_ALGORITHMS else _NEAREST.get(planned, "mpi")
    if name == "exchange" and nbytes > EXCHANGE_INLINE_BYTES:
        name = "mpi"  # (its input rides in the arrival's header up to here; past it, MPI's own)
    return Choice(name, planned, plan.reason)
