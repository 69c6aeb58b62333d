"""Device-to-device allreduce on one node: CUDA IPC, every rank reads its peers' GPU memory.

No host memory and no MPI message carries data: MPI only exchanges IPC handles (64 bytes per
buffer, with its offset and GPU) and synchronizes the ranks twice (the first time agreeing that
every rank could map its peers' memory, so that a failure there is raised on all). The buffer is
cut into p slices; rank r owns slice r. Example p = 3, in_q = rank q's input, out_q its result:

    step 1  (every rank's input is ready: each synchronized its stream before the handle exchange)
            rank 0:  out_0[s0] = (in_0[s0] + in_1[s0]) + in_2[s0]    one kernel; reads ranks 1, 2
            rank 1:  out_1[s1] = (in_0[s1] + in_1[s1]) + in_2[s1]    one kernel; reads ranks 0, 2
            rank 2:  out_2[s2] = (in_0[s2] + in_1[s2]) + in_2[s2]    one kernel; reads ranks 0, 1
    agree   (every slice is reduced; or every rank raises what failed where)
    step 2  rank r copies slice q from out_q, for every q != r
    close   each rank unmaps its peers' memory (cudaIpcCloseMemHandle)
    agree   (the last barrier: nobody frees or reuses a buffer that a peer still reads or still has
            mapped; or every rank raises what failed where)

Each slice is reduced once, in rank order, by its owner, then copied: bitwise identical results.
Step 1 is one p-input kernel (an ElementwiseKernel made once per op and p): it reads the p slices
and writes the result once, (p+1)/p n bytes of traffic where p-1 two-input kernels moved about
3(p-1)/p n. Several ranks may share one GPU (CUDA IPC works between processes on one device).

The mappings last one call. CUDA makes freeing exported memory before its importers have closed it
undefined, and a mapping kept open pins memory its owner has freed; closing before the final
barrier means that once any rank returns, no peer holds a mapping of its buffers. The price is one
cudaIpcOpenMemHandle per peer and buffer per call: on an H200, 4 ranks, a call of 1 MiB took
2.0 ms against Open MPI's 0.51 (benchmarks/results-gpu/bench-gpu.txt), the mapping's time.
"""

import contextlib
import functools

import numpy as np
from mpi4py import MPI

from ..core.buffers import copy_into
from ..device.arrays import allocation_range, close_ipc_mapping, namespace, synchronize
from ..faults.agreed_outcome import agree_on_outcome
from .base import OneNodeSlicedAlgorithm

#: CUDA code for min and max with numpy's rules: a NaN wins (the first, if both are); on a tie the
#: second argument (np.maximum(0.0, -0.0) is -0.0), in float32 and float64. The CuPy stand-in runs
#: these expressions as they are written (mpiallreduce.testing.fake_cupy_arrays), so CI compares
#: them with numpy.
RANK_ORDER_PREAMBLE = """
template <typename T> __device__ T mpiallreduce_max(T a, T b) { return (a > b || a != a) ? a : b; }
template <typename T> __device__ T mpiallreduce_min(T a, T b) { return (a < b || a != a) ? a : b; }
"""
#: numpy's float16 loops keep the first argument on a tie (np.maximum(f16(0), f16(-0.0)) is +0)
FIRST_ON_TIES_PREAMBLE = RANK_ORDER_PREAMBLE.replace("a > b", "a >= b").replace("a < b", "a <= b")
_COMBINE = {
    "sum": "({a} + {b})",
    "mean": "({a} + {b})",
    "prod": "({a} * {b})",
    "max": "mpiallreduce_max({a}, {b})",
    "min": "mpiallreduce_min({a}, {b})",
}


def rank_order_operation(op_name, count):
    """The kernel's operation: ``result = ((in0 + in1) + in2) ...``, inputs combined left to
    right."""
    expression = "in0"
    for i in range(1, count):
        expression = _COMBINE[op_name].format(a=expression, b=f"in{i}")
    return f"result = {expression}"


@functools.cache
def rank_order_kernel(xp, op_name, count, first_on_ties=False):
    """One ElementwiseKernel that reduces ``count`` same-typed inputs in rank order into ``result``
    (``first_on_ties``: min and max as numpy's float16 loops break ties)."""
    inputs = ", ".join(f"T in{i}" for i in range(count))
    return xp.ElementwiseKernel(
        inputs,
        "T result",
        rank_order_operation(op_name, count),
        f"mpiallreduce_rank_order_{op_name}_{count}{'_first' if first_on_ties else ''}",
        preamble=FIRST_ON_TIES_PREAMBLE if first_on_ties else RANK_ORDER_PREAMBLE,
    )


