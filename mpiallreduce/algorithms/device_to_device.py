"""Device-to-device allreduce on one node: CUDA IPC, every rank reads its peers' GPU memory.

No host memory and no MPI message carries data: MPI only exchanges IPC handles (64 bytes per
buffer, opened once per allocation and cached) and synchronizes the ranks twice (the first time
agreeing that every rank could map its peers' memory, so that a failure there is raised on all).
The buffer is cut into p slices; rank r owns slice r. Example p = 3, in_q = rank q's input, out_q its result:

    step 1  (every rank's input is ready: each synchronized its stream before the handle exchange)
            rank 0:  out_0[s0] = in_0[s0] + in_1[s0] + in_2[s0]      reads ranks 1, 2
            rank 1:  out_1[s1] = in_0[s1] + in_1[s1] + in_2[s1]      reads ranks 0, 2
            rank 2:  out_2[s2] = in_0[s2] + in_1[s2] + in_2[s2]      reads ranks 0, 1
    agree   (every slice is reduced; or every rank raises what failed where)
    step 2  rank r copies slice q from out_q, for every q != r
    barrier (nobody reuses a buffer a peer may still be reading)

Each slice is reduced once, in rank order, by its owner, then copied: bitwise identical results.
Several ranks may share one GPU (CUDA IPC works between processes on one device). Traffic per
rank: reads (p-1)/p n from peers twice; no PCIe, no host copies.
"""
import collections

import numpy as np
from mpi4py import MPI

from ..agreement import agree_on_outcome
from ..buffers import copy_into, scratch
from ..device import allocation_range, close_ipc_mapping, namespace, synchronize
from .base import OneNodeSlicedAlgorithm, reduce_in_rank_order_into

#: how many peers' allocations stay mapped; the least recently used beyond that are closed
OPENED_HANDLES_KEPT = 256


class DeviceToDeviceAllreduce(OneNodeSlicedAlgorithm):
    name = "device_to_device"
    memory = "device"
    device_path = "device-to-device"
    across_nodes = "staged_ring"

    def execute(self, plan, comm, send, recv, op, datatype):
        xp = namespace(recv)
        rank = comm.Get_rank()
        source = recv if send is None else send
        synchronize(xp)  # this rank's input is written before any peer reads it
        handles = exchange_handles(comm, xp, [source, recv])

        # Step 1: reduce this rank's slice over every rank's input, in rank order. Opening a peer's
        # memory can fail on one rank alone: the ranks agree on that instead of a barrier.
        error = None
        try:
            sources, results = peer_arrays(comm, xp, [source, recv], handles)
            a, b = plan.slices[rank]
            reduced = scratch("device_to_device.slice", b - a, recv.dtype, like=recv)
            reduce_in_rank_order_into(op, [peer[a:b] for peer in sources], out=reduced)
            copy_into(recv[a:b], reduced)
            synchronize(xp)
        except Exception as failure:  # noqa: BLE001 - raised on every rank by agree_on_outcome
            error = failure
        agree_on_outcome(comm, error, "device_to_device: mapping the peers' memory (CUDA IPC)")

        # Step 2: copy every other slice from its owner's result
        for q, (c, d) in enumerate(plan.slices):
            if q != rank:
                copy_into(recv[c:d], results[q][c:d])
        synchronize(xp)
        comm.Barrier()


class _OpenedHandles:
    """Peers' allocations mapped into this process, by IPC handle; least recently used closed first."""

    def __init__(self):
        self.bases = collections.OrderedDict()

    def base(self, xp, handle):
        key = (xp.__name__, handle)
        if key in self.bases:
            self.bases.move_to_end(key)
            return self.bases[key]
        lazy_peer_access = getattr(xp.cuda.runtime, "cudaIpcMemLazyEnablePeerAccess", 1)
        base = xp.cuda.runtime.ipcOpenMemHandle(handle, lazy_peer_access)
        self.bases[key] = base
        while len(self.bases) > OPENED_HANDLES_KEPT:
            _, old_base = self.bases.popitem(last=False)
            close_ipc_mapping(xp, old_base)
        return base


_opened = _OpenedHandles()


#: bytes of a CUDA IPC memory handle (cudaIpcMemHandle_t)
IPC_HANDLE_BYTES = 64


def exchange_handles(comm, xp, arrays):
    """Every rank's (IPC handle, offset) of each of ``arrays``: one allgather, rows by rank. A rank
    that cannot export its memory says so in that allgather (a status byte), and every rank raises."""
    record = IPC_HANDLE_BYTES + 8  # the handle, then the array's offset in its allocation
    mine = np.zeros(1 + len(arrays) * record, dtype=np.uint8)  # status, then the records
    error = None
    try:
        for i, array in enumerate(arrays):
            base, _ = allocation_range(xp, array.data.ptr)
            start = 1 + i * record
            mine[start:start + IPC_HANDLE_BYTES] = np.frombuffer(bytes(xp.cuda.runtime.ipcGetMemHandle(base)),
                                                                 dtype=np.uint8)
            mine[start + IPC_HANDLE_BYTES:start + record] = np.array([array.data.ptr - base],
                                                                    dtype=np.uint64).view(np.uint8)
    except Exception as failure:  # noqa: BLE001 - raised on every rank just below
        error = failure
        mine[0] = 1
    everyone = np.empty((comm.Get_size(), mine.size), dtype=np.uint8)
    comm.Allgather([mine, MPI.BYTE], [everyone, MPI.BYTE])
    if everyone[:, 0].any():
        agree_on_outcome(comm, error, "device_to_device: exporting device memory (CUDA IPC)")
    return [[(row[1 + i * record:1 + i * record + IPC_HANDLE_BYTES].tobytes(),
              int(row[1 + i * record + IPC_HANDLE_BYTES:1 + (i + 1) * record].view(np.uint64)[0]))
             for i in range(len(arrays))] for row in everyone]


def peer_arrays(comm, xp, arrays, handles):
    """For each of this rank's ``arrays``, every rank's counterpart as a device array here (a handle
    not seen before is opened and kept); local, no communication."""
    rank = comm.Get_rank()
    views = [[None] * len(handles) for _ in arrays]
    for q, entries in enumerate(handles):
        for i, (array, (handle, offset)) in enumerate(zip(arrays, entries)):
            if q == rank:
                views[i][q] = array
                continue
            memory = xp.cuda.UnownedMemory(_opened.base(xp, handle) + offset, array.nbytes, None)
            views[i][q] = xp.ndarray(array.shape, array.dtype, xp.cuda.MemoryPointer(memory, 0))
    return views


ALGORITHM = DeviceToDeviceAllreduce()
