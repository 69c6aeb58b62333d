"""Dissemination: every rank gathers every rank's input (Bruck's allgather), then reduces them all itself.

Rank r holds the blocks of ranks r, r-1, r-2, ... (mod p); in round k it sends the first ones it
holds to r + 2^k and appends what comes from r - 2^k; the last round sends only what is missing.
p = 5:

    round 0:  r -> r+1   1 block     rank r holds the inputs of r, r-1
    round 1:  r -> r+2   2 blocks    ... of r, ..., r-3
    round 2:  r -> r+4   1 block     ... of all 5

Then every rank reduces the p inputs in rank order: the same bits everywhere. ceil(log2 p) rounds,
(p-1)n bytes sent and p-1 reductions per rank: for small buffers, where the rounds' latency is all.

Its rounds are those of the signature comparison in messages (mpiallreduce.core.consistency), so
a call that compares its signature so can carry it here and send no message of its own (the
planner has ``auto`` pick it for small plain calls across nodes, where the rounds are compiled).
Each message then starts with the 32 bytes of codes (and the call's number), whose maxima every rank keeps; it goes on the
call's signature tags, within SIGNATURE_MESSAGE_BYTES, which every receive there posts (a rank
whose call differs may send the codes alone, or other blocks, never more; a message of a call given
up calls_apart calls ago, met on the same tags, is dropped by its number). The result is written only
after the last round, once the codes agree.
"""
from dataclasses import dataclass
from typing import Tuple

import numpy as np
from mpi4py import MPI

from ..core.buffers import aligned_empty, copy_into, retire_scratch, scratch
from ..core.signature_messages import CODES as _CODES, SIGNATURE_MESSAGE_BYTES, dissemination_peers, take_round
from .base import Algorithm, CallTags, reduce_in_rank_order_into, wait_all

ROUND_TAG = 210
#: the codes' bytes in front of every message (zeros where the call carries no signature)
HEADER = _CODES.size


@dataclass(frozen=True)
class DisseminationPlan:
    size: int
    #: per round: (send to, receive from, blocks sent: this rank's first ones, the block they land at)
    rounds: Tuple[Tuple[int, int, int, int], ...]

    def largest_message(self, nbytes):
        """The longest message of a run on ``nbytes`` bytes per rank, its codes included."""
        return HEADER + max((blocks for _, _, blocks, _ in self.rounds), default=0) * nbytes


class DisseminationAllreduce(Algorithm):
    name = "dissemination"
    messages_only = True
    memory = "host"
    #: in its messages, where the call compares its signature so (consistency.CarriedSignature)
    carries_signature = "messages"

    def plan(self, size, rank, count):
        rounds, held = [], 1
        for to, source in dissemination_peers(rank, size):
            blocks = min(held, size - held)
            rounds.append((to, source, blocks, held))
            held += blocks
        return DisseminationPlan(size, tuple(rounds))

    def can_carry(self, size, nbytes):
        return self.plan(size, 0, 0).largest_message(nbytes) <= SIGNATURE_MESSAGE_BYTES

    def execute(self, plan, comm, send, recv, op, datatype, signature=None):
        nbytes = recv.nbytes  # (what comes: at most the longest message, or what a rank that differs may send)
        capacity = plan.largest_message(nbytes) if signature is None else SIGNATURE_MESSAGE_BYTES
        space = scratch("dissemination", HEADER + plan.size * nbytes + capacity, np.uint8)
        memoryview(space)[HEADER:HEADER + nbytes] = memoryview(recv if send is None else send).cast("B")
        if signature is None:
            codes, tags = (0, 0), comm
        else:  # (the signature's tags, where a rank that compares first sends its codes alone)
            codes, tags = signature.codes(), CallTags(comm.comm, signature.sequence, comm.watch, CallTags.SIGNATURE_BASE)
            if plan.largest_message(nbytes) > SIGNATURE_MESSAGE_BYTES:  # (the planner's can_carry: never)
                raise RuntimeError(f"dissemination carries the signature of calls whose messages fit "
                                   f"{SIGNATURE_MESSAGE_BYTES} bytes; this one's take {plan.largest_message(nbytes)}")
        try:
            high, negated = rounds(plan, tags, space, nbytes, *codes, 0 if signature is not None else ROUND_TAG,
                                   None if signature is None else signature.sequence)
        except BaseException:  # (given up: its requests, left behind, hold this buffer; a rendezvous
            retire_scratch("dissemination")  # send may still read it, so no later call writes it)
            raise
        if signature is not None:
            signature.settle(high, negated)  # (raises on every rank where any rank's call differs)
        reduce_blocks(op, space, plan.size, comm.Get_rank(), recv)

    def bind_runs(self, execution):
        """The rounds in C (mpiallreduce.core.compiled), the Python's from a wait that lasts on
        (through the call's PeerWatch), the codes settled, the blocks reduced; None where the plan
        carries no signature, the rounds are not compiled or the arrays are not plain numpy ones."""
        from ..core.compiled import exchange_rounds, used
        from ..core.consistency import CarriedSignature
        state, count = execution.state, int(np.prod(execution.shape, dtype=np.int64))
        nbytes, size, rank = count * execution.dtype.itemsize, state.size, state.rank
        plan = self.plan(size, rank, count)
        if (not execution.carried or exchange_rounds is None or not used() or not execution.raw
                or execution.plan.route != "plain" or execution.plan.accumulate is not None
                or plan.largest_message(nbytes) > SIGNATURE_MESSAGE_BYTES):  # (widened, words: the executor's routes)
            return None
        handle, code, op = state.library.handle, execution.code, execution.op

        def fresh():  # (the buffer, its blocks in rank order, its address; a new one after a call given up)
            space = aligned_empty(HEADER + size * nbytes + SIGNATURE_MESSAGE_BYTES, np.uint8)
            blocks = space[HEADER:HEADER + size * nbytes].view(execution.dtype).reshape(size, count)
            return space, [blocks[(rank - s) % size] for s in range(size)], space.__array_interface__["data"][0]
        held = list(fresh())
        signature, slot, base = CarriedSignature(execution, 0), CallTags.slot, CallTags.SIGNATURE_BASE
        CallTags(state.library, 0)  # (the first one learns MPI_TAG_UB: CallTags.calls_apart)
        calls_apart = CallTags.calls_apart

        def run(send, recv, sequence, watch):
            space, pieces, address = held
            stopped, high, negated, receive, sent = exchange_rounds(
                handle, (sequence % calls_apart) * slot + base, size, rank, address, SIGNATURE_MESSAGE_BYTES,
                recv if send is None else send, nbytes, code, -code, sequence, _SPIN_SECONDS)
            if stopped != -1:  # (a wait that lasts, or an MPI error: the Python's, through the watch)
                requests = [MPI.Request.f2py(receive), MPI.Request.f2py(sent)]
                tags = CallTags(state.library, sequence, watch, base)
                try:
                    if stopped == -2:
                        watch.wait(requests)  # (MPI's error for them, a dead peer's say; else the C's)
                        raise MPI.Exception(high)
                    take_round(tags, watch, memoryview(space)[HEADER + size * nbytes:], plan.rounds[stopped][1],
                               stopped, sequence, requests)
                    high, negated = merge(plan, plan.rounds[stopped], space, nbytes, high, negated)
                    high, negated = rounds(plan, tags, space, nbytes, high, negated, 0, sequence, first=stopped + 1)
                except BaseException:  # (given up: MPI may still read or write the buffer, a rendezvous send
                    _keep_while_pending(requests, space)  # left behind say; kept, and never written again)
                    held[:] = fresh()
                    raise
            signature.sequence = sequence
            signature.settle(high, negated)  # (raises on every rank where any rank's call differs)
            reduce_in_rank_order_into(op, pieces, recv)  # (float errors masked by the executor)
        return run


