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
decides it by hand (ranks may differ); PyTorch's own threads are not counted
(torch.set_num_threads, which train_bench sets to the cores per rank). Where no rank overlaps,
GradientSync's ``wait()`` reduces the last bucket's fused buffer (which carries the step's digest)
first: once every rank agreed on the step, the large gradients are reduced in place.
"""

from ..core.gather import gather_from_ranks
from ..core.machine import cpu_set, machine_id, share_of_cores

__all__ = ["overlap_with_backward", "untimed", "SPARE_CORES"]

#: the cores a rank needs to itself for background reductions to pay
SPARE_CORES = 2


def overlap_with_backward(comm, asked=None, timeout=None):
    """(whether this rank overlaps: ``asked``, else whether it has a core to spare; whether no rank
    of ``comm`` overlaps; whether its ranks span nodes). Collective: every rank says what it has
    and what it was asked."""
    everyone = gather_from_ranks(comm, (machine_id(), cpu_set(), asked), timeout)
    decided = [
        bool(theirs)
        if theirs is not None
        else share_of_cores((machine, cores), [e[:2] for e in everyone]) >= SPARE_CORES
        for machine, cores, theirs in everyone
    ]
    from ..core.state import state_of  # (its topology: emulated nodes share a machine, not a node)

    return decided[comm.Get_rank()], not any(decided), state_of(comm).make_ready().spans_nodes


def untimed(timeout):
    """Whether GradientSync's calls wait for ever (no ``timeout``, and none in the settings:
    MPIALLREDUCE_TIMEOUT): only then are large gradients reduced where they lie once the ranks
    agreed, since a timed call could give up after the agreement, with some reduced."""
    from ..core.settings import settings

    return timeout is None and settings().timeout is None
