"""How device memory travels between ranks: the three paths, and which one a call takes.

    cuda-aware          device pointers handed to MPI itself (the MPI library moves device memory)
    staged messages     each message of the algorithm copied device -> pinned host -> MPI -> pinned
                        host -> device; reductions stay on the GPU (CuPy ufuncs with out=)
    host round trip     the whole buffer copied to pinned host memory, reduced there by the host
                        algorithm, copied back (what Open MPI's own CUDA collectives do)
    staged pipeline     the staged_ring algorithm: the copies of one segment overlap the MPI
                        transfer of another (algorithms/staged_ring.py)
    device-to-device    the device_to_device algorithm: CUDA IPC between ranks on one node, no host
                        memory at all (algorithms/device_to_device.py)

Whatever the path, the current CUDA stream is synchronized before MPI touches device memory, and
the result is ordered on the current stream for the caller's later kernels.
"""

import threading

import numpy as np

from .arrays import synchronize

__all__ = ["device_path", "run_on_device", "pinned", "pinned_in_use", "DeviceComm", "StagingComm"]


def device_path(algorithm, aware):
    """The path (a name from this module's table) device arrays take with ``algorithm``, when the
    ranks agreed that their MPI is (``aware``) or is not CUDA-aware: the planner's decision
    (mpiallreduce.core.planner), which the executor follows."""
    if algorithm.memory == "device":
        return algorithm.device_path
    if algorithm.memory == "host":
        return "host round trip"
    if aware:
        return "cuda-aware"
    return "staged messages" if algorithm.blocking_messages_only else "host round trip"


def run_on_device(path, algorithm, comm, send, recv, op, datatype, xp, **options):
    """Run ``algorithm`` on device buffers ``send``/``recv`` along ``path`` (the plan's)."""
    if path == "cuda-aware":
        algorithm.run(DeviceComm(comm, xp), send, recv, op, datatype, **options)
    elif path == "staged messages":
        algorithm.run(StagingComm(comm, xp), send, recv, op, datatype, **options)
    elif path == "host round trip":
        host = pinned(xp, "round_trip", recv.size, recv.dtype)
        xp.asnumpy(
            recv if send is None else send, out=host
        )  # blocking: waits for the current stream
        algorithm.run(comm, None, host, op, datatype, **options)
        stream = xp.cuda.get_current_stream()
        recv.set(host, stream=stream)  # asynchronous: `host` is read after this call returns
        pinned_in_use(xp, "round_trip", stream)
    else:  # the device-only algorithms talk on their own
        algorithm.run(comm, send, recv, op, datatype, **options)


class _PinnedPool(threading.local):
    def __init__(self):
        # (slot, module) -> [memory, capacity, event of the last copy using it or None]
        self.buffers = {}


_pinned_pool = _PinnedPool()


def pinned(xp, slot, count, dtype):
    """A reusable page-locked host array of ``count`` elements, one per (thread, slot); grown, never
    shrunk.

    Pinned memory is what lets device-host copies run asynchronously at full speed; allocating it is
    slow (milliseconds), so each slot's buffer is allocated once and kept. An asynchronous copy may
    still read or write the buffer when it is asked for again, on whatever stream it was queued
    (the caller may have switched streams since): the event :func:`pinned_in_use` recorded is waited
    for first, as CuPy guards its own pinned buffers. The buffer is replaced (and the old one freed)
    only after that wait too.
    """
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    key = (slot, xp.__name__)
    entry = _pinned_pool.buffers.get(key)
    if entry is None:
        entry = _pinned_pool.buffers[key] = [None, -1, None]
    if entry[2] is not None:
        entry[2].synchronize()
        entry[2] = None
    if entry[1] < nbytes:
        entry[1] = max(nbytes, 1)
        entry[0] = xp.cuda.alloc_pinned_memory(entry[1])
    return np.frombuffer(entry[0], dtype=np.uint8, count=nbytes).view(dtype)


def pinned_in_use(xp, slot, stream):
    """Mark slot ``slot``'s pinned buffer as used by the copies queued so far on ``stream``: the
    next :func:`pinned` of that slot waits until they have run."""
    event = xp.cuda.Event(disable_timing=True)
    event.record(stream)
    _pinned_pool.buffers[(slot, xp.__name__)][2] = event


class _Forwarding:
    """The wrapped communicator's queries (Get_rank, Get_size...) unchanged; any other call that the
    wrapper does not define is an error, not a silent pass of device memory to MPI."""

    def __init__(self, comm, xp):
        self.comm = comm
        self.xp = xp

    def __getattr__(self, name):
        if name.startswith("Get_") or name in ("Is_inter", "py2f"):
            return getattr(self.comm, name)
        raise AttributeError(f"{type(self).__name__} does not carry {name}() for device buffers")


def _synchronized(name):
    """DeviceComm's method ``name``: the wrapped communicator's, after the current stream is
    synchronized."""

    def call(self, *args, **kwargs):
        synchronize(self.xp)
        return getattr(self.comm, name)(*args, **kwargs)

    call.__name__ = name
    return call


class DeviceComm(_Forwarding):
    """``comm`` for a CUDA-aware MPI: device buffers go to MPI as they are, after the current
    stream is synchronized (so that MPI reads what the kernels wrote, not what was there before)."""

    Send = _synchronized("Send")
    Recv = _synchronized("Recv")
    Sendrecv = _synchronized("Sendrecv")
    Isend = _synchronized("Isend")
    Irecv = _synchronized("Irecv")
    Allreduce = _synchronized("Allreduce")
    Reduce = _synchronized("Reduce")
    Bcast = _synchronized("Bcast")


class StagingComm(_Forwarding):
    """``comm`` for an MPI that is not CUDA-aware: each message goes through pinned host buffers.

    Only the blocking point-to-point calls are staged (``Algorithm.blocking_messages_only``); every
    call first synchronizes the current stream (MPI reads what the kernels wrote), and a pinned
    buffer that an asynchronous host-to-device copy still reads is waited for before it is reused.
    """

    def _to_host(self, spec, slot):
        array, datatype = spec
        host = pinned(self.xp, slot, array.size, array.dtype)
        self.xp.asnumpy(array, out=host)  # waits for the current stream, then copies
        return [host, datatype]

    def _host_for(self, spec, slot):
        array, datatype = spec
        return [pinned(self.xp, slot, array.size, array.dtype), datatype]

    def Send(self, buf, dest, tag=0):
        synchronize(self.xp)
        self.comm.Send(self._to_host(buf, "staging.send"), dest, tag)

    def _to_device(self, host, spec):
        stream = self.xp.cuda.get_current_stream()
        spec[0].set(host[0], stream=stream)  # asynchronous: `host` is read after this call returns
        pinned_in_use(self.xp, "staging.recv", stream)

    def Recv(self, buf, source, tag=0):
        synchronize(self.xp)
        host = self._host_for(buf, "staging.recv")
        self.comm.Recv(host, source, tag)
        self._to_device(host, buf)

    def Sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag):
        synchronize(self.xp)
        host_recv = self._host_for(recvbuf, "staging.recv")
        self.comm.Sendrecv(
            self._to_host(sendbuf, "staging.send"), dest, sendtag, host_recv, source, recvtag
        )
        self._to_device(host_recv, recvbuf)
