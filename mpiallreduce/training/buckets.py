"""Which gradient goes in which bucket, decided once from the parameters (the plan GradientSync
runs).

    parameters, as declared        p0 p1 p2 p3 p4 p5
    backward's order (reversed)    p5 p4 p3 p2 p1 p0
    buckets of >= bucket_bytes     [p5 p4] [p3] [p2 p1 p0]    bucket 0, 1, 2: started in that order,
                                                               each once all its members are ready
    a bucket's allreduces          small members fused in one buffer: | p5 | p4 |
                                   members of 1 MiB or more in place, each its own allreduce: p3
    the last bucket's buffer       | p1 | p0 | layout digest: 8 pairs (d, d*d), d in 0..15 |

Buckets are fixed, so every rank's n-th bucket has the same members, element counts and dtypes
whatever order its gradients arrive in: torch DDP's bucket assignment. Fusing exists to spare
small gradients a message each; a large one gains nothing from a copy into a buffer and back
(on a 2-core machine those two copies cost twice its allreduce), so it is reduced where it lies.

The last bucket also carries what this rank gave for every gradient of the step (a gradient,
none, one of another shape...), hashed to 32 bits and spread over 8 digits d = 0..15, each sent as
d and d*d in that bucket's own sum. The sums are small integers, exact in any float type and any
summation order. A rank whose digit is d sees sum(d) = p*d and sum(d*d) = p*d*d only if every
rank's digit is d (the variance is zero), so when the ranks' contents differ, every rank sees it,
with no extra message.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = [
    "GradientSpec",
    "Slot",
    "Bucket",
    "plan_buckets",
    "accumulation_dtype",
    "DIGEST_ELEMENTS",
    "digest_of",
    "digest_elements",
    "digests_agree",
]

#: 8 digits of 4 bits, each as d and d*d: sums stay exact to 74565 ranks in float32
DIGEST_DIGITS = 8
DIGEST_ELEMENTS = 2 * DIGEST_DIGITS


class GradientSpec(NamedTuple):
    """What a gradient will look like, when there is no array to show yet (a torch parameter's)."""

    shape: tuple
    dtype: object
    device: bool = False


def accumulation_dtype(dtype):
    """float16, bfloat16 (ml_dtypes) and narrower floats are summed in float32; the rest in their
    own type."""
    dtype = np.dtype(dtype)
    if (
        dtype.kind == "f" and dtype.itemsize < 4
    ) or dtype.name == "bfloat16":  # ml_dtypes' bfloat16
        return np.dtype(np.float32)
    if dtype.kind not in "fc":
        raise TypeError(f"gradients must be floating or complex arrays, got dtype {dtype}")
    return dtype


class Slot(NamedTuple):
    """One gradient's place: its name, shape, dtype and whether it lives on a device."""

    name: str
    shape: tuple
    dtype: str
    device: bool

    @classmethod
    def of(cls, name, array, device):
        return cls(
            str(name), tuple(int(n) for n in array.shape), np.dtype(array.dtype).name, bool(device)
        )

    @property
    def count(self):
        return math.prod(self.shape)

    @property
    def kind(self):
        """Gradients of one kind share buckets: (on a device?, accumulation dtype)."""
        return self.device, (
            np.dtype(np.float32) if self.dtype == "bfloat16" else accumulation_dtype(self.dtype)
        ).str

    def describe(self):
        return f"{self.name!r} {self.shape} {self.dtype}{' on the device' if self.device else ''}"


@dataclass(frozen=True, slots=True)
class Bucket:  # (not a NamedTuple: its index and count would hide the tuple's methods)
    index: int
    device: bool
    dtype: np.dtype  # the accumulation dtype
    members: tuple[int, ...]  # slot indices, in the order they were assigned
    fused: tuple[int, ...]  # the members copied into the bucket's buffer, in its order
    offsets: tuple[int, ...]  # each fused member's first element in the buffer
    count: int  # fused gradient elements (the last bucket's digest follows them)
    direct: tuple[int, ...]  # the members reduced in place, each by an allreduce of its own


def plan_buckets(slots, bucket_bytes, order, direct_min_bytes=None):
    """Buckets of ``slots`` (a list of Slot), filled in ``order`` (slot indices): one open bucket
    per kind, closed once it holds ``bucket_bytes``; numbered by when they were opened. Members of
    at least ``direct_min_bytes`` (None: none) whose dtype is their
    accumulation dtype are reduced on their own rather than fused."""
    open_buckets, opened = {}, []
    for index in order:
        slot = slots[index]
        members = open_buckets.setdefault(slot.kind, [])
        if not members:
            opened.append((slot.kind, members))
        members.append(index)
        if sum(slots[i].count for i in members) * np.dtype(slot.kind[1]).itemsize >= bucket_bytes:
            del open_buckets[slot.kind]
    buckets = []
    for number, ((device, dtype), members) in enumerate(opened):
        dtype = np.dtype(dtype)

        def in_place(i, dtype=dtype):  # (the bucket's dtype, bound: called in this iteration)
            return (
                direct_min_bytes is not None
                and slots[i].dtype == dtype.name
                and slots[i].count * dtype.itemsize >= direct_min_bytes
            )

        fused = tuple(i for i in members if not in_place(i))
        offsets = tuple(int(o) for o in np.cumsum([0] + [slots[i].count for i in fused])[:-1])
        count = sum(slots[i].count for i in fused)
        buckets.append(
            Bucket(
                number,
                device,
                dtype,
                tuple(members),
                fused,
                offsets,
                count,
                tuple(i for i in members if in_place(i)),
            )
        )
    return buckets


def digest_of(contents):
    """32 bits that name what a rank put in a bucket (a tuple of plain values): the library's one
    digest (mpiallreduce.core.consistency), cut to what the bucket's digest elements carry."""
    from ..core.consistency import digest

    return digest(contents, bits=32)


def digest_elements(digest):
    """The digest as DIGEST_ELEMENTS float64 values: its 4-bit digits d, each followed by d*d."""
    digits = np.array([(digest >> (4 * k)) & 0xF for k in range(DIGEST_DIGITS)], dtype=np.float64)
    return np.stack([digits, digits * digits], axis=1).reshape(-1)


def digests_agree(summed, digest, size, mean=False):
    """Whether every rank sent ``digest``, given the elements' sum over ``size`` ranks (any dtype),
    or with ``mean`` their mean: times ``size`` and rounded, the sum again (exact: the sums are
    integers far below 2**23, and a mean's relative error is at most float32's 2**-24)."""
    summed = np.real(np.asarray(summed)).astype(np.float64)
    return bool(
        np.array_equal(np.rint(summed * size) if mean else summed, size * digest_elements(digest))
    )
