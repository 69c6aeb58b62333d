"""PyTorch on mpiallreduce (``import mpiallreduce.torch as mt``), with the names Horovod and torch users know.

    import mpiallreduce.torch as hvd                       # a horovod.torch script, one line changed
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    loss.backward(); optimizer.step()          # step() uses gradients averaged over the ranks
    mean = hvd.allreduce(torch.tensor([val]))          # a new tensor: the mean (Horovod's default)
    hvd.allreduce_(metrics, op=hvd.Sum)                # in place, the sum
    hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()

    mt.init_process_group()                            # or keep torch's DistributedDataParallel
    ddp = DistributedDataParallel(model)               # and reduce its buckets here:
    ddp.register_comm_hook(mt.HookState(), mt.allreduce_hook)   # fp16_/bf16_compress_hook, reproducible_hook

The pieces: tensors seen as numpy or CuPy arrays without copies (training/torch_tensors.py),
DistributedOptimizer and the broadcasts (training/torch_optimizer.py), the rest of Horovod's API
(training/horovod.py, which says where it differs from Horovod), DDP's comm hooks
(training/ddp_hooks.py). Call ``mpiallreduce.select_gpu()`` first and put the model on
``torch.cuda.current_device()`` for CUDA tensors. torch stays optional: importing this module
needs it, the rest of the package does not.
"""

from .ddp_hooks import (
    HookState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    init_process_group,
    reproducible_hook,
)
from .horovod import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    broadcast,
    broadcast_,
    broadcast_object,
    cuda_built,
    gloo_built,
    init,
    is_initialized,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    shutdown,
    synchronize,
)
from .torch_optimizer import (
    Compression,
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .torch_tensors import local_rank, local_size, rank, size

__all__ = [
    "DistributedOptimizer",
    "Compression",
    "broadcast_parameters",
    "broadcast_optimizer_state",
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
    "init",
    "shutdown",
    "is_initialized",
    "Average",
    "Sum",
    "Min",
    "Max",
    "Product",
    "Adasum",
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
    "HookState",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "reproducible_hook",
    "init_process_group",
]
