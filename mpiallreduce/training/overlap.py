"""Whether GradientSync reduces buckets in the background during backward, or all at ``wait()``.

    a core to spare (2 or more per rank)     one core per rank (or less)
    main:   backward ─────────────┐          main: backward ──────── wait: b0 b1 b2 ── step
    worker:   b0 ─── b1 ─── b2 ───┴─ step          (no worker: each bucket here, in turn)

Overlap hides a bucket's allreduce behind the rest of backward only if something runs it while
backward computes: a core that backward does not use. Where the rank has one core, the worker
thread takes it from backward (Open MPI's waits poll, so a waiting reduction burns the core),
every bucket pays a hand-off between threads, and the step gets slower, not faster (measured in
docs/training.md). So buckets are reduced in the background only where the rank has at least
two cores to itself (mpiallreduce.core.machine.cores_per_rank: its CPU affinity, shared with the
ranks of its machine that may run on the same cores). ``GradientSync(overlap=True/False)``
decides it by hand; PyTorch's own threads are not counted (torch.set_num_threads, which
train_bench sets to the cores per rank).
"""
from ..core.machine import cores_per_rank

__all__ = ["overlap_with_backward", "SPARE_CORES"]

#: the cores a rank needs to itself for background reductions to pay
SPARE_CORES = 2


def overlap_with_backward(comm, timeout=None):
    """Whether this rank has a core to spare for reductions while backward runs (collective)."""
    return cores_per_rank(comm, timeout) >= SPARE_CORES
