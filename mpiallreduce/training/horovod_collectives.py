"""Horovod's collectives as negotiated ops (mpiallreduce.training.horovod_engine), each with the
data move it makes once the ranks agree, and the gradient Horovod gives it.

    allreduce       the library's allreduce (sum, min, max, prod) out of place on the engine's data
                    communicator; Average: a sum divided by the ranks (integers: truncated, as
                    Horovod's); prescale on each rank's input first, postscale on the result
                    (integers scaled in float64, float16 in float32, as Horovod's)
                    gradient: the same reduction of the gradients
    broadcast       MPI_Bcast of the root's bytes;   gradient: the mean of the gradients, at the
                    root only (zeros elsewhere)
    allgather       MPI_Allgatherv, each rank its own first dimension;   gradient: the mean of the
                    gradients, this rank's rows
    alltoall        MPI_Alltoallv by the ranks' splits;   gradient: an alltoall back
    reducescatter   the allreduce, then this rank's rows (the first shape[0] % size ranks one
                    more);   gradient: an allgather of the gradients (Sum: times the ranks)
    barrier         the negotiation itself (every rank meets there)

Data moves as bytes (every dtype, bfloat16 and float16 included); where a rank cannot make the
call (bad splits, a root out of range), its descriptor says so and every rank raises.
"""

import numpy as np
import torch
from mpi4py import MPI

from .horovod_engine import (
    JOINED,
    REFUSED,
    Descriptor,
    HorovodArgumentError,
    Op,
    engine_for,
    joined_runner,
)
from .torch_tensors import default_comm, reduce_tensor

__all__ = [
    "Average",
    "Sum",
    "Min",
    "Max",
    "Product",
    "HorovodArgumentError",
    "rows_of",
    "allreduce_op",
    "broadcast_op",
    "allgather_op",
    "alltoall_op",
    "reducescatter_op",
    "barrier_op",
    "join_op",
    "run",
    "start",
]

#: Horovod's ops, as this package names them
Average, Sum, Min, Max, Product = "mean", "sum", "min", "max", "prod"


def _dtype_name(tensor):
    return str(tensor.dtype).replace("torch.", "")


def _bytes(tensor):
    """A contiguous CPU copy's bytes (numpy uint8), and the copy."""
    copy = tensor.detach().contiguous().cpu().clone()
    return copy.reshape(-1).view(torch.uint8).numpy(), copy


def _from_bytes(array, dtype, shape, like):
    tensor = torch.from_numpy(array).view(dtype).reshape(shape)
    return tensor.to(like.device) if like.device.type != "cpu" else tensor


def _refused(kind, reason):
    return Descriptor(REFUSED, (kind, reason))


def start(op, name=None, comm=None):
    """Submit ``op`` to the engine of ``comm`` (the facade's default); its Handle."""
    return engine_for(default_comm() if comm is None else comm).submit(op, name)


def run(op, name=None, comm=None):
    return start(op, name, comm).wait()


# ---- allreduce ---------------------------------------------------------------------------------
def _scaled(tensor, factor):
    if factor == 1.0:
        return tensor
    if not tensor.is_floating_point():
        return (tensor.to(torch.float64) * factor).to(tensor.dtype)
    if tensor.dtype in (torch.float16, torch.bfloat16):
        return (tensor.to(torch.float32) * factor).to(tensor.dtype)
    return tensor * factor


def _averaged(tensor, size):
    if not tensor.is_floating_point() and not tensor.is_complex():
        return torch.div(tensor, size, rounding_mode="trunc")
    return tensor / size


def _base(op):
    return Sum if op == Average else op


def _op_refused(kind, op):
    """The refusal of an op this package does not reduce by (hvd.Adasum), or None."""
    if op in (Average, Sum, Min, Max, Product):
        return None
    what = "hvd.Adasum is" if op == "adasum" else f"the op {op!r} is"
    return _refused(kind, f"{what} not implemented by mpiallreduce: use hvd.Average or hvd.Sum")


def allreduce_op(tensor, op, prescale_factor=1.0, postscale_factor=1.0):
    """The op reducing ``tensor`` (detached) by ``op`` (a new tensor)."""
    descriptor = _op_refused("allreduce", op) or Descriptor(
        "allreduce", (_dtype_name(tensor), tuple(tensor.shape), op)
    )

    def move(descriptors, engine):
        work = _scaled(tensor.detach(), prescale_factor)
        result = reduce_tensor(work.contiguous(), _base(op), False, comm=engine.data)
        if op == Average:
            result = _averaged(result, engine.size)
        return _scaled(result, postscale_factor)

    return Op(descriptor, move)


@joined_runner("allreduce")
def _zeros_to_an_allreduce(descriptors, engine):
    dtype, shape, op = next(d.matched for d in descriptors if d.kind != JOINED)
    zeros = torch.zeros(shape, dtype=getattr(torch, dtype))
    reduce_tensor(zeros, _base(op), False, comm=engine.data)


