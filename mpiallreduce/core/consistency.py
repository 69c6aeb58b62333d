"""The consistency service: everything the ranks must have alike is compared here, and only here.

A check that fails on one rank only and raises there leaves the other ranks waiting in the next
collective: a hang, not an error. So every comparison is collective and ends the same way on every
rank: all go on, or all raise the same exception naming the ranks and what differs.

    digest(value, bits)        the one digest scheme: call signatures, settings, gradient buckets
    content_digest(array)      the same for an array's bytes: replicas, an input that must not
                               change
    compare(state, code, ...)  a call's signature code against every rank's, before data moves:
                               the shared slots on one node (mpiallreduce.core.slots), else the
                               max of (code, -code) by dissemination in messages on the
                               call's tags (mpiallreduce.core.signature_messages); the waits notice
                               a failed or departed peer (the call's PeerWatch; a timed call's
                               arrival is bounded by its rendezvous); on a mismatch, every rank
                               gathers what each called and raises
    CarriedSignature           the same comparison made inside an algorithm: in shared_memory's
                               first barrier, or in the messages of dissemination's rounds
    codes_agree(comm, code)    a 16-byte allreduce, for what is compared once per communicator
                               (settings; a gradient bucket's digest rides in the bucket's own
                               allreduce instead: mpiallreduce.training.buckets)
    agree_on_call(...)         ``check=True`` and prepared calls: everything compared, arguments
                               validated on every rank, in one allgather
    agree_on_outcome(...)      a step that can fail on one rank (inside an algorithm) made
                               collective
"""

import numpy as np
from mpi4py import MPI

from ..faults.agreed_outcome import agree_on_outcome
from ..faults.errors import AllreduceAborted, ranks_phrase
from .digests import content_digest, digest
from .signature_messages import codes_agree_by_messages as _codes_agree_by_messages

__all__ = [
    "digest",
    "content_digest",
    "compare",
    "SignatureMismatch",
    "meet",
    "codes_agree",
    "raise_signature_mismatch",
    "agree_on_call",
    "agree_on_outcome",
    "describe_differences",
    "CarriedSignature",
]


def codes_agree(comm, code):
    """Collective: whether every rank of ``comm`` gave the same ``code`` (a signed 64-bit number):
    one 16-byte blocking allreduce of (code, -code) with MPI_MAX. Only for what is compared once per
    communicator, when it is made ready (a call's signature goes through ``compare``, whose waits
    watch the peers)."""
    extremes = np.array([code, -code], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, [extremes, MPI.INT64_T], MPI.MAX)
    return extremes[0] == -extremes[1]


def set_up_codes_agree(state, code, sequence):
    """``codes_agree`` for the set-up of call #``sequence`` (CommState.make_ready): (whether every
    rank's code is the same, the AllreduceAborted to raise once the set-up is done or None). Its
    allreduce is non-blocking and waited for through the control channel (faults.watch.
    wait_for_set_up); left pending in ``state.settings_request`` where a peer gave its timed call
    up, for the next set-up: so it carries the call's number (``_set_up_numbers``). Where the codes
    differ, once more with every rank's code of now: a code left pending may be one of settings
    replaced since (every rank saw the same maxima, so every rank does it)."""
    from ..faults.watch import wait_for_set_up

    aborted, again = None, True
    while True:
        if state.settings_request is None:
            fields = np.array([code, -code, sequence, -sequence], dtype=np.int64)
            state.settings_request = (
                state.library.Iallreduce(MPI.IN_PLACE, [fields, MPI.INT64_T], MPI.MAX),
                fields,
            )
        request, fields = state.settings_request
        aborted = wait_for_set_up(state, request, sequence) or aborted
        state.settings_request = None
        if not _set_up_numbers(state, fields, sequence, aborted):
            continue
        if fields[0] == -fields[1] or not again:
            return fields[0] == -fields[1], aborted
        again = False


def _set_up_numbers(state, fields, sequence, aborted):
    """Whether every rank posted its part of the settings' allreduce (``fields``' last two: the max
    and minus the min of the numbers of the calls whose set-up posted them) for call #``sequence``:
    then every rank is in that set-up now. Otherwise a part left pending by a set-up given up met
    one of a later call, and a rank that went on would wait in the set-up's blocking collectives
    for a rank not in them (in its timed call's rendezvous, say):
        a part posted for a later call -> this call was given up: AllreduceAborted
        else (one posted earlier)      -> False: post again, for call #sequence
    Every rank that took part sees the same numbers (one that has moved on, in its next set-up,
    posting again there), so the parts posted again meet."""
    highest, lowest = int(fields[2]), -int(fields[3])
    if highest == lowest == sequence:
        return True
    if aborted is not None:
        raise aborted
    if highest > sequence:
        raise AllreduceAborted(
            f"rank {state.rank}: allreduce call #{sequence} on {state.size} ranks: another rank "
            f"has gone on to call #{highest} without it (it gave this call up: did the ranks give "
            "it different timeouts?); this rank gave up its part",
            sequence=sequence,
        )
    return False


