"""Dissemination: every rank gathers every rank's input (Bruck's allgather), then reduces them all
itself.

Rank r holds the blocks of ranks r, r-1, r-2, ... (mod p); in round k it sends the first ones it
holds to r + 2^k and appends what comes from r - 2^k; the last round sends only what is missing.
p = 5:

    round 0:  r -> r+1   1 block     rank r holds the inputs of r, r-1
    round 1:  r -> r+2   2 blocks    ... of r, ..., r-3
    round 2:  r -> r+4   1 block     ... of all 5

Then every rank reduces the p inputs in rank order: the same bits everywhere. ceil(log2 p) rounds,
(p-1)n bytes sent and p-1 reductions per rank: for small buffers, where the rounds' latency is all.

Its rounds are those of the signature comparison in messages (mpiallreduce.core.signature_messages),
so a call that compares its signature so can carry it here and send no message of its own (the
planner has ``auto`` pick it for plain calls across nodes, where the rounds are compiled). Each
message starts with the 32 bytes of codes (the call's number and the tail's length among them),
whose maxima every rank keeps, on the call's signature tags: its head, at most
SIGNATURE_MESSAGE_BYTES, which every receive there posts; blocks that do not fit go in its tail,
received once the head is in, whole whatever its length (a rank whose call differs sends other
blocks, or the codes alone; a message of a call given up calls_apart calls ago, met on the same
tags, is dropped by its number). The result is written only after the last round, once the codes
agree.

    round k:   head: codes + the first blocks (<= 60 KiB)  tag + k        posted ahead
               tail: the rest of the blocks, if any        tag + k + 256  posted once the head is in
               (past one head, the blocks go half in each while a half fits: both eager on TCP)
"""

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ..core import signature_messages as _messages
from ..core.buffers import aligned_empty, copy_into, retire_scratch, scratch
from ..core.plan_cases import Carries, Route
from ..core.signature_messages import (
    CODES as _CODES,
)
from ..core.signature_messages import (
    SIGNATURE_MESSAGE_BYTES,
    TAIL_OFFSET,
    dissemination_peers,
    drop_tail,
    keep_while_pending,
    take_round,
)
from .base import Algorithm, CallTags, reduce_in_rank_order_into, wait_all

ROUND_TAG = 210
#: the codes' bytes in front of every message (zeros where the call carries no signature)
HEADER = _CODES.size


@dataclass(frozen=True)
class DisseminationPlan:
    size: int
    #: per round: (send to, receive from, blocks sent: this rank's first ones, the block they land
    #: at)
    rounds: tuple[tuple[int, int, int, int], ...]

    def largest_message(self, nbytes):
        """The longest message of a run on ``nbytes`` bytes per rank, its codes included."""
        return HEADER + max((blocks for _, _, blocks, _ in self.rounds), default=0) * nbytes


