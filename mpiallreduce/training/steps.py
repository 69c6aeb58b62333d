"""What one rank gave GradientSync in one step, against the plan, and how the ranks compare that.

A step's record (Step) says, for every planned gradient, whether this rank marked it ready as
planned, not at all, twice, or as something else (another shape, dtype, name, a read-only array),
and what it marked that has no place in the plan. Its ``contents()`` feed the digest that rides in
the last bucket (mpiallreduce.buckets); when the digests differ, ``describe_step_differences``
gathers every rank's contents and names the first gradient that differs and the ranks.
``agree_on_slots`` is the one collective comparison of a plan's gradients and options (declared
parameters, or the first step's gradients).
"""

from collections import Counter

import numpy as np

from ..core.consistency import describe_differences
from ..core.gather import gather_from_ranks
from ..device.arrays import namespace
from .buckets import GradientSpec, Slot, accumulation_dtype

__all__ = [
    "Step",
    "agree_on_slots",
    "describe_step_differences",
    "given_slot",
    "on_device",
    "problem",
    "twins",
    "refuse_ambiguous_slots",
    "common_order",
    "UNNAMED_TWIN",
]

#: why an unnamed gradient cannot be told from another (a later step's ready() without a name)
UNNAMED_TWIN = "unnamed, and another gradient has its shape and dtype: give ready(..., name=)"


class _Text(str):
    """A string that describe_differences shows as it is, without quotes."""

    def __repr__(self):
        return str(self)


OK, MISSING = _Text("ready"), _Text("not marked ready")


class Step:
    """This rank's record of one step: what it gave for each of ``slots`` (None: no plan yet)."""

    def __init__(self, slots, find_unused):
        self.slots, self.find_unused = slots, find_unused
        self.filled = {}  # slot -> the gradient given for it
        self.copied = set()  # slots whose gradient is in its bucket's buffer already
        self.status = {}  # slot -> how it differs from the plan (its description), when it does
        self.extras = []  # gradients that have no slot
        self.arrivals = []  # slot indices, in the order they were marked ready
        self.calls = []  # (grad, name): what this step was given, to replan from
        self.failed = (
            None  # what starting a bucket raised (a timeout at its first start): wait() raises it
        )

    def accept(self, index, grad):
        """Record ``grad``, known to fit slot ``index`` (the short way); False if the slot has been
        given one already (``mark`` says how)."""
        if index in self.filled or index in self.status:
            return False
        self.arrivals.append(index)
        self.filled[index] = grad
        return True

    def mark(self, index, grad, given, trouble):
        """Record ``grad`` (whose Slot is ``given``; ``trouble``: why it cannot be a gradient, or
        None) for slot ``index`` (None: no slot). Returns whether it counts towards its bucket."""

        def described():
            return given.describe() + (f" ({trouble})" if trouble else "")

        self.arrivals.append(index)
        if index is None:
            self.extras.append(described())
            return False
        slot = self.slots[index]
        if index in self.filled or index in self.status:
            self.status[index] = f"marked ready twice (once as {described()})"
            return False
        if trouble is not None or (given.shape, given.dtype, given.device) != (
            slot.shape,
            slot.dtype,
            slot.device,
        ):
            self.status[index] = f"given {described()}"
        else:
            self.filled[index] = grad
        return True

    def clean(self):
        """Whether every gradient came as planned (nothing to tell the others)."""
        return (
            not self.status
            and not self.extras
            and (self.find_unused or len(self.filled) == len(self.slots))
        )

    def contents(self):
        """What this rank gave for each gradient, and what it gave that has no slot: the digest's
        input, and what the ranks compare when the digests differ."""
        contents = {}
        for index, slot in enumerate(self.slots):
            if index in self.status:
                contents[slot.describe()] = _Text(self.status[index])
            elif index in self.filled or self.find_unused:
                contents[slot.describe()] = OK
            else:
                contents[slot.describe()] = MISSING
        contents["gradients marked ready that were not expected"] = _Text(
            ", ".join(self.extras) or "none"
        )
        return contents

    def trouble(self):
        """What is wrong with this step (lines), when every rank's contents are alike."""
        if self.clean():
            return []
        trouble = [
            f"{self.slots[i].describe()} was {status}" for i, status in sorted(self.status.items())
        ]
        if not self.find_unused:
            missing = [
                self.slots[i].name
                for i in range(len(self.slots))
                if i not in self.filled and i not in self.status
            ]
            if missing:
                trouble.append(
                    f"{len(missing)} declared gradient(s) were not marked ready: {missing[:8]} "
                    "(pass find_unused=True to count them as zeros)"
                )
        if self.extras:
            trouble.append(f"gradients that were not declared were marked ready: {self.extras[:8]}")
        return trouble


def describe_step_differences(comm, step, buckets):
    """Every rank's contents of ``step``, compared (collective): the message each rank raises."""
    everyone = gather_from_ranks(
        comm, step.contents()
    )  # (every rank is here: its digests disagreed)
    lines = describe_differences(everyone)
    bucket_of = {
        step.slots[i].describe(): bucket.index for bucket in buckets for i in bucket.members
    }
    where = next(
        (
            bucket_of[line.split(" differs:")[0]]
            for line in lines
            if line.split(" differs:")[0] in bucket_of
        ),
        None,
    )
    missing = any(MISSING in theirs.values() for theirs in everyone)
    hint = (
        ""
        if not missing
        else (
            "\n(a gradient not marked ready on some ranks: an unused parameter there? "
            "pass find_unused=True to count it as zeros there)"
        )
    )
    return (
        "GradientSync: the ranks' gradients differ"
        + (f" (first in bucket {where} of {len(buckets)})" if where is not None else "")
        + "; no gradient was changed:\n  "
        + "\n  ".join(lines)
        + hint
    )


