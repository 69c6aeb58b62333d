"""The public calls: ``allreduce``, ``prepare`` (a call made once, run many times), ``describe_call``.

A call flows one way:

    entry point    arguments checked, call site and settings captured, the communicator resolved
                   (mesh axis, groups) and its state made (mpiallreduce.state), all on the caller's
                   thread, in program order; the call numbered
    rendezvous     only with a timeout (mpiallreduce.faults.rendezvous)
    agreement      with ``check``: everything compared (one allgather); otherwise, from
                   ``signature_min_bytes`` on, shape, dtype, op and algorithm (on one node in shared memory,
                   else one 16-byte allreduce)
    plan           mpiallreduce.planner: what runs, decided once and cached
    execution      the algorithm on the library's own communicator, reductions ignoring
                   floating-point errors (np.errstate), as MPI's own do

A call that repeats one already made (same communicator, dtype, shape, op and algorithm, no check,
no timeout, contiguous numpy arrays) takes a short path with the plan it made the first time.
"""
import threading
import zlib

import numpy as np
from mpi4py import MPI

from .core import buffers
from .core.consistency import agree_on_call, describe_differences
from .algorithms.base import CallTags
from .core.worker import Meeting, _worker, check_thread_level, run_in_order, submit, submit_prepared
from .device.arrays import namespace
from .faults.errors import AllreduceAborted, AllreduceTimeout, call_site
from .faults.rendezvous import Rendezvous
from .faults.watch import PeerWatch
from .faults.ulfm import failure_of
from .core.mesh import resolve_communicator
from .core.ops import OPS, get_op, ignore_float_errors, restore_float_errors
from .core.planner import CallFacts, check_algorithm_name, plan_call
from .reproducible.exact import EXACT_OPS, sum_by_words
from .core.settings import settings
from .core.startup import check_world_matches_slurm
from .core.state import state_of
from .device.transports import run_on_device

__all__ = ["allreduce", "allreduce_async", "prepare", "PreparedAllreduce", "describe_call", "psum", "pmean", "pmax", "pmin",
           "CHECK_ENV"]

check_world_matches_slurm()  # the silent-singleton trap, before anything is reduced

#: environment variable that turns ``check`` on for every call (read once: mpiallreduce.settings)
CHECK_ENV = "MPIALLREDUCE_CHECK"
_WORLD = MPI.COMM_WORLD
_WORLD_FAST_CALLS = {}  # COMM_WORLD's state's fast_calls (the same dict, bound when the state is made)


