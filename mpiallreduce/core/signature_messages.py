"""The signature's messages: one protocol for the check in messages and for dissemination's rounds.

Across nodes (or under ULFM) a call's signature code is compared by dissemination: in round k each
rank sends to rank + 2^k and receives from rank - 2^k, on the call's own tags
(CallTags.SIGNATURE_BASE + k), and keeps the maxima of (code, -code). The dissemination algorithm
(mpiallreduce.algorithms) sends its blocks behind the same codes in the same rounds, so the two pair
with each other:

    every message:   CODES (high, negated, the call's number, its tail's length; 32 bytes), then
                     blocks or nothing, SIGNATURE_MESSAGE_BYTES in all at most
    its tail:        the blocks that did not fit, in one message on its tag + TAIL_OFFSET
    every receive:   SIGNATURE_MESSAGE_BYTES; then the tail its codes announce, whole: so whatever
                     a rank whose call differs sends, no message is truncated or left unmatched
    a message whose number is another call's (one given up CallTags.calls_apart calls ago):
                     dropped with its tail, and the receive posted again (take_round)

A tail's receive is posted once its head is in (60 KiB at most: eager on TCP, whose limit is 64
KiB with Open MPI's header); a tail above the eager limit waits for it in a rendezvous, which
costs its round trip anyway. A call whose blocks pass one head splits them in halves while those
fit (dissemination.split): two eager messages up to 120 KiB, and no rendezvous.
"""

import struct
from typing import Any

import numpy as np
from mpi4py import MPI

from .mpi_requests import request_done

__all__ = [
    "codes_agree_by_messages",
    "codes_by_messages",
    "resume_codes",
    "signature_tag",
    "call_tags",
    "keep_while_pending",
    "SPIN_SECONDS",
    "SPIN_SECONDS_PER_BYTE",
    "take_round",
    "dissemination_peers",
    "CODES",
    "SIGNATURE_MESSAGE_BYTES",
    "TAIL_OFFSET",
    "drop_tail",
]


def codes_agree_by_messages(state, code, sequence, watch):
    """Across nodes (or under ULFM): the max of (code, -code) by dissemination, in messages on the
    call's own tags (CallTags.SIGNATURE_BASE) waited for through its PeerWatch. p = 5:

        round 0:  r -> r+1 (mod 5)     each rank holds the max over {r, r-1}
        round 1:  r -> r+2             ... over {r, ..., r-3}
        round 2:  r -> r+4             ... over all 5: every rank the same pair

    ceil(log2 p) rounds of one 32-byte message each way for any p (a max may count a rank twice).
    The dissemination algorithm sends its blocks behind the same 32 bytes in the same rounds, so a
    rank whose call runs it pairs with one that compares first (receives post
    SIGNATURE_MESSAGE_BYTES). A rank that gives the call up leaves its requests behind (PeerWatch:
    receives cancelled, every request kept with its buffer, new arrays each round) on tags no call
    of the next CallTags.calls_apart uses (a collective, once started, could not be given up); a
    message of it met there later carries its number, and is dropped (``take_round``)."""
    high, negated = codes_by_messages(state, sequence, watch, code, -code)
    return high == -negated


def codes_by_messages(state, sequence, watch, high, negated, first=0):
    """``codes_agree_by_messages``' rounds from round ``first`` on, from the maxima so far; the
    maxima over every rank."""
    library, rank, size = state.library, state.rank, state.size
    tag = signature_tag(library, sequence) + first  # (+ the round)
    for to, source in dissemination_peers(rank, size)[first:]:
        theirs = np.empty(SIGNATURE_MESSAGE_BYTES, dtype=np.uint8)
        sent = library.Isend([_CODES.pack(high, negated, sequence, 0), MPI.BYTE], to, tag)
        tail = take_round(
            library,
            watch,
            theirs,
            source,
            tag,
            sequence,
            [library.Irecv([theirs, MPI.BYTE], source, tag), sent],
        )  # (32 bytes: eager)
        if tail:
            # (a rank whose call differs runs dissemination on a longer buffer: its tail taken,
            # dropped)
            drop_tail(library, watch, source, tag, tail)
        their_high, their_negated, _, _ = _CODES.unpack_from(theirs)
        high, negated = max(high, their_high), max(negated, their_negated)
        tag += 1
    return high, negated


def resume_codes(state, sequence, watch, stopped, high, negated, taken, requests, incoming):
    """The compiled check's rounds (the codes alone: mpiallreduce.core.compiled) from round
    ``stopped``, where they stopped (-2: an MPI error, ``high`` its code), with that round's
    ``requests`` (the head's receive into ``incoming``, the head's send, then nulls; ``taken``: the
    head is in), through ``watch``; the maxima over every rank."""
    if stopped == -2:
        watch.wait(requests)  # (MPI's error for them, a dead peer's say; else the C's)
        raise MPI.Exception(high)
    library = state.library
    _, source = dissemination_peers(state.rank, state.size)[stopped]
    if not taken:
        tag = signature_tag(library, sequence) + stopped
        tail = take_round(library, watch, incoming, source, tag, sequence, requests[:1])
        if tail:
            drop_tail(library, watch, source, tag, tail)
    watch.wait(requests[1:])
    their_high, their_negated, _, _ = _CODES.unpack_from(incoming)
    return codes_by_messages(
        state, sequence, watch, max(high, their_high), max(negated, their_negated), stopped + 1
    )


