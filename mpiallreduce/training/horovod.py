"""Horovod's PyTorch API over mpiallreduce: a script written for ``horovod.torch`` runs with one line
changed, ``import mpiallreduce.torch as hvd``.

    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16, backward_passes_per_step=1)
    loss.backward(); optimizer.step()
    mean = hvd.allreduce(torch.tensor(val))            # Horovod averages by default: op=hvd.Average
    handle = hvd.allreduce_async(t, op=hvd.Sum); total = hvd.synchronize(handle)

Where it differs from Horovod: fp16 and bf16 are summed in float32 and rounded once (Horovod sums
fp16 in fp16); ``name=`` is accepted and not needed (calls are matched by their order on each
rank, and their signatures compared); there are no process sets other than ``init(comm)``'s ranks
(COMM_WORLD by default), no Adasum, no tensor allgather or alltoall (docs/training.md).
"""

import torch
from mpi4py import MPI

from ..core.gather import gather_from_ranks
from .torch_optimizer import (
    Compression,
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .torch_tensors import (
    _as_array,
    _as_tensor,
    _op_for,
    default_comm,
    local_rank,
    local_size,
    rank,
    reduce_tensor,
    set_default_comm,
    size,
)

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "Average",
    "Sum",
    "Min",
    "Max",
    "Product",
    "Adasum",
    "Compression",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "synchronize",
    "poll",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "allgather_object",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "DistributedOptimizer",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "gloo_built",
    "nccl_built",
    "cuda_built",
]

#: Horovod's ops, as this package names them
Average, Sum, Min, Max, Product = "mean", "sum", "min", "max", "prod"
Adasum = "adasum"


def init(comm=None):
    """Start (MPI is already up once mpi4py is imported). ``comm``: an mpi4py communicator whose
    ranks every call of mpiallreduce.torch then uses by default, ``rank()`` and ``size()``
    included (Horovod takes one too, or a list of world ranks; collective over COMM_WORLD then)."""
    if isinstance(comm, (list, tuple)):
        comm = MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl(list(comm)))
    set_default_comm(comm)


def shutdown():
    set_default_comm(None)


def is_initialized():
    return MPI.Is_initialized() and not MPI.Is_finalized()


def mpi_built():
    return True


mpi_enabled = mpi_built


def mpi_threads_supported():
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def gloo_built():
    return False


nccl_built = gloo_built


def cuda_built():
    """Whether CUDA tensors can be reduced here: CuPy imports and sees a GPU."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all "no"
        return False


def _op(average, op):
    """Horovod's rule: ``average`` (deprecated) or ``op``, not both; neither: Average."""
    if average is not None and op is not None:
        raise ValueError("give op= or average=, not both (Horovod's rule)")
    op = (Average if average in (None, True) else Sum) if op is None else op
    if op == Adasum:
        raise NotImplementedError(
            "hvd.Adasum is not implemented by mpiallreduce: use hvd.Average or hvd.Sum"
        )
    return op


def _options(name, process_set, kwargs):
    if process_set is not None:
        raise NotImplementedError(
            "process sets are not implemented by mpiallreduce: init(comm) picks the ranks"
        )
    kwargs.setdefault("comm", default_comm())
    return kwargs


class _Allreduce(torch.autograd.Function):
    """allreduce as autograd sees it (Horovod's): the gradient is the same reduction of the
    gradients that reach the result."""

    @staticmethod
    def forward(ctx, tensor, op, kwargs):
        ctx.op, ctx.kwargs = op, kwargs
        return reduce_tensor(tensor.detach(), op, False, **kwargs)

    @staticmethod
    def backward(ctx, grad):
        return reduce_tensor(grad.contiguous(), ctx.op, False, **ctx.kwargs), None, None


