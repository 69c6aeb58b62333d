"""The one digest scheme (blake2b, 63 bits): what the ranks compare is a digest of it, made here and
only here. Call signatures, settings and the tuning table, gradient buckets (``digest``); an array's
bytes, replicas and inputs that must not change (``content_digest``). The comparisons themselves:
mpiallreduce.core.consistency, which gives these names too."""

import hashlib

import numpy as np

__all__ = ["digest", "content_digest"]


def digest(value, bits=63):
    """A ``bits``-bit number that differs (but for a 2**-bits chance) when ``repr(value)``
    differs."""
    text = repr(value).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> (64 - bits)


def content_digest(array):
    """A 63-bit digest of an array's bytes (host or device): replicas and inputs compared by
    content."""
    from .buffers import array_module

    xp = array_module(array)
    host = array if xp.__name__ == "numpy" else xp.asnumpy(array)
    data = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
