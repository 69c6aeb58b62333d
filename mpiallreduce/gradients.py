"""Gradient synchronization for data-parallel training: fused buckets, averaging, identical replicas.

    sync = GradientSync(bucket_bytes=25 * 2**20, op="mean")
    for grad in reversed(gradients):      # as backward produces them
        sync.ready(grad)                  # a bucket is allreduced in the background once it is full
    sync.wait()                           # every gradient now holds the mean over the ranks, in place

Many small gradients cost a few large allreduces instead of hundreds of small ones (torch DDP's
25 MB buckets, Horovod's tensor fusion). Every rank must mark the same gradients ready in the same
order (as data-parallel replicas do). float16 and bfloat16 (ml_dtypes) are summed in float32 and
rounded once, on the way back. Gradients may be numpy or CuPy arrays (device buckets for device
gradients, fused and written back on the GPU).
"""
import hashlib

import numpy as np
from mpi4py import MPI

from .agreement import describe_differences
from .buffers import array_module, mpi_datatype
from .device import namespace, synchronize

__all__ = ["GradientSync", "broadcast_parameters", "check_replicas"]

#: how many prepared bucket calls a GradientSync keeps (buckets that change every step are
#: prepared anew each time, beyond these)
MAX_PREPARED_BUCKETS = 256


def accumulation_dtype(dtype):
    """float16, bfloat16 (ml_dtypes) and narrower floats are summed in float32; the rest in their own type."""
    dtype = np.dtype(dtype)
    if (dtype.kind == "f" and dtype.itemsize < 4) or dtype.name == "bfloat16":  # ml_dtypes' bfloat16
        return np.dtype(np.float32)
    if dtype.kind not in "fc":
        raise TypeError(f"gradients must be floating or complex arrays, got dtype {dtype}")
    return dtype


class _Bucket:
    def __init__(self, dtype):
        self.dtype = dtype
        self.members = []
        self.nbytes = 0

    def add(self, grad):
        self.members.append(grad)
        self.nbytes += grad.size * self.dtype.itemsize


