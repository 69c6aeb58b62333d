"""A stand-in for the few CuPy calls mpiallreduce makes: "device" arrays that live in host memory.

CI machines have no GPU, yet the device paths (dispatch, staging through pinned buffers, pipelining
over several streams, the device-to-device exchange of IPC handles, error paths) must run on every
CI run. This module imitates the part of CuPy they use, with the same names and signatures:

* ``ndarray`` exposes ``__cuda_array_interface__`` (so mpi4py takes it as a device buffer); its
  memory is a file in /dev/shm, so that ``cuda.runtime.ipcGetMemHandle`` / ``ipcOpenMemHandle``
  can map it into another process on the node, as CUDA IPC does for device memory.
* Kernels are asynchronous, as on a GPU: ``add``, ``copyto``, ``astype``, ``ndarray.set``... are
  queued on the current stream and run only when that stream is synchronized (or an event
  recorded after them is waited for). Reading device memory without synchronizing first gives the
  stale bytes a real GPU would give, so a missing ``synchronize`` fails tests here as on hardware.
* ``asnumpy`` and ``ndarray.get`` synchronize their stream first, as CuPy's blocking copies do.

Use it as ``import mpiallreduce.testing.fake_cupy as cp`` in place of ``import cupy as cp``.
"""
import atexit
import ctypes
import itertools
import mmap
import os
import threading
import types
import weakref

import numpy as np

__all__ = ["ndarray", "ElementwiseKernel", "empty", "zeros", "asarray", "asnumpy", "copyto", "ascontiguousarray",
           "may_share_memory", "add", "multiply", "minimum", "maximum", "divide", "cuda"]

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
_counter = itertools.count()
_live_files = set()
_allocations = weakref.WeakValueDictionary()  # base address -> _Memory


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
    try:
        os.unlink(path)
    except OSError:
        pass


atexit.register(lambda: [_unlink(p) for p in list(_live_files)])


def _allocation_range(ptr):
    """(base, size) of the allocation holding ``ptr`` (cuMemGetAddressRange's answer), in this process."""
    for base, memory in list(_allocations.items()):
        if base <= ptr < base + memory.size:
            return base, memory.size
    for base, (mapping, size) in list(_opened.items()):
        if base <= ptr < base + size:
            return base, size
    raise ValueError(f"{ptr:#x} is not fake device memory")


# ---------------------------------------------------------------------------------------------
# Streams and events: queues of kernels that run when synchronized

class Stream:
    """``cupy.cuda.Stream``: kernels launched while it is current wait in it until synchronized."""

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.null = null
        self._pending = []
        self._launched = 0  # kernels ever queued here
        self._started = 0  # kernels taken off the queue (run, or running)
        self._lock = threading.RLock()

    def launch(self, kernel):
        with self._lock:
            self._pending.append(kernel)
            self._launched += 1

    def _run_until(self, position):
        """Run queued kernels, in order, until the first ``position`` ever queued have run."""
        with self._lock:
            while self._started < position and self._pending:
                kernel = self._pending.pop(0)
                self._started += 1
                kernel()

    def synchronize(self):
        self._run_until(float("inf"))

    def record(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event):
        """Kernels queued here after this call wait until ``event``'s point in its stream is reached."""
        stream, position = event._stream, event._position
        if stream is not None:
            self.launch(lambda: stream._run_until(position))

    def use(self):
        _current.stream = self
        return self

    def __enter__(self):
        _current.stack = getattr(_current, "stack", []) + [get_current_stream()]
        return self.use()

    def __exit__(self, *exc):
        _current.stream = _current.stack.pop()

    @property
    def done(self):
        return not self._pending