# ---- broadcast ---------------------------------------------------------------------------------
def broadcast_op(tensor, root_rank, size):
    """The op giving rank ``root_rank``'s ``tensor`` to every rank (a new tensor)."""
    if not isinstance(root_rank, int) or not 0 <= root_rank < size:
        descriptor = _refused("broadcast", f"root_rank {root_rank!r} is not a rank of {size}")
    else:
        descriptor = Descriptor(
            "broadcast", (_dtype_name(tensor), tuple(tensor.shape), f"root {root_rank}")
        )

    def move(descriptors, engine):
        data, copy = _bytes(tensor)
        request = engine.data.Ibcast([data, MPI.BYTE], root=root_rank)
        engine.wait(request, "broadcast", "a peer stopped in it")
        return copy.to(tensor.device) if tensor.device.type != "cpu" else copy

    return Op(descriptor, move)


# ---- allgather ---------------------------------------------------------------------------------
def allgather_op(tensor):
    """The op concatenating every rank's ``tensor`` along its first dimension (a new tensor)."""
    if tensor.dim() == 0:
        descriptor = _refused("allgather", "a 0-dimensional tensor has no first dimension")
    else:
        descriptor = Descriptor(
            "allgather",
            (_dtype_name(tensor), f"rows of {tuple(tensor.shape[1:])}"),
            (int(tensor.shape[0]),),
        )

    def move(descriptors, engine):
        data, _ = _bytes(tensor)
        row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
        rows = [d.own[0] for d in descriptors]
        row = row or (tensor.element_size() * int(np.prod(tensor.shape[1:], dtype=np.int64)))
        counts = [r * row for r in rows]
        received = np.empty(sum(counts), dtype=np.uint8)
        displacements = np.cumsum([0, *counts[:-1]]).tolist()
        request = engine.data.Iallgatherv(
            [data, MPI.BYTE], [received, counts, displacements, MPI.BYTE]
        )
        engine.wait(request, "allgather", "a peer stopped in it")
        return _from_bytes(received, tensor.dtype, (sum(rows), *tensor.shape[1:]), tensor)

    return Op(descriptor, move)


# ---- alltoall ----------------------------------------------------------------------------------
def _splits_of(tensor, splits, size):
    """This rank's splits (a list of ints), or the reason it has none."""
    if splits is None:
        if tensor.shape[0] % size:
            return f"the first dimension {tensor.shape[0]} does not divide among {size} ranks"
        return [tensor.shape[0] // size] * size
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            return f"splits must be a tensor of int32, got {splits.dtype}"
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != size or any(s < 0 for s in splits):
        return f"splits must be {size} counts, none negative; got {splits}"
    if sum(splits) != tensor.shape[0]:
        return f"the splits sum to {sum(splits)}, not the first dimension {tensor.shape[0]}"
    return splits


def alltoall_op(tensor, splits, size):
    """The op sending rows of ``tensor`` to each rank by ``splits``: (the rows received, the
    splits received)."""
    mine = _splits_of(tensor, splits, size) if tensor.dim() else "a 0-dimensional tensor"
    if isinstance(mine, str):
        descriptor = _refused("alltoall", mine)
    else:
        descriptor = Descriptor(
            "alltoall", (_dtype_name(tensor), f"rows of {tuple(tensor.shape[1:])}"), tuple(mine)
        )

    def move(descriptors, engine):
        data, _ = _bytes(tensor)
        row = tensor.element_size() * int(np.prod(tensor.shape[1:], dtype=np.int64))
        received_splits = [d.own[engine.rank] for d in descriptors]
        send_counts = [s * row for s in mine]
        receive_counts = [s * row for s in received_splits]
        received = np.empty(sum(receive_counts), dtype=np.uint8)
        request = engine.data.Ialltoallv(
            [data, send_counts, np.cumsum([0, *send_counts[:-1]]).tolist(), MPI.BYTE],
            [received, receive_counts, np.cumsum([0, *receive_counts[:-1]]).tolist(), MPI.BYTE],
        )
        engine.wait(request, "alltoall", "a peer stopped in it")
        shape = (sum(received_splits), *tensor.shape[1:])
        return (
            _from_bytes(received, tensor.dtype, shape, tensor),
            torch.tensor(received_splits, dtype=torch.int32),
        )

    return Op(descriptor, move)


# ---- reducescatter -----------------------------------------------------------------------------
def rows_of(count, size, rank):
    """(first row, rows) of ``rank``'s part of ``count`` rows (numpy.array_split's)."""
    base, extra = divmod(count, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def reducescatter_op(tensor, op, prescale_factor=1.0, postscale_factor=1.0):
    """The op reducing ``tensor`` by ``op`` and giving each rank its rows of the result."""
    if tensor.dim() == 0:
        reduce = None
        descriptor = _refused("reducescatter", "a 0-dimensional tensor has no rows to scatter")
    else:
        reduce = allreduce_op(tensor, op, prescale_factor, postscale_factor)
        descriptor = _op_refused("reducescatter", op) or Descriptor(
            "reducescatter", reduce.descriptor.matched
        )

    def move(descriptors, engine):
        whole = reduce.run(descriptors, engine)
        first, rows = rows_of(tensor.shape[0], engine.size, engine.rank)
        return whole[first : first + rows].clone()

    return Op(descriptor, move)


# ---- barrier -----------------------------------------------------------------------------------
def barrier_op():
    return Op(Descriptor("barrier"), lambda descriptors, engine: None)


# ---- join --------------------------------------------------------------------------------------
def join_op():
    """The op of join() (the engine answers the others' negotiations until every rank joined)."""
    return Op(Descriptor("join"), None)