def allreduce(x, op="sum", algorithm="auto", comm=None, out=None, check=False, *, axis=None, mesh=None,
              groups=None, timeout=None, reproducible=False):
    """Reduce ``x`` elementwise over every rank of ``comm``; every rank gets the same bits.

    Args:
        x: numpy or CuPy array, any shape, contiguous or strided, of an integer, float or complex
            dtype (float16 and bfloat16 included: the hand-written algorithms sum those in float32
            and round once). A CuPy array's result is a CuPy array on the same device, ordered on
            CuPy's current stream; see mpiallreduce.transports for how device memory travels.
        op: "sum", "prod", "min", "max" or "mean" (sum, then divided by the number of ranks;
            floating and complex dtypes only).
        algorithm: "auto" or one of ``mpiallreduce.ALGORITHMS``.
        comm: an mpi4py intracommunicator; ``MPI.COMM_WORLD`` if None.
        out: None for a new array, or an array of x's shape and dtype to write into; ``out=x``
            reduces in place. Otherwise ``x`` is not modified.
        check: True (or MPIALLREDUCE_CHECK=1) to have the ranks first agree that their arguments
            are valid and that shape, dtype, op, the algorithm ``auto`` resolved to, the call's
            number on ``comm`` and its call site (file:line) match; otherwise every rank raises the
            same ValueError/TypeError naming the ranks and what differs. Without it, calls of at
            least 64 KiB (MPIALLREDUCE_SIGNATURE_MIN_BYTES) still compare shape, dtype, op and
            algorithm, so that a mismatch is an error on every rank, never wrong values.
        axis: a mesh axis name or tuple of names: reduce over the ranks along it, of ``mesh`` or of
            the mesh made current with ``with mesh:`` (instead of ``comm``).
        mesh: a :class:`mpiallreduce.Mesh`; without ``axis``, all its ranks.
        groups: a partition of the ranks (of the axis, or of the communicator) into lists; each
            rank reduces with its own group only (``mean`` divides by that group's size).
        timeout: seconds (> 0) to wait for the other ranks to reach this call (default
            MPIALLREDUCE_TIMEOUT; None there: wait for ever); see mpiallreduce.faults.
        reproducible: True (op "sum" or "mean"; float16, bfloat16, float32, float64): the same bits
            whatever the algorithm, segment size, rank order, or ranks that add zeros: exact
            fixed-point accumulation (mpiallreduce.reproducible, which states the error bound);
            ``auto`` moves the bytes of an ordinary sum (the direct route).

    Returns:
        the result: ``out`` if given, else a new C-contiguous array shaped like ``x``.

    Raises:
        TypeError, ValueError: bad arguments, raised before any communication on the rank given
            them (on every rank, with ``check``); ValueError on every rank when the ranks' calls
            differ (with ``check``, or from 64 KiB on), or their settings do (mpiallreduce.settings).
        AllreduceTimeout: not every rank reached this call within ``timeout``, on every rank that did.
        RankFailure: a rank died during the call (under ULFM), on every survivor.
    """
    if reproducible:
        if (check is False and timeout is None and axis is None and mesh is None and groups is None and type(x) is
                np.ndarray and not _worker.pending and isinstance(op, str) and op in EXACT_OPS):  # (its short path)
            fast = (_WORLD_FAST_CALLS if comm is None else _fast_calls_of(comm)).get((x.shape, x.dtype, EXACT_OPS[op],
                                                                                      algorithm))
            if fast is not None:
                result = fast(x, out)
                if result is not None:
                    return result
        return _reproducible(x, op, algorithm, comm, out, check, axis, mesh, groups, timeout)
    if (check is False and timeout is None and axis is None and mesh is None and groups is None
            and type(x) is np.ndarray and not _worker.pending):
        fast = (_WORLD_FAST_CALLS if comm is None else _fast_calls_of(comm)).get((x.shape, x.dtype, op, algorithm))
        if fast is not None:
            result = fast(x, out)
            if result is not None:
                return result
    call = _Call.start(x, op, algorithm, comm, out, check, axis, mesh, groups, timeout)
    if _worker.pending and threading.current_thread() is not _worker.thread:
        return run_in_order(call.run)  # keep to the order in which this process started collectives
    return call.run()


def allreduce_async(x, op="sum", algorithm="auto", comm=None, out=None, check=False, **kwargs):
    """Start ``allreduce(x, ...)`` (same arguments) in the background; returns an AllreduceHandle.

    The communicator, its library state, the call's number and call site are taken here, on the
    calling thread, in program order; the worker thread only runs the call, on the library's own
    communicators. ``x`` (and ``out``) must not change until ``wait()`` returns: the worker reads
    and writes them meanwhile, and a change makes the result wrong on every rank (Horovod has the
    same rule). With ``check=True`` (or MPIALLREDUCE_DEBUG_INPUTS=1) the input is checksummed here
    and again when the reduction has finished, and the ranks agree: if it changed on any rank, every
    rank's ``wait()`` raises RuntimeError naming the ranks.
    """
    check_thread_level()
    unknown = set(kwargs) - {"axis", "mesh", "groups", "timeout", "reproducible"}
    if unknown:
        raise TypeError(f"allreduce_async got unexpected keyword arguments {sorted(unknown)}")
    if kwargs.pop("reproducible", False):  # (its call is numbered on the worker, in the order of submission)
        run = _reproducible_call(x, op, algorithm, comm, out, check, kwargs.get("axis"), kwargs.get("mesh"),
                                 kwargs.get("groups"), kwargs.get("timeout"))
        description = f"reproducible allreduce of {x.shape} {x.dtype} op={op}"
        return submit(run, x, description, Meeting(None, ""))
    call = _Call.start(x, op, algorithm, comm, out, check, kwargs.get("axis"), kwargs.get("mesh"),
                       kwargs.get("groups"), kwargs.get("timeout"))
    meeting = call.meeting = Meeting(call.timeout, call.site)
    description = f"allreduce of {getattr(x, 'shape', '?')} {getattr(x, 'dtype', type(x).__name__)} op={op}"
    checked = call.check or settings().debug_inputs
    return submit(call.run, x, description, meeting, checksum_comm=call.state.library if checked else None)



