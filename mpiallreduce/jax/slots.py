"""The handler's arrival in shared memory, for a communicator whose ranks share one node: a window
with a region per rank (_ffi_slots.h says what a region holds and how a call uses it), handed to
the handler once, so that a call's code (and a small exchange's input) is written and read in
place rather than sent in MPI messages.

    made       at a communicator's first trace, on every rank (a collective, where its state is
               made ready): where the core compares in shared memory too (one node, more than one
               rank, not under ULFM: core.state's signature slots), else not at all
    handed     MpiallreduceJaxSlots(comm, size, each rank's address, bytes): the handler's calls
               on that communicator arrive through it from then on
    kept       for the process's life, as the communicator is (a compiled program holds both)
"""

import ctypes
import os

from mpi4py import MPI

from ..core.state import state_of

__all__ = ["DATA_BYTES", "REGION_BYTES", "hand_slots", "handed"]

#: the most a call's data shared_memory takes (a half's data; larger calls run another algorithm)
DATA_BYTES = 256 << 10
#: a rank's region: two halves, each a cache line (the call's number and length), a header of at
#: most 4096 bytes and DATA_BYTES of data (_ffi_slots.h)
REGION_BYTES = 2 * (64 + 4096 + DATA_BYTES)

_made: list[MPI.Win] = []  # (the windows, kept: the handler reads them for good)
_handed: set[int] = set()  # (the handles of the communicators whose calls have regions)


def spin_looks(ranks: int) -> int:
    """How many looks at the peers a wait makes before it also yields the core: 64 where the
    node's ``ranks`` (all of the communicator's: it is on one node) outnumber its cores (all of
    them: a launcher may bind each rank to one), so that a peer sharing one gets it; else 16384,
    tens of microseconds of spinning, as MPI's own waits spin."""
    return 64 if ranks > (os.cpu_count() or 1) else 16384


def handed(comm: MPI.Intracomm) -> bool:
    """Whether ``comm``'s calls have shared regions (hand_slots gave them)."""
    return comm.handle in _handed


def hand_slots(comm, library):
    """Give ``library`` (the loaded handler) shared regions for ``comm``'s calls where its ranks
    share a node (collective there: every rank's first trace on ``comm``). True where handed."""
    if state_of(comm).signature_slots is None:
        return False
    size = comm.Get_size()
    window = MPI.Win.Allocate_shared(REGION_BYTES, 1, comm=comm)
    addresses = (ctypes.c_int64 * size)(*(window.Shared_query(r)[0].address for r in range(size)))
    window.Lock_all(MPI.MODE_NOCHECK)  # (loads and stores from then on, as core.slots')
    ctypes.memset(addresses[comm.Get_rank()], 0, REGION_BYTES)
    window.Sync()
    comm.Barrier()  # (every region zero before any rank's first call reads one)
    window.Sync()
    _made.append(window)
    library.MpiallreduceJaxSlots.restype = ctypes.c_int
    library.MpiallreduceJaxSlots.argtypes = (
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_int64,
        ctypes.c_int64,
    )
    if library.MpiallreduceJaxSlots(comm.handle, size, addresses, REGION_BYTES, spin_looks(size)):
        raise RuntimeError("mpiallreduce.jax: the handler refused the shared regions")
    _handed.add(comm.handle)
    return True
