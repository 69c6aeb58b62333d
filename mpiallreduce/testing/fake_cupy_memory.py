"""fake_cupy's device memory: allocations that are files in /dev/shm, mapped into this process and,
through the IPC calls (``cuda.runtime.ipcGetMemHandle`` / ``ipcOpenMemHandle`` /
``ipcCloseMemHandle``), into the other processes of the node, as CUDA IPC does for device memory."""

import atexit
import contextlib
import itertools
import mmap
import os
import weakref

import numpy as np

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
_counter = itertools.count()
_live_files: set[str] = set()
_allocations: weakref.WeakValueDictionary[int, "_Memory"] = weakref.WeakValueDictionary()
_opened: dict[int, tuple[mmap.mmap, int]] = {}  # base address -> (mmap, size), peers' memory

#: what the stand-in counts, for tests: pointer-attribute queries (an UnownedMemory made without its
#: device id), IPC mappings opened and closed, ElementwiseKernel launches
counts = {"pointer_queries": 0, "ipc_opened": 0, "ipc_closed": 0, "elementwise_launches": 0}


class _Memory:
    """One "device allocation": a file mapped into this process (and, through IPC, into peers)."""

    def __init__(self, nbytes):
        self.size = max(int(nbytes), 1)
        self.name = f"fakecupy-{os.getpid()}-{next(_counter)}-{os.urandom(4).hex()}"
        self.path = os.path.join(_SHM_DIR or "/tmp", self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self.map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.host = np.frombuffer(self.map, dtype=np.uint8)
        self.ptr = self.host.ctypes.data
        _live_files.add(self.path)
        _allocations[self.ptr] = self
        weakref.finalize(self, _unlink, self.path)


def _unlink(path):
    _live_files.discard(path)
    with contextlib.suppress(OSError):
        os.unlink(path)


atexit.register(lambda: [_unlink(p) for p in list(_live_files)])


def _allocation_range(ptr):
    """(base, size) of the allocation holding ``ptr`` (cuMemGetAddressRange's answer), in this
    process."""
    for base, memory in list(_allocations.items()):
        if base <= ptr < base + memory.size:
            return base, memory.size
    for base, (_mapping, size) in list(_opened.items()):
        if base <= ptr < base + size:
            return base, size
    raise ValueError(f"{ptr:#x} is not fake device memory")


def _ipc_get_mem_handle(ptr):
    base, size = _allocation_range(ptr)
    memory = _allocations.get(base)
    if memory is None:
        raise RuntimeError("cudaErrorInvalidValue: not memory this process allocated")
    return memory.name.encode().ljust(64, b"\0")


#: set (or MPIALLREDUCE_FAKE_CUPY_IPC=refuse in the environment): opening a peer's memory fails,
#: as CUDA IPC does in sandboxes that refuse it (gVisor, some containers)
refuse_ipc = os.environ.get("MPIALLREDUCE_FAKE_CUPY_IPC") == "refuse"


def _ipc_open_mem_handle(handle, flags=1):
    if refuse_ipc:
        raise RuntimeError(
            "cudaErrorMapBufferObjectFailed: mapping of buffer object failed "
            "(the CuPy stand-in refuses CUDA IPC: MPIALLREDUCE_FAKE_CUPY_IPC=refuse)"
        )
    name = bytes(handle).rstrip(b"\0").decode()
    fd = os.open(os.path.join(_SHM_DIR or "/tmp", name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    base = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    _opened[base] = (mapping, size)
    counts["ipc_opened"] += 1
    return base


def _ipc_close_mem_handle(ptr):
    if _opened.pop(ptr, None) is None:
        raise RuntimeError("cudaErrorInvalidValue: not a mapping opened with ipcOpenMemHandle")
    counts["ipc_closed"] += 1


def open_ipc_mappings():
    """How many peers' allocations are mapped into this process now."""
    return len(_opened)
