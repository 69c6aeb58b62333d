"""What a plain call of each algorithm costs over a prepared one, against the same for MPI's own.

A plain call of MPI's own allreduce runs the compiled short path (mpiallreduce.core.compiled); a
plain call of any other algorithm goes through the Python path, and pays there for what a
prepared call did once: the plan's lookup, the call's checks, the signature (which `shared_memory`
carries in its barrier). ``tune`` keeps MPI's own wherever another algorithm gains less than this
price (mpiallreduce.core.tuning.rules_from_measurements), so that a plain call does not lose where
a prepared one would gain a little.

    algorithm X, mode m:  price = (plain X - prepared X) - (plain mpi - prepared mpi)
                          at PRICE_BYTES

(prepared mpi: the blocking call, as a plain call of it is, wherever the table would make a
prepared one a persistent request: tune's contender mpi:blocking)

each time `bench`'s (the slowest rank's, the median of interleaved repetitions: its contenders X
and X:plain), in each of ``runs`` runs; the price is the median of the runs'.
"""

import statistics

from ..algorithms import HOST_ALGORITHMS
from .bench import compare
from .bench.contenders import OURS_BLOCKING, PLAIN

__all__ = ["PRICE_BYTES", "plain_call_prices_us"]

#: the size calls are priced at (float32 elements)
PRICE_BYTES = 4096


def plain_call_prices_us(comm, algorithms, modes=(False, True), repetitions=5, runs=3):
    """{(in_place, algorithm): its plain call's price in us (see above), at least 0} for each of
    ``algorithms`` that runs on any numpy arrays (HOST_ALGORITHMS; not MPI's own) in each of
    ``modes`` (collective: every rank passes the same arguments), and {the same key: (lowest,
    highest) of the runs' prices}."""
    names = [name for name in algorithms if name != "mpi" and name in HOST_ALGORITHMS]
    per_run = {}
    for _ in range(max(1, runs)):
        took = {
            (m.in_place, m.algorithm): m.time_us
            for m in compare(
                comm,
                [PRICE_BYTES],
                names + [OURS_BLOCKING] + [name + PLAIN for name in names + ["mpi"]],
                "float32",
                "sum",
                repetitions,
                modes,
                forced=(),
            )
        }
        for in_place in modes:
            own = took[in_place, "mpi" + PLAIN] - took[in_place, OURS_BLOCKING]
            for name in names:
                per_run.setdefault((in_place, name), []).append(
                    took[in_place, name + PLAIN] - took[in_place, name] - own
                )
    prices = {key: max(0.0, statistics.median(values)) for key, values in per_run.items()}
    return prices, {key: (min(values), max(values)) for key, values in per_run.items()}
