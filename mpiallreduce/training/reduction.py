"""A plan's bucket allreduces: started in the background, waited for, and written back only at the
end.

Each bucket's small gradients are copied into its fused buffer (the last bucket's followed by the
step's digest, mpiallreduce.buckets) and reduced there; each large one (DIRECT_MIN_BYTES or more,
already in its accumulation dtype) is copied into a result buffer of its own, kept from step to
step (times ``prescale``, if given), and reduced there, in place (every call of a step is in
place, on every rank: in-place calls have plans of their own, mpiallreduce.core.tuning), by a call
of the mean itself (divided slice by slice where the algorithm finishes slices). No
gradient a caller gave is written before ``write_back``, which GradientSync calls only once every
bucket is done and every rank agreed: a step that fails (the ranks' gradients differ, a timeout, a
lost rank) leaves every gradient as it was. The price: two copies of each
large gradient more per step (into its result buffer, and back),
and memory for its result buffer; where no rank overlaps and there is no timeout, none (the
gradients are reduced where they lie, once every rank agreed on the step: GradientSync.wait).
With ``views`` (GradientSync(write_back=False)), host buckets hand their results over as views of
their buffers (symmetric ones on one node), two a bucket used in turn, ending as the mean (a call of
the mean itself, or, on a power-of-two rank count, gradients copied in times 1/p and summed): a copy
less (mpiallreduce.training.fused).
"""

import numpy as np

from ..core.ops import divide_by_size
from ..core.worker import Done as _Done
from ..device.arrays import namespace
from .buckets import digest_of, digests_agree
from .compression import CompressedSum
from .fused import FusedBuffers

__all__ = ["DIRECT_MIN_BYTES", "BucketReducer"]

#: gradients of at least this many bytes (in their accumulation dtype) are reduced on their own,
#: not copied into a bucket's buffer (mpiallreduce.buckets); smaller ones cost less fused than a
#: call each, across nodes (a message) and on one node (where the bucket is symmetric: single copy),
#: and so where they could be reduced in place (docs/training-notes.md: 64 KiB there before,
#: 1.1-2x slower)
DIRECT_MIN_BYTES = 1 << 20
_byte_bounds = (
    getattr(np, "byte_bounds", None) or np.lib.array_utils.byte_bounds
)  # (numpy 1 / numpy 2)


def _copy_into(xp, view, grad, scale):
    """A gradient into its place in a bucket's buffer: copied, or times ``scale`` (the mean divided
    on the way in: FusedBuffers.in_scale), in the same pass, in the bucket's dtype."""
    if scale is None:
        xp.copyto(view, grad, casting="unsafe")
    else:
        xp.multiply(grad, scale, out=view, dtype=view.dtype, casting="unsafe")


