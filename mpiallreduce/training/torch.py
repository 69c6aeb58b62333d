"""PyTorch on mpiallreduce (``import mpiallreduce.torch as mt``), with the names Horovod and torch
users know.

    import mpiallreduce.torch as hvd                   # a horovod.torch script, one line changed
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    loss.backward(); optimizer.step()          # step() uses gradients averaged over the ranks
    mean = hvd.allreduce(torch.tensor([val]))          # a new tensor: the mean (Horovod's default)
    hvd.allreduce_(metrics, op=hvd.Sum)                # in place, the sum
    hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()

    mt.init_process_group()                            # or keep torch's DistributedDataParallel
    ddp = DistributedDataParallel(model)               # and reduce its buckets here:
    ddp.register_comm_hook(mt.HookState(), mt.allreduce_hook)   # fp16_/bf16_compress_hook,
                                                                # reproducible_hook

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
from .horovod import *  # noqa: F403 - Horovod's names, as mpiallreduce.torch's
from .horovod import __all__ as _horovod_names

__all__ = [
    *_horovod_names,
    "HookState",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "reproducible_hook",
    "init_process_group",
]
