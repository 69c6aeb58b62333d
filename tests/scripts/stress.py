"""Seeded stress test (issue #24, item 6): every kind of entry of the public API, interleaved, under
random rank skew, every result checked against numpy. Run on every rank:

    mpiallreduce launch -n 4 [--nodes 2] --timeout 240 -- python tests/scripts/stress.py --seed S
        [--ops N]

Operation i is drawn from a random stream seeded by (--seed, i) (default seed: from the clock,
rank 0's, broadcast), the same on every rank, so every rank makes the same collective calls in the
same order; what is drawn per rank (from a stream seeded by (seed, rank)) changes only what is
local: a sleep of 0..--skew-ms before each operation and between the steps of one, which async
handles are waited for and when, the order of a GradientSync's ready() calls where the buckets are
fixed; the gradients a rank leaves out under find_unused are a function of (seed, operation,
gradient, rank). The seed is printed at the start and in every failure message: the same seed,
rank count, --ops, --kinds and --flags replay the same operations (not the same timings: a race
may need a few runs). ``--only 7,8`` (or ``0-5,9``) runs just those operations, drawn as in the
full run, to narrow a failure down to the few operations it needs.

Kinds of entry (--kinds, default all):
    sync          allreduce(x, op, algorithm, out) over 4 B .. 1 MiB, float32/float64/int32/int64,
                  sum/max/min (and mean for floats), auto and every host algorithm that can run on
                  the communicator, out None / x / another array, strided x, comm None or given
    repeat        the same call repeated (the short path): same shape, dtype, op, algorithm
    async         allreduce_async(...) handles, waited later in a random order (a few in flight)
    reproducible  allreduce(..., reproducible=True) and allreduce_async(..., reproducible=True)
    prepared      prepare(x, out=...), then run several times with new contents, and .start()
    gradsync      GradientSync steps: ready() several gradients, wait(); declared parameters or
                  not, find_unused, reproducible, no_sync, gradients that change alike (replans)
    user          the user's own collectives on the same communicators (comm.allreduce(int),
                  Barrier, bcast, Allreduce of numpy, allgather), with async calls in flight
    groups        groups=, psum/pmean/pmax/pmin, a Mesh axis
    newcomm       a communicator made (Dup, Split), used, freed
Flags (--flags, default all): check (check=True on some calls), timeout (timeout=30 on some
calls), sub (sub-communicators from comm.Split, one with its ranks reversed, besides COMM_WORLD).

Inputs are small integers (-4..4), a function of (seed, operation, rank, element index): every rank
computes every other rank's input itself and reduces with numpy, so sums are exact in every dtype
and results are compared exactly (means: numpy's division of the exact sum, in the dtype, as the
library divides). At the end every rank prints

    stress: seed S, ranks P, N operations, W wrong

(W counted over all ranks) and exits 1 if W > 0. An exception on any rank prints the seed, the
operation and the traceback, and aborts the job (exit 3); a rank that makes no progress for
--stall seconds prints the seed, its last operations and every thread's stack, and exits 4 (in
MPI_Finalize, at the end: its stacks, exit 1).

What a correct program must not do is left out: mismatched calls between ranks (a separate check),
a collective between two GradientSync.ready() calls made in a different order on different ranks
(ready() may prepare a bucket's call, collectively), and waiting for a handle while another rank
is inside mpi4py's comm.allreduce of a Python int, which holds the GIL (op_user puts a Barrier
before it).
"""

import argparse
import collections
import contextlib
import faulthandler
import hashlib
import os
import sys
import threading
import time
import traceback

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar
from mpiallreduce.algorithms import REGISTRY

KINDS = (
    "sync",
    "repeat",
    "async",
    "reproducible",
    "prepared",
    "gradsync",
    "user",
    "groups",
    "newcomm",
)
WEIGHTS = {
    "sync": 20,
    "repeat": 10,
    "async": 15,
    "reproducible": 10,
    "prepared": 10,
    "gradsync": 10,
    "user": 10,
    "groups": 7,
    "newcomm": 3,
}
FLAGS = ("check", "timeout", "sub")
TIMEOUT = 30  # seconds, for the timed calls
MAX_IN_FLIGHT = 4  # async handles (and prepared starts) a rank keeps before it waits for some
FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
DTYPES = FLOATS + (np.dtype(np.int32), np.dtype(np.int64))
MAX_BYTES = 1 << 20