def _reproducible(x, op, algorithm, comm, out, check, axis, mesh, groups, timeout):
    run = _reproducible_call(x, op, algorithm, comm, out, check, axis, mesh, groups, timeout)
    if _worker.pending and threading.current_thread() is not _worker.thread:
        return run_in_order(run)
    return run()


def _reproducible_call(x, op, algorithm, comm, out, check, axis, mesh, groups, timeout):
    """Check a reproducible call's arguments (no communication; on every rank with ``check``); the
    function that runs it: one allreduce of host arrays with op ``EXACT_OPS[op]``, whose plan says
    how (mpiallreduce.planner: the direct route, or the words route for an algorithm asked for)."""
    from .reproducible.exact import check_reproducible, reproducible_allreduce
    if axis is not None or mesh is not None or groups is not None:
        comm = resolve_communicator(comm, axis, mesh, groups)
    comm = _check_comm(_WORLD if comm is None else comm)

    def validate():
        buffers.check_array(x)
        check_reproducible(x, op, comm.Get_size())
        check_algorithm_name(algorithm, namespace(x) is not None)
        buffers.check_out(out, x)
    if check or settings().check:  # the ranks agree first, as for any call with check
        agree_on_call(comm, validate, dict(_signature(x, op, algorithm), reproducible=True))
    else:
        validate()  # a bad argument raises here, before any communication
    from .algorithms import HOST_ALGORITHMS
    host_algorithm = algorithm if algorithm in HOST_ALGORITHMS else "auto"  # (device arrays go through the host)

    def run_on_host(host, host_out):
        return _Call.start(host, EXACT_OPS[op], host_algorithm, comm, host_out, check, None, None, None, timeout).run()
    return lambda: reproducible_allreduce(x, op, out, run_on_host)


class _Call:
    """One call's arguments, captured by the entry point on the caller's thread."""

    __slots__ = ("x", "op", "algorithm", "out", "check", "timeout", "site", "state", "sequence", "meeting")

    @classmethod
    def start(cls, x, op, algorithm, comm, out, check, axis, mesh, groups, timeout, site=None):
        """Resolve the communicator, make its state and number the call: on the caller's thread."""
        call = cls()
        if not isinstance(check, bool):
            raise TypeError(f"check must be True or False, got {type(check).__name__} {check!r}")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
                raise ValueError(f"timeout must be a number of seconds > 0 (or None), got {timeout!r}")
        if axis is not None or mesh is not None or groups is not None:
            comm = resolve_communicator(comm, axis, mesh, groups)
        comm = _check_comm(_WORLD if comm is None else comm)
        current = settings()
        call.x, call.op, call.algorithm, call.out = x, op, algorithm, out
        call.check = check or current.check
        call.timeout = current.timeout if timeout is None else timeout
        # the call site (a walk up the stack) only where it is compared or reported
        call.site = site if site is not None else call_site() if (call.check or call.timeout is not None) else ""
        call.meeting = None
        call.state = state = state_of(comm, blocking=call.timeout is None)
        if comm is _WORLD and state.fast_calls is not _WORLD_FAST_CALLS:
            _WORLD_FAST_CALLS.clear()
            state.fast_calls = _WORLD_FAST_CALLS
        if state.settings is not current:  # settings replaced (tests): agree on them again
            state.renew_settings(current)
        if not call.check:
            _validate(x, op, algorithm, out)  # a bad argument raises here, before any communication
        state.sequence += 1  # (the calls that reach communication: with check, every call does)
        call.sequence = state.sequence
        return call

    def run(self):
        state = self.state
        if self.timeout is not None:  # (the same on every rank: the rendezvous is collective)
            if self.meeting is not None:  # allreduce_async: wait(timeout) may bring the deadline forward
                self.meeting(state, self.sequence, self.site).run()
            else:
                Rendezvous(state, self.sequence, self.timeout, self.site).run()
        state.make_ready()
        x = self.x
        if self.check:
            def prepare():
                _validate(x, self.op, self.algorithm, self.out)
                return _plan_for(state, x, self.op, self.algorithm)
            signature = dict(_signature(x, self.op, self.algorithm), call_number=self.sequence,
                             call_site=self.site)
            plan = agree_on_call(state.library, prepare, signature, resolve=lambda p: {"runs": p.name})
        xp = None if type(x) is np.ndarray else namespace(x)
        code = None
        if not self.check:
            plan = _plan_for(state, x, self.op, self.algorithm)
            code = _signature_code(x, self.op, plan) if plan.check_signature else None

        def describe():
            return _signature(x, self.op, plan.name)
        if code is not None and (xp is not None or not plan.algorithm.carries_signature):
            agree_on_signature(state, code, describe)
        signature = _carried_signature(state, plan, xp, x.nbytes, code, describe)
        flat = buffers.flat_buffers(x, self.out)
        op = get_op(self.op)
        result = execute(state, plan, flat, op, buffers.mpi_datatype(x.dtype), xp, self.sequence, signature,
                         self.timeout)
        if (xp is None and not self.check and self.timeout is None and plan.accumulate is None
                and x.flags.c_contiguous):
            _remember_fast_call(state, x, self.op, self.algorithm, plan, op)
        return result