def signature_tag(comm, sequence):
    """The tag of call #``sequence``'s first round on its signature tags
    (CallTags.SIGNATURE_BASE)."""
    return call_tags()(comm, sequence, None, call_tags().SIGNATURE_BASE).offset


def call_tags():
    """CallTags (mpiallreduce.algorithms.base), imported on first use: the algorithms import the
    core."""
    if not _TAGS:
        from ..algorithms.base import CallTags

        _TAGS.append(CallTags)
    return _TAGS[0]


def keep_while_pending(requests, space):
    """Keep ``space`` until ``requests``, left behind by a call given up, are done (the f2py
    requests of the compiled rounds do not hold their buffers, as mpi4py's own do): a later call
    takes a new buffer."""
    _KEPT[:] = [(r, s) for r, s in _KEPT if not all(request_done(q) for q in r)] + [
        (requests, space)
    ]


_KEPT: list[Any] = []
#: how long the compiled rounds test a wait's requests before the Python waits for them (and then
#: looks at the control channel and the deadline: mpiallreduce.faults.watch, every millisecond);
#: read at each call, by the check's and by dissemination's
SPIN_SECONDS = 1e-3
#: and this much longer per byte of a round's blocks: their transfer takes time of its own (a MiB
#: each way about 0.7 ms between 2 emulated nodes here), which a return to the Python's millisecond
#: watch would round up; a dead peer is noticed that much later. dissemination by name on 2 ranks
#: across 2 emulated nodes, against 0 (a /tmp script, 2026-12-04 15:24, three launches
#: of 9 interleaved rounds, not kept): 3-9% faster at 2 MiB in each, at 1 and 4 MiB within the noise
SPIN_SECONDS_PER_BYTE = 2e-9


def take_round(comm, watch, incoming, source, tag, sequence, requests):
    """Wait for ``requests`` (a round's receive into ``incoming`` first, never a tail's send: the
    peer posts its receive once this wait is over) through ``watch``; a message that carries
    another call's number (a call given up CallTags.calls_apart calls ago, whose message stayed
    unmatched on these tags) is dropped with its tail and the receive posted again. Returns the
    length of the kept message's tail, for the caller to receive (on ``tag`` + TAIL_OFFSET)."""
    watch.wait(requests)
    _, _, number, tail = _CODES.unpack_from(incoming)
    while number != sequence:
        if tail:
            drop_tail(comm, watch, source, tag, tail)
        watch.wait([comm.Irecv([incoming, MPI.BYTE], source, tag)])
        _, _, number, tail = _CODES.unpack_from(incoming)
    return tail


def drop_tail(comm, watch, source, tag, nbytes):
    """Receive a tail no one wants (a message of a call that differs, or of one given up), whole:
    left unmatched, its rendezvous send would never end."""
    watch.wait([comm.Irecv([np.empty(nbytes, np.uint8), MPI.BYTE], source, tag + TAIL_OFFSET)])


#: the codes in front of every message on the signature's tags, (high, negated, the call's number,
#: the length of the message's tail), 32 bytes (the blocks behind them aligned): native order, as
#: the compiled rounds write them
CODES = _CODES = struct.Struct("=qqqq")
#: the longest message (head) on a call's signature tags, and what every receive there posts: the
#: codes' 32 bytes, or dissemination's blocks behind them; what does not fit goes in the message's
#: tail. A longer message would be truncated, and Open MPI 5 crashed the receiving process on a
#: message truncated past its eager limit (seen here: docs/notes-benchmarks.md). 60 KiB: under Open
#: MPI's TCP eager limit; 2 emulated nodes, plain calls of 16 to 48 KiB 1.18x to 1.59x raw
#: MPI_Allreduce's speed with it, 0.91x to 1.02x with 16 KiB (benchmarks/plain_across_nodes.py)
SIGNATURE_MESSAGE_BYTES = 60 << 10
#: a message's tail goes on its tag + this, in the call's slot (CallTags: the signature's tags from
#: 512, a round each; the tails' from 768)
TAIL_OFFSET = 256


def dissemination_peers(rank, size):
    """(send to, receive from) in each round of dissemination: round k, rank + 2**k and
    rank - 2**k."""
    return [((rank + 2**k) % size, (rank - 2**k) % size) for k in range((size - 1).bit_length())]


_TAGS: list[type] = []
