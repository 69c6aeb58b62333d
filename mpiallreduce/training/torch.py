"""PyTorch on mpiallreduce, with the names Horovod and torch users know.

    import mpiallreduce.torch as mt
    optimizer = mt.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    mt.broadcast_parameters(model.state_dict(), root=0)
    mt.broadcast_optimizer_state(optimizer, root=0)
    loss.backward(); optimizer.step()          # step() uses gradients averaged over the ranks
    total = mt.allreduce(torch.tensor([n_correct]))   # a new tensor: the sum over the ranks
    mt.allreduce_(metrics, op="mean")                 # in place, as Horovod's allreduce_
    mt.rank(), mt.size(), mt.local_rank(), mt.local_size()

Each parameter's gradient is handed to a GradientSync bucket from a post-accumulate-grad hook while
backward is still running; the buckets are fixed from ``named_parameters`` (as DDP's), so full
buckets are allreduced in the background during backward, whatever order the hooks fire in.
Tensors are shared, not copied: CPU tensors with numpy (``Tensor.numpy()``), CUDA tensors with
CuPy through DLPack (``cupy.from_dlpack``, which orders CuPy's stream after torch's with an event:
no host synchronization per gradient), so the same code serves both. bfloat16 gradients (which
neither numpy nor CuPy's DLPack takes) are widened to float32 by torch, reduced, and rounded back
once. ``step()`` waits for the buckets and for CuPy's stream (once a step).
Call ``mpiallreduce.select_gpu()`` first and put the model on ``torch.cuda.current_device()``.
torch stays optional: importing this module needs it, the rest of the package does not.
"""
import numpy as np
import torch
from mpi4py import MPI

from .gradients import GradientSpec, GradientSync
from .gradients import broadcast_parameters as _broadcast_arrays

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "allreduce", "allreduce_",
           "rank", "size", "local_rank", "local_size"]


def _as_array(tensor):
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


def _as_tensor(array, like):
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


def _op_for(tensor, op, options):
    """The op a tensor is reduced with: ``op``, or for a CUDA bfloat16 tensor's words its
    Bfloat16Bits (mpiallreduce.core.ops)."""
    if tensor.dtype != torch.bfloat16 or tensor.device.type != "cuda":
        return op
    if options.get("reproducible"):
        raise TypeError("reproducible sums of CUDA bfloat16 tensors are not supported; reduce a float32 copy")
    from ..core.ops import Bfloat16Bits, get_op
    return Bfloat16Bits(get_op(op))


def allreduce(tensor, op="sum", algorithm="auto", comm=None, **options):
    """``tensor`` (CPU or CUDA) reduced over the ranks, as a new tensor on its device (the input is
    left as it is). ``op``, ``algorithm``, ``comm`` and the other keywords (check, timeout, axis,
    mesh, groups) as ``mpiallreduce.allreduce``: "sum" by default, as torch.distributed's; Horovod's
    ``hvd.allreduce`` averages by default, here that is ``op="mean"``. CPU tensors travel through
    numpy and CUDA tensors through CuPy (DLPack), without copies; what requires grad is detached."""
    from ..api import allreduce as reduce_array
    return _as_tensor(reduce_array(_as_array(tensor), op=_op_for(tensor, op, options), algorithm=algorithm, comm=comm,
                                   **options), tensor)


def allreduce_(tensor, op="sum", algorithm="auto", comm=None, **options):
    """``tensor`` reduced over the ranks in place (Horovod's ``allreduce_``, torch.distributed's
    ``all_reduce``); returns it. Keywords as :func:`allreduce`."""
    from ..api import allreduce as reduce_array
    array = _as_array(tensor)
    reduce_array(array, op=_op_for(tensor, op, options), algorithm=algorithm, comm=comm, out=array, **options)
    if tensor.device.type == "cuda":
        import cupy
        cupy.cuda.get_current_stream().synchronize()
    return tensor


def rank():
    """This process's rank in COMM_WORLD (Horovod's ``hvd.rank()``)."""
    return MPI.COMM_WORLD.Get_rank()


def size():
    """The number of ranks in COMM_WORLD (``hvd.size()``)."""
    return MPI.COMM_WORLD.Get_size()


def local_rank():
    """This process's rank among the ranks of its node (``hvd.local_rank()``), 0..local_size()-1:
    as the launcher numbers them (Open MPI's need not follow the world ranks' order), else from
    the node communicator (collective over COMM_WORLD the first time)."""
    from ..device.arrays import local_rank as node_local_rank
    return node_local_rank()


def local_size():
    """The number of ranks on this process's node (``hvd.local_size()``; collective over COMM_WORLD
    the first time)."""
    from ..core.state import state_of
    from ..core.topology import node_communicator
    return node_communicator(state_of(MPI.COMM_WORLD).make_ready().library).Get_size()


