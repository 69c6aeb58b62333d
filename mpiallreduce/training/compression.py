"""Gradient compression on the wire: half the bytes, summed in float32, rounded once.

    p = 3 ranks, a bucket of n elements split into p chunks (padded to p * c), each rounded to
    16 bits (float16 or bfloat16) and followed by the bucket's 32-bit layout digest:

    step 1  Alltoall      rank r sends chunk j (+ digest) to rank j; rank j receives chunk j of
                          every rank
              rank 0: [a0|a1|a2]     rank 0 holds a0 b0 c0
              rank 1: [b0|b1|b2] --> rank 1 holds a1 b1 c1       (p - 1) * c * 2 bytes each way
              rank 2: [c0|c1|c2]     rank 2 holds a2 b2 c2
    step 2  rank j sums its p chunks in float32, in rank order (then divides by p for a mean, and
            applies the postscale), rounds once to 16 bits; it compares the p digests it received
    step 3  Allgather     every rank gets every owner's rounded chunk and its verdict on the
                          digests:
              [s0, ok0 | s1, ok1 | s2, ok2]                   (p - 1) * c * 2 bytes each way

Horovod's ``Compression.fp16`` and torch's ``fp16_compress_hook`` allreduce float16 itself: every
partial sum is rounded to float16 on the way, so error grows with the rank count, and a sum past
65504 overflows. Here each contribution is rounded once on the way out, the sum is exact to
float32, and the result is rounded once, by its owner, so every rank gets the same bits. The
bytes on the wire are those of a ring in 16 bits: 2 (p - 1)/p * n * 2 bytes.

bfloat16 rounding (to nearest, ties to even) is done on the float32 bits, so neither ml_dtypes nor
a device bfloat16 type is needed. Device (CuPy) buckets are compressed on the host: the network
carries half the bytes, the copy to the host does not.
"""

import numpy as np

from ..core.ops import ReduceOp, divide_by_size

__all__ = [
    "COMPRESSIONS",
    "check_compression",
    "to_wire",
    "from_wire",
    "compressed_allreduce",
    "CompressedSum",
]

#: the 16-bit formats on the wire
COMPRESSIONS = ("fp16", "bf16")


def check_compression(compression):
    if compression is not None and compression not in COMPRESSIONS:
        raise ValueError(f"compression must be None, 'fp16' or 'bf16', got {compression!r}")
    return compression


def to_wire(values, compression):
    """float values (any float dtype) -> their 16-bit encodings (uint16), each rounded once."""
    if compression == "fp16":
        with np.errstate(over="ignore", invalid="ignore"):  # past 65504: inf, as IEEE rounding says
            return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint16)
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():  # (the rounding above would carry a NaN's payload into the exponent)
        rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x0040)).astype(
            np.uint16
        )  # a quiet NaN, sign kept
    return rounded


def from_wire(encoded, compression):
    """16-bit encodings (uint16) -> float32 values (exactly: both formats widen exactly)."""
    encoded = np.ascontiguousarray(encoded, dtype=np.uint16)
    if compression == "fp16":
        return encoded.view(np.float16).astype(np.float32)
    return (encoded.astype(np.uint32) << 16).view(np.float32)


def _torch():
    """torch, if the program has imported it: its conversions to and from 16 bits are several times
    numpy's (vectorized); the bits are the same (round to nearest even) but for NaN payloads."""
    import sys

    return sys.modules.get("torch")


def _encode_into(destination, values, compression):
    """``destination`` (uint16) = ``values`` (float) in 16 bits, each rounded once."""
    torch = _torch()
    if torch is None:
        destination[...] = to_wire(values, compression)
        return
    wire = torch.float16 if compression == "fp16" else torch.bfloat16
    torch.from_numpy(destination.view(np.int16)).view(wire).copy_(
        torch.from_numpy(np.ascontiguousarray(values))
    )