def _check_comm(comm):
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator (MPI.Intracomm), got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL")
    return comm


def _validate(x, op, algorithm, out):
    """Every check that needs no communication; TypeError/ValueError naming what is wrong."""
    buffers.check_array(x)
    get_op(op).check_dtype(x.dtype)
    check_algorithm_name(algorithm, type(x) is not np.ndarray and namespace(x) is not None)
    buffers.check_out(out, x)


def _facts(state):
    from .device.arrays import cuda_aware
    return CallFacts(size=state.size, spans_nodes=state.spans_nodes, node_count=state.node_count,
                     equal_nodes=state.equal_nodes,
                     cuda_aware=bool(state.settings.cuda_aware) if state.settings.cuda_aware is not None
                     else cuda_aware()[0], signature_min_bytes=state.settings.signature_min_bytes)


def _plan_for(state, x, op, algorithm):
    facts = state.facts
    if facts is None:
        facts = state.facts = _facts(state)
    on_device = type(x) is not np.ndarray and namespace(x) is not None
    return plan_call(facts, on_device, x.dtype, x.nbytes, get_op(op).name, algorithm)


def _signature(x, op, algorithm):
    """What must be equal on every rank, in a form that pickles and compares whatever x is."""
    names = {"op": _plain(op), "algorithm": _plain(algorithm)}
    if isinstance(x, np.ndarray) or namespace(x) is not None:
        return {"memory": "host" if isinstance(x, np.ndarray) else "device", "shape": tuple(x.shape),
                "dtype": str(x.dtype), **names}
    return {"x": type(x).__name__, **names}


def _plain(value):
    return value if isinstance(value, str) else repr(value)


def _signature_code(x, op, plan):
    """A 63-bit digest of (shape, dtype, op, algorithm, memory kind): equal codes mean equal calls
    (but for a 2**-63 chance); computed once per repeated call (the short path keeps it)."""
    text = f"{x.shape}|{x.dtype.str}|{get_op(op).name}|{plan.name}|{type(x) is np.ndarray}".encode()
    return (zlib.crc32(text) << 31) ^ zlib.adler32(text[::-1])


def _carried_signature(state, plan, xp, nbytes, code, describe):
    """The CallSignature an algorithm that carries the comparison (shared_memory: its first barrier)
    is given, or None: the call's ``code`` when its signature is checked; otherwise, on one node,
    its size (negative, never a signature code). So every call such an algorithm runs on that
    communicator, checked or not, prepared or not, meets the others' in the same shared slots
    (never a barrier on one rank and a wait on the slots on another), and sizes are compared for
    nothing but a few loads."""
    if xp is not None or not plan.algorithm.carries_signature:
        return None
    if code is None:
        if state.signature_slots is None:
            return None
        code = -1 - nbytes
    return CallSignature(state, code, describe)


