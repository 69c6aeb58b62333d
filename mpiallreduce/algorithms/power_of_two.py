"""Shared by the algorithms that run on a power of two of ranks: folding the others in and out.

MPICH's scheme (Thakur, Rabenseifner & Gropp 2005). With pof2 the largest power of two <= p and
rem = p - pof2, the first 2*rem ranks pair up: p = 6 (rem = 2):

    fold in:    0 -> 1      2 -> 3          (even rank sends its input; odd rank reduces it in)
    core:       1, 3, 4, 5 act as new ranks 0, 1, 2, 3 of a power-of-two algorithm
    fold out:   1 -> 0      3 -> 2          (odd rank sends the finished result back)

Every reduction puts the lower rank's data first, so partners compute the identical expression.
This is a helper, not an algorithm: the registry skips it.
"""

from dataclasses import dataclass

__all__ = [
    "Fold",
    "fold_plan",
    "largest_power_of_two_at_most",
    "reduce_in_rank_order",
    "fold_in",
    "fold_out",
]

FOLD_TAG = 201


def largest_power_of_two_at_most(n):
    return 1 << (n.bit_length() - 1)


@dataclass(frozen=True)
class Fold:
    #: the rank this one hands its input to and then waits on (it sits out the core), or None
    fold_into: int | None
    #: the rank whose input this one reduces in first and sends the result to last, or None
    fold_from: int | None
    #: this rank's number among the pof2 ranks of the core (None if it sits out)
    new_rank: int | None
    pof2: int
    rem: int

    def old_rank(self, new_rank):
        """The communicator rank of core rank ``new_rank``."""
        return 2 * new_rank + 1 if new_rank < self.rem else new_rank + self.rem


def fold_plan(size, rank):
    pof2 = largest_power_of_two_at_most(size)
    rem = size - pof2
    if rank < 2 * rem and rank % 2 == 0:
        return Fold(fold_into=rank + 1, fold_from=None, new_rank=None, pof2=pof2, rem=rem)
    if rank < 2 * rem:
        return Fold(fold_into=None, fold_from=rank - 1, new_rank=rank // 2, pof2=pof2, rem=rem)
    return Fold(fold_into=None, fold_from=None, new_rank=rank - rem, pof2=pof2, rem=rem)


def reduce_in_rank_order(op, rank, mine, partner, theirs, out=None):
    """``out`` (``mine`` if None) = (lower rank's data) op (higher rank's data)."""
    out = mine if out is None else out
    if partner < rank:
        op.reduce_local(theirs, mine, out=out)
    else:
        op.reduce_local(mine, theirs, out=out)


def fold_in(fold, comm, recv, incoming, op, datatype):
    """Before the core. Returns True if this rank sits out: it has then already got the result."""
    if fold.fold_into is not None:
        comm.Send([recv, datatype], fold.fold_into, FOLD_TAG)
        comm.Recv([recv, datatype], fold.fold_into, FOLD_TAG)
        return True
    if fold.fold_from is not None:
        comm.Recv([incoming, datatype], fold.fold_from, FOLD_TAG)
        reduce_in_rank_order(op, comm.Get_rank(), recv, fold.fold_from, incoming)
    return False


def fold_out(fold, comm, recv, datatype):
    """After the core: hand the result to the rank that sat out."""
    if fold.fold_from is not None:
        comm.Send([recv, datatype], fold.fold_from, FOLD_TAG)