class DisseminationAllreduce(Algorithm):
    name = "dissemination"
    messages_only = True
    memory = "host"
    #: in its messages, where the call compares its signature so (consistency.CarriedSignature)
    carries_signature = Carries.MESSAGES

    def plan(self, size, rank, count):
        rounds, held = [], 1
        for to, source in dissemination_peers(rank, size):
            blocks = min(held, size - held)
            rounds.append((to, source, blocks, held))
            held += blocks
        return DisseminationPlan(size, tuple(rounds))

    def execute(self, plan, comm, send, recv, op, datatype, signature=None):
        nbytes = recv.nbytes
        space = scratch(
            "dissemination", HEADER + plan.size * nbytes + SIGNATURE_MESSAGE_BYTES, np.uint8
        )
        memoryview(space)[HEADER : HEADER + nbytes] = memoryview(
            recv if send is None else send
        ).cast("B")
        if signature is None:
            codes, tags = (0, 0), comm
        else:  # (the signature's tags, where a rank that compares first sends its codes alone)
            codes, tags = (
                signature.codes(),
                CallTags(comm.comm, signature.sequence, comm.watch, CallTags.SIGNATURE_BASE),
            )
        try:
            high, negated = rounds(
                plan,
                tags,
                space,
                nbytes,
                *codes,
                0 if signature is not None else ROUND_TAG,
                None if signature is None else signature.sequence,
            )
        except (
            BaseException
        ):  # (given up: its requests, left behind, hold this buffer; a rendezvous
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
        if (
            not execution.carried
            or exchange_rounds is None
            or not used()
            or not execution.raw
            or execution.plan.route is not Route.PLAIN
            or execution.plan.accumulate is not None  # (widened, words: the executor's routes)
            or size * nbytes >= 2**31 - SIGNATURE_MESSAGE_BYTES
        ):  # (what one C int counts: the Python's)
            return None
        handle, code, op = state.library.handle, execution.code, execution.op

        # (the buffer, its blocks in rank order, its address; a new one after a call given up)
        def fresh():
            space = aligned_empty(HEADER + size * nbytes + SIGNATURE_MESSAGE_BYTES, np.uint8)
            blocks = (
                space[HEADER : HEADER + size * nbytes].view(execution.dtype).reshape(size, count)
            )
            return (
                space,
                [blocks[(rank - s) % size] for s in range(size)],
                space.__array_interface__["data"][0],
            )

        held = list(fresh())
        signature, slot, base = (
            CarriedSignature(execution, 0),
            CallTags.slot,
            CallTags.SIGNATURE_BASE,
        )
        CallTags(state.library, 0)  # (the first one learns MPI_TAG_UB: CallTags.calls_apart)
        calls_apart = CallTags.calls_apart

        def resume(sequence, watch, stopped, high, negated, taken, handles, owner=None):
            """The rounds from where the compiled ones stopped (round ``stopped``; -2, an MPI error:
            ``high``), their requests as Fortran handles, through ``watch``; the codes' maxima.
            ``owner``: the array a send reads from where it lies (the short path's on 2 ranks)."""
            space, requests = held[0], [MPI.Request.f2py(h) for h in handles]
            tags = CallTags(state.library, sequence, watch, base)
            try:
                if stopped == -2:
                    watch.wait(requests)  # (MPI's error for them, a dead peer's say; else the C's)
                    raise MPI.Exception(high)
                high, negated = finish_round(
                    plan, tags, space, nbytes, stopped, high, negated, 0, sequence, requests, taken
                )
                return rounds(
                    plan, tags, space, nbytes, high, negated, 0, sequence, first=stopped + 1
                )
            except (
                BaseException
            ):  # (given up: MPI may still read or write the buffer, a rendezvous send
                keep_while_pending(
                    requests, (space, owner)
                )  # left behind say; kept, never written again)
                held[:] = fresh()
                raise

        def run(send, recv, sequence, watch):
            space, pieces, address = held
            stopped, high, negated, taken, *handles = exchange_rounds(
                handle,
                (sequence % calls_apart) * slot + base,
                size,
                rank,
                address,
                SIGNATURE_MESSAGE_BYTES,
                recv if send is None else send,
                nbytes,
                code,
                -code,
                sequence,
                _messages.SPIN_SECONDS,
                _messages.SPIN_SECONDS_PER_BYTE,
                TAIL_OFFSET,
            )
            if (
                stopped != -1
            ):  # (a wait that lasts, a message left to the Python, an MPI error: through the watch)
                high, negated = resume(sequence, watch, stopped, high, negated, taken, handles)
            signature.sequence = sequence
            signature.settle(high, negated)  # (raises on every rank where any rank's call differs)
            reduce_in_order(op, pieces, recv)  # (float errors masked by the executor)

        if by_mpi(op, execution.dtype):
            #: what the compiled short path binds to run the same call itself
            #: (core.compiled.short_path): its buffer (held[2]: the address), ``resume``, the tags,
            #: the capacity, this module's variables of signature_messages (SPIN_SECONDS and
            #: SPIN_SECONDS_PER_BYTE, read at each call) and the tails' offset
            run.compiled = (
                held,
                resume,
                base,
                slot,
                calls_apart,
                size,
                rank,
                SIGNATURE_MESSAGE_BYTES,
                vars(_messages),
                TAIL_OFFSET,
            )
        return run


def rounds(plan, tags, space, nbytes, high, negated, tag, sequence=None, first=0):
    """The rounds from ``first`` (mpiallreduce.core.compiled's C does the same, message for message)
    on ``tags`` (CallTags: its PeerWatch waits): ``space`` holds the codes, the blocks, then room
    for a head (SIGNATURE_MESSAGE_BYTES); ``sequence``: the call's number, where it carries the
    signature (a message of another call is dropped: signature_messages.take_round). Returns the
    codes' maxima."""
    work = memoryview(space)
    incoming = work[HEADER + plan.size * nbytes :]
    for step in range(first, len(plan.rounds)):
        to, source, count, _ = plan.rounds[step]
        head, tail = split(
            count * nbytes
        )  # (uncompared: the number's field says the blocks' length)
        _CODES.pack_into(
            work, 0, high, negated, count * nbytes if sequence is None else sequence, tail
        )
        requests = [
            tags.Irecv([incoming, MPI.BYTE], source, tag + step),
            tags.Isend([work[: HEADER + head], MPI.BYTE], to, tag + step),
        ]
        if tail:
            requests.append(
                tags.Isend(
                    [work[HEADER + head : HEADER + count * nbytes], MPI.BYTE],
                    to,
                    tag + step + TAIL_OFFSET,
                )
            )
        high, negated = finish_round(
            plan, tags, space, nbytes, step, high, negated, tag, sequence, requests
        )
    return high, negated