class BucketReducer:
    """The allreduces of ``buckets`` (over ``slots``), with their buffers, kept for as long as the
    plan."""

    def __init__(
        self,
        comm,
        slots,
        buckets,
        *,
        op,
        algorithm,
        prescale,
        postscale,
        timeout,
        compression,
        reproducible,
        one_node=False,
        views=False,
        replaced=None,
    ):
        """``one_node``: the host buckets' buffers are symmetric (mpiallreduce.empty: made here, in
        bucket order, on every rank, as the plan is agreed), so their reductions run single copy.
        ``views``: host buckets hand their results over as views (two buffers a bucket, in turn:
        ``write_back``), ending as the mean where nothing else is left to apply
        (FusedBuffers.call_op). ``replaced``: the reducer of the plan this one replaces (a replan:
        every rank at once, nothing in flight): its buffers are freed now, or, where it handed
        results over, two successful steps on (``write_back``), as long as those results stay
        valid."""
        self.comm, self.slots, self.buckets, self.op, self.algorithm = (
            comm,
            slots,
            buckets,
            op,
            algorithm,
        )
        self.timeout, self.prescale, self.postscale = timeout, prescale, postscale
        self.compression, self.reproducible = compression, reproducible
        self.fused = FusedBuffers(
            comm,
            slots,
            buckets,
            op=op,
            algorithm=algorithm,
            timeout=timeout,
            compression=compression,
            reproducible=reproducible,
            prescale=prescale,
            postscale=postscale,
            one_node=one_node,
            views=views,
        )  # (each bucket's buffers and calls)
        self._fused_in = {
            i: bucket for bucket in buckets for i in bucket.fused
        }  # slot -> its bucket
        self._member_at = {
            i: n for bucket in buckets for n, i in enumerate(bucket.fused)
        }  # slot -> its place
        self._direct_slots = [i for bucket in buckets for i in bucket.direct]
        # slot -> the result buffer of a large gradient (zeros reduced where one is missing)
        self._results = {}
        # slot -> its PreparedAllreduce, in place on its result buffer (or on the gradient)
        self._direct = {}
        #: its op: the mean itself, but a reproducible sum divided at the end as a bucket's is (the
        #: same bits: a reproducible mean rounds the exact sum divided, not the rounded sum divided)
        self._direct_op, self._direct_divides = (
            ("sum", op == "mean") if reproducible else (op, False)
        )
        self._clean_digest = None  # the digest of a step where every gradient came as planned
        #: [FusedBuffers of replaced plans, successful steps until they are freed]
        self._retired = [] if replaced is None else replaced._retired
        if (
            replaced is not None and replaced.fused.views
        ):  # (its results, maybe the next gradients, live there)
            self._retired = [*self._retired, [replaced.fused, 2]]
        elif replaced is not None:
            replaced.fused.free()

    def digest(self, step):
        """The digest of ``step``'s contents (mpiallreduce.training.steps); that of a step where
        every gradient came as planned is made once (no walk over every gradient on every step)."""
        clean = step.clean()
        if clean and self._clean_digest is not None:
            return self._clean_digest
        digest = digest_of(tuple(step.contents().items()))
        if clean:
            self._clean_digest = digest
        return digest

    def copy_in(self, index, grad):
        """Copy numpy gradient ``grad`` into its place in its bucket's buffer now, at ``ready()``,
        while backward has just written it (in cache; Torch DDP copies there too). Returns whether
        it did (not for a gradient reduced on its own, nor for device buckets)."""
        bucket = self._fused_in.get(index)
        if bucket is None or bucket.device:
            return False
        _copy_into(
            np,
            self.fused.current(bucket, np)[1][self._member_at[index]][1],
            grad,
            self.fused.in_scale.get(bucket.index),
        )
        return True

    def apart(self, filled):
        """The large gradients of ``filled`` (slot -> gradient), numpy, C-contiguous and writeable,
        that share no memory with another large one: those that may be reduced in place (by byte
        bounds, sorted). A fused one that shares their memory is harmless: it was copied into its
        bucket at ready(), and its result is written back last, from what it held then."""
        bounds = sorted(
            (*_byte_bounds(grad), index)
            for index in self._direct_slots  # (strided ones too)
            if isinstance(grad := filled.get(index), np.ndarray)
        )
        apart, reach = set(), None
        for k, (low, high, index) in enumerate(bounds):
            after = bounds[k + 1][0] if k + 1 < len(bounds) else None
            grad = filled[index]
            if (
                (reach is None or low >= reach)
                and (after is None or after >= high)
                and type(grad) is np.ndarray
                and grad.flags.c_contiguous
                and grad.flags.writeable
            ):
                apart.add(index)
            reach = high if reach is None else max(reach, high)
        return apart

    def start(self, bucket, filled, copied, digest, xp, here=False, in_place=(), part="all"):
        """Start ``bucket``'s allreduces in the background (``here``: run them on this thread, now)
        (``filled``: slot -> this rank's gradient; zeros for the others; ``copied``: the slots
        copied in already; ``in_place``: the large gradients reduced where they lie, once the ranks
        agreed on the step (those ``apart`` gives); ``part``: "all", only the "fused" buffer or only
        the "direct" gradients; ``digest``: the step's,
        carried by the last bucket); returns what ``collect`` and ``write_back`` take. A bucket's
        buffer and prepared call are made at its first start (mpiallreduce.prepare: agreed on and
        planned once) and kept. A bucket's sum is divided on the way back (write_back), in the one
        pass that copies each result into its gradient; a large gradient's call is the mean itself
        (the algorithms that finish slices divide each slice as they reduce it: 1/p of a pass), but
        for a reproducible sum, divided as a bucket's."""
        from ..api import prepare_at

        if xp is None:  # a device bucket none of whose gradients came: any device module will do
            import cupy as xp
        last = bucket.index == len(self.buckets) - 1
        compressed = self.compression is not None and bucket.dtype.kind == "f"
        carries_digest = last and not compressed
        scale = bucket.dtype.type(self.prescale)
        handles, reduced_in_place, finished = [], set(), set()
        if (bucket.count or last) and part != "direct":
            fused, views, _ = self.fused.current(bucket, xp)
            in_scale = self.fused.in_scale.get(bucket.index)
            for index, view in views:
                if index in copied:  # (copied in at ready(): copy_in)
                    continue
                grad = filled.get(index)
                if grad is None:
                    view.fill(0)
                else:
                    _copy_into(xp, view, grad, in_scale)
            payload = fused[: bucket.count]
            if self.prescale != 1.0:
                xp.multiply(payload, scale, out=payload)
            if carries_digest:
                tail, elements = fused[bucket.count :], self.fused.digest_array(xp, bucket, digest)
                xp.copyto(tail, elements) if in_scale is None else xp.multiply(
                    elements, in_scale, out=tail
                )
            if compressed:
                handle = self._start_compressed(fused, digest, here)
            else:
                prepared = self.fused.call(bucket)
                handle = _Done.of(prepared)() if here else prepared.start()
            handles.append((None, handle))
        # the large ones: each reduced in place (one plan on every rank: mpiallreduce.core.planner),
        # in its result buffer (the gradient only read until write_back) or, ``in_place``, in the
        # gradient
        for index in bucket.direct if part != "fused" else ():
            result = self._results.get(index)
            if result is None:
                result = self._results[index] = xp.empty(
                    self.slots[index].shape, dtype=bucket.dtype
                )
            grad = filled.get(index)
            if index in in_place:  # (agreed everywhere; no other gradient shares its memory)
                result = grad
                reduced_in_place.add(index)
            if (
                grad is None
            ):  # zeros in its place (find_unused), or a gradient that did not fit its slot
                result.fill(0)
            elif self.prescale != 1.0:
                xp.multiply(grad, scale, out=result)
            elif result is not grad:
                xp.copyto(result, grad)
            # (prepared once on its result buffer: agreed then; the step's digest says the ranks'
            # calls match)
            own = self._results[index]
            prepared = self._direct.get(index)
            if (
                prepared is None
            ):  # (not persistent: run on other memory as well, the same kind of call)
                prepared = self._direct[index] = prepare_at(
                    "",
                    own,
                    self._direct_op,
                    self.algorithm,
                    self.comm,
                    out=own,
                    timeout=self.timeout,
                    persistent=False,
                    reproducible=self.reproducible,
                )
            on = None if result is own else result
            handle = _Done.of(prepared._run_on)(on) if here else prepared._start_on(on)
            if (
                here and index in reduced_in_place and handle.error is None
            ):  # (what remains now, while in cache)
                self._finish(np, grad, grad, bucket, self.comm.Get_size(), self._direct_divides)
                finished.add(index)
            handles.append((index, handle))
        return bucket, handles, digest, compressed, self.op == "mean", reduced_in_place, finished

    def collect(self, in_flight):
        """Wait for every started allreduce. Returns (the first error raised, or None; whether
        every rank's digest was the same)."""
        first_error, agreed = None, True
        for bucket, handles, digest, compressed, *_ in in_flight:
            for index, handle in handles:
                try:
                    handle.wait()
                except Exception as error:  # noqa: BLE001 - the caller raises it, once every bucket is done
                    first_error = first_error or error
                    continue
                if index is None and bucket.index == len(self.buckets) - 1:
                    if compressed:
                        agreed = handle.compressed_op.agreed
                    else:
                        tail = self.fused.current(bucket)[0][bucket.count :]
                        agreed = digests_agree(
                            tail if namespace(tail) is None else namespace(tail).asnumpy(tail),
                            digest,
                            self.comm.Get_size(),
                            mean=self.fused.ends_as_mean(bucket),
                        )
        return first_error, agreed

    def write_back(self, in_flight, filled):
        """Write every result into its gradient (``filled``: slot -> gradient). Returns {name:
        result} for the planned gradients that were not given and, with ``views``, for those of host
        buckets of their own dtype: views of the bucket's buffer, not copied (valid until the step
        after next refills that buffer: the turn moves on here, after a step that succeeded)."""
        size = self.comm.Get_size()
        unused = {}
        for bucket, handles, _, compressed, divide, in_place, finished in in_flight:
            for index, _ in handles:
                if index in finished:  # (reduced in place and divided already)
                    continue
                if index is None:  # the fused members: from the buffer
                    fused, views, _ = self.fused.current(bucket)
                    xp = namespace(fused) or np
                    handed = self.fused.hands_over(bucket)
                    if handed and not self.fused.ends_as_mean(
                        bucket
                    ):  # (what the call left: in place, one pass)
                        self._finish(
                            xp, fused[: bucket.count], fused[: bucket.count], bucket, size, divide
                        )
                    for member, result in views:
                        slot = self.slots[member]
                        grad = filled.get(member)
                        if handed and (
                            grad is None
                            or (type(grad) is np.ndarray and grad.dtype == result.dtype)
                        ):
                            unused[slot.name] = result
                            continue
                        target = xp.empty_like(result) if grad is None else grad
                        if (
                            compressed or handed
                        ):  # (a compressed sum was divided and scaled before its one rounding)
                            xp.copyto(target, result, casting="unsafe")
                        else:
                            self._finish(xp, result, target, bucket, size, divide)
                        if grad is None:
                            unused[slot.name] = target
                    continue
                grad = filled.get(index)
                result = grad if index in in_place else self._results[index]
                xp = namespace(result) or np
                target = xp.empty_like(result) if grad is None else grad
                self._finish(
                    xp, result, target, bucket, size, self._direct_divides
                )  # (else its call's mean)
                if grad is None:
                    unused[self.slots[index].name] = target
        self.fused.next_turn()
        if self._retired:  # (after a replan only)
            self._free_retired()
        return unused

    def _free_retired(self):
        """After a step that succeeded on every rank (collective): free the replaced plans' buffers
        whose handed-over results are no longer valid (two successful steps on)."""
        for retired in self._retired:
            retired[1] -= 1
            if retired[1] == 0:
                retired[0].free()
        self._retired = [retired for retired in self._retired if retired[1] > 0]

    def _finish(self, xp, result, target, bucket, size, divide):
        """``target`` = ``result`` (a sum) divided by ``size`` (a mean) and times ``postscale``: the
        copy into a gradient, made by the first of these that applies (one pass, unless both do). A
        narrower gradient (float16, bfloat16) gets it rounded once, from ``result``'s dtype."""
        out = target if target.dtype == result.dtype else result
        if divide:
            divide_by_size(xp, result, size, out)
            result = out
        if self.postscale != 1.0:
            xp.multiply(result, bucket.dtype.type(self.postscale), out=out)
            result = out
        if result is not target:
            xp.copyto(target, result, casting="unsafe")

    def _start_compressed(self, fused, digest, here=False):
        """A compressed bucket through the call pipeline (route "compressed fp16"/"bf16"): numbered
        here, on the caller's thread; the handle's op says whether the digests agreed."""
        from ..core.call import Call
        from ..core.worker import Meeting, submit

        op = CompressedSum(self.compression, digest, self.op == "mean", self.postscale)
        call = Call.start(
            fused, op, "auto", self.comm, fused, False, None, None, None, None, site=""
        )
        handle = submit(
            call.state,
            call.run,
            fused,
            f"{self.compression} bucket of {fused.size} {fused.dtype}",
            Meeting(None, ""),
            here=here or call.sets_up(),
        )
        handle.compressed_op = op
        return handle
