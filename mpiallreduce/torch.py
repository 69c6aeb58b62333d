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
backward is still running, so full buckets are allreduced in the background during backward.
Tensors are shared, not copied: CPU tensors with numpy (``Tensor.numpy()``), CUDA tensors with
CuPy through DLPack (``cupy.from_dlpack``), so the same code serves both. For CUDA tensors, torch's
current stream is synchronized before CuPy reads a gradient, and CuPy's before ``step()`` runs.
Call ``mpiallreduce.select_gpu()`` first and put the model on ``torch.cuda.current_device()``.
torch stays optional: importing this module needs it, the rest of the package does not.
"""
import torch
from mpi4py import MPI

from .gradients import GradientSync
from .gradients import broadcast_parameters as _broadcast_arrays

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "allreduce", "allreduce_",
           "rank", "size", "local_rank", "local_size"]


def _as_array(tensor):
    """The tensor's memory as a numpy array (CPU) or a CuPy array (CUDA), shared, not copied."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.numpy()
    if tensor.device.type == "cuda":
        import cupy
        torch.cuda.current_stream(tensor.device).synchronize()  # what torch queued has been written
        return cupy.from_dlpack(tensor)
    raise TypeError(f"mpiallreduce.torch handles CPU and CUDA tensors; got one on {tensor.device}")


def _as_tensor(array, like):
    """A tensor sharing ``array``'s memory (numpy or CuPy), on ``like``'s device."""
    if like.device.type == "cpu":
        return torch.from_numpy(array)
    import cupy
    cupy.cuda.get_current_stream().synchronize()  # what CuPy queued has been written
    return torch.from_dlpack(array)


def allreduce(tensor, op="sum", algorithm="auto", comm=None, **options):
    """``tensor`` (CPU or CUDA) reduced over the ranks, as a new tensor on its device (the input is
    left as it is). ``op``, ``algorithm``, ``comm`` and the other keywords (check, timeout, axis,
    mesh, groups) as ``mpiallreduce.allreduce``: "sum" by default, as torch.distributed's; Horovod's
    ``hvd.allreduce`` averages by default, here that is ``op="mean"``. CPU tensors travel through
    numpy and CUDA tensors through CuPy (DLPack), without copies; what requires grad is detached."""
    from .api import allreduce as reduce_array
    return _as_tensor(reduce_array(_as_array(tensor), op=op, algorithm=algorithm, comm=comm, **options), tensor)


def allreduce_(tensor, op="sum", algorithm="auto", comm=None, **options):
    """``tensor`` reduced over the ranks in place (Horovod's ``allreduce_``, torch.distributed's
    ``all_reduce``); returns it. Keywords as :func:`allreduce`."""
    from .api import allreduce as reduce_array
    array = _as_array(tensor)
    reduce_array(array, op=op, algorithm=algorithm, comm=comm, out=array, **options)
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
    from .device import local_rank as node_local_rank
    return node_local_rank()


def local_size():
    """The number of ranks on this process's node (``hvd.local_size()``; collective over COMM_WORLD
    the first time)."""
    from .state import state_of
    from .topology import node_communicator
    return node_communicator(state_of(MPI.COMM_WORLD).make_ready().library).Get_size()


class DistributedOptimizer:
    """Wraps ``optimizer``: gradients are averaged (or summed) over the ranks before ``step()``.

    Args:
        optimizer: any torch optimizer.
        named_parameters: ``model.named_parameters()`` (the parameters whose gradients to synchronize).
        comm, bucket_bytes, op, algorithm, prescale, postscale, timeout: as GradientSync.
    """

    def __init__(self, optimizer, named_parameters, comm=None, bucket_bytes=25 * 2**20, op="mean",
                 algorithm="auto", prescale=1.0, postscale=1.0, timeout=None):
        self.optimizer = optimizer
        self.sync = GradientSync(comm=comm, bucket_bytes=bucket_bytes, op=op, algorithm=algorithm,
                                 prescale=prescale, postscale=postscale, timeout=timeout)
        self.parameters = [p for _, p in sorted(named_parameters, key=lambda item: item[0]) if p.requires_grad]
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self.parameters]

    def _ready(self, parameter):
        self.sync.ready(_as_array(parameter.grad))

    def synchronize(self):
        """Wait for every bucket; gradients then hold the mean over the ranks."""
        self.sync.wait()
        if any(p.grad is not None and p.grad.is_cuda for p in self.parameters):
            import cupy
            cupy.cuda.get_current_stream().synchronize()  # the write-backs, before torch's step reads them

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
