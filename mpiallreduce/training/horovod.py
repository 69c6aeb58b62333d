"""Horovod's PyTorch API over mpiallreduce: a script written for ``horovod.torch`` runs with
one line changed, ``import mpiallreduce.torch as hvd``.

    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, model.named_parameters(),
                                         compression=hvd.Compression.fp16)
    loss.backward(); optimizer.step()
    mean = hvd.allreduce(torch.tensor(val))            # Horovod averages by default: op=hvd.Average
    handle = hvd.allreduce_async(t, op=hvd.Sum); total = hvd.synchronize(handle)
    rows = hvd.allgather(t); out, splits = hvd.alltoall(t, splits); part = hvd.reducescatter(t)
    hvd.barrier(); last = hvd.join()                   # uneven data: joined ranks give zeros

The tensor collectives (allreduce, broadcast, allgather, alltoall, reducescatter, their async and
grouped forms, barrier, join) are negotiated ops, matched by name (unnamed ones by their order on
each rank) and run in the background (mpiallreduce.training.horovod_engine; their data moves:
horovod_collectives): ranks whose calls of one name differ raise HorovodMismatchError (a
RuntimeError, as Horovod's, and this project's SignatureMismatch) on every rank, and the next call
pairs up. Where it differs from Horovod: docs/training.md.
"""

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, overload

import torch
from mpi4py import MPI

from ..core.gather import gather_from_ranks
from .horovod_allreduce import differentiable_allreduce
from .horovod_collectives import (
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather_op,
    allreduce_op,
    alltoall_op,
    barrier_op,
    broadcast_op,
    join_op,
    reducescatter_op,
    run,
    start,
)
from .horovod_engine import (
    Handle,
    HorovodInternalError,
    HorovodMismatchError,
    engine_for,
    forget_engine,
    forget_engines,
)
from .horovod_process_sets import (
    ProcessSet,
    add_process_set,
    forget_process_sets,
    global_process_set,
    remove_process_set,
)
from .horovod_sync_batch_norm import SyncBatchNorm
from .horovod_timeline import start_timeline, stop_timeline
from .torch_optimizer import Compression, _Codec, broadcast_optimizer_state, broadcast_parameters
from .torch_optimizer import DistributedOptimizer as _DistributedOptimizer
from .torch_tensors import (
    default_comm,
    local_rank,
    local_size,
    rank,
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
    "HorovodInternalError",
    "HorovodMismatchError",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "sparse_allreduce_async",
    "synchronize",
    "poll",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "allgather_object",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "barrier",
    "join",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "DistributedOptimizer",
    "SyncBatchNorm",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "start_timeline",
    "stop_timeline",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "gloo_built",
    "gloo_enabled",
    "nccl_built",
    "ccl_built",
    "cuda_built",
]

Adasum = "adasum"

_T = TypeVar("_T")


def init(
    comm: MPI.Intracomm | list[int] | tuple[int, ...] | None = None,
    process_sets: Iterable[ProcessSet] | None = None,
) -> None:
    """Start (MPI is already up once mpi4py is imported). ``comm``: an mpi4py communicator whose
    ranks every call of mpiallreduce.torch then uses by default, ``rank()`` and ``size()``
    included (Horovod takes one too, or a list of world ranks; collective over COMM_WORLD then).
    ``process_sets``: ProcessSets to add now (collective, as add_process_set)."""
    if isinstance(comm, (list, tuple)):
        comm = MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl(list(comm)))
    before = default_comm()
    set_default_comm(comm)
    after = default_comm()
    if before != after and before != MPI.COMM_WORLD and before != MPI.COMM_NULL:
        forget_engine(before)  # (the communicator an earlier init gave)
    if after != MPI.COMM_NULL:  # (made here, collectively: an async call never waits for it)
        engine_for(after)
    for process_set in process_sets or ():
        add_process_set(process_set)


def shutdown() -> None:
    """Stop: the facade's engines go (a later init makes new ones: after a stall too)."""
    forget_engines()
    forget_process_sets()
    set_default_comm(None)


def is_initialized() -> bool:
    return MPI.Is_initialized() and not MPI.Is_finalized()