class Event:
    """``cupy.cuda.Event``: marks a point in a stream (everything queued there so far)."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._stream = None
        self._position = 0

    def record(self, stream=None):
        self._stream = get_current_stream() if stream is None else stream
        self._position = self._stream._launched

    def synchronize(self):
        if self._stream is not None:
            self._stream._run_until(self._position)

    @property
    def done(self):
        return self._stream is None or self._stream._started >= self._position


_null_stream = Stream(null=True)
_current = threading.local()


def get_current_stream():
    return getattr(_current, "stream", None) or _null_stream


def _launch(kernel):
    get_current_stream().launch(kernel)


# ---------------------------------------------------------------------------------------------
# Arrays

class _Flags:
    def __init__(self, host):
        self.c_contiguous = host.flags.c_contiguous
        self.f_contiguous = host.flags.f_contiguous


class MemoryPointer:
    """``cupy.cuda.MemoryPointer``: a memory object and an offset into it."""

    def __init__(self, mem, offset):
        self.mem = mem
        self.ptr = mem.ptr + offset


#: what the stand-in counts, for tests: pointer-attribute queries (an UnownedMemory made without its
#: device id), IPC mappings opened and closed, ElementwiseKernel launches
counts = {"pointer_queries": 0, "ipc_opened": 0, "ipc_closed": 0, "elementwise_launches": 0}


class UnownedMemory:
    """``cupy.cuda.UnownedMemory``: device memory at ``ptr`` that someone else owns. Without a
    ``device_id`` (or with -1) CuPy asks the driver which GPU holds ``ptr``: counted here."""

    def __init__(self, ptr, size, owner, device_id=-1):
        if device_id is None or device_id < 0:
            counts["pointer_queries"] += 1
            device_id = _Device._selected
        self.ptr = ptr
        self.size = size
        self.owner = owner
        self.device_id = device_id


class ndarray:
    """``cupy.ndarray``: shape, dtype, views, ``__cuda_array_interface__``; memory in /dev/shm."""

    def __init__(self, shape, dtype=float, memptr=None, strides=None, _host=None):
        if _host is not None:
            self._host = _host
            return
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if memptr is None:
            memory = _Memory(nbytes)
            self._owner = memory
            raw = memory.host[:nbytes]
        else:
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(memptr.ptr))[:nbytes]
            self._owner = memptr.mem
        self._host = raw.view(dtype).reshape(shape)

    @classmethod
    def _view(cls, host, owner):
        view = cls(None, _host=host)
        view._owner = owner
        return view

    # what CuPy arrays have
    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    size = property(lambda self: self._host.size)
    nbytes = property(lambda self: self._host.nbytes)
    ndim = property(lambda self: self._host.ndim)
    strides = property(lambda self: self._host.strides)
    itemsize = property(lambda self: self._host.itemsize)
    flags = property(lambda self: _Flags(self._host))
    data = property(lambda self: MemoryPointer(UnownedMemory(self._host.ctypes.data, self.nbytes, self, 0), 0))
    device = property(lambda self: cuda.Device(0))

    @property
    def __cuda_array_interface__(self):
        host = self._host
        return {
            "shape": host.shape,
            "typestr": host.dtype.str,
            "descr": host.dtype.descr,
            "data": (host.ctypes.data, False),
            "strides": None if host.flags.c_contiguous else host.strides,
            "version": 3,
            "stream": None,
        }

    def __len__(self):
        return len(self._host)

    def __getitem__(self, key):
        return ndarray._view(self._host[key], self._owner)

    def __setitem__(self, key, value):
        target = self._host[key]
        value = value._host if isinstance(value, ndarray) else value
        _launch(lambda: target.__setitem__(Ellipsis, value))

    def reshape(self, *shape):
        return ndarray._view(self._host.reshape(*shape), self._owner)

    def ravel(self):
        return self.reshape(-1) if self.flags.c_contiguous else ascontiguousarray(self).reshape(-1)

    def view(self, dtype):
        return ndarray._view(self._host.view(dtype), self._owner)

    def astype(self, dtype, copy=True):
        result = empty(self.shape, dtype)
        source, target = self._host, result._host
        _launch(lambda: np.copyto(target, source, casting="unsafe"))
        return result

    def copy(self):
        return ascontiguousarray(self)

    def fill(self, value):
        target = self._host
        _launch(lambda: target.fill(value))

    def get(self, stream=None, order="C", out=None, blocking=True):
        """Device to host: waits for ``stream`` (the current one if None), then copies."""
        (stream or get_current_stream()).synchronize()
        if out is None:
            return np.array(self._host, order="C", copy=True)
        np.copyto(out, self._host)
        return out

    def set(self, arr, stream=None):
        """Host to device, asynchronous on ``stream``: ``arr`` is read when the copy runs."""
        target = self._host
        (stream or get_current_stream()).launch(lambda: np.copyto(target, arr.reshape(target.shape)))

    def __repr__(self):
        return f"fake_cupy.ndarray(shape={self.shape}, dtype={self.dtype})"

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")


def empty(shape, dtype=float, order="C"):
    return ndarray(shape, dtype)


def zeros(shape, dtype=float):
    array = empty(shape, dtype)
    array.fill(0)
    return array


def asarray(a, dtype=None):
    """Host to device (or the array itself): a blocking copy, as ``cupy.asarray`` of host data."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    host = np.asarray(a, dtype=dtype)
    array = empty(host.shape, host.dtype)
    get_current_stream().synchronize()
    np.copyto(array._host, host)
    return array


array = asarray


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    return a.get(stream=stream, out=out) if isinstance(a, ndarray) else np.asarray(a)


def copyto(dst, src, casting="same_kind"):
    target = dst._host
    source = src._host if isinstance(src, ndarray) else src
    _launch(lambda: np.copyto(target, source, casting=casting))