def on_device(array):
    if isinstance(array, GradientSpec):
        return bool(array.device)
    return namespace(array) is not None


def problem(grad):
    """Why ``grad`` cannot be a gradient (a line), or None."""
    if namespace(grad) is None and (not isinstance(grad, np.ndarray) or not grad.flags.writeable):
        if isinstance(grad, np.ndarray):
            return "a read-only numpy array"
        return f"a {type(grad).__name__}, not a writeable numpy array or a CuPy array"
    try:
        accumulation_dtype(grad.dtype)
    except TypeError as error:
        return str(error)
    return None


def given_slot(name, grad):
    """What was given for a gradient, as a Slot (whatever it is)."""
    if isinstance(grad, GradientSpec) or hasattr(grad, "dtype") and hasattr(grad, "shape"):
        try:
            return Slot.of(name, grad, on_device(grad))
        except TypeError:
            pass
    return Slot(str(name), tuple(getattr(grad, "shape", ())), type(grad).__name__, False)


def twins(slots):
    """The indices of the slots whose shape, dtype and device another slot has too: gradients that
    only a name, or a declared parameter, tells apart."""
    kinds = Counter((slot.shape, slot.dtype, slot.device) for slot in slots)
    return {i for i, slot in enumerate(slots) if kinds[(slot.shape, slot.dtype, slot.device)] > 1}


def refuse_ambiguous_slots(slots):
    """A step that plans the buckets (the first, or one changed alike on every rank) declared
    gradients that cannot be told apart: one name given twice (each later step would find it
    "marked ready twice" and plan anew, for ever), or, without names, gradients that another of the
    same shape and dtype could stand in for (a rank that marks them in another order would go
    unnoticed, and its means be wrong). Raise. Read from the slots the ranks agreed on (an unnamed
    gradient's is "#i", its place), so that every rank raises alike."""
    names = Counter(slot.name for slot in slots)
    twice = sorted(name for name, count in names.items() if count > 1)
    if twice:
        raise ValueError(
            f"GradientSync: gradient name(s) {twice[:8]} given to more than one gradient in a step "
            "that plans the buckets: give each gradient its own name; no gradient was changed"
        )
    unnamed = [i for i in sorted(twins(slots)) if slots[i].name == f"#{i}"]
    if unnamed:
        raise ValueError(
            f"GradientSync: gradients #{', #'.join(map(str, unnamed[:8]))} of a step that plans "
            "the buckets (the first, or one whose gradients changed alike on every rank) were "
            "marked ready without a name and share their shape and dtype with another "
            f"({slots[unnamed[0]].describe()}): their order cannot be checked across ranks, and a "
            "rank that swapped them would get wrong means. Pass ready(grad, name=...) or "
            "GradientSync(parameters=...); no gradient was changed"
        )


def agree_on_slots(comm, slots, what, options, problems=(), timeout=None, any_order=False):
    """One allgather (bounded by ``timeout``: mpiallreduce.core.gather.gather_from_ranks): every
    rank has the same options and slots and no rank has a problem with its gradients, or every rank
    raises the same error naming the ranks and the first difference. Returns the slots agreed on:
    ``any_order`` (a first step's, named by ``name`` or by position), every rank's slots may come in
    its own order if they are the same by name, and rank 0's order is taken."""
    everyone = gather_from_ranks(comm, (options, list(problems), slots), timeout)
    troubled = [(rank, p) for rank, (_, theirs, _) in enumerate(everyone) for p in theirs]
    if troubled:
        raise TypeError(
            f"{what}: gradients that are not writeable float or complex arrays:\n  "
            + "\n  ".join(f"rank {rank}: {p}" for rank, p in troubled[:8])
        )
    differences = describe_differences([theirs for theirs, _, _ in everyone])
    if differences:
        raise ValueError(
            f"{what}: the ranks' GradientSync options differ:\n  " + "\n  ".join(differences)
        )
    every_slots = [theirs for _, _, theirs in everyone]
    if all(theirs == every_slots[0] for theirs in every_slots):
        return every_slots[0]
    by_name = [sorted(theirs, key=lambda slot: slot.name) for theirs in every_slots]
    if (
        any_order
        and len({slot.name for slot in slots}) == len(slots)
        and all(b == by_name[0] for b in by_name)
    ):
        return every_slots[0]
    lengths = {len(theirs) for theirs in every_slots}
    fields = [{"count": len(theirs)} for theirs in every_slots] if len(lengths) > 1 else []
    if not fields:
        first = next(i for i in range(len(slots)) if len({theirs[i] for theirs in every_slots}) > 1)
        fields = [{f"gradient #{first}": _Text(theirs[first].describe())} for theirs in every_slots]
    raise ValueError(
        f"{what}: the ranks hold different gradients:\n  "
        + "\n  ".join(describe_differences(fields))
    )


def common_order(comm, arrivals, count, timeout=None):
    """The order in which every rank marked all ``count`` gradients ready once (``arrivals``: this
    rank's slot indices), if it is one same order (collective), else None: DDP's bucket rebuild."""
    complete = sorted(a for a in arrivals if a is not None) == list(range(count))
    orders = gather_from_ranks(comm, list(arrivals) if complete else None, timeout)
    return (
        orders[0] if orders[0] is not None and all(order == orders[0] for order in orders) else None
    )