def agree_on_signature(state, code, describe):
    """One 16-byte allreduce on the library's communicator: raise ValueError on every rank, naming
    what differs and where, unless every rank's ``code`` is the same. ``describe()``: this rank's
    signature as a dict, gathered only when the codes differ."""
    slots = state.signature_slots
    if slots is not None:  # one node: codes in shared memory, no collective (mpiallreduce.state.SignatureSlots)
        slots.publish(code)
        if slots.all_equal(code):
            return
    else:
        extremes = state.signature_buffer
        extremes[0], extremes[1] = code, -code
        state.library.Allreduce(MPI.IN_PLACE, [extremes, MPI.INT64_T], MPI.MAX)
        if extremes[0] == -extremes[1]:
            return
    raise_signature_mismatch(state, describe)


def raise_signature_mismatch(state, describe):
    """Collective, on ranks that all know the codes differ: gather what each rank called, raise."""
    differences = describe_differences(state.library.allgather(describe()))
    raise ValueError(f"rank {state.rank}: allreduce call #{state.sequence} differs between the {state.size} ranks "
                     "(shape, dtype, op or algorithm; see also check=True):\n  "
                     + "\n  ".join(differences or ["(the calls' digests differ)"]))


class CallSignature:
    """A call's signature code, for an algorithm that carries the comparison (``carries_signature``):
    ``agree()`` compares it (in shared memory on one node, else in a small allreduce); an algorithm
    that needs a barrier of its own on one node (shared_memory) instead calls ``publish()`` and then
    ``compare()``, which waits for every rank's code, as a barrier would, and raises on every rank
    when they differ (``agree()`` does the same two steps, so ranks that run different algorithms
    for calls that differ still compare the same codes)."""

    __slots__ = ("state", "code", "describe")

    def __init__(self, state, code, describe):
        self.state, self.code, self.describe = state, code, describe

    def agree(self):
        agree_on_signature(self.state, self.code, self.describe)

    def shared(self):
        """Whether the codes go through shared memory (publish/compare around a barrier)."""
        return self.state.signature_slots is not None

    def publish(self):
        self.state.signature_slots.publish(self.code)

    def compare(self):
        if not self.state.signature_slots.all_equal(self.code):
            raise_signature_mismatch(self.state, self.describe)  # (collective: every rank is here)


def execute(state, plan, flat, op, datatype, xp, sequence, signature=None, timeout=None):
    """Run ``plan`` on the flat buffers on the library's communicator; the result array.
    ``signature``: the signature comparison, for an algorithm that carries it (numpy arrays).
    A hand-written algorithm's waits watch the peers (mpiallreduce.faults.watch): a rank that fails
    midway ends the call on every rank, and so does ``timeout`` running out in the middle."""
    size = state.size
    if plan.local_only:
        if flat.send is not None:
            buffers.copy_into(flat.recv, flat.send)
        op.finish(flat.recv, size)
        return flat.finish()
    comm, watch = _algorithm_comm(state, plan.algorithm, sequence, timeout)
    options = {} if plan.inner is None else {"inner": plan.inner}
    if signature is not None:
        options["signature"] = signature
    ignoring = ignore_float_errors()
    try:
        if op.exact and not plan.algorithm.sees_every_contribution:  # a reproducible sum's words route
            def allreduce_in_place(array, step_op):
                _run(plan, comm, None, array, OPS[step_op], buffers.mpi_datatype(array.dtype), None, options)
            allreduce_in_place.size = size
            sum_by_words(flat.send, flat.recv, op.mean, allreduce_in_place)
        elif plan.accumulate is not None:  # float16/bfloat16: accumulate in float32, round once
            wide = (flat.recv if flat.send is None else flat.send).astype(plan.accumulate)
            _run(plan, comm, None, wide, op, buffers.mpi_datatype(plan.accumulate), xp, options)
            op.finish(wide, size)
            buffers.array_module(wide).copyto(flat.recv, wide, casting="unsafe")
        else:
            _run(plan, comm, flat.send, flat.recv, op, datatype, xp, options)
            op.finish(flat.recv, size)
    except BaseException as error:
        _raise_failed(error, state, sequence, watch)
    finally:
        restore_float_errors(ignoring)
    return flat.finish()