def mpi_built() -> bool:
    return True


mpi_enabled = mpi_built


def mpi_threads_supported() -> bool:
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    return False


nccl_built = gloo_built


def cuda_built() -> bool:
    """Whether CUDA tensors can be reduced here: CuPy imports and sees a GPU."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all "no"
        return False


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: str | _Codec | None = Compression.none,
    backward_passes_per_step: int = 1,
    op: str | None = None,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet | None = None,
    **options: Any,
) -> _DistributedOptimizer:
    """Horovod's ``hvd.DistributedOptimizer``: mpiallreduce.torch's, with Horovod's defaults: a
    parameter that got no gradient on a rank counts as zeros there (Horovod reduces zeros for
    it), and ``op`` Average. ``num_groups``, ``groups`` and ``sparse_as_dense`` are taken and not
    needed (buckets are planned by size)."""
    options.setdefault("find_unused", True)
    if process_set is not None and process_set is not global_process_set:
        if not process_set.included():
            if process_set.process_set_id is None:
                process_set.communicator()  # (raises: the set was not added)
            return _OutsideTheSet(optimizer, named_parameters)
        options.setdefault("comm", process_set.communicator())
    return _DistributedOptimizer(
        optimizer,
        named_parameters=named_parameters,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        # (Horovod's ops are str here, hvd.Sum "sum"; GradientSync raises for any but mean, sum)
        op="mean" if op in (None, Average) else op,  # type: ignore[arg-type]
        gradient_predivide_factor=gradient_predivide_factor,
        **options,
    )


class _OutsideTheSet(_DistributedOptimizer):
    """Horovod's DistributedOptimizer on a rank outside its process set: the wrapped optimizer,
    stepping on this rank's own gradients (``synchronize`` has nothing to do)."""

    def __init__(  # (no GradientSync: nothing reduced)
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        self.optimizer, self._skip, self._synchronized, self._hooks = optimizer, False, False, []
        named = list(named_parameters or [])
        self._parameter_names = {p: name for name, p in named} or {
            p: f"param.{i}.{j}"
            for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])
        }

    def synchronize(self) -> None:
        pass

    # (no GradientSync to give outside the set: ``with no_sync():`` there only runs its block)
    def no_sync(self) -> contextlib.nullcontext[None]:  # type: ignore[override]
        return contextlib.nullcontext()

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        return self.optimizer.step(closure)


def _op(average: bool | None, op: str | None) -> str:
    """Horovod's rule: ``average`` (deprecated) or ``op``, not both; neither: Average."""
    if average is not None and op is not None:
        raise ValueError("give op= or average=, not both (Horovod's rule)")
    return (Average if average in (None, True) else Sum) if op is None else op


def _comm(process_set: ProcessSet | None) -> MPI.Intracomm:
    """The communicator of ``process_set`` (None: the facade's default); this rank must be in it."""
    if process_set is None or process_set is global_process_set:
        return default_comm()
    return process_set.communicator()


def _kwargs_left(kwargs: dict[str, Any]) -> None:
    if kwargs:
        raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")


# ---- allreduce ---------------------------------------------------------------------------------
def _compressed(tensor: torch.Tensor, compression: str | _Codec | None) -> torch.Tensor:
    codec = getattr(compression, "name", compression)
    if codec is not None and tensor.is_floating_point() and tensor.element_size() > 2:
        return tensor.to(torch.float16 if codec == "fp16" else torch.bfloat16)
    return tensor


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: str | _Codec | None = Compression.none,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """A new tensor: ``tensor`` reduced over the ranks, averaged unless ``op`` says otherwise
    (Horovod's default; torch.distributed's is a sum: ``op=hvd.Sum``); differentiable."""
    op, comm = _op(average, op), _comm(process_set)
    work = _compressed(tensor, compression)
    result = differentiable_allreduce(work, op, prescale_factor, postscale_factor, name, comm)
    return result.to(tensor.dtype)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """``tensor`` reduced over the ranks in place; returns it."""
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


