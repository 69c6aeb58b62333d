"""``mpiallreduce bench``: our algorithms against Open MPI's MPI_Allreduce, side by side, in one
run.

One driver owns sizes, buffers, warm-up, timing, correctness and the tables; each contender is a
small adapter (a function that performs one allreduce of ``send`` into ``out``), as in nccl-tests.

Contenders: ``openmpi`` (a direct mpi4py ``comm.Allreduce``: Open MPI's default choice), each of
Open MPI's six tuned algorithms forced in turn (``openmpi:ring`` ...; see openmpi_tuned.py), and our
algorithms through ``mpiallreduce.allreduce``.

``--device gpu``: the buffers are CuPy arrays on each rank's GPU (``select_gpu``). ``openmpi`` is
then MPI_Allreduce on the device pointers where the MPI is CUDA-aware, else a host round trip
(device to pinned host buffers allocated once, MPI_Allreduce, back: what Open MPI's coll/cuda does,
minus its per-call malloc). The reference reported is the GPU's device-to-device copy bandwidth.
``--device fake-gpu`` runs the same code on mpiallreduce.testing.fake_cupy (for tests).

Timing: for each size and mode (out of place, in place), repetitions of the contenders are
interleaved (A B C A B C ...) so that a drift in the machine's speed hits all of them alike. One
repetition is ``iterations`` back-to-back calls between barriers (about 20 ms, sized from the
fastest of 3 single calls of Open MPI's default); its time per call is the slowest rank's. After
the least number of rounds (--repetitions), the contenders whose middle half of repetitions
(first to third quartile) is wider than 10% of their median are repeated again, each round with
Open MPI's default, up to --max-repetitions (timing.settled). The figure reported is the median;
its middle half is kept too, and a gain is noise where the middle halves of the two overlap
(report.within_noise). Every contender's result is compared
bitwise with MPI_Allreduce's and the wrong elements counted (the data are small integers, so every
summation order gives the same bits).

The package: driver.py (the command), timing.py (buffers, warm-up, timing, the wrong-element count),
limits.py (the copy and link bandwidths measured in the run), contenders.py (the adapters; Open
MPI's are algorithms/mpi.py and mpiallreduce.transports, as ours), report.py (tables and files),
metadata.py (what a result needs to be read later).
"""

from .contenders import (
    BASELINE,
    DEVICE_ALGORITHMS,
    FORCED_PREFIX,
    DeviceMemory,
    HostMemory,
    device_memory,
)
from .driver import (
    DEFAULT_SIZES,
    Measurement,
    compare,
    count_wrong,
    device_copy_bandwidth,
    main,
    memory_copy_bandwidth,
)
from .metadata import run_metadata
from .report import format_field_table, format_gain_table, gain_rows, write_results

__all__ = [
    "BASELINE",
    "FORCED_PREFIX",
    "DEVICE_ALGORITHMS",
    "HostMemory",
    "DeviceMemory",
    "device_memory",
    "DEFAULT_SIZES",
    "Measurement",
    "compare",
    "count_wrong",
    "memory_copy_bandwidth",
    "device_copy_bandwidth",
    "main",
    "run_metadata",
    "format_field_table",
    "format_gain_table",
    "gain_rows",
    "write_results",
]