def _algorithm_comm(state, algorithm, sequence, timeout):
    """(the communicator ``algorithm`` talks on, its PeerWatch or None): a message-passing
    algorithm gets the call's tags and a watch on its peers (mpiallreduce.faults.watch)."""
    if not algorithm.messages_only:
        return state.library, None
    watch = PeerWatch(state, sequence, timeout, algorithm.name)
    return CallTags(state.library, sequence, watch), watch


def _raise_failed(error, state, sequence, watch):
    """Raise what a call that failed with ``error`` on this rank raises: RankFailure for a dead rank
    (ULFM, on every survivor), else ``error`` itself, after telling the peers of a message-passing
    algorithm that this rank left it midway (AllreduceAborted is a peer's failure, already known to
    all; a timeout in the algorithm has told them)."""
    if isinstance(error, MPI.Exception):
        failure = failure_of(error, state.user, sequence, also_revoke=state.library_communicators())
        if failure is not None:
            raise failure from error
    if watch is not None and not isinstance(error, (AllreduceAborted, AllreduceTimeout)):
        watch.fail()
    raise error


def _run(plan, comm, send, recv, op, datatype, xp, options):
    if xp is None:
        plan.algorithm.run(comm, send, recv, op, datatype, **options)
    else:
        run_on_device(plan.algorithm, comm, send, recv, op, datatype, xp)


# ---------------------------------------------------------------------------------------------
# The short path of a repeated call

_COMMUNICATOR_TYPES = (MPI.Intracomm, MPI.Cartcomm, MPI.Graphcomm, MPI.Distgraphcomm)
_NO_FAST_CALLS = {}
_fast_states = {}  # communicator handle -> state, for states with short paths (forgotten when freed)


def _short_path(state, plan, shape, dtype, reduce_op, code, describe):
    """The short path of a repeated call on contiguous numpy arrays: a function (x, out) -> the
    result, or None when these arrays need the general path (strided, views, another kind of out).
    Everything it needs is bound here, once; it makes the same collectives as the general path."""
    strides = np.empty(shape, dtype).strides  # C order (the key holds x's shape and dtype)
    datatype = buffers.mpi_datatype(dtype)
    divide = reduce_op.divide_by_size
    algorithm = plan.algorithm
    direct = algorithm.name == "mpi"
    mpi_op = reduce_op.mpi_op(dtype) if direct else None
    # mpi4py finds a predefined datatype from the array itself: no [buffer, datatype] list to make
    raw = datatype.is_predefined and dtype.char in "bhilqBHILQefdgFDG?"
    empty, ndarray, in_place, divide_ufunc = np.empty, np.ndarray, MPI.IN_PLACE, np.divide
    ignore, restore = ignore_float_errors, restore_float_errors
    may_share_memory = np.may_share_memory
    carried = algorithm.carries_signature
    options = {} if plan.inner is None else {"inner": plan.inner}
    signature = _carried_signature(state, plan, None, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, code,
                                   describe)
    if signature is not None:
        options["signature"] = signature

    def run(x, out):
        if x.strides != strides:
            return None
        if out is None:
            result, send = empty(shape, dtype), x
        elif out is x:
            result, send = x, in_place
        elif (type(out) is ndarray and out.dtype is dtype and out.shape == shape and out.strides == strides
              and ((out.base is None and x.base is None) or not may_share_memory(x, out))):
            result, send = out, x  # (they do not overlap; MPI refuses a read-only out)
        else:
            return None
        state.sequence += 1
        watch = ignoring = None
        try:
            if code is not None and not carried:
                agree_on_signature(state, code, describe)
            if direct:  # MPI_Allreduce itself
                if raw:
                    state.library.Allreduce(send, result, mpi_op)
                else:
                    state.library.Allreduce(send if send is in_place else [send, datatype], [result, datatype], mpi_op)
            else:
                comm, watch = _algorithm_comm(state, algorithm, state.sequence, None)
                ignoring = ignore()
                algorithm.run(comm, None if send is in_place else x.reshape(-1), result.reshape(-1), reduce_op,
                              datatype, **options)
        except BaseException as error:
            _raise_failed(error, state, state.sequence, watch)
        finally:
            if ignoring is not None:
                restore(ignoring)
        if divide:
            ignoring = ignore()
            divide_ufunc(result, dtype.type(state.size), out=result)
            restore(ignoring)
        return result

    return run