class _Handle:
    """What the async calls return: ``synchronize(handle)`` waits and gives the result (written
    into ``into`` for the in-place forms)."""

    def __init__(
        self,
        pending: Handle,
        into: torch.Tensor | list[torch.Tensor] | None = None,
        finish: Callable[[Any], Any] | None = None,
    ) -> None:
        self.pending, self.into, self.finish = pending, into, finish

    def wait(self) -> Any:  # (what the call gives: a tensor, (tensor, splits) or a list)
        result = self.pending.wait()
        if self.finish is not None:
            result = self.finish(result)
        if self.into is not None:
            with torch.no_grad():
                for target, value in zip(*_as_lists(self.into, result), strict=True):
                    target.copy_(value)
            return self.into
        return result

    __call__ = wait  # (sparse_allreduce_async's handle is called, in Horovod)


def _as_lists(
    into: torch.Tensor | list[torch.Tensor], result: Any
) -> tuple[list[torch.Tensor], list[Any]]:
    return (into, result) if isinstance(into, list) else ([into], [result])


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> "_Handle":
    """Start reducing ``tensor`` in the background; ``synchronize(handle)`` returns a new tensor.
    ``tensor`` must not change until then."""
    op = _op(average, op)
    pending = start(allreduce_op(tensor, op, prescale_factor, postscale_factor), name,
                    _comm(process_set))  # fmt: skip
    return _Handle(pending, finish=lambda result: result.to(tensor.dtype))


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> "_Handle":
    """As allreduce_async, in place: ``synchronize(handle)`` returns ``tensor``, reduced."""
    op = _op(average, op)
    pending = start(allreduce_op(tensor, op, prescale_factor, postscale_factor), name,
                    _comm(process_set))  # fmt: skip
    return _Handle(pending, into=tensor)


