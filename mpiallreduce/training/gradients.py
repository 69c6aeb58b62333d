"""Gradient synchronization for data-parallel training: fixed buckets, averaging, identical replicas.

    sync = GradientSync(parameters=params, bucket_bytes=25 * 2**20)   # {name: array}, as DDP takes the model
    for name, grad in reversed(gradients.items()):                     # as backward produces them
        sync.ready(grad, name=name)   # a bucket is allreduced in the background once all its members are ready
    sync.wait()                       # every gradient now holds the mean over the ranks, in place

Many small gradients cost a few large allreduces instead of hundreds of small ones (torch DDP's
25 MB buckets, Horovod's tensor fusion). The buckets are fixed once (mpiallreduce.buckets): from
the declared parameters, in reverse order, or, without them, from the first step's ``ready``
calls, which the ranks compare at its ``wait``. Gradients may then arrive in any order on any
rank; bucket n holds the same gradients everywhere. Each bucket carries a digest of what this
rank put in it, inside its own allreduce: a rank that marked other gradients, in another order, of
another shape, or missed one, makes every rank raise the same ValueError at ``wait()``, naming
the gradient and the ranks, never wrong values. With ``find_unused=True`` a gradient a rank did not
mark ready counts as zeros there (DDP's ``find_unused_parameters``).

float16 and bfloat16 (ml_dtypes) are summed in float32 and rounded once, on the way back.
``compression="fp16"`` or ``"bf16"`` sends 16 bits per element and still sums in float32
(mpiallreduce.compression). Gradients may be numpy or CuPy arrays (device buckets for device
gradients, fused and written back on the GPU, ordered on CuPy's current stream).
"""
import contextlib
import hashlib

import numpy as np
from mpi4py import MPI

from ..core.consistency import describe_differences
from .buckets import (DIGEST_ELEMENTS, GradientSpec, Slot, accumulation_dtype, digest_elements, digest_of,
                      digests_agree, plan_buckets)
from ..core.buffers import mpi_datatype
from .compression import check_compression, compressed_allreduce
from ..device.arrays import namespace, synchronize

__all__ = ["GradientSync", "GradientSpec", "broadcast_parameters", "check_replicas"]

class _Text(str):
    """A string that describe_differences shows as it is, without quotes."""

    def __repr__(self):
        return str(self)


_OK, _MISSING = _Text("ready"), _Text("not marked ready")

#: gradients of at least this many bytes (in their accumulation dtype) are reduced in place, not
#: copied into a bucket's buffer and back (mpiallreduce.buckets)
DIRECT_MIN_BYTES = 1 << 20