def _remember_fast_call(state, x, op, algorithm, plan, reduce_op):
    key = (x.shape, x.dtype, op, algorithm)
    if (key in state.fast_calls or plan.local_only or len(state.fast_calls) >= 256 or not isinstance(algorithm, str)
            or not (isinstance(op, str) or (reduce_op.exact and plan.algorithm.sees_every_contribution))):
        return  # (already made: a call that takes the general path anyway, with strided or other arrays, or
        # a reproducible sum's words route, two reductions in execute)
    shape, dtype_name = x.shape, str(x.dtype)
    code = _signature_code(x, op, plan) if plan.check_signature else None

    def describe():
        return {"memory": "host", "shape": tuple(shape), "dtype": dtype_name, "op": _plain(op), "algorithm": plan.name}
    state.fast_calls[key] = _short_path(state, plan, x.shape, x.dtype, reduce_op,
                                                                       code, describe)
    if state.handle not in _fast_states:  # (COMM_WORLD too, when it is passed as comm=)
        _fast_states[state.handle] = state
        state.on_free.append(lambda: _fast_states.pop(state.handle, None))


def _fast_calls_of(comm):
    state = _fast_states.get(comm.handle) if type(comm) in _COMMUNICATOR_TYPES else None
    return _NO_FAST_CALLS if state is None else state.fast_calls


# ---------------------------------------------------------------------------------------------
# Prepared calls

def prepare(x, op="sum", algorithm="auto", comm=None, out=None, *, axis=None, mesh=None, groups=None,
            timeout=None):
    """Agree on one call once, run it many times: ``prepared = prepare(grad, out=grad)`` then
    ``prepared()`` every step (as MPI-4's ``MPI_Allreduce_init``, NCCL's registered buffers, Gloo's
    algorithm objects).

    Collective: every rank of the communicator calls it, with the same arguments as ``allreduce``.
    The ranks compare everything once (as ``check=True`` does, the call site included) and plan
    the call once; each ``prepared()`` then reduces the current contents of ``x`` into its result
    with no check and no decision. ``x`` and ``out`` must stay the same arrays (their contents may
    change; do not resize them). With ``timeout``, every run first meets the other ranks.

    Returns:
        a PreparedAllreduce: call it (or ``.run()``) for the result; ``.start()`` runs it in the
        background (an AllreduceHandle, as allreduce_async's); ``.plan.describe()`` says what it runs.
    """
    return prepare_at(call_site(2), x, op, algorithm, comm, out, axis=axis, mesh=mesh, groups=groups, timeout=timeout)


def prepare_at(site, x, op="sum", algorithm="auto", comm=None, out=None, *, axis=None, mesh=None, groups=None,
               timeout=None):
    """``prepare`` with the call site to compare given (the library's own prepared calls, GradientSync's
    buckets, give "": they are compared by what they reduce, not by where the user's code was)."""
    call = _Call.start(x, op, algorithm, comm, out, True, axis, mesh, groups, timeout, site)
    if _worker.pending and threading.current_thread() is not _worker.thread:
        return run_in_order(lambda: PreparedAllreduce(call))
    return PreparedAllreduce(call)


