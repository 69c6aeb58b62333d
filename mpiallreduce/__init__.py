"""mpiallreduce: allreduce for numpy arrays over MPI, MPI_Allreduce and hand-written algorithms side by side.

    import mpiallreduce as mar
    total = mar.allreduce(x)                       # sum over all ranks of COMM_WORLD
    mar.allreduce(g, op="mean", out=g)             # in place
    mar.allreduce(x, algorithm="ring", comm=sub)   # a chosen algorithm on a sub-communicator

Names are loaded on first use, so that ``import mpiallreduce`` (the ``mpiallreduce launch`` command
among others) does not start MPI by itself; the first use of the API does.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "allreduce": ".api", "prepare": ".api", "PreparedAllreduce": ".api", "describe_call": ".api", "psum": ".api", "pmean": ".api", "pmax": ".api", "pmin": ".api",
    "allreduce_async": ".api",
    "GradientSync": ".gradients", "broadcast_parameters": ".gradients", "check_replicas": ".gradients",
    "Mesh": ".mesh",
    "ALGORITHMS": ".algorithms",
    "HOST_ALGORITHMS": ".algorithms",
    "select_gpu": ".device",
    "OPS": ".ops",
    "AllreduceTimeout": ".faults", "RankFailure": ".faults", "AllreduceStallWarning": ".faults",
    "AllreduceAborted": ".faults",
    "survivors": ".faults", "exit_after_rank_failures": ".faults",
    "abort_on_exception": ".aborting",
}

__all__ = list(_EXPORTS) + ["__version__"]

from .aborting import abort_on_exception_from_environment  # noqa: E402 (no MPI at import)

abort_on_exception_from_environment()


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mpiallreduce' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
