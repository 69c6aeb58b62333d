"""Identical replicas: give every rank one rank's arrays, and check that every rank's are the same.

    broadcast_parameters(params, root=0)   # before the first step: every replica starts alike
    check_replicas(params)                  # ValueError on every rank, naming the array, unless
                                            # identical

Both take a list of arrays or a dict {name: array} (numpy or CuPy) and first compare every rank's
names, shapes and dtypes (else the same ValueError on every rank).
"""

import numpy as np
from mpi4py import MPI

from ..core.buffers import mpi_datatype
from ..core.consistency import content_digest, describe_differences
from ..core.gather import gather_from_ranks
from ..device.arrays import namespace, synchronize

__all__ = ["broadcast_parameters", "check_replicas"]


def _named(arrays):
    """[(name, array)] in an order every rank agrees on: dict keys sorted, list positions."""
    if isinstance(arrays, dict):
        return sorted(arrays.items())
    return [(str(i), a) for i, a in enumerate(arrays)]


def _agree_on_layout(comm, named, what):
    layout = {"names": [name for name, _ in named]}
    layout.update((name, (tuple(a.shape), str(a.dtype))) for name, a in named)
    differences = describe_differences(gather_from_ranks(comm, layout))
    if differences:
        raise ValueError(f"{what}: the ranks hold different arrays:\n  " + "\n  ".join(differences))


def broadcast_parameters(arrays, root=0, comm=None):
    """Copy rank ``root``'s arrays (a list, or a dict by name) into every rank's, in place.

    The ranks first agree that they hold the same names, shapes and dtypes (else ValueError on all).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    named = _named(arrays)
    _agree_on_layout(comm, named, "broadcast_parameters")
    for _, array in named:
        xp = namespace(array)
        if xp is not None:  # device memory: through the host (parameters are broadcast once)
            host = xp.asnumpy(array)
            comm.Bcast([host.reshape(-1), mpi_datatype(array.dtype)], root=root)
            xp.copyto(array, xp.asarray(host))
            synchronize(xp)
            continue
        buffer = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        comm.Bcast([buffer.reshape(-1), mpi_datatype(array.dtype)], root=root)
        if buffer is not array:
            np.copyto(array, buffer)
    return arrays


def check_replicas(arrays, comm=None):
    """Raise ValueError on every rank, naming the ranks and the first array that differs, unless
    every rank's arrays (a list, or a dict by name) are bitwise identical."""
    comm = MPI.COMM_WORLD if comm is None else comm
    named = _named(arrays)
    _agree_on_layout(comm, named, "check_replicas")
    digests = [f"{content_digest(a):016x}" for _, a in named]
    everyone = gather_from_ranks(comm, digests)
    for index, (name, _) in enumerate(named):
        groups = {}
        for rank, rank_digests in enumerate(everyone):
            groups.setdefault(rank_digests[index], []).append(rank)
        if len(groups) > 1:
            parts = "; ".join(f"ranks {ranks} hold {digest}" for digest, ranks in groups.items())
            raise ValueError(
                f"replicas differ: array {name!r} is not the same on every rank ({parts})"
            )