class PreparedAllreduce:
    """An allreduce agreed on and planned once (see ``prepare``)."""

    def __init__(self, call):
        state = call.state
        if call.timeout is not None:
            Rendezvous(state, call.sequence, call.timeout, call.site).run()
        state.make_ready()
        x, op_name, algorithm = call.x, call.op, call.algorithm

        def plan_it():
            _validate(x, op_name, algorithm, call.out)
            return _plan_for(state, x, op_name, algorithm)
        signature = dict(_signature(x, op_name, algorithm), call_site=call.site, call_number=call.sequence,
                         prepared=True)
        self.plan = agree_on_call(state.library, plan_it, signature, resolve=lambda p: {"runs": p.name})
        self.state, self.timeout, self.site = state, call.timeout, call.site
        self.op = get_op(op_name)
        self.x = x
        self.xp = None if type(x) is np.ndarray else namespace(x)
        self.flat = buffers.flat_buffers(x, call.out)
        self.result = self.flat.result
        self.datatype = buffers.mpi_datatype(x.dtype)
        self._direct = None
        plan, flat = self.plan, self.flat
        #: what shared_memory waits for in place of its first barrier (its size; compared once above)
        self.signature = _carried_signature(state, plan, self.xp, x.nbytes, None,
                                            lambda: _signature(x, op_name, algorithm))
        #: the flat input is x itself (a view), or a copy to refresh before each run
        self._input_is_x = flat.send is None and flat.write_back is None or (
            flat.send is not None and _views(flat.send, x))
        if (self.xp is None and plan.name == "mpi" and plan.accumulate is None and not plan.local_only
                and flat.write_back is None and not self.op.divide_by_size and self._input_is_x):
            send = MPI.IN_PLACE if flat.send is None else [flat.send, self.datatype]
            library, recv, mpi_op = state.library, [flat.recv, self.datatype], self.op.mpi_op(x.dtype)
            self._direct = lambda: library.Allreduce(send, recv, mpi_op)

    def __call__(self):
        """Reduce the current contents of ``x``; returns the result array (the same every run)."""
        state = self.state
        state.sequence += 1  # numbered on the caller's thread, in program order
        if _worker.pending and threading.current_thread() is not _worker.thread:
            sequence = state.sequence
            return run_in_order(lambda: self._run(sequence))
        return self._run(state.sequence)

    run = __call__

    def _run(self, sequence):
        state = self.state
        if self.timeout is not None:
            Rendezvous(state, sequence, self.timeout, self.site).run()
        if self._direct is not None and self.timeout is None:
            try:
                self._direct()
            except MPI.Exception as error:
                failure = failure_of(error, state.user, sequence, also_revoke=state.library_communicators())
                if failure is None:
                    raise
                raise failure from error
            return self.result
        flat = self.flat
        if not self._input_is_x:  # a strided or overlapping x: refresh the contiguous copy
            buffers.copy_into((flat.recv if flat.send is None else flat.send).reshape(self.x.shape), self.x)
        return execute(state, self.plan, flat, self.op, self.datatype, self.xp, sequence, self.signature,
                       timeout=self.timeout)

    def start(self):
        """Run in the background (allreduce_async's worker); an AllreduceHandle."""
        self.state.sequence += 1  # numbered here, on the caller's thread
        sequence = self.state.sequence
        return submit_prepared(self, lambda: self._run(sequence))

    def __repr__(self):
        return f"<PreparedAllreduce {self.x.shape} {self.x.dtype} {self.op.name}: {self.plan.describe()}>"


def _views(a, b):
    """Whether flat ``a`` is a view of ``b``'s memory (so needs no refresh)."""
    return a.size == b.size and buffers.array_module(a).may_share_memory(a, b)


def describe_call(x, op="sum", algorithm="auto", comm=None):
    """What ``allreduce(x, op=op, algorithm=algorithm, comm=comm)`` would run, and why (a line).

    Collective the first time a communicator is used (its state is made), then local.
    """
    comm = _check_comm(_WORLD if comm is None else comm)
    state = state_of(comm)
    state.make_ready()
    _validate(x, op, algorithm, None)
    return _plan_for(state, x, op, algorithm).describe()


# JAX's names and argument order (jax.lax.psum(x, axis_name, *, axis_index_groups=None)).
# axis_name=None: every rank of COMM_WORLD.

def psum(x, axis_name=None, *, axis_index_groups=None):
    """Sum over the mesh axis ``axis_name`` (within ``axis_index_groups`` if given)."""
    return allreduce(x, op="sum", axis=axis_name, groups=axis_index_groups)


def pmean(x, axis_name=None, *, axis_index_groups=None):
    """Mean over the axis; with groups, each rank divides by the size of its own group."""
    return allreduce(x, op="mean", axis=axis_name, groups=axis_index_groups)


def pmax(x, axis_name=None, *, axis_index_groups=None):
    return allreduce(x, op="max", axis=axis_name, groups=axis_index_groups)


def pmin(x, axis_name=None, *, axis_index_groups=None):
    return allreduce(x, op="min", axis=axis_name, groups=axis_index_groups)
