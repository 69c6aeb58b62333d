"""What an algorithm builds once per communicator and reuses, cached on it as an MPI attribute.

Node communicators, shared windows, group communicators (``cached``). The library's own
duplicates of a user's communicator, and what it keeps per user communicator, live in
mpiallreduce.state.

The attribute's delete callback frees what it holds when the user's communicator is freed (or at
``MPI_Finalize`` for ``COMM_WORLD``).
"""

import contextlib
import threading

from mpi4py import MPI

__all__ = ["cached", "cached_if_made", "replace_cached"]

_KEYVAL = None
_lock = threading.Lock()


def _free_cache(comm, keyval, cache):
    if MPI.Is_finalized():
        return
    for value in reversed(list(cache.values())):
        for item in value if isinstance(value, tuple) else (value,):
            if hasattr(item, "free"):  # a holder of MPI objects that knows how to let them go
                item.free()
            elif isinstance(item, MPI.Win) and item != MPI.WIN_NULL:
                item.Free()
            elif isinstance(item, MPI.Comm) and item != MPI.COMM_NULL and not item.is_predefined:
                # a communicator revoked after a rank died (ULFM)
                with contextlib.suppress(MPI.Exception):
                    item.Free()


def _cache_of(comm):
    global _KEYVAL
    with _lock:  # (two threads' first use must not make two keyvals, or two caches)
        if _KEYVAL is None:
            _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_cache)
        cache = comm.Get_attr(_KEYVAL)
        if cache is None:
            cache = {}
            comm.Set_attr(_KEYVAL, cache)
        return cache


def cached(comm, name, make):
    """``make()``'s result, made once per communicator (collective the first time if ``make`` is).

    Communicators and windows in the result (or in a tuple result) are freed with ``comm``.
    """
    cache = _cache_of(comm)
    if name not in cache:
        cache[name] = make()
    return cache[name]


def cached_if_made(comm, name):
    """What ``cached`` made under ``name`` for ``comm``, or None if nothing was made yet."""
    return _cache_of(comm).get(name)


def replace_cached(comm, name, value):
    """Put ``value`` under ``name``, freeing what was there (collective if freeing is)."""
    cache = _cache_of(comm)
    old = cache.pop(name, None)
    if old is not None:
        _free_cache(comm, None, {name: old})
    cache[name] = value
    return value