class GradientSync:
    """Fuses gradients into fixed buckets, allreduces each in the background as soon as all its
    gradients are ready, writes the results back in place at ``wait()``.

    Args:
        comm: communicator of the replicas (COMM_WORLD if None).
        bucket_bytes: a bucket holds gradients (in backward's order) until it has this many bytes.
        op: "mean" (default) or "sum".
        algorithm: passed to allreduce ("auto" by default).
        prescale, postscale: multiply each gradient before the reduction / the result after it.
        timeout: seconds each bucket's allreduce waits for the other ranks (see allreduce); None:
            MPIALLREDUCE_TIMEOUT, else for ever.
        parameters: the gradients to expect, as DDP takes the model: a dict {name: array} or a
            list of arrays (the gradient arrays, or the parameters themselves, or GradientSpec:
            only shape, dtype and device are read). Collective: the ranks compare them here.
            ``ready(grad, name=...)`` then names the gradient (a dict key, or a list index); without
            a name, ``grad`` must be the declared array itself. Without ``parameters``, the first
            step's ``ready`` calls declare them, in their order (that step's buckets start at
            ``wait``), and the n-th ``ready`` of a later step is the n-th gradient; if every rank
            changes the gradients alike, the buckets are made again from that step.
        find_unused: a declared gradient that this rank did not mark ready counts as zeros here
            (torch DDP's ``find_unused_parameters``); ``wait()`` returns its result. Without it, a
            missing gradient is a ValueError on every rank at ``wait()``.
        compression: None, "fp16" or "bf16": float gradients travel as 16 bits, are summed in
            float32 and rounded once (complex ones travel as they are; see mpiallreduce.compression).
            Compressed buckets are not timed: no ``timeout`` with it.
        reproducible: every bucket's sum is reproducible (``allreduce(..., reproducible=True)``):
            the same bits whatever the bucket size, the algorithm, the ranks' order.
        rebuild_buckets: after the first step with declared parameters, if every rank's gradients
            arrived in one same order, refill the buckets in that order (as DDP does), so that
            each starts as early as it can.
    """

    def __init__(self, comm=None, bucket_bytes=25 * 2**20, op="mean", algorithm="auto", prescale=1.0,
                 postscale=1.0, timeout=None, *, parameters=None, find_unused=False, compression=None,
                 reproducible=False, rebuild_buckets=True):
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
        self.find_unused = bool(find_unused)
        self.compression = check_compression(compression)
        self.reproducible = bool(reproducible)
        if self.reproducible and self.compression:
            raise ValueError("GradientSync: compression rounds each contribution on the way: it cannot be "
                             "reproducible=True as well")
        if self.compression and timeout is not None:
            raise ValueError("GradientSync: compressed buckets cannot be timed yet (timeout=None with compression)")
        self.declared = parameters is not None
        self._rebuild_pending = bool(rebuild_buckets) and self.declared
        self._slots = None
        self._by_name, self._by_identity = {}, {}
        self._device_xp = None
        self._no_sync = 0
        self._buckets = []
        #: what every rank's GradientSync must have alike (compared with the gradients, collectively)
        self._options = {"bucket_bytes": bucket_bytes, "op": op, "algorithm": algorithm, "prescale": prescale,
                         "postscale": postscale, "timed": timeout is not None, "find_unused": self.find_unused,
                         "compression": compression, "reproducible": self.reproducible,
                         "rebuild_buckets": bool(rebuild_buckets), "declared": self.declared}
        if self.declared:
            named = list(parameters.items()) if isinstance(parameters, dict) else list(enumerate(parameters))
            slots = [_given_slot(name, array) for name, array in named]
            problems = [f"{slot.describe()}: {reason}" for slot, (_, array) in zip(slots, named)
                        if not isinstance(array, GradientSpec) and (reason := _problem(array)) is not None
                        and "read-only" not in reason]  # (parameters may be read-only views: only their shape counts)
            _agree_on_slots(self.comm, slots, "GradientSync(parameters=...)", self._options, problems)
            self._by_identity = {id(array): i for i, (_, array) in enumerate(named)}
            self._use_slots(slots, order=range(len(slots) - 1, -1, -1))
        self._new_step()

    # --- the plan ---------------------------------------------------------------------------

    def _use_slots(self, slots, order):
        self._slots = slots
        self._by_name = {slot.name: i for i, slot in enumerate(slots)}
        self._buckets = plan_buckets(slots, self.bucket_bytes, list(order),
                                     None if self.compression else DIRECT_MIN_BYTES)
        self._bucket_of = {}
        for bucket in self._buckets:
            for member in bucket.members:
                self._bucket_of[member] = bucket.index
        self._buffers = {}  # bucket index -> (fused buffer, PreparedAllreduce or None)
        self._digest_arrays = {}  # (bucket index, digest) -> its elements, in the bucket's memory
        self._zeros = {}  # slot -> the zeros reduced in place of a missing large gradient
        self._clean_digest = None  # the digest of a step where every gradient came as declared

    @property
    def buckets(self):
        """The buckets, in the order they are started: lists of gradient names."""
        return [[self._slots[i].name for i in bucket.members] for bucket in self._buckets]

    def _new_step(self):
        self._filled = {}  # slot -> the gradient given for it
        self._status = {}  # slot -> how it differs from the plan (its description), when it does
        self._extras = []  # gradients that have no slot
        self._arrivals = []  # slot indices, in the order they were marked ready
        self._calls = []  # (grad, name): what this step was given, to replan from
        self._arrived = [0] * len(self._buckets)
        self._next_bucket = 0
        self._in_flight = []

    # --- a step -------------------------------------------------------------------------------

    @property
    def in_no_sync(self):
        """Whether a ``no_sync()`` block is open."""
        return self._no_sync > 0

    @contextlib.contextmanager
    def no_sync(self):
        """Within it, ``ready`` and ``wait`` do nothing (DDP's ``no_sync``): accumulate gradients over
        micro-batches, then reduce once, in the first step outside it. As with DDP, every rank must
        enter it for the same micro-batches: a rank that reduces while the others do not waits for
        them (for ever, or until ``timeout``, which then names the ranks that did not come)."""
        self._no_sync += 1
        try:
            yield self
        finally:
            self._no_sync -= 1

    def ready(self, grad, name=None):
        """Mark ``grad`` (a writeable numpy array, or a CuPy array) ready; start every bucket that is
        then complete, in bucket order. ``name``: the declared parameter it is the gradient of."""
        if self._no_sync:
            return
        # Nothing here raises: what is wrong with a gradient (it is not a writeable float array,
        # not declared, of another shape...) is recorded and reaches every rank through the
        # digest, so that every rank's wait() raises, not only this one's (leaving the others in
        # the next bucket's allreduce).
        problem = _problem(grad)
        if problem is None and self._device_xp is None and _on_device(grad):
            self._device_xp = namespace(grad)
        self._calls.append((grad, name))
        if self._slots is None:  # the first step declares the gradients: its buckets start at wait()
            return
        if self.declared:
            index = self._by_name.get(str(name)) if name is not None else self._by_identity.get(id(grad))
        else:
            index = len(self._arrivals) if len(self._arrivals) < len(self._slots) else None
        given = _given_slot(name if name is not None else index, grad)
        described = given.describe() + (f" ({problem})" if problem else "")
        self._arrivals.append(index)
        if index is None:
            self._extras.append(described)
            return
        slot = self._slots[index]
        if index in self._filled or index in self._status:
            self._status[index] = f"marked ready twice (once as {described})"
            return
        if problem is not None or (given.shape, given.dtype, given.device) != (slot.shape, slot.dtype, slot.device) or (
                not self.declared and name is not None and given.name != slot.name):
            self._status[index] = f"given {described}"
        else:
            self._filled[index] = grad
        bucket = self._bucket_of[index]
        self._arrived[bucket] += 1
        last = len(self._buckets) - 1  # (the last bucket starts at wait(): its digest counts the extras)
        while self._next_bucket < last and self._arrived[self._next_bucket] == len(
                self._buckets[self._next_bucket].members):
            self._start(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _step_contents(self):
        """What this rank gave for each gradient this step, and what it gave that has no slot: the
        digest's input, and what the ranks compare when the digests differ."""
        contents = {}
        for index, slot in enumerate(self._slots):
            if index in self._status:
                contents[slot.describe()] = _Text(self._status[index])
            elif index in self._filled or self.find_unused:
                contents[slot.describe()] = _OK
            else:
                contents[slot.describe()] = _MISSING
        contents["gradients marked ready that were not expected"] = _Text(", ".join(self._extras) or "none")
        return contents

    def _start(self, bucket):
        """Start the bucket's allreduces in the background: its small members fused in its buffer
        (zeros where a gradient is missing; the last bucket's followed by the step's digest), its
        large ones in place. The n-th bucket's buffer and prepared call are made at its first
        start (mpiallreduce.prepare: agreed on and planned once) and kept."""
        from ..api import allreduce_async, prepare_at
        xp = self._device_xp if bucket.device else np
        if xp is None:  # a device bucket none of whose gradients came: any device module will do
            import cupy as xp
        last = bucket.index == len(self._buckets) - 1
        compressed = self.compression is not None and bucket.dtype.kind == "f"
        digest = self._digest() if last else 0
        carries_digest = last and not compressed
        # a mean is divided by the library, in the background, except where a digest rides along
        # (and for reproducible sums: then every gradient is divided alike, in its own dtype, at wait)
        fused_op = "sum" if carries_digest or self.reproducible else self.op
        direct_op = "sum" if self.reproducible else self.op
        handles = []
        if bucket.count or last:
            fused, prepared = self._buffers.get(bucket.index, (None, None))
            if fused is None:
                fused = xp.empty(bucket.count + (DIGEST_ELEMENTS if carries_digest else 0), dtype=bucket.dtype)
            for index, offset in zip(bucket.fused, bucket.offsets):
                slot = self._slots[index]
                view = fused[offset:offset + slot.count].reshape(slot.shape)
                grad = self._filled.get(index)
                if grad is None:
                    view.fill(0)
                else:
                    xp.copyto(view, grad, casting="unsafe")
            payload = fused[:bucket.count]
            if self.prescale != 1.0:
                xp.multiply(payload, bucket.dtype.type(self.prescale), out=payload)
            if compressed:
                handle = self._start_compressed(fused, digest)
            elif self.reproducible:
                if carries_digest:
                    xp.copyto(fused[bucket.count:], self._digest_array(xp, bucket, digest))
                handle = allreduce_async(fused, op=fused_op, algorithm=self.algorithm, comm=self.comm, out=fused,
                                         timeout=self.timeout, reproducible=True)
            else:
                if carries_digest:
                    xp.copyto(fused[bucket.count:], self._digest_array(xp, bucket, digest))
                if prepared is None:
                    prepared = prepare_at("", fused, op=fused_op, algorithm=self.algorithm, comm=self.comm, out=fused,
                                          timeout=self.timeout)
                handle = prepared.start()
            self._buffers[bucket.index] = (fused, prepared)
            handles.append((None, handle))
        for index in bucket.direct:
            memory = self._filled.get(index)
            if memory is None:  # zeros in its place (find_unused), or a gradient that did not fit its slot
                memory = self._zeros.get(index)
                if memory is None:
                    slot = self._slots[index]
                    memory = self._zeros[index] = xp.empty(slot.shape, dtype=bucket.dtype)
                memory.fill(0)
            elif self.prescale != 1.0:
                xp.multiply(memory, bucket.dtype.type(self.prescale), out=memory)
            handles.append((index, allreduce_async(memory, op=direct_op, algorithm=self.algorithm, comm=self.comm,
                                                   out=memory, timeout=self.timeout,
                                                   reproducible=self.reproducible)))
        self._in_flight.append((bucket, handles, digest, compressed, fused_op == "sum" and self.op == "mean"))

    def _clean(self):
        """Whether every gradient came as declared this step (nothing to tell the others)."""
        return not self._status and not self._extras and (self.find_unused or len(self._filled) == len(self._slots))

    def _digest(self):
        """The digest of this step's contents; that of a step where every gradient came as declared
        is made once (the common case: no walk over every gradient on every step)."""
        clean = self._clean()
        if clean and self._clean_digest is not None:
            return self._clean_digest
        digest = digest_of(tuple(self._step_contents().items()))
        if clean:
            self._clean_digest = digest
        return digest

    def _digest_array(self, xp, bucket, digest):
        """The digest's elements in xp's memory: made once for each digest a bucket has (a copy to
        the device would wait for the host), then copied from on the stream."""
        key = (bucket.index, digest)
        elements = self._digest_arrays.get(key)
        if elements is None:
            if len(self._digest_arrays) > 4 * len(self._buckets):
                self._digest_arrays.clear()
            elements = self._digest_arrays[key] = xp.asarray(digest_elements(digest).astype(bucket.dtype))
        return elements

    def _start_compressed(self, fused, digest):
        from ..core.worker import submit
        from ..core.state import state_of
        state = state_of(self.comm)  # (on the caller's thread, in program order: collective the first time)
        xp = namespace(fused)
        mean, postscale, compression = self.op == "mean", self.postscale, self.compression

        def run():
            state.make_ready()
            host = fused if xp is None else xp.asnumpy(fused)
            agreed = compressed_allreduce(state.library, host, compression, digest, mean, postscale)
            if xp is not None:
                xp.copyto(fused, xp.asarray(host))
            return agreed
        return submit(run, fused, f"{compression} bucket of {fused.size} {fused.dtype}", None)

    def wait(self):
        """Start the buckets not yet started, wait for every bucket, write the results back in place.

        Returns {name: result} for the declared gradients this rank did not mark ready (with
        ``find_unused``): what the other ranks' gradients summed (or averaged) to.

        Raises:
            ValueError, on every rank: the ranks' gradients differ (names, shapes, dtypes, order, or
                one missing without ``find_unused``); no gradient was changed.
            what a bucket's allreduce raised (a timeout, a lost rank), once every bucket is done;
                the gradients are then partly synchronized: recompute them.
        """
        if self._no_sync:
            return {}
        if self._slots is None:
            calls = self._calls
            slots = [_given_slot(name if name is not None else i, grad) for i, (grad, name) in enumerate(calls)]
            problems = [f"{slot.describe()}: {reason}" for slot, (grad, _) in zip(slots, calls)
                        if (reason := _problem(grad)) is not None]
            _agree_on_slots(self.comm, slots, "GradientSync: the first step's gradients", self._options, problems)
            if not slots:
                self._new_step()
                return {}
            self._use_slots(slots, order=range(len(slots)))
            self._replay(calls)
        for bucket in self._buckets[self._next_bucket:]:
            self._start(bucket)
        self._next_bucket = len(self._buckets)
        in_flight = self._in_flight
        first_error, agreed = None, True
        for bucket, handles, digest, compressed, _ in in_flight:
            for index, handle in handles:
                try:
                    result = handle.wait()
                except Exception as error:  # noqa: BLE001 - re-raised below, once every bucket is done
                    first_error = first_error or error
                    continue
                if index is None and bucket.index == len(self._buckets) - 1:
                    if compressed:
                        agreed = result
                    else:
                        tail = self._buffers[bucket.index][0][bucket.count:]
                        agreed = digests_agree(tail if namespace(tail) is None else namespace(tail).asnumpy(tail),
                                               digest, self.comm.Get_size())
        if first_error is not None:
            self._new_step()
            raise first_error
        if not agreed:
            message = self._describe_differences()  # collective: every rank saw the digests differ
            self._new_step()
            raise ValueError(message)
        trouble = self._local_trouble()
        if trouble:  # the same on every rank (the digests agreed)
            if not self.declared:  # every rank's gradients changed alike: plan anew from this step
                self._slots = None
                self._replay(self._calls)
                return self.wait()
            self._new_step()
            raise ValueError("GradientSync: on every rank, " + "; ".join(trouble))
        unused = self._write_back(in_flight)
        if self._rebuild_pending:
            self._rebuild_pending = False
            self._rebuild_from(self._arrivals)
        self._new_step()
        return unused

    def _replay(self, calls):
        self._new_step()
        for grad, name in calls:
            self.ready(grad, name)

    def _write_back(self, in_flight):
        size = self.comm.Get_size()
        unused = {}
        for bucket, handles, _, _, divide in in_flight:
            xp = self._device_xp if bucket.device else np
            for index, _ in handles:
                if index is None:  # the fused members: from the buffer
                    fused = self._buffers[bucket.index][0]
                    payload = fused[:bucket.count]
                    self._finish(xp, payload, bucket, size, divide)
                    for member, offset in zip(bucket.fused, bucket.offsets):
                        slot = self._slots[member]
                        result = payload[offset:offset + slot.count].reshape(slot.shape)
                        grad = self._filled.get(member)
                        if grad is not None:
                            xp.copyto(grad, result, casting="unsafe")
                        else:
                            unused[slot.name] = result.copy()
                    continue
                grad = self._filled.get(index)  # reduced in place
                self._finish(xp, grad if grad is not None else self._zeros[index], bucket, size,
                             self.reproducible and self.op == "mean")
                if grad is None:
                    unused[self._slots[index].name] = self._zeros[index].copy()
        return unused

    def _finish(self, xp, result, bucket, size, divide):
        if divide:
            xp.divide(result, bucket.dtype.type(size), out=result)
        if self.postscale != 1.0:
            xp.multiply(result, bucket.dtype.type(self.postscale), out=result)

    def _local_trouble(self):
        if self._clean():
            return []
        trouble = [f"{self._slots[i].describe()} was {status}" for i, status in sorted(self._status.items())]
        if not self.find_unused:
            missing = [self._slots[i].name for i in range(len(self._slots))
                       if i not in self._filled and i not in self._status]
            if missing:
                trouble.append(f"{len(missing)} declared gradient(s) were not marked ready: {missing[:8]} "
                               "(pass find_unused=True to count them as zeros)")
        if self._extras:
            trouble.append(f"gradients that were not declared were marked ready: {self._extras[:8]}")
        return trouble

    def _describe_differences(self):
        """Every rank's contents of the step, compared (collective)."""
        everyone = self.comm.allgather(self._step_contents())
        lines = describe_differences(everyone)
        bucket_of = {self._slots[i].describe(): self._bucket_of[i] for i in range(len(self._slots))}
        where = next((bucket_of[line.split(" differs:")[0]] for line in lines
                      if line.split(" differs:")[0] in bucket_of), None)
        missing = any(_MISSING in theirs.values() for theirs in everyone)
        hint = "" if not missing else ("\n(a gradient not marked ready on some ranks: an unused parameter there? "
                                       "pass find_unused=True to count it as zeros there)")
        in_place = [self._slots[i].name for b in self._buckets for i in b.direct]
        changed = ("no gradient was changed" if not in_place else
                   f"no gradient was written back, but those reduced in place ({len(in_place)} of "
                   f"{DIRECT_MIN_BYTES >> 20} MiB or more) hold sums of unlike data now: recompute them")
        return ("GradientSync: the ranks' gradients differ"
                + (f" (first in bucket {where} of {len(self._buckets)})" if where is not None else "")
                + f"; {changed}:\n  " + "\n  ".join(lines) + hint)

    def _rebuild_from(self, arrivals):
        """DDP's bucket rebuild: if every rank marked all the gradients ready once, in one same order,
        fill the buckets in that order from now on (collective, once)."""
        complete = sorted(a for a in arrivals if a is not None) == list(range(len(self._slots)))
        orders = self.comm.allgather(list(arrivals) if complete else None)
        if orders[0] is not None and all(order == orders[0] for order in orders):
            if [m for b in self._buckets for m in b.members] != orders[0]:
                self._use_slots(self._slots, order=orders[0])

    def synchronize(self, gradients):
        """``ready`` every gradient in order, then ``wait``; returns the gradients."""
        for grad in gradients:
            self.ready(grad)
        self.wait()
        return gradients


def _on_device(array):
    if isinstance(array, GradientSpec):
        return bool(array.device)
    return namespace(array) is not None


def _agree_on_slots(comm, slots, what, options, problems=()):
    """One allgather: every rank has the same options and slots and no rank has a problem with its
    gradients, or every rank raises the same error naming the ranks and the first difference."""
    everyone = comm.allgather((options, list(problems), slots))
    troubled = [(rank, p) for rank, (_, theirs, _) in enumerate(everyone) for p in theirs]
    if troubled:
        raise TypeError(f"{what}: gradients that are not writeable float or complex arrays:\n  "
                        + "\n  ".join(f"rank {rank}: {p}" for rank, p in troubled[:8]))
    differences = describe_differences([theirs for theirs, _, _ in everyone])
    if differences:
        raise ValueError(f"{what}: the ranks' GradientSync options differ:\n  " + "\n  ".join(differences))
    every_slots = [theirs for _, _, theirs in everyone]
    if all(theirs == every_slots[0] for theirs in every_slots):
        return
    lengths = {len(theirs) for theirs in every_slots}
    fields = [{"count": len(theirs)} for theirs in every_slots] if len(lengths) > 1 else []
    if not fields:
        first = next(i for i in range(len(slots)) if len({theirs[i] for theirs in every_slots}) > 1)
        fields = [{f"gradient #{first}": _Text(theirs[first].describe())} for theirs in every_slots]
    raise ValueError(f"{what}: the ranks hold different gradients:\n  " + "\n  ".join(describe_differences(fields)))


def _problem(grad):
    """Why ``grad`` cannot be a gradient (a line), or None."""
    if namespace(grad) is None and (not isinstance(grad, np.ndarray) or not grad.flags.writeable):
        if isinstance(grad, np.ndarray):
            return "a read-only numpy array"
        return f"a {type(grad).__name__}, not a writeable numpy array or a CuPy array"
    try:
        accumulation_dtype(grad.dtype)
    except TypeError as error:
        return str(error)
    return None


def _given_slot(name, grad):
    """What was given for a gradient, as a Slot (whatever it is)."""
    if isinstance(grad, GradientSpec) or hasattr(grad, "dtype") and hasattr(grad, "shape"):
        try:
            return Slot.of(name, grad, _on_device(grad))
        except TypeError:
            pass
    return Slot(str(name), tuple(getattr(grad, "shape", ())), type(grad).__name__, False)


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