def split(nbytes):
    """(head, tail): how many of a message's ``nbytes`` of blocks go behind its codes, and in its
    tail."""
    room = SIGNATURE_MESSAGE_BYTES - HEADER
    head = (
        nbytes if nbytes <= room else min(room, (nbytes + 1) // 2)
    )  # (past one head, halves while they fit)
    return head, nbytes - head


def finish_round(
    plan, tags, space, nbytes, step, high, negated, tag, sequence, requests, taken=False
):
    """Round ``step`` from its posted ``requests`` (the head's receive, the head's send, the tail's
    send; and the tail's receive where the compiled rounds took the head in, ``taken``): the head
    taken (another call's message dropped), the tail received into place, or dropped where it is
    not this call's length. Returns the codes' maxima; the head's blocks go where they belong."""
    _, source, count, at = plan.rounds[step]
    work = memoryview(space)
    incoming = work[HEADER + plan.size * nbytes :]
    head, tail = split(count * nbytes)
    if not taken:
        if sequence is None:
            wait_all(tags, requests[:1])
            _, _, length, theirs = _CODES.unpack_from(incoming)
        else:
            theirs, length = (
                take_round(tags, tags.watch, incoming, source, tag + step, sequence, requests[:1]),
                count * nbytes,
            )
        if theirs == tail and tail and length == count * nbytes:
            requests.append(
                tags.Irecv(
                    [work[HEADER + at * nbytes + head : HEADER + (at + count) * nbytes], MPI.BYTE],
                    source,
                    tag + step + TAIL_OFFSET,
                )
            )
        elif (
            theirs != tail or length != count * nbytes
        ):  # (a rank whose call differs: the codes say so)
            if theirs:
                drop_tail(tags, getattr(tags, "watch", None) or _Waits, source, tag + step, theirs)
            if (
                sequence is None
            ):  # (uncompared: the lengths say so, on each rank that receives another length)
                wait_all(tags, requests[1:])
                raise ValueError(
                    f"rank {tags.Get_rank()}: dissemination received {length} bytes of blocks from "
                    f"rank {source} where this call sends {count * nbytes}: the ranks' calls "
                    f"differ in size (their signatures are not compared: a prepared call, or below "
                    f"MPIALLREDUCE_SIGNATURE_MIN_BYTES)"
                )
    wait_all(tags, requests[1:])
    their_high, their_negated, _, _ = _CODES.unpack_from(incoming)
    work[HEADER + at * nbytes : HEADER + at * nbytes + head] = incoming[HEADER : HEADER + head]
    return max(high, their_high), max(negated, their_negated)


class _Waits:
    """A watch's ``wait`` for tags that have none."""

    @staticmethod
    def wait(requests):
        MPI.Request.Waitall(requests)


def reduce_blocks(op, space, size, rank, recv):
    """recv = the p blocks reduced in rank order (block j holds rank - j's input)."""
    blocks = space[HEADER : HEADER + size * recv.nbytes].view(recv.dtype).reshape(size, recv.size)
    if size == 1:
        copy_into(recv, blocks[0])
    else:
        reduce_in_order(op, [blocks[(rank - s) % size] for s in range(size)], recv)


def by_mpi(op, dtype):
    """Whether dissemination reduces ``op`` over ``dtype`` by MPI_Reduce_local (a sum, or a mean's
    sum, of native float32, float64, int32 or int64), on every path: the compiled short path's
    reduction, done alike in Python; else by the op's own numpy (reduce_in_rank_order_into)."""
    return (
        op.name in ("sum", "mean") and dtype.isnative and dtype.str[1:] in ("f4", "f8", "i4", "i8")
    )


def reduce_in_order(op, pieces, recv):
    """recv = ``pieces`` reduced left to right: rank 0's copied, each next one reduced into it by
    MPI_Reduce_local (in (op) inout: a + b is b + a, the same bits as numpy's left to right) where
    ``by_mpi``, as the compiled short path does; the same NaN payloads whichever path a rank takes
    (numpy's loops keep one operand's, MPI's the other's). Else the op's own, in numpy."""
    if not by_mpi(op, recv.dtype):
        reduce_in_rank_order_into(op, pieces, recv)
        return
    copy_into(recv, pieces[0])
    mpi_op = op.mpi_op(recv.dtype)
    for piece in pieces[1:]:
        mpi_op.Reduce_local(piece, recv)


ALGORITHM = DisseminationAllreduce()