class SignatureMismatch(ValueError):
    """The ranks' calls differ (raised on every rank, before any data moved)."""


def compare(state, code, describe, watch, sequence, published=False):
    """Raise SignatureMismatch (a ValueError) on every rank of ``state``'s communicator, naming what
    differs, unless every rank's call #``sequence`` has the same ``code``. ``describe()``: this
    rank's signature as a dict, gathered only when the codes differ. ``watch()``: the call's
    PeerWatch (watching the peers; no deadline: a timed call's rendezvous bounded the ranks'
    arrival), made only when a wait needs it. ``published``: this
    rank's code is in the shared slots already (SignatureSlots.agree found it not yet agreed)."""
    slots = state.signature_slots
    if slots is not None:
        if not published:
            slots.publish(code, sequence)
        if slots.all_equal(code, sequence, watch):
            return
    elif _codes_agree_by_messages(state, code, sequence, watch()):
        return
    raise_signature_mismatch(state, describe, sequence)


def raise_signature_mismatch(state, describe, sequence):
    """Collective, on ranks that all know the codes differ: gather what each rank called, raise."""
    everyone = state.library.allgather(describe())
    rejected = [
        f"rank {rank}: {theirs['rejected']}"
        for rank, theirs in enumerate(everyone)
        if "rejected" in theirs
    ]
    if rejected:  # (a bad argument there: mpiallreduce.core.call)
        raise SignatureMismatch(
            f"rank {state.rank}: allreduce call #{sequence} was rejected on "
            f"{ranks_phrase([r for r, t in enumerate(everyone) if 'rejected' in t])} before any "
            "data moved; nothing was reduced:\n  " + "\n  ".join(rejected)
        )
    checked = [rank for rank, theirs in enumerate(everyone) if theirs.get("check")]
    if checked:  # (mpiallreduce.core.call.Call.agreed_execution)
        raise SignatureMismatch(
            f"rank {state.rank}: allreduce call #{sequence} was made with check=True on "
            f"{ranks_phrase(checked)} and without it on the others (check must be the same "
            "on every rank, or set for all by MPIALLREDUCE_CHECK=1); nothing was reduced"
        )
    differences = describe_differences(everyone)
    raise SignatureMismatch(
        f"rank {state.rank}: allreduce call #{sequence} differs between the {state.size} ranks "
        "(shape, dtype, op, algorithm or route; see also check=True); nothing was reduced:\n  "
        + "\n  ".join(differences or ["(the calls' digests differ)"])
    )


def agree_on_call(comm, prepare, signature, resolve=None):
    """Run ``prepare()`` on every rank and make its outcome collective.

    Args:
        comm: the communicator whose ranks must agree (all of them call this).
        prepare: a callable validating this rank's arguments; it raises TypeError/ValueError if bad
            (any other exception is agreed on too, and re-raised as it is on its own rank).
        signature: a dict of what must be equal on every rank (shape, dtype, op, ...).
        resolve: optional, ``resolve(prepared)`` -> a dict compared too (what "auto" resolved to).

    Returns:
        what ``prepare()`` returned, once every rank has succeeded with equal signatures.

    Raises:
        TypeError or ValueError on every rank if any rank's ``prepare`` failed or signatures differ.
    """
    local_error = None
    prepared = None
    try:
        prepared = prepare()
        if resolve is not None:
            signature = dict(signature, **resolve(prepared))
    except (
        Exception
    ) as exc:  # any exception: raised alone, it would leave the others in the allgather
        local_error = exc
    reports = comm.allgather(
        (None if local_error is None else (type(local_error).__name__, str(local_error)), signature)
    )
    failures = [(rank, error) for rank, (error, _) in enumerate(reports) if error is not None]
    if failures:
        kinds = {kind for _, (kind, _) in failures}
        exc_type = TypeError if kinds == {"TypeError"} else ValueError
        if local_error is not None and not isinstance(local_error, (TypeError, ValueError)):
            # not a bad argument but a fault here: keep its type (the others raise too)
            raise local_error
        lines = [f"rank {rank}: {kind}: {message}" for rank, (kind, message) in failures]
        raise exc_type(
            f"allreduce arguments rejected on {ranks_phrase([r for r, _ in failures])} "
            f"of {len(reports)}:\n  " + "\n  ".join(lines)
        ) from local_error
    differences = describe_differences([sig for _, sig in reports])
    if differences:
        raise ValueError(
            f"allreduce called with different arguments on the {len(reports)} ranks of the "
            "communicator:\n  " + "\n  ".join(differences)
        )
    return prepared


