"""What a timed call (``timeout``) runs in place of an algorithm whose end no timeout can bound and
no agreement can take back (``Algorithm.unbounded_when_timed``: single_copy, device_to_device).
Where a timed call's plan would first grow a shared window, the planner's ``without_set_up`` plans
the ring instead (it plans again: mpiallreduce.core.planner).
"""

from ..algorithms import REGISTRY
from .tuning import choose_on_device

__all__ = ["timed_instead"]


def timed_instead(chosen, facts, nbytes, reason):
    """(algorithm, reason) a timed call runs in place of ``chosen``, one whose end no timeout can
    bound and no agreement can take back (``Algorithm.unbounded_when_timed``): single_copy writes
    straight into every peer's array, so a peer that gave up would find its array written after
    it raised; device_to_device maps the peers' memory, which a peer that gave up may free. A
    timed call keeps its result from the user's array until every rank's part is done
    (mpiallreduce.faults.outcome), so it runs ``shared_memory`` on symmetric arrays (the same bits:
    each slice reduced in rank order) and, on device arrays, the table's choice across nodes
    (messages through the call's watch)."""
    if chosen.memory == "host":
        name = "shared_memory"
        why = "single_copy writes into the peers' arrays before the ranks agree on the call's end"
    else:
        name, _ = choose_on_device(nbytes, True, facts.cuda_aware, REGISTRY)
        why = f"{chosen.name} maps the peers' memory, which a rank that gave up may free"
    return REGISTRY[name], f"{reason}; timed: {name} instead, since {why}"
