"""Gradient synchronization for data-parallel training: fixed buckets, averaging, identical
replicas.

    sync = GradientSync(parameters=params, bucket_bytes=25 * 2**20)   # {name: array}, as DDP takes
                                                                      # the model
    for name, grad in reversed(gradients.items()):                     # as backward produces them
        sync.ready(grad, name=name)   # a bucket is allreduced in the background once all its
                                      # members are ready
    sync.wait()                       # every gradient now holds the mean over the ranks, in place

Many small gradients cost a few large allreduces instead of hundreds of small ones (torch DDP's
25 MB buckets, Horovod's tensor fusion). The buckets are fixed once (mpiallreduce.buckets): from
the declared parameters, in reverse order, or, without them, from the first step's ``ready``
calls, which the ranks compare at its ``wait``. Gradients may then arrive in any order on any
rank; bucket n holds the same gradients everywhere. Each bucket carries a digest of what this
rank put in it, inside its own allreduce: a rank that marked other gradients, in another order, of
another shape, or missed one, makes every rank raise the same ValueError at ``wait()``, naming
the gradient and the ranks, never wrong values (mpiallreduce.training.steps). With
``find_unused=True`` a gradient a rank did not mark ready counts as zeros there (DDP's
``find_unused_parameters``). No gradient is written before ``wait()`` knows that the step succeeded
on every rank (mpiallreduce.training.reduction).

float16 and bfloat16 are summed in float32, rounded once; ``compression`` sends 16 bits. Gradients
may be numpy or CuPy arrays (device buckets); on one node host buckets are symmetric buffers (single
copy).
"""

import contextlib
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import numpy as np
from mpi4py import MPI

from ..core.annotations import Array, Timeout
from ..device.arrays import namespace
from .buckets import Bucket, GradientSpec, Slot, plan_buckets
from .compression import check_compression
from .overlap import overlap_with_backward, untimed
from .reduction import DIRECT_MIN_BYTES, BucketReducer
from .replicas import broadcast_parameters, check_replicas
from .steps import (
    UNNAMED_TWIN,
    Step,
    agree_on_slots,
    common_order,
    describe_step_differences,
    given_slot,
    on_device,
    problem,
    refuse_ambiguous_slots,
    twins,
)

__all__ = ["GradientSync", "GradientSpec", "broadcast_parameters", "check_replicas"]

#: a gradient's name: a key of the parameters declared in a dict, else its index (or None: by
#: position, or the declared array itself)
GradientName = str | int | None
Gradients = TypeVar("Gradients", bound=Iterable[Array])


