"""Tensors as arrays: a torch tensor's memory seen by numpy (CPU) or CuPy (CUDA, through DLPack),
shared, not copied, and back; the one place mpiallreduce.torch converts
(mpiallreduce.training.torch).

    tensor ──_as_array──> numpy / CuPy array ──(allreduce, GradientSync)──> array
           ──_as_tensor──> tensor

CUDA tensors go through ``cupy.from_dlpack``, which orders CuPy's stream after torch's with an
event: no host synchronization per tensor. bfloat16 (which neither numpy nor CuPy's DLPack takes)
goes as ml_dtypes.bfloat16 on the CPU and as its 16-bit words on the GPU, reduced with
Bfloat16Bits: either way summed in float32 and rounded once. Also the ranks as Horovod names them.
"""

from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ..core.annotations import Array, Op

__all__ = [
    "reduce_tensor",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "default_comm",
    "set_default_comm",
]


def _as_array(tensor: torch.Tensor) -> Array:
    """The tensor's memory as a numpy array (CPU) or a CuPy array (CUDA), shared, not copied. A CPU
    bfloat16 tensor is an ml_dtypes bfloat16 array, and a CUDA one (CuPy has no bfloat16) a uint16
    array of its words, reduced with the op ``_op_for`` gives it: either way the planner sums it in
    float32 and rounds once, as any bfloat16 array (mpiallreduce.core.planner)."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        if tensor.dtype == torch.bfloat16:
            import ml_dtypes

            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return tensor.numpy()
    if tensor.device.type == "cuda":
        import cupy  # (DLPack: CuPy's current stream waits for torch's, on the GPU)

        if tensor.dtype == torch.bfloat16:
            return cupy.from_dlpack(tensor.view(torch.int16)).view(cupy.uint16)
        return cupy.from_dlpack(tensor)
    raise TypeError(f"mpiallreduce.torch handles CPU and CUDA tensors; got one on {tensor.device}")


def _as_tensor(array: Array, like: torch.Tensor) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (numpy or CuPy), on ``like``'s device."""
    if like.device.type == "cpu":
        if like.dtype == torch.bfloat16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
    import cupy

    cupy.cuda.get_current_stream().synchronize()  # what CuPy queued has been written
    if like.dtype == torch.bfloat16:
        return torch.from_dlpack(array.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(array)


def _op_for(tensor: torch.Tensor, op: Op, options: dict[str, Any]) -> Op:
    """The op a tensor is reduced with: ``op``, or for a CUDA bfloat16 tensor's words its
    Bfloat16Bits (mpiallreduce.core.ops)."""
    if tensor.dtype != torch.bfloat16 or tensor.device.type != "cuda":
        return op
    if options.get("reproducible"):
        raise TypeError(
            "reproducible sums of CUDA bfloat16 tensors are not supported; reduce a float32 copy"
        )
    from ..core.ops import Bfloat16Bits, get_op

    return Bfloat16Bits(get_op(op))


def reduce_tensor(
    tensor: torch.Tensor,
    op: Op,
    in_place: bool,
    algorithm: str = "auto",
    comm: MPI.Intracomm | None = None,
    **options: Any,
) -> torch.Tensor:
    """``tensor`` (CPU or CUDA) reduced over the ranks: in place (returns it) or as a new tensor on
    its device; what requires grad is detached. Keywords as ``mpiallreduce.allreduce``."""
    from ..api import allreduce as reduce_array

    array = _as_array(tensor)
    result = reduce_array(
        array,
        op=_op_for(tensor, op, options),
        algorithm=algorithm,
        comm=default_comm() if comm is None else comm,
        out=array if in_place else None,
        **options,
    )
    if not in_place:
        return _as_tensor(result, tensor)
    if tensor.device.type == "cuda":
        import cupy

        cupy.cuda.get_current_stream().synchronize()
    return tensor


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a gradient of torch ``dtype`` reaches GradientSync as (bfloat16: widened)."""
    if dtype == torch.bfloat16:
        return np.dtype(np.float32)
    return torch.empty(0, dtype=dtype).numpy().dtype


_default: list[MPI.Intracomm | None] = [None]  # hvd.init(comm)'s communicator


def default_comm() -> MPI.Intracomm:
    """The ranks mpiallreduce.torch works over when no ``comm`` is given: ``hvd.init(comm)``'s, else
    COMM_WORLD."""
    return _default[0] if _default[0] is not None else MPI.COMM_WORLD


def set_default_comm(comm: MPI.Intracomm | None) -> None:
    _default[0] = comm


def rank() -> int:
    """This process's rank among default_comm()'s (Horovod's ``hvd.rank()``)."""
    return default_comm().Get_rank()


def size() -> int:
    """The number of ranks of default_comm() (``hvd.size()``)."""
    return default_comm().Get_size()


def local_rank() -> int:
    """This process's rank among the ranks of its node (``hvd.local_rank()``, of COMM_WORLD's
    ranks), 0..local_size()-1: as the launcher numbers them (Open MPI's need not follow the world
    ranks' order), else from the node communicator (collective over COMM_WORLD the first time)."""
    from ..core.node_rank import local_rank as node_local_rank

    return node_local_rank()


def local_size() -> int:
    """The number of ranks on this process's node (``hvd.local_size()``; collective over COMM_WORLD
    the first time)."""
    from ..core.state import state_of
    from ..core.topology import node_communicator

    return node_communicator(state_of(MPI.COMM_WORLD).make_ready().library).Get_size()
