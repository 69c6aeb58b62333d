"""Stalls, stragglers and lost ranks: a diagnosis instead of a hang.

- errors.py      the exceptions (AllreduceTimeout, RankFailure, AllreduceStallWarning), call_site
- rendezvous.py  timeouts: the ranks meet before a timed call moves data
- channel.py     the control messages (kind, call number, code) of rendezvous and watch
- watch.py       a rank that fails in the middle of an algorithm ends the call on every rank
- ulfm.py        lost ranks under ULFM: RankFailure, survivors(), exit_after_rank_failures()
"""
from .errors import AllreduceAborted, AllreduceStallWarning, AllreduceTimeout, RankFailure, call_site, ranks_phrase
from .rendezvous import Rendezvous
from .ulfm import caused_by_rank_failure, exit_after_rank_failures, failed_ranks, failure_of, survivors

__all__ = ["AllreduceTimeout", "AllreduceAborted", "RankFailure", "AllreduceStallWarning", "call_site", "ranks_phrase", "Rendezvous",
           "failure_of", "caused_by_rank_failure", "failed_ranks", "survivors", "exit_after_rank_failures"]