class GradientSync:
    """Fuses gradients into buckets, allreduces full buckets asynchronously, writes results back in place.

    Args:
        comm: communicator of the replicas (COMM_WORLD if None).
        bucket_bytes: a bucket is started once it holds at least this many bytes.
        op: "mean" (default) or "sum".
        algorithm: passed to allreduce ("auto" by default).
        prescale, postscale: multiply each gradient before the reduction / the result after it.
        timeout: seconds each bucket's allreduce waits for the other ranks (see allreduce); None:
            MPIALLREDUCE_TIMEOUT, else for ever.
    """

    def __init__(self, comm=None, bucket_bytes=25 * 2**20, op="mean", algorithm="auto", prescale=1.0,
                 postscale=1.0, timeout=None):
        if op not in ("mean", "sum"):
            raise ValueError(f"GradientSync op must be 'mean' or 'sum', got {op!r}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.bucket_bytes = bucket_bytes
        self.op = op
        self.algorithm = algorithm
        self.prescale = prescale
        self.postscale = postscale
        self.timeout = timeout
        self._open = {}
        self._in_flight = []
        #: (position in the step, array module, dtype, count) -> (fused buffer, PreparedAllreduce)
        self._prepared = {}
        self._position = 0

    def ready(self, grad):
        """Mark ``grad`` (a writeable numpy array, or a CuPy array) ready; start its bucket if that is now full."""
        on_device = namespace(grad) is not None
        if not on_device and (not isinstance(grad, np.ndarray) or not grad.flags.writeable):
            raise TypeError(f"a gradient must be a writeable numpy array or a CuPy array, got {type(grad).__name__}")
        dtype = accumulation_dtype(grad.dtype)
        key = ("device" if on_device else "host", dtype.str)
        bucket = self._open.setdefault(key, _Bucket(dtype))
        bucket.add(grad)
        if bucket.nbytes >= self.bucket_bytes:
            self._start(self._open.pop(key))

    def _start(self, bucket):
        """Fuse the bucket into its buffer and start its prepared allreduce in the background.

        The n-th bucket of a step, of the same kind, dtype and size as last step's, reuses last
        step's buffer and prepared call (mpiallreduce.prepare: agreed on and planned once): no
        allocation, no plan, no check per step. A bucket unlike last step's is prepared anew
        (collective: the ranks' buckets are compared then, and one that differs is an error on
        every rank)."""
        xp = array_module(bucket.members[0])
        count = sum(g.size for g in bucket.members)
        key = (self._position, xp.__name__, bucket.dtype.str, count)
        self._position += 1
        entry = self._prepared.get(key)
        fused = xp.empty(count, dtype=bucket.dtype) if entry is None else entry[0]
        offset = 0
        for grad in bucket.members:
            view = fused[offset:offset + grad.size].reshape(grad.shape)
            xp.copyto(view, grad, casting="unsafe")
            offset += grad.size
        if self.prescale != 1.0:
            xp.multiply(fused, bucket.dtype.type(self.prescale), out=fused)
        if entry is None:
            from .api import prepare_at
            entry = (fused, prepare_at("", fused, op=self.op, algorithm=self.algorithm, comm=self.comm, out=fused,
                                       timeout=self.timeout))
            if len(self._prepared) < MAX_PREPARED_BUCKETS:
                self._prepared[key] = entry
        handle = entry[1].start()
        self._in_flight.append((handle, fused, bucket.members))

    def wait(self):
        """Start the partly filled buckets, wait for every bucket, write the results back in place.

        If a bucket's allreduce fails (a timeout, a lost rank), every bucket is still waited for,
        then the first error is raised; the gradients are then partly synchronized: recompute them.
        """
        for key in sorted(self._open):
            self._start(self._open.pop(key))
        in_flight, self._in_flight = self._in_flight, []
        self._position = 0
        first_error = None
        for handle, fused, members in in_flight:
            try:
                handle.wait()
            except Exception as error:  # noqa: BLE001 - re-raised below, once every bucket is done
                first_error = first_error or error
                continue
            xp = array_module(fused)
            if self.postscale != 1.0:
                xp.multiply(fused, fused.dtype.type(self.postscale), out=fused)
            offset = 0
            for grad in members:
                xp.copyto(grad, fused[offset:offset + grad.size].reshape(grad.shape), casting="unsafe")
                offset += grad.size
        if first_error is not None:
            raise first_error

    def synchronize(self, gradients):
        """``ready`` every gradient in order, then ``wait``; returns the gradients."""
        for grad in gradients:
            self.ready(grad)
        self.wait()
        return gradients


def _named(arrays):
    """[(name, array)] in an order every rank agrees on: dict keys sorted, list positions."""
    if isinstance(arrays, dict):
        return sorted(arrays.items())
    return [(str(i), a) for i, a in enumerate(arrays)]


def _agree_on_layout(comm, named, what):
    layout = {"names": [name for name, _ in named]}
    layout.update((name, (tuple(a.shape), str(a.dtype))) for name, a in named)
    differences = describe_differences(comm.allgather(layout))
    if differences:
        raise ValueError(f"{what}: the ranks hold different arrays:\n  " + "\n  ".join(differences))


def broadcast_parameters(arrays, root=0, comm=None):
    """Copy rank ``root``'s arrays (a list, or a dict by name) into every rank's, in place.

    The ranks first agree that they hold the same names, shapes and dtypes (else ValueError on all).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    named = _named(arrays)
    _agree_on_layout(comm, named, "broadcast_parameters")
    for _, array in named:
        xp = namespace(array)
        if xp is not None:  # device memory: through the host (parameters are broadcast once)
            host = xp.asnumpy(array)
            comm.Bcast([host.reshape(-1), mpi_datatype(array.dtype)], root=root)
            xp.copyto(array, xp.asarray(host))
            synchronize(xp)
            continue
        buffer = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        comm.Bcast([buffer.reshape(-1), mpi_datatype(array.dtype)], root=root)
        if buffer is not array:
            np.copyto(array, buffer)
    return arrays


def check_replicas(arrays, comm=None):
    """Raise ValueError on every rank, naming the ranks and the first array that differs, unless
    every rank's arrays (a list, or a dict by name) are bitwise identical."""
    comm = MPI.COMM_WORLD if comm is None else comm
    named = _named(arrays)
    _agree_on_layout(comm, named, "check_replicas")
    digests = [hashlib.sha256(np.ascontiguousarray(_on_host(a)).tobytes()).hexdigest()[:16] for _, a in named]
    everyone = comm.allgather(digests)
    for index, (name, _) in enumerate(named):
        groups = {}
        for rank, rank_digests in enumerate(everyone):
            groups.setdefault(rank_digests[index], []).append(rank)
        if len(groups) > 1:
            parts = "; ".join(f"ranks {ranks} hold {digest}" for digest, ranks in groups.items())
            raise ValueError(f"replicas differ: array {name!r} is not the same on every rank ({parts})")


def _on_host(array):
    xp = namespace(array)
    return array if xp is None else xp.asnumpy(array)
