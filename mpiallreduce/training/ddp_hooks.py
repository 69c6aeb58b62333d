"""Communication hooks for torch's DistributedDataParallel: DDP keeps its buckets, ``no_sync`` and
``find_unused_parameters``; each bucket is reduced through mpiallreduce instead of DDP's process
group (which DDP still needs for its own setup: broadcasting the model, finding unused parameters).

    mt.init_process_group()                                   # gloo, its rendezvous given out
                                                              # through MPI
    model = DistributedDataParallel(model)
    model.register_comm_hook(mt.HookState(), mt.allreduce_hook)    # or fp16_compress_hook,
                                                                   # bf16_compress_hook,
                                                                   # reproducible_hook
    backward: DDP bucket i full ──hook(state, bucket)──> mean of bucket.buffer() over the ranks
              ──> Future ──> DDP copies the bucket back into the gradients

The hooks reduce synchronously and return a completed Future: DDP calls them in bucket order on
every rank, as each bucket fills during backward. ``fp16_compress_hook`` and ``bf16_compress_hook``
send 16 bits per element and sum in float32, rounded once (torch's own fp16 hook sums in fp16):
through a GradientSync of one gradient per bucket (mpiallreduce.training.compression), made at
the bucket's first use, and again when DDP rebuilds its buckets after the first step.
"""

import os
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed
from mpi4py import MPI

from ..core.annotations import Timeout
from ..core.gather import gather_from_ranks
from ..core.machine import machine_id
from .gradients import GradientSpec, GradientSync
from .torch_tensors import _as_array, _numpy_dtype, default_comm, reduce_tensor

__all__ = [
    "HookState",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "reproducible_hook",
    "init_process_group",
]


class HookState:
    """What the hooks use: the ranks (``comm``, COMM_WORLD by default: DDP's process group must hold
    the same ranks, in the same order), the algorithm and a timeout (not with compression)."""

    def __init__(
        self, comm: MPI.Intracomm | None = None, algorithm: str = "auto", timeout: Timeout = None
    ) -> None:
        self.comm = default_comm() if comm is None else comm
        self.algorithm, self.timeout = algorithm, timeout
        #: (bucket index, elements, dtype, codec) -> its GradientSync
        self._syncs: dict[tuple[int, int, torch.dtype, str], GradientSync] = {}


if TYPE_CHECKING:
    from torch.distributed import GradBucket
else:
    # (evaluated, not postponed: DDP's register_comm_hook checks that the hook's ``bucket`` is
    # annotated with this very class; named only where torch.distributed has it)
    GradBucket = getattr(torch.distributed, "GradBucket", None)

if TYPE_CHECKING:
    #: what DistributedDataParallel.register_comm_hook takes: hook(state, bucket) -> a Future of
    #: the bucket's reduced tensor
    CommHook = Callable[[HookState, GradBucket], torch.futures.Future[torch.Tensor]]


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def allreduce_hook(state: HookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The mean of the bucket over the ranks (DDP's default, through mpiallreduce)."""
    tensor = bucket.buffer()
    reduce_tensor(
        tensor, "mean", True, algorithm=state.algorithm, comm=state.comm, timeout=state.timeout
    )
    return _done(tensor)


def reproducible_hook(state: HookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The mean, its sum reproducible: the same bits whatever the algorithm or the ranks' order
    (mpiallreduce.reproducible)."""
    tensor = bucket.buffer()
    reduce_tensor(
        tensor,
        "mean",
        True,
        algorithm=state.algorithm,
        comm=state.comm,
        timeout=state.timeout,
        reproducible=True,
    )
    return _done(tensor)


def _compressed_hook(codec: str) -> "CommHook":
    def hook(state: HookState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        tensor = bucket.buffer()
        if not tensor.is_floating_point() or tensor.element_size() <= 2:
            return allreduce_hook(state, bucket)
        key = (bucket.index(), tensor.numel(), tensor.dtype, codec)
        sync = state._syncs.get(key)
        if sync is None:  # (collective: every rank meets this bucket here, in the same order)
            spec = GradientSpec((tensor.numel(),), _numpy_dtype(tensor.dtype), tensor.is_cuda)
            sync = state._syncs[key] = GradientSync(
                comm=state.comm,
                parameters={"bucket": spec},
                algorithm=state.algorithm,
                compression=codec,
                bucket_bytes=1 << 62,
                rebuild_buckets=False,
            )
        sync.ready(_as_array(tensor), name="bucket")
        sync.wait()
        if tensor.is_cuda:
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        return _done(tensor)

    # (not torch's own names: DistributedDataParallel refuses a hook named bf16_compress_hook
    # without NCCL)
    hook.__name__ = hook.__qualname__ = f"mpiallreduce_{codec}_compress_hook"
    hook.__doc__ = (
        f"The mean of the bucket, sent as {codec} and summed in float32, rounded once "
        "(16-bit buckets go as they are)."
    )
    return hook


fp16_compress_hook = _compressed_hook("fp16")
bf16_compress_hook = _compressed_hook("bf16")


def init_process_group(
    backend: str = "gloo", comm: MPI.Intracomm | None = None, address: str | None = None
) -> None:
    """``torch.distributed.init_process_group`` over the ranks of ``comm`` (COMM_WORLD), ranks as
    MPI numbers them: the rendezvous is a free port of rank 0's, given out through MPI. ``address``:
    rank 0's, as the others reach it. Default: MASTER_ADDR; else 127.0.0.1 when every rank runs on
    rank 0's machine (one kernel: the same boot id, emulated nodes included); else rank 0's host
    name."""
    comm = default_comm() if comm is None else comm
    boots = gather_from_ranks(comm, machine_id())  # (the library's own collectives: core.gather)
    where = None
    if comm.Get_rank() == 0:
        one_machine = all(boot == boots[0] for boot in boots)
        host = (
            address
            or os.environ.get("MASTER_ADDR")
            or ("127.0.0.1" if one_machine else socket.gethostname())
        )
        with socket.socket() as probe:
            probe.bind(("127.0.0.1" if host == "127.0.0.1" else "", 0))
            where = (host, probe.getsockname()[1])
    host, port = gather_from_ranks(comm, where)[0]
    torch.distributed.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
    )