class GradientSync:
    """Fuses gradients into fixed buckets, allreduces each (in the background as soon as all its
    gradients are ready, with ``overlap``), writes the results back in place at ``wait()``, once
    every rank's step succeeded. Large gradients are reduced on their own: in a buffer kept from
    step to step, or where no rank overlaps and untimed, where they lie once the ranks agreed
    (training.reduction).

    Args:
        comm: communicator of the replicas (COMM_WORLD if None).
        bucket_bytes: a bucket holds gradients (in backward's order) until it has this many bytes.
        op: "mean" (default) or "sum".
        algorithm: passed to allreduce ("auto" by default).
        prescale, postscale: multiply each gradient before the reduction / the result after it
            (the gradient itself is not changed before ``wait()`` writes the result).
        timeout: seconds each bucket's allreduce waits for the other ranks (see allreduce); None:
            MPIALLREDUCE_TIMEOUT, else for ever.
        parameters: the gradients to expect, as DDP takes the model: a dict {name: array} or a
            list of arrays (the gradient arrays, or the parameters themselves, or GradientSpec:
            only shape, dtype and device are read). Collective: the ranks compare them here.
            ``ready(grad, name=...)`` then names the gradient (a dict key, or a list index); without
            a name, ``grad`` must be the declared array itself. Without ``parameters``, the first
            step's ``ready`` calls declare them, by ``name``, else by position (the n-th ``ready``
            is the n-th gradient: unnamed ones of one shape and dtype are a ValueError on every
            rank, as a swap could not be seen); if every rank changes them alike, they are planned
            anew.
        find_unused: a declared gradient that this rank did not mark ready counts as zeros here
            (torch DDP's ``find_unused_parameters``); ``wait()`` returns its result. Without it, a
            missing gradient is a ValueError on every rank at ``wait()``.
        compression: None, "fp16" or "bf16": float gradients travel as 16 bits, are summed in
            float32 and rounded once (complex ones travel as they are; see
            mpiallreduce.compression). Compressed buckets are not timed: no ``timeout`` with it.
        reproducible: every bucket's sum is reproducible (``allreduce(..., reproducible=True)``):
            the same bits whatever the bucket size, the algorithm, the ranks' order.
        rebuild_buckets: after the first step with declared parameters, if every rank's gradients
            arrived in one same order, refill the buckets in that order (as DDP does), so that
            each starts as early as it can.
        overlap: True: reduce each full bucket in the background while backward goes on; False: at
            ``wait()``, on the caller's thread; None: where this rank has a core to spare
            (mpiallreduce.training.overlap). Ranks may differ; where none overlaps, large gradients
            go in place.
        write_back: False: host buckets' results (of the gradients' dtype) are not copied into them
            but returned by ``wait()``, views of a bucket's two buffers (used in turn: valid until
            the step after next), for a framework to point its gradients at (``grad.set_``; on one
            node with a timeout, written back: mpiallreduce.training.fused).
    """

    def __init__(
        self,
        comm: MPI.Intracomm | None = None,
        bucket_bytes: int = 25 * 2**20,
        op: Literal["mean", "sum"] = "mean",
        algorithm: str = "auto",
        prescale: float = 1.0,
        postscale: float = 1.0,
        timeout: Timeout = None,
        *,
        parameters: dict[str, Array] | Sequence[Array] | None = None,
        find_unused: bool = False,
        compression: str | None = None,
        reproducible: bool = False,
        rebuild_buckets: bool = True,
        overlap: bool | None = None,
        write_back: bool = True,
    ) -> None:
        if op not in ("mean", "sum"):
            raise ValueError(f"GradientSync op must be 'mean' or 'sum', got {op!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.bucket_bytes, self.op, self.algorithm, self.timeout = (
            bucket_bytes,
            op,
            algorithm,
            timeout,
        )
        self.prescale, self.postscale, self.write_back = prescale, postscale, bool(write_back)
        self.find_unused, self.reproducible = bool(find_unused), bool(reproducible)
        self.compression = check_compression(compression)
        if self.reproducible and self.compression:
            raise ValueError(
                "GradientSync: compression rounds each contribution on the way: it cannot be "
                "reproducible=True as well"
            )
        if self.compression and timeout is not None:
            raise ValueError(
                "GradientSync: compressed buckets cannot be timed yet (timeout=None with "
                "compression)"
            )
        self.declared = parameters is not None
        #: declared as a dict: named by its keys (synchronize then finds each by identity)
        self._declared_by_name = isinstance(parameters, dict)
        self.overlap, self._asked_overlap = None, overlap  # (decided at the first plan: collective)
        self._rebuild_pending = bool(rebuild_buckets) and self.declared
        self._slots: list[Slot] | None = None  # (planned at the first step, or here)
        self._reducer: BucketReducer | None = None
        self._by_name: dict[str, int] = {}  # (a slot's name -> its index)
        self._by_identity: dict[int, int] = {}  # (a declared array's id -> its slot's index)
        self._device_xp, self._no_sync = None, 0
        self._buckets: list[Bucket] = []
        #: what every rank's GradientSync must have alike (compared with the gradients,
        #: collectively)
        self._options = {
            "bucket_bytes": bucket_bytes,
            "op": op,
            "algorithm": algorithm,
            "prescale": prescale,
            "postscale": postscale,
            "timed": timeout is not None,
            "find_unused": self.find_unused,
            "compression": compression,
            "reproducible": self.reproducible,
            "rebuild_buckets": bool(rebuild_buckets),
            "declared": self.declared,
            "write_back": self.write_back,
        }
        if parameters is not None:
            named = (
                list(parameters.items())
                if isinstance(parameters, dict)
                else list(enumerate(parameters))
            )
            slots = [given_slot(name, array) for name, array in named]
            problems = [
                f"{slot.describe()}: {reason}"
                for slot, (_, array) in zip(slots, named, strict=True)
                if not isinstance(array, GradientSpec)
                and (reason := problem(array)) is not None
                and "read-only" not in reason
            ]  # (parameters may be read-only views: only their shape counts)
            agree_on_slots(
                self.comm, slots, "GradientSync(parameters=...)", self._options, problems, timeout
            )
            self._by_identity = {id(array): i for i, (_, array) in enumerate(named)}
            # (held: an id is unique only while its object lives; freed, another array could take
            # it)
            self._declared_arrays = [array for _, array in named]
            self._use_slots(slots, order=range(len(slots) - 1, -1, -1))
        self._new_step()

    def _use_slots(self, slots: list[Slot], order: Iterable[int]) -> None:
        if self.overlap is None:  # (every rank plans here, together, whatever it was asked)
            self.overlap, self._agree_first, self._spans_nodes = overlap_with_backward(
                self.comm, self._asked_overlap, self.timeout
            )
        self._slots = slots
        self._by_name, self._twins = {slot.name: i for i, slot in enumerate(slots)}, twins(slots)
        # slot -> (shape, dtype) of a numpy gradient that fitted it: later ones take the short way
        self._fits: dict[int, tuple[tuple[int, ...], np.dtype]] = {}
        self._buckets = plan_buckets(
            slots, self.bucket_bytes, list(order), None if self.compression else DIRECT_MIN_BYTES
        )
        self._bucket_of = {
            member: bucket.index for bucket in self._buckets for member in bucket.members
        }
        self._reducer = BucketReducer(
            self.comm,
            slots,
            self._buckets,
            op=self.op,
            algorithm=self.algorithm,
            prescale=self.prescale,
            postscale=self.postscale,
            timeout=self.timeout,
            compression=self.compression,
            reproducible=self.reproducible,
            one_node=not self._spans_nodes,
            views=not self.write_back,
            replaced=self._reducer,
        )  # (a replan: every rank together, nothing in flight)

    buckets = property(
        lambda self: (
            []
            if self._slots is None
            else [[self._slots[i].name for i in b.members] for b in self._buckets]
        ),
        doc="The buckets, in the order they are started: lists of gradient names (none unplanned).",
    )

    def _new_step(self) -> None:
        self._step = Step(self._slots, self.find_unused)
        self._arrived, self._next_bucket = [0] * len(self._buckets), 0
        self._in_flight: list[tuple[Any, ...]] = []  # (BucketReducer.start's, per bucket)

    in_no_sync = property(
        lambda self: self._no_sync > 0, doc="Whether a ``no_sync()`` block is open."
    )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator["GradientSync"]:
        """Within it, ``ready`` and ``wait`` do nothing (DDP's ``no_sync``): gradients accumulate
        over micro-batches, reduced once in the first step outside it. As with DDP, every rank must
        enter it alike (else the ranks wait for each other, for ever or until ``timeout``, which
        names them)."""
        self._no_sync += 1
        try:
            yield self
        finally:
            self._no_sync -= 1

    def ready(self, grad: Array, name: GradientName = None) -> None:
        """Mark ``grad`` (a writeable numpy array, or a CuPy array) ready; start every bucket that
        is then complete, in bucket order. ``name``: the declared parameter it is the gradient of.
        ``grad`` is read, not written, until ``wait()``: it must not change before then."""
        if self._no_sync:
            return
        (step := self._step).calls.append((grad, name))
        if (
            self._slots is not None
            and type(grad) is np.ndarray
            and (name is not None or self.declared)
        ):
            index = (
                self._by_name.get(str(name))
                if name is not None
                else self._by_identity.get(id(grad))
            )
            if (
                index is not None
                and self._fits.get(index) == (grad.shape, grad.dtype)
                and grad.flags.writeable
                and step.accept(index, grad)
            ):  # (the common case: as it came before)
                return self._arrive(index, grad)
        # Nothing here raises: what is wrong with a gradient is recorded and reaches every rank
        # through the digest, so that every rank's wait() raises, not this one's alone (leaving the
        # others).
        trouble = problem(grad)
        if trouble is None and self._device_xp is None and on_device(grad):
            self._device_xp = namespace(grad)
        if (
            self._slots is None
        ):  # the first step declares the gradients: its buckets start at wait()
            return
        if name is not None or self.declared:  # (by name, else the declared array itself)
            index = (
                self._by_name.get(str(name))
                if name is not None
                else self._by_identity.get(id(grad))
            )
        else:
            # (by position: the n-th ready is the n-th gradient, unless another has its shape and
            # dtype)
            index = len(step.arrivals) if len(step.arrivals) < len(self._slots) else None
            trouble = UNNAMED_TWIN if trouble is None and index in self._twins else trouble
        given = given_slot(name if name is not None else f"#{index}", grad)
        if step.mark(index, grad, given, trouble):
            assert index is not None  # (a gradient counts only towards a slot)
            if index in step.filled and type(grad) is np.ndarray:
                self._fits[index] = (grad.shape, grad.dtype)
            self._arrive(index, step.filled.get(index))

    def _arrive(self, index: int, grad: Array | None) -> None:
        """Count slot ``index`` in (``grad``: its gradient, if it fits: copied into its bucket now);
        with ``overlap``, start every bucket then complete, in order."""
        reducer = self._reducer
        assert reducer is not None  # (planned: a gradient arrives in a planned step only)
        if grad is not None and type(grad) is np.ndarray and reducer.copy_in(index, grad):
            self._step.copied.add(index)
        self._arrived[self._bucket_of[index]] += 1
        last, step = (
            len(self._buckets) - 1,
            self._step,
        )  # (the last starts at wait(): its digest counts extras)
        try:
            while (
                self.overlap
                and step.failed is None
                and self._next_bucket < last
                and self._arrived[self._next_bucket]
                == len(self._buckets[self._next_bucket].members)
            ):
                self._start(self._buckets[self._next_bucket])
                self._next_bucket += 1
        except (
            Exception
        ) as error:  # (a bucket's first start meets the other ranks: a timeout there)
            step.failed = (
                error  # no later bucket starts; wait() raises it on every rank that saw it
            )

    def _start(self, bucket: Bucket, in_place: Collection[int] = (), part: str = "all") -> None:
        step, xp, last = (
            self._step,
            self._device_xp if bucket.device else np,
            bucket.index == len(self._buckets) - 1,
        )
        reducer = self._reducer
        assert reducer is not None  # (a bucket starts once planned)
        self._in_flight.append(
            reducer.start(
                bucket,
                step.filled,
                step.copied,
                reducer.digest(step) if last else 0,
                xp,
                not self.overlap,
                in_place,
                part,
            )
        )

    def wait(self) -> dict[str, Array]:
        """Start the buckets not yet started, wait for them; if the step succeeded everywhere, write
        back.

        Returns {name: result} for the declared gradients this rank did not mark ready (with
        ``find_unused``): what the other ranks' gradients summed (or averaged) to; with
        ``write_back=False``, also those handed over as views (see there), not written.

        Raises (on any error, no gradient was changed: each holds what this rank gave; without a
        timeout where no rank overlaps, a rank lost after the ranks agreed may leave large ones
        partly reduced):
            ValueError, on every rank: the ranks' gradients differ (names, shapes, dtypes, order, or
                one missing without ``find_unused``).
            what a bucket's allreduce raised (a timeout, a lost rank), once every bucket is done.
        """
        if self._no_sync:
            return {}
        if self._slots is None:
            calls = self._step.calls
            slots = [
                given_slot(name if name is not None else f"#{i}", grad)
                for i, (grad, name) in enumerate(calls)
            ]
            problems = [
                f"{slot.describe()}: {reason}"
                for slot, (grad, _) in zip(slots, calls, strict=True)
                if (reason := problem(grad)) is not None
            ]
            try:
                slots = agree_on_slots(
                    self.comm,
                    slots,
                    "GradientSync: the first step's gradients",
                    self._options,
                    problems,
                    self.timeout,
                    any_order=True,
                )
                refuse_ambiguous_slots(slots)  # (alike everywhere: the slots agreed)
            except Exception:
                self._new_step()  # (this step is over: the next one starts afresh)
                raise
            if not slots:
                self._new_step()
                return {}
            self._use_slots(slots, order=range(len(slots)))
            self._replay(calls)
        planned, reducer = self._slots, self._reducer
        assert planned is not None and reducer is not None  # (planned just above, or before)
        step, first = self._step, self._buckets[self._next_bucket :]
        agreed = (
            self._reduce(first[-1:], last_part="fused")
            if self._agree_first
            else self._reduce(first)
        )
        self._next_bucket = len(self._buckets)
        if not agreed:
            message = describe_step_differences(
                self.comm, step, self._buckets
            )  # collective: every rank saw it
            self._new_step()
            raise ValueError(message)
        trouble = step.trouble()
        if trouble:  # the same on every rank (the digests agreed)
            if not self.declared and UNNAMED_TWIN not in str(
                trouble
            ):  # changed alike: plan anew from this step
                self._slots = None  # (nothing was written: the step is replayed as it was given)
                self._replay(step.calls)
                return self.wait()
            self._new_step()
            raise ValueError(
                "GradientSync: on every rank, " + "; ".join(trouble) + "; no gradient was changed"
            )
        if (
            self._agree_first
        ):  # (agreed on the step: the other buckets, their large gradients in place)
            apart = reducer.apart(step.filled) if untimed(self.timeout) else ()
            self._reduce(first, len(self._in_flight), in_place=apart, last_part="direct")
        unused: dict[str, Array] = reducer.write_back(self._in_flight, step.filled)
        if self._rebuild_pending:  # (DDP's bucket rebuild: collective, once)
            self._rebuild_pending = False
            order = common_order(self.comm, step.arrivals, len(planned), self.timeout)
            if order is not None and [m for b in self._buckets for m in b.members] != order:
                self._use_slots(planned, order=order)
        self._new_step()
        return unused

    def _reduce(
        self,
        buckets: list[Bucket],
        since: int = 0,
        in_place: Collection[int] = (),
        last_part: str = "all",
    ) -> bool:
        """Start ``buckets`` (of the last, ``last_part``), wait for those started from ``since`` on:
        whether the digests agreed. An error ends the step and is raised, once all started are
        done."""
        try:
            if self._step.failed is not None:
                raise self._step.failed
            for bucket in buckets:
                self._start(
                    bucket, in_place, last_part if bucket.index == len(self._buckets) - 1 else "all"
                )
        except Exception:  # (a bucket's first start agrees with the other ranks: a timeout there)
            assert self._reducer is not None
            self._reducer.collect(
                self._in_flight[since:]
            )  # those started finish before their buffers are reused
            self._new_step()
            raise
        assert self._reducer is not None  # (planned: buckets start from a plan)
        first_error, agreed = self._reducer.collect(self._in_flight[since:])
        if first_error is not None:
            self._new_step()
            raise first_error
        return agreed

    def _replay(self, calls: list[tuple[Array, GradientName]]) -> None:
        self._new_step()
        for grad, name in calls:
            self.ready(grad, name)

    def synchronize(self, gradients: Gradients) -> Gradients:
        """``ready`` every gradient in order, then ``wait``; returns the gradients. Named by
        position (the parameters declared in a list, or none declared); declared in a dict, each
        gradient must be the declared array itself."""
        if not self.write_back:
            raise ValueError(
                "GradientSync(write_back=False) hands results over: use ready() and wait()"
            )
        by_position = not self.declared or not self._declared_by_name
        for i, grad in enumerate(gradients):
            self.ready(grad, name=i if by_position else None)
        self.wait()
        return gradients