def grouped_allreduce(
    tensors: Iterable[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: str | _Codec | None = Compression.none,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    """Each of ``tensors`` reduced (new tensors), as allreduce's, in one group."""
    return [
        allreduce(
            t,
            average,
            None if name is None else f"{name}.{i}",
            compression,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
        )  # fmt: skip
        for i, t in enumerate(tensors)
    ]


def grouped_allreduce_async(
    tensors: Iterable[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> "_Group":
    handles = [
        allreduce_async(
            t,
            average,
            None if name is None else f"{name}.{i}",
            op,
            prescale_factor,
            postscale_factor,
            process_set,
        )  # fmt: skip
        for i, t in enumerate(tensors)
    ]
    return _Group(handles)


def grouped_allreduce_async_(
    tensors: Iterable[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> "_Group":
    handles = [
        allreduce_async_(
            t,
            average,
            None if name is None else f"{name}.{i}",
            op,
            prescale_factor,
            postscale_factor,
            process_set,
        )  # fmt: skip
        for i, t in enumerate(tensors)
    ]
    return _Group(handles)


def grouped_allreduce_(
    tensors: Iterable[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))  # fmt: skip


class _Group:
    """Handles of a grouped call: ``synchronize`` gives every result, in order."""

    def __init__(self, handles: list[_Handle]) -> None:
        self.handles = handles

    def wait(self) -> list[Any]:
        return [handle.wait() for handle in self.handles]

    @property
    def pending(self) -> "_Group":
        return self


def synchronize(handle: _Handle | _Group) -> Any:
    """Wait for an async call; its result."""
    return handle.wait()


def poll(handle: _Handle | _Group) -> bool:
    """Whether an async call has finished (``synchronize`` then does not wait)."""
    if isinstance(handle, _Group):
        return all(h.pending.done() for h in handle.handles)
    return handle.pending.done()


# ---- broadcast ---------------------------------------------------------------------------------
class _Broadcast(torch.autograd.Function):
    """broadcast as autograd sees it (Horovod's): the mean of the gradients, at the root only."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, comm: MPI.Intracomm
    ) -> torch.Tensor:
        ctx.root, ctx.comm = root_rank, comm
        return run(broadcast_op(tensor, root_rank, comm.Get_size()), comm=comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        mean = run(allreduce_op(grad, Average), comm=ctx.comm)
        if ctx.comm.Get_rank() != ctx.root:
            mean = mean * 0
        return mean, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """A new tensor holding rank ``root_rank``'s ``tensor``; differentiable."""
    comm = _comm(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, comm)
    return run(broadcast_op(tensor, root_rank, comm.Get_size()), name, comm)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> _Handle:
    comm = _comm(process_set)
    return _Handle(start(broadcast_op(tensor, root_rank, comm.Get_size()), name, comm))


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> _Handle:
    comm = _comm(process_set)
    return _Handle(start(broadcast_op(tensor, root_rank, comm.Get_size()), name, comm), tensor)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """Rank ``root_rank``'s ``tensor`` into every rank's, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_object(
    obj: _T, root_rank: int = 0, name: str | None = None, process_set: ProcessSet | None = None
) -> _T:
    """Rank ``root_rank``'s picklable ``obj``, on every rank (numbered and run as the library's own
    collectives are: core.gather)."""
    comm = _comm(process_set)
    return gather_from_ranks(comm, obj if comm.Get_rank() == root_rank else None)[root_rank]


def allgather_object(
    obj: _T, name: str | None = None, process_set: ProcessSet | None = None
) -> list[_T]:
    """Every rank's picklable ``obj``, in rank order, on every rank."""
    return gather_from_ranks(_comm(process_set), obj)


# ---- allgather, alltoall, reducescatter ---------------------------------------------------------
class _Allgather(torch.autograd.Function):
    """allgather as autograd sees it (Horovod's): the mean of the gradients, this rank's rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: MPI.Intracomm) -> torch.Tensor:
        ctx.comm, ctx.rows = comm, tensor.shape[0]
        result = run(allgather_op(tensor), comm=comm)
        # (_Wrapped stands in for a ProcessSet: _comm asks it only for its communicator())
        ctx.first = sum(allgather_object(ctx.rows, process_set=_Wrapped(comm))[: comm.Get_rank()])  # type: ignore[arg-type]
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        mean = run(allreduce_op(grad.contiguous(), Average), comm=ctx.comm)
        return mean[ctx.first : ctx.first + ctx.rows], None


class _Wrapped:
    """A communicator where a process set is taken (the autograd functions' own calls)."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm

    def communicator(self) -> MPI.Intracomm:
        return self.comm


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension (each rank's may differ in
    it); differentiable."""
    comm = _comm(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, comm)
    return run(allgather_op(tensor), name, comm)


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet | None = None
) -> _Handle:
    return _Handle(start(allgather_op(tensor), name, _comm(process_set)))


def grouped_allgather(
    tensors: Iterable[torch.Tensor], name: str | None = None, process_set: ProcessSet | None = None
) -> list[torch.Tensor]:
    return [allgather(t, None if name is None else f"{name}.{i}", process_set)
            for i, t in enumerate(tensors)]  # fmt: skip


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        splits: torch.Tensor | Sequence[int] | None,
        comm: MPI.Intracomm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.comm = comm
        result, received = run(alltoall_op(tensor, splits, comm.Get_size()), comm=comm)
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return result, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        back, _ = run(alltoall_op(grad.contiguous(), ctx.received, ctx.comm.Get_size()),
                      comm=ctx.comm)  # fmt: skip
        return back, None, None


@overload
def alltoall(
    tensor: torch.Tensor,
    splits: None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> torch.Tensor: ...
@overload
def alltoall(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int],
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def alltoall(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``tensor`` to each rank by ``splits`` (int32, one count a rank; None: equal parts):
    (the rows received, in rank order, and the splits received); without ``splits``, the rows
    alone. Differentiable."""
    comm = _comm(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        result, received = _Alltoall.apply(tensor, splits, comm)
    else:
        result, received = run(alltoall_op(tensor, splits, comm.Get_size()), name, comm)
    return result if splits is None else (result, received)


def alltoall_async(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> _Handle:
    comm = _comm(process_set)
    return _Handle(start(alltoall_op(tensor, splits, comm.Get_size()), name, comm),
                   finish=lambda result: result[0] if splits is None else result)  # fmt: skip


class _Reducescatter(torch.autograd.Function):
    """reducescatter as autograd sees it (Horovod's): every rank's gradient rows gathered, then
    reduced as the forward was (a sum: times the ranks; a mean: as they are)."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        op: str,
        prescale: float,
        postscale: float,
        comm: MPI.Intracomm,
    ) -> torch.Tensor:
        ctx.op, ctx.comm = op, comm
        return run(reducescatter_op(tensor, op, prescale, postscale), comm=comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        gathered = run(allgather_op(grad.contiguous()), comm=ctx.comm)
        return run(allreduce_op(gathered, ctx.op), comm=ctx.comm), None, None, None, None


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: str | _Codec | None = Compression.none,
    op: str = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """``tensor`` reduced over the ranks (Average by default), each rank given its rows of the
    result (the first ``shape[0] % size`` ranks one more); differentiable."""
    comm = _comm(process_set)
    work = _compressed(tensor, compression)
    if work.requires_grad and torch.is_grad_enabled():
        result = _Reducescatter.apply(work, op, prescale_factor, postscale_factor, comm)
    else:
        result = run(reducescatter_op(work, op, prescale_factor, postscale_factor), name, comm)
    return result.to(tensor.dtype)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: str = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> _Handle:
    return _Handle(start(reducescatter_op(tensor, op, prescale_factor, postscale_factor), name,
                         _comm(process_set)))  # fmt: skip


def grouped_reducescatter(
    tensors: Iterable[torch.Tensor],
    name: str | None = None,
    compression: str | _Codec | None = Compression.none,
    op: str = Average,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    return [reducescatter(t, None if name is None else f"{name}.{i}", compression, op,
                          prescale_factor, postscale_factor, process_set)
            for i, t in enumerate(tensors)]  # fmt: skip


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: str = Average,
    process_set: ProcessSet | None = None,
) -> _Handle:
    """A sparse tensor reduced over the ranks (Horovod's way: every rank's indices and values
    gathered, then summed where they coincide); ``synchronize`` gives a sparse tensor."""
    tensor = tensor.coalesce()
    comm = _comm(process_set)
    indices = start(allgather_op(tensor.indices().t().contiguous()), None, comm)
    values = start(allgather_op(tensor.values().contiguous()), None, comm)

    def finish(gathered_values: torch.Tensor) -> torch.Tensor:
        gathered = torch.sparse_coo_tensor(
            indices.wait().t(), gathered_values, tensor.shape
        ).coalesce()
        return gathered / comm.Get_size() if op == Average else gathered

    return _Handle(values, finish=finish)


# ---- barrier, join -----------------------------------------------------------------------------
def barrier(process_set: ProcessSet | None = None) -> None:
    """Wait until every rank is here (after its earlier async calls were negotiated)."""
    run(barrier_op(), comm=_comm(process_set))


def join(device: int = -1, process_set: ProcessSet | None = None) -> int:
    """This rank has no more data: until every rank has joined, it takes part in the others'
    allreduces with zeros (any other collective raises there). Returns the rank that joined last,
    the same on every rank. ``device``: Horovod's, unused (CPU tensors)."""
    return run(join_op(), comm=_comm(process_set))


# ---- what Horovod tells of itself --------------------------------------------------------------
def cross_rank() -> int:
    """This rank's node's number (among the nodes; Horovod's cross_rank)."""
    return _nodes()[0]


def cross_size() -> int:
    """The number of nodes (Horovod's cross_size)."""
    return _nodes()[1]


_node_facts: list[int] = []


def _nodes() -> tuple[int, ...]:
    if not _node_facts:
        comm = default_comm()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        leaders = comm.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, key=comm.Get_rank())
        number = leaders.Get_rank() if leaders != MPI.COMM_NULL else -1
        number = node.bcast(number, root=0)
        count = comm.allreduce(1 if node.Get_rank() == 0 else 0)
        for made in (node, leaders):
            if made != MPI.COMM_NULL:
                made.Free()
        _node_facts[:] = [number, count]
    return tuple(_node_facts)


def gloo_enabled() -> bool:
    return False


def ccl_built() -> bool:
    return False
