"""What a plain call of each algorithm costs over a prepared one, against the same for MPI's own.

A plain call of MPI's own allreduce runs the compiled short path (mpiallreduce.core.compiled); a
plain call of any other algorithm goes through the Python path, and pays there for what a
prepared call did once: the plan's lookup, the call's checks, the signature (which `shared_memory`
carries in its barrier). ``tune`` keeps MPI's own wherever another algorithm gains less than this
price (mpiallreduce.core.tuning.rules_from_measurements), so that a plain call does not lose where
a prepared one would gain a little.

    algorithm X, mode m:  price = (plain X - prepared X) - (plain mpi - prepared mpi)    at PRICE_BYTES

each the median of interleaved repetitions of a loop of calls, the largest over the ranks.
"""
import statistics
import time

import numpy as np
from mpi4py import MPI

from ..algorithms import HOST_ALGORITHMS
from ..api import allreduce, prepare
from ..core.planner import PERSISTENT_BELOW

__all__ = ["PRICE_BYTES", "plain_call_prices_us"]

#: the size calls are priced at: a prepared call of MPI's own runs MPI_Allreduce there, as a plain
#: one does (below PERSISTENT_BELOW it would be a persistent request, another call); float32 elements
PRICE_BYTES = -(-max(4096, PERSISTENT_BELOW) // 4) * 4


def plain_call_prices_us(comm, algorithms, modes=(False, True), calls=100, repetitions=5):
    """{(in_place, algorithm): its plain call's price in us (see above), at least 0} for each of
    ``algorithms`` that runs on any numpy arrays (HOST_ALGORITHMS; not MPI's own) in each of ``modes``
    (collective: every rank passes the same arguments). Returns ({key: price}, {key: (lowest,
    highest) over the repetitions and the ranks})."""
    names = [name for name in algorithms if name != "mpi" and name in HOST_ALGORITHMS]
    x = np.arange(PRICE_BYTES // 4, dtype=np.float32)
    prices, spreads = {}, {}
    for in_place in modes:
        out = np.zeros_like(x) if in_place else np.empty_like(x)  # (zeros: summed in place, they stay finite)
        send = out if in_place else x
        kinds = {}
        for name in names + ["mpi"]:
            kinds[name, "plain"] = lambda name=name: allreduce(send, out=out, algorithm=name, comm=comm)
            kinds[name, "prepared"] = prepare(send, out=out, algorithm=name, comm=comm)
        samples = {name: [] for name in names}
        for repetition in range(repetitions + 1):
            took = {}
            for key, call in kinds.items():
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                took[key] = (time.perf_counter() - start) / calls * 1e6
            if repetition:  # (the first: a warm-up)
                own = took["mpi", "plain"] - took["mpi", "prepared"]
                for name in names:
                    samples[name].append(took[name, "plain"] - took[name, "prepared"] - own)
        medians, highest = (np.array([f(samples[name]) for name in names]) for f in (statistics.median, max))
        lowest = np.array([min(samples[name]) for name in names])
        for values, op in ((medians, MPI.MAX), (highest, MPI.MAX), (lowest, MPI.MIN)):
            comm.Allreduce(MPI.IN_PLACE, values, op=op)
        for k, name in enumerate(names):
            prices[in_place, name] = max(0.0, float(medians[k]))
            spreads[in_place, name] = (float(lowest[k]), float(highest[k]))
    return prices, spreads
