"""fake_cupy's arrays and kernels: ``ndarray`` (``__cuda_array_interface__`` over fake device
memory), the functions that make and copy arrays, and the asynchronous kernels (elementwise,
ElementwiseKernel)."""

import ctypes
import re

import numpy as np

from .fake_cupy_memory import _Memory, counts
from .fake_cupy_streams import _Device, _launch, get_current_stream


class _Flags:
    def __init__(self, host):
        self.c_contiguous = host.flags.c_contiguous
        self.f_contiguous = host.flags.f_contiguous


class MemoryPointer:
    """``cupy.cuda.MemoryPointer``: a memory object and an offset into it."""

    def __init__(self, mem, offset):
        self.mem = mem
        self.ptr = mem.ptr + offset


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
            raw = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(memptr.ptr))[
                :nbytes
            ]
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
    data = property(
        lambda self: MemoryPointer(UnownedMemory(self._host.ctypes.data, self.nbytes, self, 0), 0)
    )
    device = property(lambda self: _Device(0))  # (cuda.Device)

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
        (stream or get_current_stream()).launch(
            lambda: np.copyto(target, arr.reshape(target.shape))
        )

    def __repr__(self):
        return f"fake_cupy.ndarray(shape={self.shape}, dtype={self.dtype})"

    def __array__(self, *args, **kwargs):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )


def empty(shape, dtype=float, order="C"):
    return ndarray(shape, dtype)


def zeros(shape, dtype=float):
    array = empty(shape, dtype)
    array.fill(0)
    return array


def empty_like(array, dtype=None):
    return empty(array.shape, array.dtype if dtype is None else dtype)


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


def isnan(a):
    out = empty(a.shape, np.bool_)
    source, target = a._host, out._host
    _launch(lambda: np.isnan(source, out=target))
    return out


def where(condition, a, b):
    hosts = [v._host if isinstance(v, ndarray) else v for v in (condition, a, b)]
    out = empty(np.broadcast_shapes(*(np.shape(h) for h in hosts)), np.result_type(*hosts[1:]))
    target = out._host
    _launch(lambda: np.copyto(target, np.where(*hosts)))
    return out


def _elementwise(ufunc):
    def kernel(a, b, out=None):
        a_host = a._host if isinstance(a, ndarray) else a
        b_host = b._host if isinstance(b, ndarray) else b
        if out is None:
            out = empty(
                np.broadcast_shapes(np.shape(a_host), np.shape(b_host)),
                np.result_type(a_host, b_host),
            )
        target = out._host
        _launch(lambda: ufunc(a_host, b_host, out=target))
        return out

    kernel.__name__ = ufunc.__name__
    return kernel


class ElementwiseKernel:
    """``cupy.ElementwiseKernel`` for the operations mpiallreduce writes: one assignment to the
    output whose right side is also a Python expression (names, ``+``, ``*``, parentheses, calls of
    functions that the preamble defines). The preamble's functions are run as they are written
    there (``preamble_functions``), not replaced by numpy's: a rule of theirs that differs from
    numpy's (which argument wins a tie, say) shows here as it would on a GPU. Evaluated with numpy,
    in the inputs' dtype, when the stream runs it."""

    def __init__(self, in_params, out_params, operation, name="kernel", preamble="", **options):
        self.inputs = [param.split()[-1] for param in in_params.split(",")]
        self.outputs = [param.split()[-1] for param in out_params.split(",")]
        target, _, expression = operation.strip().rstrip(";").partition("=")
        if len(self.outputs) != 1 or target.strip() != self.outputs[0]:
            raise NotImplementedError(
                f"the stand-in runs one assignment to the one output, not {operation!r}"
            )
        self.code = compile(expression.strip(), name, "eval")
        self.name = name
        self._functions = preamble_functions(preamble)

    def __call__(self, *args):
        if len(args) != len(self.inputs) + 1:
            raise TypeError(f"{self.name} takes {len(self.inputs)} inputs and the output")
        hosts = [a._host if isinstance(a, ndarray) else a for a in args[:-1]]
        target = args[-1]._host
        variables = dict(zip(self.inputs, hosts, strict=True))

        def run():
            with np.errstate(all="ignore"):
                np.copyto(
                    target, eval(self.code, dict(self._functions), variables), casting="unsafe"
                )

        counts["elementwise_launches"] += 1
        _launch(run)
        return args[-1]


#: a preamble function the stand-in can run: ``template <typename T> __device__ T f(T a, T b)
#: { return (CONDITION) ? a : b; }``, CONDITION comparisons joined by ``||`` or ``&&``
_DEVICE_FUNCTION = re.compile(
    r"template\s*<typename T>\s*__device__\s+T\s+(\w+)\s*\(\s*T\s+(\w+)\s*,\s*T\s+(\w+)\s*\)"
    r"\s*\{\s*return\s*\((.*?)\)\s*\?\s*(\w+)\s*:\s*(\w+)\s*;\s*\}"
)


_COMPARISON = re.compile(r"\w+\s*(==|!=|<=|>=|<|>)\s*\w+")


def preamble_functions(preamble):
    """The preamble's two-argument functions as numpy functions that evaluate the same condition
    elementwise (``np.where``); NotImplementedError for a preamble of any other form."""
    functions = {}
    for name, a, b, condition, chosen, other in _DEVICE_FUNCTION.findall(preamble):
        if "||" in condition and "&&" in condition:
            raise NotImplementedError(f"the stand-in cannot run {condition!r} (both || and &&)")
        joiner = "||" if "||" in condition else "&&"
        parts = [part.strip() for part in condition.split(joiner)]
        odd = [part for part in parts if not _COMPARISON.fullmatch(part)]
        if (
            odd
        ):  # (anything else could mean one thing in C and another in Python: refused, not guessed)
            raise NotImplementedError(
                f"the stand-in runs comparisons of two names joined by || or &&, not {odd}"
            )
        python = {"||": " | ", "&&": " & "}[joiner].join(f"({part})" for part in parts)
        code = compile(f"where({python}, {chosen}, {other})", name, "eval")
        functions[name] = (
            lambda code, a, b: lambda x, y: eval(code, {"where": np.where}, {a: x, b: y})  # noqa: B023 (bound by the outer lambda)
        )(code, a, b)
    leftover = _DEVICE_FUNCTION.sub("", preamble).strip()
    if leftover:
        raise NotImplementedError(f"the stand-in cannot run this preamble: {leftover!r}")
    return functions


add = _elementwise(np.add)
multiply = _elementwise(np.multiply)
minimum = _elementwise(np.minimum)
maximum = _elementwise(np.maximum)
divide = _elementwise(np.divide)
true_divide = divide
left_shift = _elementwise(np.left_shift)
right_shift = _elementwise(np.right_shift)
bitwise_and = _elementwise(np.bitwise_and)
bitwise_or = _elementwise(np.bitwise_or)