class DeviceToDeviceAllreduce(OneNodeSlicedAlgorithm):
    name = "device_to_device"
    memory = "device"
    device_path = "device-to-device"
    across_nodes = "staged_ring"
    #: it maps the peers' memory: the planner uses it only where probe_cuda_ipc found that works
    needs_cuda_ipc = True
    #: it maps the peers' memory: a timed call runs the table's choice across nodes instead
    unbounded_when_timed = True

    def execute(self, plan, comm, send, recv, op, datatype):
        xp = namespace(recv)
        rank = comm.Get_rank()
        a, b = plan.slices[rank]
        own_slice = recv[a:b]
        source = recv if send is None else send
        # Each step that can fail on one rank alone (a CUDA error, a peer's memory that cannot be
        # mapped) ends in an agreement, a collective, so that every rank raises it instead of the
        # others going on into the next collective and waiting there for ever.
        handles = exchange_handles(
            comm, xp, [source, recv]
        )  # (synchronizes first: the input is written)
        mappings = PeerMappings(xp)
        try:
            # Step 1: reduce this rank's slice over every rank's input, in rank order, in one kernel
            error = None
            try:
                sources, results = peer_arrays(comm, xp, [source, recv], handles, mappings)
                pieces = [
                    own_slice if q == rank and send is None else peer[a:b]
                    for q, peer in enumerate(sources)
                ]
                rank_order_kernel(xp, op.name, len(pieces), recv.dtype == np.float16)(
                    *pieces, own_slice
                )
                synchronize(xp)
            except Exception as failure:  # noqa: BLE001 - raised on every rank by agree_on_outcome
                error = failure
            agree_on_outcome(comm, error, "device_to_device: mapping the peers' memory (CUDA IPC)")

            # Step 2: copy every other slice from its owner's result, then unmap; the agreement is
            # the last barrier (nobody frees or reuses a buffer a peer still reads or has mapped)
            try:
                for q, (c, d) in enumerate(plan.slices):
                    if q != rank:
                        copy_into(recv[c:d], results[q][c:d])
                mappings.close()
            except Exception as failure:  # noqa: BLE001 - raised on every rank by agree_on_outcome
                error = failure
            agree_on_outcome(
                comm, error, "device_to_device: copying the peers' slices and unmapping them"
            )
        finally:
            if (
                mappings.bases
            ):  # (after a failure every rank raises already: what is left is unmapped quietly)
                with contextlib.suppress(Exception):
                    mappings.close()


class PeerMappings:
    """The peers' allocations this call mapped into this process (by IPC handle), closed at its
    end."""

    def __init__(self, xp):
        self.xp = xp
        self.bases = {}

    def base(self, handle):
        """Where the peer's allocation of ``handle`` starts in this process (opened once per
        call)."""
        base = self.bases.get(handle)
        if base is None:
            runtime = self.xp.cuda.runtime
            base = runtime.ipcOpenMemHandle(
                handle, getattr(runtime, "cudaIpcMemLazyEnablePeerAccess", 1)
            )
            self.bases[handle] = base
        return base

    def close(self):
        """Unmap them all, once the current stream's kernels (which may read them) have run."""
        bases, self.bases = self.bases, {}
        if bases:
            self.xp.cuda.get_current_stream().synchronize()
        failure = None
        for base in bases.values():  # (all of them, even after one fails; then the first failure)
            try:
                close_ipc_mapping(self.xp, base)
            except Exception as error:  # noqa: BLE001 - raised below, once every mapping was tried
                failure = failure or error
        if failure is not None:
            raise failure


#: bytes of a CUDA IPC memory handle (cudaIpcMemHandle_t)
IPC_HANDLE_BYTES = 64
#: one array's record in the exchange: its handle, its offset in the allocation, its GPU
RECORD_BYTES = IPC_HANDLE_BYTES + 8 + 8