def parse():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock (rank 0's)")
    parser.add_argument("--ops", type=int, default=300, help="operations (default 300)")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}"
    )
    parser.add_argument(
        "--flags", default=",".join(FLAGS), help=f"comma-separated, of {', '.join(FLAGS)}; or none"
    )
    parser.add_argument(
        "--skew-ms", type=float, default=5.0, help="each rank sleeps 0..this before each step"
    )
    parser.add_argument(
        "--stall", type=float, default=60.0, help="seconds without progress that count as a hang"
    )
    parser.add_argument(
        "--trace", action="store_true", help="every rank prints every operation as it starts"
    )
    parser.add_argument(
        "--only",
        default=None,
        help=(
            "run only these operations (e.g. 0-5,9), the others skipped (to narrow a failure down)"
        ),
    )
    args = parser.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.flags = [] if args.flags in ("", "none") else args.flags.split(",")
    for name in args.kinds:
        if name not in KINDS:
            parser.error(f"unknown kind {name!r}")
    for name in args.flags:
        if name not in FLAGS:
            parser.error(f"unknown flag {name!r}")
    if not args.kinds:
        parser.error("no kinds")
    if args.only is not None:
        only = set()
        for part in args.only.split(","):
            first, _, last = part.partition("-")
            only.update(range(int(first), int(last or first) + 1))
        args.only = only
    return args


