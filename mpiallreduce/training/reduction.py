"""A plan's bucket allreduces: started in the background, waited for, and written back only at the end.

Each bucket's small gradients are copied into its fused buffer (the last bucket's followed by the
step's digest, mpiallreduce.buckets) and reduced there; each large one (DIRECT_MIN_BYTES or more,
already in its accumulation dtype) is reduced out of place, from the gradient into a result buffer
of its own, kept from step to step (with ``prescale``, gradient * prescale is written there first
and reduced in place). No gradient a caller gave is written before ``write_back``, which GradientSync
calls only once every bucket is done and every rank agreed: a step that fails (the ranks' gradients
differ, a timeout, a lost rank) leaves every gradient as it was. The price: one copy of each large
gradient more per step (result buffer -> gradient, fused with the mean's division), and memory for
its result buffer.
"""
import numpy as np

from ..device.arrays import namespace
from .buckets import DIGEST_ELEMENTS, digest_elements, digests_agree
from .compression import CompressedSum

__all__ = ["DIRECT_MIN_BYTES", "BucketReducer"]

#: gradients of at least this many bytes (in their accumulation dtype) are reduced on their own,
#: not copied into a bucket's buffer (mpiallreduce.buckets)
DIRECT_MIN_BYTES = 1 << 20


class BucketReducer:
    """The allreduces of ``buckets`` (over ``slots``), with their buffers, kept for as long as the plan."""

    def __init__(self, comm, slots, buckets, *, op, algorithm, prescale, postscale, timeout, compression,
                 reproducible):
        self.comm, self.slots, self.buckets = comm, slots, buckets
        self.op, self.algorithm, self.timeout = op, algorithm, timeout
        self.prescale, self.postscale = prescale, postscale
        self.compression, self.reproducible = compression, reproducible
        self._buffers = {}  # bucket index -> (fused buffer, PreparedAllreduce or None)
        self._results = {}  # slot -> the result buffer of a large gradient (zeros reduced where one is missing)
        self._digest_arrays = {}  # (bucket index, digest) -> its elements, in the bucket's memory

    def start(self, bucket, filled, digest, xp):
        """Start ``bucket``'s allreduces in the background (``filled``: slot -> this rank's gradient;
        zeros for the others; ``digest``: the step's, carried by the last bucket); returns what
        ``collect`` and ``write_back`` take. A bucket's buffer and prepared call are made at its first
        start (mpiallreduce.prepare: agreed on and planned once) and kept."""
        from ..api import allreduce_async, prepare_at
        if xp is None:  # a device bucket none of whose gradients came: any device module will do
            import cupy as xp
        last = bucket.index == len(self.buckets) - 1
        compressed = self.compression is not None and bucket.dtype.kind == "f"
        carries_digest = last and not compressed
        # a mean is divided by the library, in the background, except where a digest rides along
        # (and for reproducible sums: then every gradient is divided alike, in its own dtype, at the end)
        fused_op = "sum" if carries_digest or self.reproducible else self.op
        direct_op = "sum" if self.reproducible else self.op
        scale = bucket.dtype.type(self.prescale)
        handles = []
        if bucket.count or last:
            fused, prepared = self._buffers.get(bucket.index, (None, None))
            if fused is None:
                fused = xp.empty(bucket.count + (DIGEST_ELEMENTS if carries_digest else 0), dtype=bucket.dtype)
            for index, offset in zip(bucket.fused, bucket.offsets):
                slot = self.slots[index]
                view = fused[offset:offset + slot.count].reshape(slot.shape)
                grad = filled.get(index)
                if grad is None:
                    view.fill(0)
                else:
                    xp.copyto(view, grad, casting="unsafe")
            payload = fused[:bucket.count]
            if self.prescale != 1.0:
                xp.multiply(payload, scale, out=payload)
            if carries_digest:
                xp.copyto(fused[bucket.count:], self._digest_array(xp, bucket, digest))
            if compressed:
                handle = self._start_compressed(fused, digest)
            elif self.reproducible:
                handle = allreduce_async(fused, op=fused_op, algorithm=self.algorithm, comm=self.comm, out=fused,
                                         timeout=self.timeout, reproducible=True)
            else:
                if prepared is None:
                    prepared = prepare_at("", fused, op=fused_op, algorithm=self.algorithm, comm=self.comm, out=fused,
                                          timeout=self.timeout)
                handle = prepared.start()
            self._buffers[bucket.index] = (fused, prepared)
            handles.append((None, handle))
        for index in bucket.direct:  # out of place: the gradient is only read, until write_back
            result = self._results.get(index)
            if result is None:
                result = self._results[index] = xp.empty(self.slots[index].shape, dtype=bucket.dtype)
            grad = filled.get(index)
            if grad is None:  # zeros in its place (find_unused), or a gradient that did not fit its slot
                result.fill(0)
                source = result
            elif self.prescale != 1.0:
                xp.multiply(grad, scale, out=result)
                source = result
            else:
                source = grad
            handles.append((index, allreduce_async(source, op=direct_op, algorithm=self.algorithm, comm=self.comm,
                                                   out=result, timeout=self.timeout,
                                                   reproducible=self.reproducible)))
        return bucket, handles, digest, compressed, fused_op == "sum" and self.op == "mean"

    def collect(self, in_flight):
        """Wait for every started allreduce. Returns (the first error raised, or None; whether
        every rank's digest was the same)."""
        first_error, agreed = None, True
        for bucket, handles, digest, compressed, _ in in_flight:
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
                        tail = self._buffers[bucket.index][0][bucket.count:]
                        agreed = digests_agree(tail if namespace(tail) is None else namespace(tail).asnumpy(tail),
                                               digest, self.comm.Get_size())
        return first_error, agreed

    def write_back(self, in_flight, filled):
        """Write every result into its gradient (``filled``: slot -> gradient). Returns {name: result}
        for the planned gradients that were not given."""
        size = self.comm.Get_size()
        unused = {}
        for bucket, handles, _, compressed, divide in in_flight:
            for index, _ in handles:
                if index is None:  # the fused members: from the buffer
                    payload = self._buffers[bucket.index][0][:bucket.count]
                    xp = namespace(payload) or np
                    if not compressed:  # (a compressed sum was divided and scaled before its one rounding)
                        self._finish(xp, payload, payload, bucket, size, divide)
                    for member, offset in zip(bucket.fused, bucket.offsets):
                        slot = self.slots[member]
                        result = payload[offset:offset + slot.count].reshape(slot.shape)
                        grad = filled.get(member)
                        if grad is not None:
                            xp.copyto(grad, result, casting="unsafe")
                        else:
                            unused[slot.name] = result.copy()
                    continue
                grad, result = filled.get(index), self._results[index]
                xp = namespace(result) or np
                self._finish(xp, result, result if grad is None else grad, bucket, size,
                             self.reproducible and self.op == "mean")
                if grad is None:
                    unused[self.slots[index].name] = result.copy()
        return unused

    def _finish(self, xp, result, target, bucket, size, divide):
        """``target`` = ``result`` divided by ``size`` (a mean the library did not divide) and times
        ``postscale``: the copy into a large gradient, made with the first of these that applies."""
        if divide:
            xp.divide(result, bucket.dtype.type(size), out=target)
            result = target
        if self.postscale != 1.0:
            xp.multiply(result, bucket.dtype.type(self.postscale), out=target)
            result = target
        if result is not target:
            xp.copyto(target, result)

    def _digest_array(self, xp, bucket, digest):
        """The digest's elements in xp's memory: made once for each digest a bucket has (a copy to
        the device would wait for the host), then copied from on the stream."""
        key = (bucket.index, digest)
        elements = self._digest_arrays.get(key)
        if elements is None:
            if len(self._digest_arrays) > 4 * len(self.buckets):
                self._digest_arrays.clear()
            elements = self._digest_arrays[key] = xp.asarray(digest_elements(digest).astype(bucket.dtype))
        return elements

    def _start_compressed(self, fused, digest):
        """A compressed bucket through the call pipeline (route "compressed fp16"/"bf16"): numbered
        here, on the caller's thread; the handle's op says whether the digests agreed."""
        from ..core.call import Call
        from ..core.worker import Meeting, submit
        op = CompressedSum(self.compression, digest, self.op == "mean", self.postscale)
        call = Call.start(fused, op, "auto", self.comm, fused, False, None, None, None, None, site="")
        handle = submit(call.run, fused, f"{self.compression} bucket of {fused.size} {fused.dtype}", Meeting(None, ""),
                        here=call.sets_up())
        handle.compressed_op = op
        return handle