class DistributedOptimizer:
    """Wraps ``optimizer``: gradients are averaged (or summed) over the ranks before ``step()``.

    Args:
        optimizer: any torch optimizer.
        named_parameters: ``model.named_parameters()``: the parameters whose gradients to
            synchronize; their buckets are fixed from these, in reverse order (collective: the
            ranks compare names, shapes and dtypes here).
        find_unused: a parameter that got no gradient on this rank in a step (a branch not taken
            here) counts as zeros here, and gets the other ranks' mean (DDP's
            ``find_unused_parameters``); without it, that is a ValueError on every rank.
        compression: None, "fp16" or "bf16": gradients travel in 16 bits, summed in float32.
        reproducible: True: the same bits whatever the bucket size, algorithm or rank order
            (mpiallreduce.reproducible).
        comm, bucket_bytes, op, algorithm, prescale, postscale, timeout: as GradientSync.
    """

    def __init__(self, optimizer, named_parameters, comm=None, bucket_bytes=25 * 2**20, op="mean",
                 algorithm="auto", prescale=1.0, postscale=1.0, timeout=None, find_unused=False, compression=None,
                 reproducible=False):
        self.optimizer = optimizer
        self.named_parameters = [(name, p) for name, p in named_parameters if p.requires_grad]
        self._options = dict(bucket_bytes=bucket_bytes, op=op, algorithm=algorithm, prescale=prescale,
                             postscale=postscale, timeout=timeout, find_unused=find_unused, compression=compression,
                             reproducible=reproducible)
        self.rebind(MPI.COMM_WORLD if comm is None else comm)
        self.parameters = [p for _, p in self.named_parameters]
        self._widened = {}  # name -> (parameter, its bfloat16 gradient widened to float32), this step
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(name)) for name, p in self.named_parameters]

    def rebind(self, comm):
        """Synchronize over ``comm`` from now on (a survivors' communicator after a rank failure;
        collective over it)."""
        specs = {name: GradientSpec(tuple(p.shape), _numpy_dtype(p.dtype), p.is_cuda) for name, p in self.named_parameters}
        self.sync = GradientSync(comm=comm, parameters=specs, **self._options)

    def _hook(self, name):
        def ready(parameter):
            if self.sync.in_no_sync:  # (gradients only accumulate: nothing to widen or hand over)
                return
            grad = parameter.grad
            if grad.dtype == torch.bfloat16:
                grad = grad.float()  # (on torch's stream; rounded back once at step())
                self._widened[name] = (parameter, grad)
            self.sync.ready(_as_array(grad), name=name)
        return ready

    def no_sync(self):
        """``with optimizer.no_sync():`` backward passes accumulate gradients locally (DDP's
        ``no_sync``); the first backward outside it reduces the accumulated gradients once."""
        return self.sync.no_sync()

    def synchronize(self):
        """Wait for every bucket; gradients then hold the mean over the ranks."""
        unused = self.sync.wait()
        widened, self._widened = self._widened, {}
        cuda = any(p.is_cuda for p in self.parameters)
        if cuda:
            import cupy
            cupy.cuda.get_current_stream().synchronize()  # the write-backs, before torch's step reads them (once a step)
        with torch.no_grad():
            for parameter, wide in widened.values():
                parameter.grad.copy_(wide)
            by_name = dict(self.named_parameters)
            for name, result in unused.items():  # a parameter unused here: the other ranks' gradients
                parameter = by_name[name]
                grad = _as_tensor(result, parameter).to(parameter.dtype)
                if parameter.grad is None:
                    parameter.grad = grad
                else:
                    parameter.grad.copy_(grad)

    def step(self, closure=None):
        self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    @property
    def param_groups(self):
        return self.optimizer.param_groups


def _numpy_dtype(dtype):
    """The numpy dtype a gradient of torch ``dtype`` reaches GradientSync as (bfloat16: widened)."""
    if dtype == torch.bfloat16:
        return np.dtype(np.float32)
    return torch.empty(0, dtype=dtype).numpy().dtype


def broadcast_parameters(state_dict, root=0, comm=None):
    """Copy rank ``root``'s tensors (a ``state_dict()`` or a list of tensors) into every rank's, in place."""
    if isinstance(state_dict, dict):
        arrays = {name: _as_array(t) for name, t in state_dict.items() if isinstance(t, torch.Tensor)}
    else:
        arrays = [_as_array(t) for t in state_dict]
    _broadcast_arrays(arrays, root=root, comm=comm)
    return state_dict


def broadcast_optimizer_state(optimizer, root=0, comm=None):
    """Give every rank rank ``root``'s optimizer state (moments, step counts, hyper-parameters)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    state = comm.bcast(inner.state_dict() if comm.Get_rank() == root else None, root=root)
    if comm.Get_rank() != root:
        inner.load_state_dict(state)
    return optimizer