def _reduce(tensor, average, op, compression, prescale_factor, postscale_factor, in_place, kwargs):
    """The reduction behind allreduce and allreduce_: scale, (compress,) reduce, scale back; out of
    place on a tensor that requires grad (a sum or a mean), differentiable."""
    op = _op(average, op)
    codec = getattr(compression, "name", compression)
    if not in_place and op in (Average, Sum) and tensor.requires_grad and torch.is_grad_enabled():
        work = tensor * prescale_factor if prescale_factor != 1.0 else tensor
        if codec is not None and work.is_floating_point() and work.element_size() > 2:
            work = work.to(torch.float16 if codec == "fp16" else torch.bfloat16)
        result = _Allreduce.apply(work, op, kwargs)
        return (result * postscale_factor if postscale_factor != 1.0 else result).to(tensor.dtype)
    work, copied = tensor.detach(), False
    if prescale_factor != 1.0:
        work, copied = work * prescale_factor, True
    if codec is not None and work.is_floating_point() and work.element_size() > 2:
        work, copied = work.to(torch.float16 if codec == "fp16" else torch.bfloat16), True
    # (allreduce: out of place, as the autograd branch above: ranks that differ in requires_grad
    # make one plan; allreduce_: in place, on the scaled or compressed copy if there is one)
    result = reduce_tensor(work, op, in_place=in_place, **kwargs)
    if postscale_factor != 1.0:
        result = result * postscale_factor
    if not in_place:
        return result if result.dtype == tensor.dtype else result.to(tensor.dtype)
    if copied or postscale_factor != 1.0:
        tensor.detach().copy_(result)
    return tensor


def allreduce(
    tensor,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
    **kwargs,
):
    """A new tensor: ``tensor`` reduced over the ranks, averaged unless ``op`` says otherwise
    (Horovod's default; torch.distributed's is a sum: ``op=hvd.Sum``). Keywords of
    ``mpiallreduce.allreduce`` (algorithm, timeout, reproducible...) pass through."""
    return _reduce(
        tensor,
        average,
        op,
        compression,
        prescale_factor,
        postscale_factor,
        False,
        _options(name, process_set, kwargs),
    )


def allreduce_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
    **kwargs,
):
    """``tensor`` reduced over the ranks in place; returns it."""
    return _reduce(
        tensor,
        average,
        op,
        None,
        prescale_factor,
        postscale_factor,
        True,
        _options(name, process_set, kwargs),
    )


class _Handle:
    """What allreduce_async returns: ``synchronize(handle)`` waits and gives the tensor."""

    def __init__(self, pending, tensor, in_place):
        self.pending, self.tensor, self.in_place = pending, tensor, in_place

    def wait(self):
        result = self.pending.wait()
        if self.tensor.device.type == "cuda":
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        return self.tensor if self.in_place else _as_tensor(result, self.tensor)


def _reduce_async(tensor, average, op, in_place, name, process_set, kwargs):
    from ..api import allreduce_async as start

    kwargs = _options(name, process_set, kwargs)
    array = _as_array(tensor)
    return _Handle(
        start(
            array,
            op=_op_for(tensor, _op(average, op), kwargs),
            out=array if in_place else None,
            **kwargs,
        ),
        tensor,
        in_place,
    )


def allreduce_async(tensor, average=None, name=None, op=None, process_set=None, **kwargs):
    """Start reducing ``tensor`` in the background; ``synchronize(handle)`` returns a new tensor.
    ``tensor`` must not change until then."""
    return _reduce_async(tensor, average, op, False, name, process_set, kwargs)


def allreduce_async_(tensor, average=None, name=None, op=None, process_set=None, **kwargs):
    """As allreduce_async, in place: ``synchronize(handle)`` returns ``tensor``, reduced."""
    return _reduce_async(tensor, average, op, True, name, process_set, kwargs)


def synchronize(handle):
    """Wait for an allreduce_async; its tensor."""
    return handle.wait()


def poll(handle):
    """Whether an allreduce_async has finished (``synchronize`` then does not wait)."""
    return handle.pending.done()


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Rank ``root_rank``'s ``tensor`` into every rank's, in place; returns it."""
    _options(name, process_set, {})
    broadcast_parameters([tensor], root_rank=root_rank)
    return tensor


def broadcast(tensor, root_rank, name=None, process_set=None):
    """A new tensor holding rank ``root_rank``'s ``tensor``."""
    return broadcast_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Rank ``root_rank``'s picklable ``obj``, on every rank (numbered and run as the library's own
    collectives are: core.gather)."""
    _options(name, process_set, {})
    comm = default_comm()
    return gather_from_ranks(comm, obj if comm.Get_rank() == root_rank else None)[root_rank]


def allgather_object(obj, name=None, process_set=None):
    """Every rank's picklable ``obj``, in rank order, on every rank."""
    _options(name, process_set, {})
    return gather_from_ranks(default_comm(), obj)
