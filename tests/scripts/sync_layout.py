"""GradientSync where no rank overlaps, untimed: a 256 KiB gradient is copied into its bucket, on
one node (a symmetric buffer: single copy) and across nodes (a message there costs more than the
copy); a 2 MiB one is reduced on its own. Prints ``rank R direct|fused <large fused?> ok`` once the
means match a reference computed here from the formula."""

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
shapes = {
    "small": (300,),
    "medium": (256, 256),
    "large": (1 << 19,),
}  # 1.2 KiB, 256 KiB, 2 MiB of float32


def gradient(name, r):
    n = int(np.prod(shapes[name]))
    return (
        ((np.arange(n, dtype=np.float64) % 97) * (r + 1) + len(name))
        .astype(np.float32)
        .reshape(shapes[name])
    )


sync = mar.GradientSync(
    comm=comm,
    parameters={name: np.empty(s, np.float32) for name, s in shapes.items()},
    overlap=False,
)
grads = {name: gradient(name, rank) for name in shapes}
for name, grad in grads.items():
    sync.ready(grad, name=name)
sync.wait()
for (
    name,
    grad,
) in grads.items():  # (every addend is an integer below 2**24: exact in float32, in any order)
    expected = sum(gradient(name, r).astype(np.float64) for r in range(size)) / size
    assert np.array_equal(grad, expected.astype(np.float32)), name
fused = [name for bucket in sync._buckets for name in (sync._slots[i].name for i in bucket.fused)]
print(f"rank {rank} {'fused' if 'medium' in fused else 'direct'} {'large' in fused} ok", flush=True)