def ascontiguousarray(a, dtype=None):
    result = empty(a.shape, a.dtype if dtype is None else dtype)
    copyto(result, a, casting="unsafe")
    return result


def may_share_memory(a, b, max_work=None):
    return np.may_share_memory(a._host, b._host)


def _elementwise(ufunc):
    def kernel(a, b, out=None):
        a_host = a._host if isinstance(a, ndarray) else a
        b_host = b._host if isinstance(b, ndarray) else b
        if out is None:
            out = empty(np.broadcast_shapes(np.shape(a_host), np.shape(b_host)),
                        np.result_type(a_host, b_host))
        target = out._host
        _launch(lambda: ufunc(a_host, b_host, out=target))
        return out

    kernel.__name__ = ufunc.__name__
    return kernel


class ElementwiseKernel:
    """``cupy.ElementwiseKernel`` for the operations mpiallreduce writes: one assignment to the
    output whose right side is also a Python expression (names, ``+``, ``*``, parentheses, calls of
    ``mpiallreduce_max``/``mpiallreduce_min``, which the preamble defines on a GPU and numpy's
    maximum/minimum stand in for here). Evaluated with numpy, in the inputs' dtype, when the stream runs it."""

    _functions = {"mpiallreduce_max": np.maximum, "mpiallreduce_min": np.minimum}

    def __init__(self, in_params, out_params, operation, name="kernel", preamble="", **options):
        self.inputs = [param.split()[-1] for param in in_params.split(",")]
        self.outputs = [param.split()[-1] for param in out_params.split(",")]
        target, _, expression = operation.strip().rstrip(";").partition("=")
        if len(self.outputs) != 1 or target.strip() != self.outputs[0]:
            raise NotImplementedError(f"the stand-in runs one assignment to the one output, not {operation!r}")
        self.code = compile(expression.strip(), name, "eval")
        self.name = name

    def __call__(self, *args):
        if len(args) != len(self.inputs) + 1:
            raise TypeError(f"{self.name} takes {len(self.inputs)} inputs and the output")
        hosts = [a._host if isinstance(a, ndarray) else a for a in args[:-1]]
        target = args[-1]._host
        variables = dict(zip(self.inputs, hosts))

        def run():
            with np.errstate(all="ignore"):
                np.copyto(target, eval(self.code, dict(self._functions), variables), casting="unsafe")

        counts["elementwise_launches"] += 1
        _launch(run)
        return args[-1]


add = _elementwise(np.add)
multiply = _elementwise(np.multiply)
minimum = _elementwise(np.minimum)
maximum = _elementwise(np.maximum)
divide = _elementwise(np.divide)
true_divide = divide


# ---------------------------------------------------------------------------------------------
# cuda: devices, pinned memory, IPC

_opened = {}  # base address -> (mmap, size), peers' memory mapped here


def _device_count():
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return int(os.environ.get("FAKE_CUPY_DEVICE_COUNT", "1"))


class _Device:
    _selected = 0

    def __init__(self, device=None):
        self.id = _Device._selected if device is None else int(device)

    def use(self):
        if not 0 <= self.id < _device_count():
            raise RuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")
        _Device._selected = self.id

    def synchronize(self):
        _null_stream.synchronize()

    def __enter__(self):
        self._previous = _Device._selected
        self.use()
        return self

    def __exit__(self, *exc):
        _Device._selected = self._previous


def _ipc_get_mem_handle(ptr):
    base, size = _allocation_range(ptr)
    memory = _allocations.get(base)
    if memory is None:
        raise RuntimeError("cudaErrorInvalidValue: not memory this process allocated")
    return memory.name.encode().ljust(64, b"\0")


def _ipc_open_mem_handle(handle, flags=1):
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


runtime = types.SimpleNamespace(
    getDeviceCount=_device_count,
    getDevice=lambda: _Device._selected,
    setDevice=lambda i: _Device(i).use(),
    ipcGetMemHandle=_ipc_get_mem_handle,
    ipcOpenMemHandle=_ipc_open_mem_handle,
    ipcCloseMemHandle=_ipc_close_mem_handle,
    cudaIpcMemLazyEnablePeerAccess=1,
)

cuda = types.SimpleNamespace(
    Stream=Stream,
    Event=Event,
    Device=_Device,
    MemoryPointer=MemoryPointer,
    UnownedMemory=UnownedMemory,
    get_current_stream=get_current_stream,
    alloc_pinned_memory=lambda nbytes: bytearray(max(int(nbytes), 1)),
    runtime=runtime,
    is_available=lambda: True,
)
cuda.Stream.null = _null_stream


def synchronize_all():
    """Run every queued kernel of every stream this module knows of (for tests' teardown)."""
    _null_stream.synchronize()
