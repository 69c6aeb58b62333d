"""mpiallreduce: allreduce for numpy arrays over MPI, MPI_Allreduce and hand-written algorithms side by side.

    import mpiallreduce as mar
    total = mar.allreduce(x)                       # sum over all ranks of COMM_WORLD
    mar.allreduce(g, op="mean", out=g)             # in place
    mar.allreduce(x, algorithm="ring", comm=sub)   # a chosen algorithm on a sub-communicator
"""
__version__ = "0.1.0"

from .algorithms import ALGORITHMS  # noqa: E402
from .api import allreduce, pmax, pmean, pmin, psum  # noqa: E402
from .asynchronous import allreduce_async  # noqa: E402
from .gradients import GradientSync, broadcast_parameters, check_replicas  # noqa: E402
from .mesh import Mesh  # noqa: E402
from .ops import OPS  # noqa: E402

__all__ = ["allreduce", "allreduce_async", "GradientSync", "broadcast_parameters", "check_replicas", "psum", "pmean", "pmax", "pmin", "Mesh", "ALGORITHMS", "OPS", "__version__"]
