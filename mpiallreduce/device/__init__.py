"""The device layer: device (CuPy) arrays, which GPU a node-local rank uses, whether MPI takes
device pointers (``arrays``), and how device memory travels between ranks (``transports``). The
device-only algorithms (device_to_device, staged_ring) live with the others in
mpiallreduce.algorithms; ``mpiallreduce.select_gpu``, which asks a communicator's state for the
node-local rank, in mpiallreduce.core.node_rank, above."""

from .arrays import *  # noqa: F401,F403
from .arrays import __all__  # noqa: F401
