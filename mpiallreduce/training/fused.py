"""The fused buffers of a plan's buckets: each member's place in them, their prepared calls, and,
where results are handed over as views (GradientSync(write_back=False)), the two buffers a bucket
fills in turn.

    step s    gradients ──copy──> buffer[t] ──allreduce in place──> the results: views of buffer[t]
    step s+1  gradients (those views, or new arrays) ──copy──> buffer[1 - t]
              ──> views of buffer[1 - t]

The turn t moves on only after a step that succeeded (BucketReducer.write_back): the buffer a step
reduces is never the one the last results live in (once handed over, the gradients), so a step that
fails changes none of them. The results stay valid until the step after next refills their buffer
(a replan frees it two successful steps later: BucketReducer). On one node the buffers are symmetric
(mpiallreduce.empty: single copy), made at once on every rank, both of them with views; there a
timed step could fail on some ranks only and leave the turns apart, and each rank's single copy
would then write into the peers' other buffer (the last results): with a timeout, one buffer a
bucket, written back.
"""

import numpy as np

from .buckets import DIGEST_ELEMENTS, digest_elements
from .overlap import untimed

__all__ = ["FusedBuffers"]


class FusedBuffers:
    """The fused buffers and calls of ``buckets`` (over ``slots``), for as long as the plan."""

    def __init__(
        self,
        comm,
        slots,
        buckets,
        *,
        op,
        algorithm,
        timeout,
        compression,
        reproducible,
        prescale,
        postscale,
        one_node,
        views,
    ):
        self.comm, self.slots, self.buckets, self.algorithm = comm, slots, buckets, algorithm
        self.timeout, self.compression, self.reproducible = timeout, compression, reproducible
        # bucket index -> [fused buffer, its members' views, its PreparedAllreduce or None]
        self._own = {}
        self._second = {}  # bucket index -> the same, of the buffer for odd turns (with views)
        self._symmetric = []  # the fused buffers made symmetric (freed with the plan: free)
        self._digest_arrays = {}  # (bucket index, digest) -> its elements, in the bucket's memory
        #: on one node, only where every failed step fails on every rank (untimed: turns never
        #: differ, and a symmetric buffer must lie at the same place on every rank); else written
        #: back
        self.views = views and not (one_node and compression is None and not untimed(timeout))
        self._turn = 0  # which buffer this step fills
        #: a bucket that hands its results over ends as the mean where nothing else is left to apply
        #: (no postscale, no reproducible sum: divided after, as a large gradient's): by a call of
        #: the mean, or divided on the way in (in_scale) and summed; the others sum
        self._mean_in_call = self.views and op == "mean" and not reproducible and postscale == 1.0
        #: bucket index -> 1/p, where the mean is divided on the way in instead: p a power of two
        #: (exact, values staying normal; where the sum would overflow, the mean stays finite, as
        #: DDP's, which divides first), each gradient copied in times it (the same pass as a copy),
        #: and the bucket summed by what sums fastest (MPI's own: its mean costs a pass more;
        #: docs/training.md). Real floats only: a complex product by 1/p can flip the sign of a
        #: zero, a division does not
        size = comm.Get_size()
        self.in_scale = {
            bucket.index: bucket.dtype.type(1 / size)
            for bucket in buckets
            if self._mean_in_call
            and prescale == 1.0
            and size > 1
            and not size & (size - 1)
            and bucket.dtype.kind == "f"
            and self.hands_over(bucket)
        }
        if one_node and compression is None:
            for bucket in buckets:
                if not bucket.device and (bucket.count or bucket.index == len(buckets) - 1):
                    self._make(bucket, np, symmetric=True)
                    if self.hands_over(
                        bucket
                    ):  # (its second buffer: symmetric too, made now on every rank)
                        self._second[bucket.index] = self._make(
                            bucket, np, symmetric=True, second=True
                        )

    def free(self):
        """Free the symmetric buffers (collective: a replan, every rank at once, nothing in
        flight)."""
        from ..core.state import state_of
        from ..core.symmetric import free_array

        for fused in self._symmetric:  # (not used again)
            free_array(state_of(self.comm), fused)
        self._symmetric, self._own, self._second = [], {}, {}

    def hands_over(self, bucket):
        """Whether ``bucket``'s results go back as views of its buffers (``views``: host, not
        compressed)."""
        return (
            self.views
            and not bucket.device
            and not (self.compression is not None and bucket.dtype.kind == "f")
        )

    def call_op(self, bucket):
        """The op of ``bucket``'s fused call: "mean" (see _mean_in_call) or "sum"."""
        return "mean" if self.ends_as_mean(bucket) and bucket.index not in self.in_scale else "sum"

    def ends_as_mean(self, bucket):
        """Whether ``bucket``'s buffer holds the mean once its call is done (its call's, or divided
        on the way in: ``in_scale``), not a sum to divide."""
        return self._mean_in_call and self.hands_over(bucket)

    def current(self, bucket, xp=None):
        """[the fused buffer this step fills, its members' views (slot, shaped like it), its call or
        None before the first start]: made at the bucket's first use (xp None: made already)."""
        own = self._own.get(bucket.index) or self._make(bucket, xp)
        return self._second[bucket.index] if self._turn and self.hands_over(bucket) else own

    def call(self, bucket):
        """The prepared call of the buffer this step fills, made at the bucket's first start: on
        every rank, in bucket order (collective); with views one on each buffer, neither persistent:
        where a step failed on some ranks only their turns differ, and the two are the same call to
        MPI."""
        from ..api import prepare_at

        own = self._own[bucket.index]
        if own[2] is None:
            handed = self.hands_over(bucket)
            made = [own] + (
                [self._second.get(bucket.index) or [np.empty_like(own[0]), None, None]]
                if handed
                else []
            )
            for kept in made:
                if kept[1] is None:
                    kept[1] = self._members_in(kept[0], bucket)
                kept[2] = prepare_at(
                    "",
                    kept[0],
                    self.call_op(bucket),
                    self.algorithm,
                    self.comm,
                    out=kept[0],
                    timeout=self.timeout,
                    persistent=not handed,
                    reproducible=self.reproducible,
                )
            if handed:
                self._second[bucket.index] = made[1]
        return self.current(bucket)[2]

    def next_turn(self):
        """After a step that succeeded: the other buffers fill next (with views)."""
        if self.views:
            self._turn ^= 1

    def digest_array(self, xp, bucket, digest):
        """The digest's elements in xp's memory: made once for each digest a bucket has (a copy to
        the device would wait for the host), then copied from on the stream."""
        key = (bucket.index, digest)
        elements = self._digest_arrays.get(key)
        if elements is None:
            if len(self._digest_arrays) > 4 * len(self.buckets):
                self._digest_arrays.clear()
            elements = self._digest_arrays[key] = xp.asarray(
                digest_elements(digest).astype(bucket.dtype)
            )
        return elements

    def _make(self, bucket, xp, symmetric=False, second=False):
        """``bucket``'s own fused buffer (its payload, then the last bucket's digest), with its
        views."""
        last = bucket.index == len(self.buckets) - 1
        carries_digest = last and not (self.compression is not None and bucket.dtype.kind == "f")
        count = bucket.count + (DIGEST_ELEMENTS if carries_digest else 0)
        if symmetric:
            from ..api import empty

            fused = empty(count, bucket.dtype, comm=self.comm)
            self._symmetric.append(fused)
        else:
            fused = xp.empty(count, dtype=bucket.dtype)
        made = [fused, self._members_in(fused, bucket), None]
        if not second:
            self._own[bucket.index] = made
        return made

    def _members_in(self, fused, bucket):
        """Each fused member's place in ``fused``, shaped like its gradient (made once per
        buffer)."""
        return [
            (
                index,
                fused[offset : offset + self.slots[index].count].reshape(self.slots[index].shape),
            )
            for index, offset in zip(bucket.fused, bucket.offsets, strict=False)
        ]