def mix(*key):
    """A 64-bit integer from ``key`` (the same on every rank and run)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


class Comm:
    """A communicator and the world ranks of this rank's group, in the communicator's rank order."""

    def __init__(self, name, comm, order, node_of):
        self.name, self.comm, self.order = name, comm, list(order)
        nodes = collections.Counter(node_of[r] for r in self.order)
        spans, equal = len(nodes) > 1, len(set(nodes.values())) == 1
        #: the algorithms this communicator can run (the same on every rank of it)
        self.algorithms = [
            n
            for n in mar.HOST_ALGORITHMS
            if not (spans and REGISTRY[n].needs_one_node)
            and not (spans and not equal and REGISTRY[n].needs_equal_nodes)
        ]


class Pending:
    __slots__ = ("handle", "want", "what", "out", "keep")

    def __init__(self, handle, want, what, out=None, keep=()):
        self.handle, self.want, self.what, self.out, self.keep = handle, want, what, out, keep


class GradSync:
    """One GradientSync and the gradients its steps give it (drawn alike on every rank)."""

    def __init__(self, stress, c, key):
        rng = stress.rng
        self.c = c
        self.declared = bool(rng.random() < 0.5)
        self.op = "mean" if rng.random() < 0.6 else "sum"
        self.bucket_bytes = int(rng.choice([64, 1000, 16384, 1 << 20]))
        self.reproducible = bool(rng.random() < 0.2)
        self.find_unused = self.declared and bool(rng.random() < 0.3)
        self.timeout = TIMEOUT if stress.flag("timeout", 0.2) else None
        self.algorithm = stress.pick_algorithm(c, auto=0.6)
        self.grads = [self.draw_gradient(rng, j) for j in range(int(rng.integers(1, 7)))]
        self.steps = 0
        self.planned = []  # (undeclared: the gradients the buckets were last planned from)
        params = (
            {name: np.zeros(shape, dtype) for name, shape, dtype in self.grads}
            if self.declared
            else None
        )
        self.what = (
            f"GradientSync(comm={c.name}, bucket_bytes={self.bucket_bytes}, op={self.op}, "
            f"algorithm={self.algorithm}, timeout={self.timeout}, declared={self.declared}, "
            f"find_unused={self.find_unused}, reproducible={self.reproducible})"
        )
        self.sync = mar.GradientSync(
            comm=c.comm,
            bucket_bytes=self.bucket_bytes,
            op=self.op,
            algorithm=self.algorithm,
            timeout=self.timeout,
            parameters=params,
            find_unused=self.find_unused,
            reproducible=self.reproducible,
        )

    def needs_name(self, j):
        """Undeclared, gradient j has a twin (its shape and dtype), or the j-th gradient of the plan
        had one (self.planned: the gradients of the last step that planned; its twin may be gone):
        only a name tells them apart (GradientSync refuses unnamed twins); the others go by
        position."""

        def has_twin(grads, k):
            return (
                k < len(grads)
                and sum((shape, dtype) == grads[k][1:] for _, shape, dtype in grads) > 1
            )

        return has_twin(self.grads, j) or has_twin(self.planned, j)

    @staticmethod
    def draw_gradient(rng, j):
        dtype = FLOATS[int(rng.integers(2))]
        if rng.random() < 0.05:  # 1 MiB: reduced in place, not fused
            count = MAX_BYTES // dtype.itemsize
        else:
            count = max(1, int(2 ** rng.uniform(0, 14)))
        shape = (2, count // 2) if count % 2 == 0 and rng.random() < 0.3 else (count,)
        return (f"g{j}.{int(rng.integers(1000))}", shape, dtype)


class Stress:
    def __init__(self, args):
        self.args = args
        self.world = MPI.COMM_WORLD
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        seed = args.seed if args.seed is not None else int(time.time() * 1000) % (1 << 31)
        self.seed = self.world.bcast(seed, root=0)  # (the clock's seed: rank 0's)
        self.rng = np.random.default_rng([self.seed])  # the same draws on every rank
        self.mine = np.random.default_rng([self.seed, self.rank, 1])  # this rank's own
        self.kinds = args.kinds
        self.only = args.only
        weights = np.array([WEIGHTS[k] for k in self.kinds], dtype=float)
        self.weights = weights / weights.sum()
        self.flags = set(args.flags)
        self.wrong = 0
        self.checked = 0
        self.reports = 0
        self.pending = []
        self.op_index = -1
        self.current = "setup"
        self.recent = collections.deque(maxlen=6)
        self.progress = time.monotonic()
        self.gradsyncs = []
        self.repeats = []
        node = MPI.Get_processor_name()
        self.node_of = self.world.allgather(node)
        self.nodes = len(set(self.node_of))
        P, r = self.size, self.rank
        self.comms = [Comm("world", self.world, range(P), self.node_of)]
        if "sub" in self.flags:
            half = self.world.Split(r % 2, r)
            self.comms.append(Comm(f"half{r % 2}", half, half.allgather(r), self.node_of))
            rev = self.world.Split(0, P - 1 - r)
            self.comms.append(Comm("reversed", rev, rev.allgather(r), self.node_of))
        h = (P + 1) // 2
        self.partitions = [
            [list(range(h)), list(range(h, P))],
            [[q] for q in range(P)],
            [list(range(P))],
            [[q for q in range(P) if q % 2 == 0], [q for q in range(P) if q % 2 == 1]],
        ]
        self.partitions = [[g for g in p if g] for p in self.partitions]
        cols = P // 2 if P % 2 == 0 and P >= 4 else 1
        rows = P // cols
        self.mesh = mar.Mesh((rows, cols), ("data", "model"))
        self.mesh_groups = {
            "data": [[i * cols + m for i in range(rows)] for m in range(cols)],
            "model": [[d * cols + j for j in range(cols)] for d in range(rows)],
        }

    # --- draws --------------------------------------------------------------------------------

    def flag(self, name, probability):
        """A shared draw (always made, so that the streams stay in step), true only if ``name`` is
        on."""
        return bool(self.rng.random() < probability) and name in self.flags

    def pick_comm(self):
        k = int(self.rng.integers(1 << 30))
        if "sub" not in self.flags or self.rng.random() < 0.55:
            return self.comms[0]
        return self.comms[1 + k % (len(self.comms) - 1)]

    def pick_algorithm(self, c_or_algorithms, auto=0.4):
        algorithms = (
            c_or_algorithms.algorithms if isinstance(c_or_algorithms, Comm) else c_or_algorithms
        )
        k = int(self.rng.integers(1 << 30))
        if self.rng.random() < auto:
            return "auto"
        return algorithms[k % len(algorithms)]

    def pick_dtype_op(self, floats_only=False):
        dtype = (FLOATS if floats_only else DTYPES)[int(self.rng.integers(2 if floats_only else 4))]
        ops = ("sum", "max", "min", "mean") if dtype.kind == "f" else ("sum", "max", "min")
        return dtype, ops[int(self.rng.integers(len(ops)))]

    def pick_shape(self, dtype):
        count = max(1, int(2 ** self.rng.uniform(2, 20.01)) // dtype.itemsize)
        count = min(count, MAX_BYTES // dtype.itemsize)
        if count >= 4 and count % 2 == 0 and self.rng.random() < 0.2:
            return (2, count // 2)
        self.rng.random()
        return (count,)

    def algorithms_of(self, members):
        return Comm("", None, members, self.node_of).algorithms

    # --- inputs and references ----------------------------------------------------------------

    def values(self, key, r, count):
        """World rank ``r``'s input for ``key`` (the operation and a salt): count integers in
        -4..4."""
        h = mix(self.seed, key)
        a, b, c = 1 + h % 61, 1 + (h >> 8) % 53, (h >> 16) % 9973
        i = np.arange(count, dtype=np.int64)
        return (i * a + (i >> 4) * 5 + r * b + c) % 9 - 4

    def make_x(self, key, shape, dtype, strided=False):
        v = self.values(key, self.rank, int(np.prod(shape))).astype(dtype).reshape(shape)
        if strided:
            x = np.zeros(shape[:-1] + (2 * shape[-1],), dtype)[..., ::2]
            x[...] = v
            return x
        return v

    def fill(self, x, key):
        x[...] = self.values(key, self.rank, x.size).astype(x.dtype).reshape(x.shape)

    def expected(self, key, members, shape, dtype, op, reproducible=False, skipped=()):
        count = int(np.prod(shape))
        stack = np.stack(
            [
                np.zeros(count, np.int64) if r in skipped else self.values(key, r, count)
                for r in members
            ]
        )
        if op in ("sum", "mean"):
            exact = stack.sum(axis=0)
        elif op == "max":
            exact = stack.max(axis=0)
        else:
            exact = stack.min(axis=0)
        result = exact.astype(dtype)
        if op == "mean":
            if reproducible:  # (the exact sum rounded to float64, divided, rounded to the dtype)
                result = (exact.astype(np.float64) / len(members)).astype(dtype)
            else:  # (the library divides the finished sum in the dtype)
                result = np.divide(result, dtype.type(len(members)))
        return result.reshape(shape)

    # --- checking -----------------------------------------------------------------------------

    def report(self, text):
        self.reports += 1
        if self.reports <= 20:
            print(
                f"stress: seed {self.seed}: WRONG on rank {self.rank}, op #{self.op_index} "
                f"({self.current}): {text}",
                flush=True,
            )

    def verify(self, got, want, what, out=None):
        self.checked += 1
        if out is not None and got is not out:
            self.wrong += 1
            self.report(f"{what}: returned another array than out")
        if not isinstance(got, np.ndarray) or got.shape != want.shape or got.dtype != want.dtype:
            self.wrong += want.size
            self.report(
                f"{what}: got {type(got).__name__} {getattr(got, 'shape', '')} "
                f"{getattr(got, 'dtype', '')}, "
                f"want {want.shape} {want.dtype}"
            )
            return
        bad = got != want
        n = int(np.count_nonzero(bad))
        if n:
            self.wrong += n
            first = int(np.flatnonzero(bad.reshape(-1))[0])
            self.report(
                f"{what}: {n} of {want.size} elements wrong, first at flat index {first}: "
                f"got {got.reshape(-1)[first]!r}, want {want.reshape(-1)[first]!r}"
            )

    # --- pacing, async handles ----------------------------------------------------------------

    def skew(self):
        if self.args.skew_ms > 0:
            time.sleep(self.mine.uniform(0, self.args.skew_ms) / 1000)
        self.progress = time.monotonic()

    def wait_one(self, index=None):
        if index is None:
            index = int(self.mine.integers(len(self.pending)))
        p = self.pending.pop(index)
        got = p.handle.wait(timeout=60) if self.mine.random() < 0.2 else p.handle.wait()
        self.verify(got, p.want, p.what, p.out)
        self.progress = time.monotonic()

    def maybe_wait(self):
        """This rank's own choice: wait for some handles, any of them (waiting is local)."""
        if self.pending and self.mine.random() < 0.35:
            for _ in range(int(self.mine.integers(1, 3))):
                if self.pending:
                    self.wait_one()
        while len(self.pending) > MAX_IN_FLIGHT:
            self.wait_one()

    def keep(self, pending):
        self.pending.append(pending)

    def out_for(self, x, mode):
        if mode == 0:
            return None
        if mode == 1:
            return x
        return np.empty(x.shape, x.dtype)

    # --- the kinds ----------------------------------------------------------------------------

    def pick_call(self):
        """A communicator, dtype, op, shape, algorithm, out mode and strided-or-not (in this order
        of draws)."""
        c = self.pick_comm()
        dtype, op = self.pick_dtype_op()
        shape = self.pick_shape(dtype)
        algorithm = self.pick_algorithm(c)
        return (
            c,
            dtype,
            op,
            shape,
            algorithm,
            int(self.rng.integers(3)),
            bool(self.rng.random() < 0.1),
        )

    def op_sync(self, key, asynchronous=False):
        c, dtype, op, shape, algorithm, out_mode, strided = self.pick_call()
        check = self.flag("check", 0.2)
        timeout = TIMEOUT if self.flag("timeout", 0.2) else None
        comm = None if c.name == "world" and self.rng.random() < 0.5 else c.comm
        describe = bool(self.rng.random() < 0.05)
        x = self.make_x(key, shape, dtype, strided)
        out = self.out_for(x, out_mode)
        what = (
            f"allreduce{'_async' if asynchronous else ''}({shape} {dtype}, op={op}, "
            f"algorithm={algorithm}, "
            f"comm={c.name if comm is not None else None}, out={('None', 'x', 'other')[out_mode]}"
            f"{', strided' if strided else ''}{', check=True' if check else ''}"
            f"{f', timeout={timeout}' if timeout else ''})"
        )
        self.current = what
        want = self.expected(key, c.order, shape, dtype, op)
        if describe:
            mar.describe_call(x, op=op, algorithm=algorithm, comm=comm)
        if asynchronous:
            handle = mar.allreduce_async(
                x, op=op, algorithm=algorithm, comm=comm, out=out, check=check, timeout=timeout
            )
            self.keep(Pending(handle, want, what, out, (x,)))
        else:
            got = mar.allreduce(
                x, op=op, algorithm=algorithm, comm=comm, out=out, check=check, timeout=timeout
            )
            self.verify(got, want, what, out)

    def op_async(self, key):
        self.op_sync(key, asynchronous=True)

    def op_repeat(self, key):
        if self.repeats and self.rng.random() < 0.5:
            c, dtype, op, shape, algorithm, use_none = self.repeats[
                int(self.rng.integers(len(self.repeats)))
            ]
        else:
            c = self.pick_comm()
            dtype, op = self.pick_dtype_op()
            shape = self.pick_shape(dtype)
            algorithm = self.pick_algorithm(c)
            use_none = c.name == "world" and bool(self.rng.random() < 0.5)
            self.repeats = (self.repeats + [(c, dtype, op, shape, algorithm, use_none)])[-8:]
        comm = None if use_none else c.comm
        times = int(self.rng.integers(2, 6))
        x = None
        for k in range(times):
            out_mode = int(self.rng.integers(3))
            fresh = x is None or out_mode == 1 or bool(self.rng.random() < 0.3)
            sub = (key, k)
            what = (
                f"repeat {k + 1}/{times}: allreduce({shape} {dtype}, op={op}, "
                f"algorithm={algorithm}, "
                f"comm={'None' if use_none else c.name}, out={('None', 'x', 'other')[out_mode]})"
            )
            self.current = what
            if fresh:
                x = self.make_x(sub, shape, dtype)
            else:
                self.fill(x, sub)
            out = self.out_for(x, out_mode)
            got = mar.allreduce(x, op=op, algorithm=algorithm, comm=comm, out=out)
            self.verify(got, self.expected(sub, c.order, shape, dtype, op), what, out)
            if out_mode == 1:
                x = None
            self.skew()

    def op_reproducible(self, key):
        c = self.pick_comm()
        dtype, _ = self.pick_dtype_op(floats_only=True)
        op = "mean" if self.rng.random() < 0.2 else "sum"
        shape = self.pick_shape(dtype)
        algorithm = self.pick_algorithm(c, auto=0.6)
        out_mode = int(self.rng.integers(3))
        check = self.flag("check", 0.2)
        timeout = TIMEOUT if self.flag("timeout", 0.2) else None
        asynchronous = bool(self.rng.random() < 0.5)
        x = self.make_x(key, shape, dtype)
        out = self.out_for(x, out_mode)
        what = (
            f"{'allreduce_async' if asynchronous else 'allreduce'}({shape} {dtype}, op={op}, "
            f"algorithm={algorithm}, comm={c.name}, out={('None', 'x', 'other')[out_mode]}, "
            "reproducible=True"
            f"{', check=True' if check else ''}{f', timeout={timeout}' if timeout else ''})"
        )
        self.current = what
        want = self.expected(key, c.order, shape, dtype, op, reproducible=True)
        if asynchronous:
            handle = mar.allreduce_async(
                x,
                op=op,
                algorithm=algorithm,
                comm=c.comm,
                out=out,
                check=check,
                timeout=timeout,
                reproducible=True,
            )
            self.keep(Pending(handle, want, what, out, (x,)))
        else:
            got = mar.allreduce(
                x,
                op=op,
                algorithm=algorithm,
                comm=c.comm,
                out=out,
                check=check,
                timeout=timeout,
                reproducible=True,
            )
            self.verify(got, want, what, out)

    def op_prepared(self, key):
        c, dtype, op, shape, algorithm, out_mode, strided = self.pick_call()
        timeout = TIMEOUT if self.flag("timeout", 0.2) else None
        runs = int(self.rng.integers(1, 5))
        x = self.make_x((key, 0), shape, dtype, strided)
        out = self.out_for(x, out_mode)
        what = (
            f"prepare({shape} {dtype}, op={op}, algorithm={algorithm}, comm={c.name}, "
            f"out={('None', 'x', 'other')[out_mode]}{', strided' if strided else ''}"
            f"{f', timeout={timeout}' if timeout else ''})"
        )
        self.current = what
        prepared = mar.prepare(x, op=op, algorithm=algorithm, comm=c.comm, out=out, timeout=timeout)
        for k in range(runs):
            how = int(
                self.rng.integers(4)
            )  # call, .run(), .start() waited at once, .start() kept (the last run)
            if how == 3 and k < runs - 1:
                how = 2
            sub = (key, k + 1)
            self.fill(x, sub)
            step = (
                f"{what} run {k + 1}/{runs} by "
                f"{('()', '.run()', '.start().wait()', '.start() kept')[how]}"
            )
            self.current = step
            want = self.expected(sub, c.order, shape, dtype, op)
            if how == 0:
                self.verify(prepared(), want, step, out)
            elif how == 1:
                self.verify(prepared.run(), want, step, out)
            elif how == 2:
                self.verify(prepared.start().wait(), want, step, out)
            else:
                self.keep(Pending(prepared.start(), want, step, out, (x, prepared)))
            self.skew()

    def op_gradsync(self, key):
        if self.gradsyncs and self.rng.random() < 0.6:
            gs = self.gradsyncs[int(self.rng.integers(len(self.gradsyncs)))]
        else:
            c = self.pick_comm()
            self.current = "GradientSync(...)"
            gs = GradSync(self, c, key)
            self.gradsyncs = (self.gradsyncs + [gs])[-4:]
        rng = self.rng
        c = gs.c
        changed = ""
        if (
            not gs.declared and gs.steps > 0 and rng.random() < 0.2
        ):  # every rank changes its gradients alike
            j = int(rng.integers(len(gs.grads)))
            if rng.random() < 0.5 or len(gs.grads) == 1:
                gs.grads = (
                    gs.grads[:j] + [GradSync.draw_gradient(rng, 10 + gs.steps)] + gs.grads[j:]
                )
                changed = ", a gradient added"
            else:
                gs.grads = gs.grads[:j] + gs.grads[j + 1 :]
                changed = ", a gradient dropped"
        no_sync = bool(rng.random() < 0.1)
        shared_order = not gs.declared or bool(rng.random() < 0.5)
        order = list(rng.permutation(len(gs.grads))) if gs.declared else list(range(len(gs.grads)))
        if not shared_order:
            order = list(
                self.mine.permutation(len(gs.grads))
            )  # this rank's own order (the buckets are fixed)
        gs.steps += 1
        what = (
            f"{gs.what} step {gs.steps}{changed}{', no_sync' if no_sync else ''}, "
            f"{'shared' if shared_order else 'per-rank'} order of {len(gs.grads)} gradients"
        )
        self.current = what
        # (find_unused: a gradient a rank leaves out, decided from (seed, op, gradient, rank): known
        # to all)
        left_out = {
            j: {r for r in c.order if gs.find_unused and mix(self.seed, key, j, r) % 4 == 0}
            for j in range(len(gs.grads))
        }
        arrays = [
            self.make_x((key, j), shape, dtype) for j, (_, shape, dtype) in enumerate(gs.grads)
        ]
        fillers = [float(rng.random()) for _ in order]
        with gs.sync.no_sync() if no_sync else contextlib.nullcontext():
            for t, j in enumerate(order):
                name = gs.grads[j][0]
                if self.rank not in left_out[j]:
                    self.current = f"{what}: ready({name})"
                    gs.sync.ready(arrays[j], name=name if gs.declared or gs.needs_name(j) else None)
                self.skew()
                if fillers[t] < 0.25 and shared_order and not gs.find_unused:
                    # something else between two ready()s, only where every rank has started the
                    # same buckets before it: ready() may block, in a collective (a bucket's first
                    # start prepares its call), so a collective between ready()s given in other
                    # orders on other ranks, or with some left out, deadlocks (a user's program must
                    # not do that)
                    self.filler((key, "filler", t))
                    self.current = what
            self.current = f"{what}: wait()"
            unused = gs.sync.wait()
        if (
            not no_sync
        ):  # (a step that wait()s planned, or matched the plan: either way the plan is these now)
            gs.planned = list(gs.grads)
        for j, (name, shape, dtype) in enumerate(gs.grads):
            if no_sync:
                want = self.make_x((key, j), shape, dtype)
            else:
                want = self.expected((key, j), c.order, shape, dtype, gs.op, skipped=left_out[j])
            if self.rank in left_out[j] and not no_sync:
                self.verify(unused.get(name), want, f"{what}: the result of {name} (left out here)")
            else:
                self.verify(arrays[j], want, f"{what}: {name} {shape} {dtype}")

    def filler(self, key):
        """An operation between two ready()s: the user's collective, or a library call, sync or
        async."""
        u = int(self.rng.integers(3))
        if u > 0 and ("sync" in self.kinds or "async" in self.kinds):
            self.op_sync(key, asynchronous=u == 2)
        elif "user" in self.kinds:
            self.op_user(key)

    def op_user(self, key):
        """The user's own collective on a communicator the library uses too, async calls in flight.

        mpi4py's comm.allreduce of a Python int holds the GIL while it waits for the other ranks
        (mpi4py 4.1.2; its other collectives let it go), so the library's worker thread cannot run
        on a rank inside it: a rank that waits for a handle meanwhile (at any point before its own
        allreduce, in ready() too) waits for that worker for ever. As a user must, every rank first
        passes a Barrier (which lets the GIL go): no rank is still waiting for a handle when another
        enters the allreduce (docs/architecture.md, "The worker thread and the GIL")."""
        c = self.pick_comm()
        how = int(self.rng.integers(5))
        comm = c.comm
        self.current = (
            "user's "
            f"{('allreduce(int)', 'Barrier()', 'bcast', 'Allreduce(numpy)', 'allgather')[how]} "
            f"on {c.name} with {len(self.pending)} handles in flight here"
        )
        if how == 0:
            comm.Barrier()
            got = comm.allreduce(mix(self.seed, key, self.rank) % 1000)
            ok = got == sum(mix(self.seed, key, r) % 1000 for r in c.order)
        elif how == 1:
            comm.Barrier()
            ok = True
        elif how == 2:
            got = comm.bcast(("stress", key) if comm.Get_rank() == 0 else None, root=0)
            ok = got == ("stress", key)
        elif how == 3:
            mine = self.values(key, self.rank, 37)
            got = np.empty_like(mine)
            comm.Allreduce(mine, got, op=MPI.SUM)
            ok = np.array_equal(got, sum(self.values(key, r, 37) for r in c.order))
        else:
            ok = comm.allgather(self.rank) == c.order
        self.checked += 1
        if not ok:
            self.wrong += 1
            self.report(f"{self.current}: wrong result")

    def op_groups(self, key):
        how = int(
            self.rng.integers(4)
        )  # groups=, psum & co with axis_index_groups, a mesh axis, psum & co alone
        partition = self.partitions[int(self.rng.integers(len(self.partitions)))]
        axis = ("data", "model")[int(self.rng.integers(2))]
        dtype, op = self.pick_dtype_op()
        shape = self.pick_shape(dtype)
        k = int(self.rng.integers(1 << 30))
        auto = self.rng.random() < 0.5
        if how == 2:
            groups = self.mesh_groups[axis]
        elif how == 3:
            groups = [list(range(self.size))]
        else:
            groups = partition
        members = next(g for g in groups if self.rank in g)
        algorithms = self.algorithms_of(members)
        algorithm = "auto" if auto else algorithms[k % len(algorithms)]
        x = self.make_x(key, shape, dtype)
        want = self.expected(key, members, shape, dtype, op)
        if how == 0:
            what = f"allreduce({shape} {dtype}, op={op}, algorithm={algorithm}, groups={groups})"
            self.current = what
            got = mar.allreduce(x, op=op, algorithm=algorithm, groups=groups)
        elif how == 2:
            what = (
                f"allreduce({shape} {dtype}, op={op}, algorithm={algorithm}, axis={axis!r}, "
                f"mesh={self.mesh.shape})"
            )
            self.current = what
            got = mar.allreduce(x, op=op, algorithm=algorithm, axis=axis, mesh=self.mesh)
        else:
            function = {"sum": mar.psum, "mean": mar.pmean, "max": mar.pmax, "min": mar.pmin}[op]
            given = groups if how == 1 else None
            what = f"p{op}({shape} {dtype}{f', axis_index_groups={given}' if given else ''})"
            self.current = what
            got = function(x, axis_index_groups=given)
        self.verify(got, want, what)

    def op_newcomm(self, key):
        P, r = self.size, self.rank
        dup = bool(self.rng.random() < 0.5)
        count = int(self.rng.integers(1, 4))
        calls = [(bool(self.rng.random() < 0.5), self.flag("timeout", 0.3)) for _ in range(count)]
        if dup:
            comm, order, name = self.world.Dup(), list(range(P)), "a Dup of world"
        else:
            comm = self.world.Split(r % 2, P - r)
            order, name = (
                sorted((q for q in range(P) if q % 2 == r % 2), reverse=True),
                f"a Split ({r % 2}, reversed)",
            )
        c = Comm(name, comm, order, self.node_of)
        handles = []
        for i, (asynchronous, timed) in enumerate(calls):
            dtype, op = self.pick_dtype_op()
            shape = self.pick_shape(dtype)
            algorithm = self.pick_algorithm(c)
            timeout = TIMEOUT if timed else None
            x = self.make_x((key, i), shape, dtype)
            want = self.expected((key, i), order, shape, dtype, op)
            what = (
                f"on {name}: allreduce{'_async' if asynchronous else ''}({shape} {dtype}, op={op}, "
                f"algorithm={algorithm}{f', timeout={timeout}' if timed else ''})"
            )
            self.current = what
            if asynchronous:
                handles.append(
                    (
                        mar.allreduce_async(
                            x, op=op, algorithm=algorithm, comm=comm, timeout=timeout
                        ),
                        want,
                        what,
                    )
                )
            else:
                self.verify(
                    mar.allreduce(x, op=op, algorithm=algorithm, comm=comm, timeout=timeout),
                    want,
                    what,
                )
            self.skew()
        for handle, want, what in handles:
            self.current = what + ".wait()"
            self.verify(handle.wait(), want, what)
        self.current = f"{name}.Free()"
        comm.Free()

    # --- the run ------------------------------------------------------------------------------

    def watchdog(self):
        while True:
            time.sleep(1)
            idle = time.monotonic() - self.progress
            if idle > self.args.stall:
                print(
                    f"stress: seed {self.seed}: HANG? rank {self.rank} of {self.size} "
                    "has made no progress for "
                    f"{idle:.0f} s in op #{self.op_index}: {self.current}; its last operations: "
                    f"{list(self.recent)}; {len(self.pending)} handles in flight; "
                    "every thread's stack:",
                    flush=True,
                )
                faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
                sys.stdout.flush()
                time.sleep(min(10.0, max(3.0, self.args.stall)))  # (the other ranks' reports)
                os._exit(4)

    def run(self):
        args = self.args
        print(
            f"stress: seed {self.seed}, rank {self.rank} of {self.size} "
            f"on {self.node_of[self.rank]} "
            f"({self.nodes} node(s)), {args.ops} operations, kinds {','.join(self.kinds)}, "
            f"flags {','.join(sorted(self.flags)) or 'none'}, skew 0..{args.skew_ms} ms",
            flush=True,
        )
        threading.Thread(target=self.watchdog, name="stress-watchdog", daemon=True).start()
        started = time.monotonic()
        for i in range(args.ops):
            self.op_index = i
            self.rng = np.random.default_rng(
                [self.seed, i]
            )  # (each operation's own draws: --only keeps them)
            kind = self.kinds[int(self.rng.choice(len(self.kinds), p=self.weights))]
            if self.only is not None and i not in self.only:
                continue
            self.current = kind
            self.skew()
            self.maybe_wait()
            if args.trace:
                print(f"[r{self.rank}] #{i} {kind}", flush=True)
            getattr(self, "op_" + kind)((i,))
            self.recent.append(f"#{i} {self.current}")
            if args.trace:
                print(f"[r{self.rank}] #{i} done: {self.current}", flush=True)
            self.progress = time.monotonic()
        self.op_index = args.ops
        self.current = "waiting for the handles still in flight"
        while self.pending:
            self.wait_one(0)
        self.current = "the final count"
        wrong = sum(
            self.world.allgather(self.wrong)
        )  # (allgather: it lets the GIL go while it waits)
        print(
            f"stress: seed {self.seed}, ranks {self.size}, {args.ops} operations, {wrong} wrong "
            f"(rank {self.rank}: {self.checked} results checked, {self.wrong} wrong, "
            f"{time.monotonic() - started:.1f} s)",
            flush=True,
        )
        return wrong

    def finalize(self):
        """MPI_Finalize, here, while Python can still report a hang in it (the library's
        communicators and windows are freed there): a rank stuck for --stall seconds prints its
        stacks and exits 1."""
        self.current = "MPI_Finalize"
        self.progress = time.monotonic()
        faulthandler.dump_traceback_later(self.args.stall, exit=True, file=sys.stdout)
        MPI.Finalize()
        faulthandler.cancel_dump_traceback_later()


def main():
    args = parse()
    stress = Stress(args)
    try:
        wrong = stress.run()
    except BaseException:  # noqa: BLE001 - the others would wait for this rank for ever: end the job
        print(
            f"stress: seed {stress.seed}: rank {stress.rank} of {stress.size} "
            f"RAISED in op #{stress.op_index} "
            f"({stress.current}); its last operations: {list(stress.recent)}\n"
            f"{traceback.format_exc()}",
            flush=True,
        )
        sys.stdout.flush()
        time.sleep(1)
        MPI.COMM_WORLD.Abort(3)
    print(
        f"stress: seed {stress.seed}: rank {stress.rank}: "
        f"MPI_Finalize (stuck {args.stall:.0f} s there: its "
        "stacks, exit 1)",
        flush=True,
    )
    stress.finalize()
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