def _decode_into(destination, encoded, compression, accumulate=False):
    """``destination`` (float) = (or +=, with ``accumulate``) ``encoded``'s values, widened
    exactly."""
    torch = _torch()
    if torch is None:
        wide = from_wire(encoded, compression)
        if accumulate:
            np.add(destination, wide, out=destination, casting="unsafe")
        else:
            np.copyto(destination, wide, casting="unsafe")
        return
    wire = torch.float16 if compression == "fp16" else torch.bfloat16
    source = torch.from_numpy(np.ascontiguousarray(encoded).view(np.int16)).view(wire)
    target = torch.from_numpy(destination)
    if accumulate:
        target.add_(source)
    else:
        target.copy_(source)


def compressed_allreduce(comm, values, compression, digest, mean=False, postscale=1.0):
    """Sum ``values`` (a flat float numpy array, overwritten with the result) over ``comm``'s ranks
    through ``compression`` (see the module's diagram); with ``mean`` the sum is divided by the
    rank count, then multiplied by ``postscale``, in float32, before its one rounding. Returns
    whether every rank gave the same 32-bit ``digest``."""
    size = comm.Get_size()
    count = values.size
    chunk = -(-count // size) if count else 0
    send = np.empty((size, chunk + 2), np.uint16)
    for rank in range(size):  # each chunk rounded straight into its row (the last one padded)
        part = values[rank * chunk : min((rank + 1) * chunk, count)]
        _encode_into(send[rank, : part.size], part, compression)
        send[rank, part.size : chunk] = 0
    send[:, chunk] = digest & 0xFFFF
    send[:, chunk + 1] = (digest >> 16) & 0xFFFF
    received = np.empty_like(send)
    comm.Alltoall(send, received)

    total = np.zeros(chunk, np.float32)
    for rank in range(size):  # in rank order: the owner's sum, the only one
        _decode_into(total, received[rank, :chunk], compression, accumulate=True)
    if mean:
        divide_by_size(np, total, size, total)
    if postscale != 1.0:
        np.multiply(total, np.float32(postscale), out=total)
    digests_agree = bool(np.all(received[:, chunk:] == received[:1, chunk:]))
    mine = np.empty(chunk + 1, np.uint16)
    _encode_into(mine[:chunk], total, compression)
    mine[chunk] = digests_agree
    gathered = np.empty((size, chunk + 1), np.uint16)
    comm.Allgather(mine, gathered)
    for rank in range(size):
        part = values[rank * chunk : min((rank + 1) * chunk, count)]
        _decode_into(part, gathered[rank, : part.size], compression)
    return bool(np.all(gathered[:, chunk] == 1))


class CompressedSum(ReduceOp):
    """One compressed bucket's reduction, as an op of the call pipeline: the planner gives its calls
    the route "compressed fp16" (or bf16), and the executor hands the whole flat buffer to
    ``reduce_whole`` (``compressed_allreduce`` on the library's communicator). The bucket's 32-bit
    ``digest`` rides in the wire rows; ``agreed``, after the run, says whether every rank sent the
    same. One op per call (it carries that call's digest)."""

    def __init__(self, compression, digest, mean=False, postscale=1.0):
        super().__init__(f"compressed_{compression}", np.add, None)
        for name, value in (
            ("compression", compression),
            ("digest", digest),
            ("mean", mean),
            ("postscale", postscale),
            ("agreed", None),
        ):
            object.__setattr__(self, name, value)

    def __repr__(self):
        return self.name

    def check_dtype(self, dtype):
        if dtype.kind != "f":
            raise TypeError(f"{self.name} compresses float gradients, got dtype {dtype}")

    def mpi_op(self, dtype):
        raise TypeError(f"{self.name} is no MPI op: it runs as a whole (reduce_whole)")

    def reduce_whole(self, comm, values):
        """``values`` (flat, host) replaced by the compressed sum over ``comm``'s ranks."""
        object.__setattr__(
            self,
            "agreed",
            compressed_allreduce(
                comm, values, self.compression, self.digest, self.mean, self.postscale
            ),
        )