#: how long the compiled rounds test a wait's requests before the Python waits for them (and then
#: looks at the control channel and the deadline: mpiallreduce.faults.watch, every millisecond)
_SPIN_SECONDS = 1e-3


def rounds(plan, tags, space, nbytes, high, negated, tag, sequence=None, first=0):
    """The rounds from ``first`` (mpiallreduce.core.compiled's C does the same, message for message)
    on ``tags`` (CallTags: its PeerWatch waits): ``space`` holds the codes, the blocks, then room
    for what comes; ``sequence``: the call's number, where it carries the signature (a message of
    another call is dropped: signature_messages.take_round). Returns the codes' maxima."""
    work = memoryview(space)
    incoming = work[HEADER + plan.size * nbytes:]
    for step in range(first, len(plan.rounds)):
        to, source, count, _ = plan.rounds[step]
        _CODES.pack_into(work, 0, high, negated, sequence or 0)
        requests = [tags.Irecv([incoming, MPI.BYTE], source, tag + step),
                    tags.Isend([work[:HEADER + count * nbytes], MPI.BYTE], to, tag + step)]
        if sequence is None:
            wait_all(tags, requests)
        else:
            take_round(tags, tags.watch, incoming, source, tag + step, sequence, requests)
        high, negated = merge(plan, plan.rounds[step], space, nbytes, high, negated)
    return high, negated


def _keep_while_pending(requests, space):
    """Keep ``space`` until ``requests``, left behind by a call given up, are done (the f2py
    requests of the compiled rounds do not hold it, as mpi4py's own do)."""
    from ..faults.watch import request_done
    _KEPT[:] = [(r, s) for r, s in _KEPT if not all(request_done(q) for q in r)] + [(requests, space)]


_KEPT = []


def merge(plan, round_, space, nbytes, high, negated):
    """A round's message taken in: the codes' maxima, its blocks appended where they belong."""
    _, _, count, at = round_
    work = memoryview(space)
    incoming = work[HEADER + plan.size * nbytes:]
    their_high, their_negated, _ = _CODES.unpack_from(incoming)
    work[HEADER + at * nbytes:HEADER + (at + count) * nbytes] = incoming[HEADER:HEADER + count * nbytes]
    return max(high, their_high), max(negated, their_negated)


def reduce_blocks(op, space, size, rank, recv):
    """recv = the p blocks reduced in rank order (block j holds rank - j's input)."""
    blocks = space[HEADER:HEADER + size * recv.nbytes].view(recv.dtype).reshape(size, recv.size)
    if size == 1:
        copy_into(recv, blocks[0])
    else:
        reduce_in_rank_order_into(op, [blocks[(rank - s) % size] for s in range(size)], recv)


ALGORITHM = DisseminationAllreduce()