def exchange_handles(comm, xp, arrays):
    """Every rank's (IPC handle, offset, device id) for each of ``arrays``: one allgather, rows by
    rank. A rank that cannot synchronize its stream or export its memory says so in that allgather
    (a status byte), and every rank raises."""
    mine = np.zeros(1 + len(arrays) * RECORD_BYTES, dtype=np.uint8)  # status, then the records
    error = None
    try:
        synchronize(xp)  # this rank's input is written before any peer reads it
        for i, array in enumerate(arrays):
            base, _ = allocation_range(xp, array.data.ptr)
            start = 1 + i * RECORD_BYTES
            mine[start : start + IPC_HANDLE_BYTES] = np.frombuffer(
                bytes(xp.cuda.runtime.ipcGetMemHandle(base)), dtype=np.uint8
            )
            mine[start + IPC_HANDLE_BYTES : start + RECORD_BYTES] = np.array(
                [array.data.ptr - base, array.device.id], dtype=np.uint64
            ).view(np.uint8)
    except Exception as failure:  # noqa: BLE001 - raised on every rank just below
        error = failure
        mine[0] = 1
    everyone = np.empty((comm.Get_size(), mine.size), dtype=np.uint8)
    comm.Allgather([mine, MPI.BYTE], [everyone, MPI.BYTE])
    if everyone[:, 0].any():
        agree_on_outcome(
            comm, error, "device_to_device: synchronizing and exporting device memory (CUDA IPC)"
        )
    records = []
    for row in everyone:
        entries = []
        for i in range(len(arrays)):
            start = 1 + i * RECORD_BYTES
            offset, device_id = row[start + IPC_HANDLE_BYTES : start + RECORD_BYTES].view(np.uint64)
            entries.append(
                (row[start : start + IPC_HANDLE_BYTES].tobytes(), int(offset), int(device_id))
            )
        records.append(entries)
    return records


def peer_arrays(comm, xp, arrays, handles, mappings):
    """For each of this rank's ``arrays``, every rank's counterpart as a device array here, mapped
    through ``mappings`` (a PeerMappings); local, no communication."""
    rank = comm.Get_rank()
    views = [[None] * len(handles) for _ in arrays]
    for q, entries in enumerate(handles):
        for i, (array, (handle, offset, device_id)) in enumerate(
            zip(arrays, entries, strict=False)
        ):
            if q == rank:
                views[i][q] = array
                continue
            # the device id given: CuPy need not ask the driver which GPU the pointer is on
            memory = xp.cuda.UnownedMemory(
                mappings.base(handle) + offset, array.nbytes, None, device_id
            )
            views[i][q] = xp.ndarray(array.shape, array.dtype, xp.cuda.MemoryPointer(memory, 0))
    return views


def probe_cuda_ipc(comm, xp):
    """Collective over ``comm``: whether every rank can map every other's device memory. "works",
    or "refused: " and what failed on which ranks (the same text on every rank). Sandboxes (gVisor,
    some containers) and some drivers refuse CUDA IPC; then the planner never runs this algorithm.

        every rank   a 256-byte allocation; its IPC handle exported         (exchange_handles)
        allgather    the handles, with a status byte                        (exchange_handles)
        every rank   each peer's allocation opened, then closed             (PeerMappings)
        agree        it works only if it worked on every rank               (agree_on_outcome)

    Raises (on every rank) only if a rank cannot allocate 256 bytes of device memory at all.
    """
    error, buffer = None, None
    try:
        buffer = xp.zeros(256, dtype=np.uint8)
    except Exception as failure:  # noqa: BLE001 - raised on every rank by agree_on_outcome
        error = failure
    agree_on_outcome(comm, error, "the CUDA IPC probe: allocating 256 bytes of device memory")
    mappings = PeerMappings(xp)
    try:
        handles = exchange_handles(
            comm, xp, [buffer]
        )  # (agreed: raises on every rank if one failed)
        try:
            peer_arrays(comm, xp, [buffer], handles, mappings)
            mappings.close()
        except Exception as failure:  # noqa: BLE001 - agreed just below
            error = failure
        agree_on_outcome(comm, error, "opening the peers' memory handles (cudaIpcOpenMemHandle)")
    except RuntimeError as refused:  # (agree_on_outcome's: the same on every rank)
        return f"refused: {refused}"
    finally:
        with contextlib.suppress(Exception):
            mappings.close()
    return "works"


ALGORITHM = DeviceToDeviceAllreduce()
