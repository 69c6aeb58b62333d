"""Test layout.

tests/*.py        run in one ordinary process (``make test``); they start every MPI run themselves,
                  each under a timeout, through mpiallreduce.launch.
tests/mpi/        run on every rank under mpiexec (tests/mpi_pytest.py), 1..5 ranks.
tests/mpi_faults/ tests that fail on purpose, run only by tests/test_under_mpiexec.py.
"""

import sys

import mpi4py

if "mpi4py.MPI" not in sys.modules:
    # The driver process only plans and launches: it must not become an MPI singleton itself.
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False

MPI_ONLY_DIRECTORIES = {"mpi", "mpi_faults"}


def pytest_ignore_collect(collection_path, config):
    if collection_path.name in MPI_ONLY_DIRECTORIES and not config.getoption("with_mpi", False):
        return True
    return None
