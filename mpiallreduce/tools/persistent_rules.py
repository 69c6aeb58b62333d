"""Where a prepared call of MPI's own allreduce is a persistent request: measured per size by
``tune``.

    each size and mode:   mpi:persistent   MPI_Allreduce_init once; MPI_Start + MPI_Wait each run
                          mpi:blocking     MPI_Allreduce each run
    both prepared calls of ours, timed by bench's compare (interleaved; the slowest rank's median of
    the repetitions; results checked), in each of tune's runs; per size the median of the runs'

The rules (mpiallreduce.core.tuning.rules_from_measurements, the blocking call as "mpi"): persistent
where it is faster than the blocking call by more than PREFER_MPI_WITHIN, so that one noisy run
cannot flip a size. ``tune`` writes them into the table's ``persistent_by_ranks`` sections (on
ranks that span nodes ``persistent_by_nodes``), which the planner reads
(mpiallreduce.core.tuning.choose_persistent).
"""

import statistics

from ..core.tuning import PERSISTENT, rules_from_measurements
from .bench import compare
from .bench.contenders import BASELINE, OURS_BLOCKING

__all__ = ["persistent_rules"]


def persistent_rules(comm, sizes, modes=(False, True), repetitions=5, runs=3):
    """({in_place: rules} for each of ``modes``, {in_place: {nbytes: (persistent us, blocking
    us)}}), collective: every rank passes the same arguments and gets the same result."""
    times = {}
    for _ in range(max(1, runs)):
        for m in compare(
            comm,
            sizes,
            [PERSISTENT, OURS_BLOCKING],
            "float32",
            "sum",
            repetitions,
            modes,
            forced=(),
        ):
            if m.algorithm != BASELINE:
                times.setdefault((m.in_place, m.nbytes, m.algorithm), []).append(m.time_us)
    medians = {key: statistics.median(values) for key, values in times.items()}
    rules, measured = {}, {}
    for in_place in modes:
        mine = {
            (nbytes, name): t for (mode, nbytes, name), t in medians.items() if mode == in_place
        }
        rules[in_place] = rules_from_measurements(
            [
                (nbytes, "mpi" if name == OURS_BLOCKING else name, t)
                for (nbytes, name), t in mine.items()
            ]
        )
        measured[in_place] = {
            nbytes: (mine[nbytes, PERSISTENT], mine[nbytes, OURS_BLOCKING])
            for nbytes, name in mine
            if name == PERSISTENT
        }
    return rules, measured
