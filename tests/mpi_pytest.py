"""Entry point that every rank runs under mpiexec:
``mpiexec -n N python tests/mpi_pytest.py [pytest args]``.

MPI starts before pytest. Only rank 0 prints pytest's report; the other ranks' failures reach it
through the verdict agreement in ``mpi_verdicts.py`` (and their stderr still shows).
"""

import os
import sys

import pytest
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    sys.path.insert(0, HERE)  # so that -p mpi_verdicts finds the plugin
    if MPI.COMM_WORLD.Get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (stdout for the rest of the run)
    args = [
        "--with-mpi",
        "-p",
        "mpi_verdicts",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        os.path.dirname(HERE),
        "--timeout-method=thread",
    ]  # a signal cannot interrupt a rank blocked inside MPI
    given = [a for a in sys.argv[1:] if a.startswith("--timeout=")]
    if given and MPI.COMM_WORLD.Get_rank() != 0:
        # A test in which every rank hangs is ended by pytest-timeout on the first rank whose timer
        # fires, and only rank 0 prints (its stacks, "Timeout"): give the others 3 s more, so that
        # rank 0's comes first and the reader sees it.
        args_tail = sys.argv[1:] + [f"--timeout={float(given[-1].split('=', 1)[1]) + 3:g}"]
    else:
        args_tail = sys.argv[1:]
    sys.exit(pytest.main(args + args_tail))
