"""How a plan's device arrays travel (a name from mpiallreduce.device.transports: through a
CUDA-aware MPI, staged through host memory, a round trip...), for the algorithm the planner chose,
and what a timed call changes of it: MPI's nonblocking collectives (mpiallreduce.faults.bounded)
on host memory.
"""

__all__ = ["device_path_for"]


def device_path_for(chosen, facts, timed, reason):
    """(path, reason) for device arrays reduced by ``chosen`` on a communicator of ``facts``
    (``timed``: the call has a timeout; ``reason``: the plan's, to which a change is added)."""
    from ..device.transports import device_path

    path = device_path(chosen, facts.cuda_aware)
    if timed and path == "cuda-aware" and chosen.bounded_collectives:
        # (a timed call posts MPI's collectives in their nonblocking forms, faults.bounded,
        # which Open MPI does not take on device buffers: a round trip through host memory)
        path = "host round trip"
        reason += "; timed: MPI's nonblocking collectives on host memory (a round trip)"
    return path, reason
