"""A rank's place on its node, and the GPU that place gives it (``mar.select_gpu``).

    local_rank(comm)   the launcher's word (no communication), else the rank in the node
                       communicator of the library's duplicate of ``comm`` (collective)
    select_gpu(comm)   GPU = node-local rank % visible GPUs, made current

Above the communicator's state (core.state), which the collective answer needs; the device layer
below keeps what needs no communicator (device.arrays: launcher_local_rank, gpu_for_local_rank,
visible_gpus).
"""

from mpi4py import MPI

from ..device.arrays import gpu_for_local_rank, launcher_local_rank, visible_gpus
from .state import state_of
from .topology import node_communicator

__all__ = ["local_rank", "select_gpu"]


def local_rank(comm=None):
    """This process's rank among the processes of its node.

    With ``comm``: its rank in ``comm``'s node communicator (collective over ``comm``). Without:
    what the launcher says (mpiexec, srun; no communication), else COMM_WORLD's node communicator.
    """
    if comm is None:
        declared = launcher_local_rank()
        if declared is not None:
            return declared
    comm = MPI.COMM_WORLD if comm is None else comm
    return node_communicator(state_of(comm).make_ready().library).Get_rank()


def select_gpu(comm=None, xp=None):
    """Make this rank's GPU current (``cupy.cuda.Device(i).use()``) and return its index.

    Call it once, first thing, before creating device arrays. The GPU is the node-local rank modulo
    the number of visible devices; CUDA numbers only the devices in CUDA_VISIBLE_DEVICES, so a
    scheduler's binding (``srun --gpus-per-task``, ``--gpu-bind``) is respected as it is.
    """
    xp, count = visible_gpus(xp)
    index = gpu_for_local_rank(local_rank(comm), count)
    xp.cuda.Device(index).use()
    return index
