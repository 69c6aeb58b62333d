"""Checks that all ranks agree on before anyone enters the next collective.

A check that fails on one rank only and raises there leaves the other ranks waiting in the next
collective: a hang, not an error. Here each rank runs its checks locally, then all ranks exchange
the outcome (one small allgather) and every rank raises the same exception, naming the ranks and
what was wrong, or every rank goes on.
"""
__all__ = ["agree_on_call"]


def agree_on_call(comm, prepare, signature):
    """Run ``prepare()`` on every rank and make its outcome collective.

    Args:
        comm: the communicator whose ranks must agree (all of them call this).
        prepare: a callable validating this rank's arguments; it raises TypeError/ValueError if bad
            (any other exception is agreed on too, and re-raised as it is on its own rank).
        signature: a dict of what must be equal on every rank (shape, dtype, op, ...).

    Returns:
        what ``prepare()`` returned, once every rank has succeeded with equal signatures.

    Raises:
        TypeError or ValueError on every rank if any rank's ``prepare`` failed or signatures differ.
    """
    local_error = None
    prepared = None
    try:
        prepared = prepare()
    except Exception as exc:  # any exception: raised alone, it would leave the others in the allgather
        local_error = exc
    reports = comm.allgather(
        (None if local_error is None else (type(local_error).__name__, str(local_error)), signature)
    )
    failures = [(rank, error) for rank, (error, _) in enumerate(reports) if error is not None]
    if failures:
        kinds = {kind for _, (kind, _) in failures}
        exc_type = TypeError if kinds == {"TypeError"} else ValueError
        if local_error is not None and not isinstance(local_error, (TypeError, ValueError)):
            raise local_error  # not a bad argument but a fault here: keep its type (the others raise too)
        lines = [f"rank {rank}: {kind}: {message}" for rank, (kind, message) in failures]
        raise exc_type(
            f"allreduce arguments rejected on {_ranks_phrase([r for r, _ in failures])} "
            f"of {len(reports)}:\n  " + "\n  ".join(lines)
        ) from local_error
    differences = describe_differences([sig for _, sig in reports])
    if differences:
        raise ValueError(
            f"allreduce called with different arguments on the {len(reports)} ranks of the "
            "communicator:\n  " + "\n  ".join(differences)
        )
    return prepared


def describe_differences(signatures):
    """One line per field whose value is not the same on every rank, naming which ranks had which."""
    lines = []
    for field in signatures[0]:
        ranks_by_value = {}
        for rank, sig in enumerate(signatures):
            ranks_by_value.setdefault(repr(sig.get(field)), []).append(rank)
        if len(ranks_by_value) > 1:
            parts = [f"{value} on {_ranks_phrase(ranks)}" for value, ranks in ranks_by_value.items()]
            lines.append(f"{field} differs: " + "; ".join(parts))
    return lines


def _ranks_phrase(ranks):
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)
