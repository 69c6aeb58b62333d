"""Run under mpiexec with MPIALLREDUCE_CHECK=1: mismatched shapes must raise ValueError on every
rank."""

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

comm = MPI.COMM_WORLD
x = np.ones(4 + (comm.Get_rank() == comm.Get_size() - 1), dtype=np.float64)
try:
    mar.allreduce(x, algorithm="ring")
except ValueError as exc:
    print(
        f"rank {comm.Get_rank()} raised ValueError: {str(exc).splitlines()[-1].strip()}", flush=True
    )
else:
    print(f"rank {comm.Get_rank()} raised nothing", flush=True)
total = mar.allreduce(np.ones(3), algorithm="ring")
print(f"rank {comm.Get_rank()} next call gave {total.tolist()}", flush=True)