def describe_differences(signatures):
    """One line per field whose value is not the same on every rank, naming which ranks had
    which."""
    lines = []
    for field in dict.fromkeys(
        field for sig in signatures for field in sig
    ):  # (every rank's, in order)
        ranks_by_value = {}
        for rank, sig in enumerate(signatures):
            ranks_by_value.setdefault(repr(sig.get(field)), []).append(rank)
        if len(ranks_by_value) > 1:
            parts = [f"{value} on {ranks_phrase(ranks)}" for value, ranks in ranks_by_value.items()]
            lines.append(f"{field} differs: " + "; ".join(parts))
    return lines


#: the kind of call a rank brings to a rendezvous (``meet``), besides a prepared call's own code
PLAIN_CALL, LIBRARY_GATHER = 0, digest(("a gather of the library's",)) | 1
_KIND_OF_CALL = {
    PLAIN_CALL: "a plain allreduce",
    LIBRARY_GATHER: (
        "a gather of the library's own (GradientSync's agreement on the gradients, replicas)"
    ),
}


def meet(state, sequence, timeout, site="", code=PLAIN_CALL, rendezvous=None):
    """A timed call's rendezvous (``rendezvous``: one made already, else a Rendezvous), then the
    kinds of call the ranks brought to it compared: PLAIN_CALL (its signature is compared next),
    LIBRARY_GATHER (core.gather), else a prepared call's code (its shape, dtype, op and plan: it
    compares nothing more). Where they differ, raise SignatureMismatch on every rank (every rank
    holds every rank's code), before any data moves."""
    from ..faults.rendezvous import Rendezvous

    met = rendezvous if rendezvous is not None else Rendezvous(state, sequence, timeout, site, code)
    met.code = code
    met.run()
    if len(set(met.codes.values())) > 1:
        kinds = {}
        for rank, theirs in sorted(met.codes.items()):
            kinds.setdefault(theirs, []).append(rank)
        named = [
            f"{_KIND_OF_CALL.get(theirs, 'a prepared call')} on {ranks_phrase(ranks)}"
            for theirs, ranks in kinds.items()
        ]
        raise SignatureMismatch(
            f"rank {state.rank}: allreduce call #{sequence} is not the same call on every rank: "
            + ", ".join(named)
            + (
                " (calls prepared for another shape, dtype, op, plan or symmetric arrays)"
                if len(set(kinds) - set(_KIND_OF_CALL)) > 1
                else ""
            )
            + "; every rank must make the same call at the same point (a call prepared with "
            "mpiallreduce.prepare too); nothing was reduced"
        )


class CarriedSignature:
    """The comparison an algorithm makes in place of a step of its own (``carries_signature``), for
    the executor's Execution ``execution``. In the shared slots (shared_memory, in place of its
    first barrier): ``publish()`` then ``compare()``, or ``agree()`` before a step that is itself
    collective (growing its window). In messages (dissemination, on the signature's tags):
    ``codes()`` sent first in every message, the maxima kept, then ``settle(high, negated)``."""

    __slots__ = ("execution", "sequence", "timeout")

    def __init__(self, execution, sequence, timeout=None):
        """``timeout``: a timed call's, where its waits are bounded (faults.bounded)."""
        self.execution, self.sequence, self.timeout = execution, sequence, timeout

    def _watch(self):
        from ..faults.watch import PeerWatch

        return PeerWatch(self.execution.state, self.sequence, self.timeout, "signature")

    def shared(self):
        return self.execution.state.signature_slots is not None

    def agree(self):
        e = self.execution
        compare(e.state, e.code, e.describe, self._watch, self.sequence)

    def publish(self):
        self.execution.state.signature_slots.publish(self.execution.code, self.sequence)

    def compare(self):
        e = self.execution
        if not e.state.signature_slots.all_equal(e.code, self.sequence, self._watch):
            raise_signature_mismatch(
                e.state, e.describe, self.sequence
            )  # (collective: every rank is here)

    def codes(self):
        """In messages (dissemination's): the two 64-bit numbers this rank sends first (with the
        call's number: CODES), (code, -code); every rank has the max of each over every rank by the
        last round, as ``_codes_agree_by_messages``."""
        return self.execution.code, -self.execution.code

    def settle(self, high, negated):
        """After the last round, on every rank: raise where the maxima say the calls differ."""
        if high != -negated:
            raise_signature_mismatch(self.execution.state, self.execution.describe, self.sequence)
