"""A chaos soak: ordinary calls and injected faults in a row for minutes, on 2 emulated nodes x 2 ranks
under ULFM, every result checked, every error checked to name the rank that caused it, and the
flight recorder's dumps read by ``mpiallreduce trace``'s analyzer.

    python benchmarks/soak.py --minutes 10 --seed 1 --output results/soak

The driver starts ``mpiallreduce launch -n 4 --nodes 2 --fault-tolerant`` on this file's rank side,
sends the launcher SIGTERM near the end (the ranks dump their recorders and end), then counts.
Every rank draws the same seeded schedule; each episode is one of

    sync, async, prepared, bucketed   ordinary calls (timed: TIMEOUT), results against numpy's sum
    threads    ordinary calls from THREADS threads at once, each on a duplicate of its own (a timed
               call, then an asynchronous one), started in another order on odd ranks
    delay      one rank sleeps past the timeout: the others' AllreduceTimeout names it
    mismatch   one rank's call has another length: SignatureMismatch on every rank names it
    raise      one rank fails inside the ring (MemoryError): the others' AllreduceAborted names it
    kill       once, at 3/5 of the time: one rank SIGKILLs itself mid-stream; RankFailure on every
               survivor names it, and they go on, on mar.survivors(comm)

A rank's clock decides nothing: rank 0's elapsed time rides in the first call of each episode.
Targets (issue #29): 0 wrong values, 0 calls past TIMEOUT + 5 s, every error naming its cause.
"""  # noqa: E501 (the first line is --help's description: main() reads it, so it stays one line)

import argparse
import glob
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

TIMEOUT = 2.0
ORDINARY = ("sync", "async", "prepared", "bucketed", "threads")
THREADS = 2  # threads of a "threads" episode, each on a communicator of its own
KINDS = (
    ["sync"] * 6
    + ["async"] * 3
    + ["prepared"] * 3
    + ["bucketed"] * 3
    + ["threads"] * 3
    + ["delay", "mismatch", "raise", "raise"]
)
COUNT = 20_011  # elements of an ordinary call (160 KiB of float64)


def data(world_rank, episode, count=COUNT):
    return ((np.arange(count) * 7 + world_rank * 13 + episode * 3) % 17 - 8).astype(np.float64)


def reference(members, episode, count=COUNT):
    return np.sum([data(r, episode, count) for r in members], axis=0)


class Ranks:
    """The rank side: the episodes, and one line of JSON per episode in
    OUTPUT/events-rank<R>.jsonl."""

    def __init__(self, args):
        from mpi4py import MPI

        import mpiallreduce as mar

        self.mar, self.MPI = mar, MPI
        self.world = MPI.COMM_WORLD.Get_rank()
        self.comm = MPI.COMM_WORLD.Dup()
        self.members = list(range(MPI.COMM_WORLD.Get_size()))
        self.rng, self.seconds = random.Random(args.seed), args.minutes * 60
        # (open for the rank's whole soak, one line per episode)
        self.log = open(os.path.join(args.output, f"events-rank{self.world}.jsonl"), "w")  # noqa: SIM115
        self.killed = False
        self.thread_comms = (
            None,
            [],
        )  # (the communicator they were duplicated from, the duplicates)
        import warnings

        warnings.simplefilter(
            "ignore", mar.AllreduceStallWarning
        )  # (each delay's: expected, and many)

    def comm_id(self):
        """The flight recorder's name of the episodes' communicator (threads make others of the
        same ranks: the analyzer's findings are told apart by it)."""
        from mpiallreduce.core.state import known_state

        state = known_state(self.comm)
        return "" if state is None else state.trace_id

    def note(self, **fields):
        self.log.write(json.dumps(fields) + "\n")
        self.log.flush()

    def clock(self, episode, started):
        """(rank 0's elapsed seconds, whether the rest of the call was right, what a wrong one gave
        and should have): an ordinary timed call."""
        x = data(self.world, episode, 8)
        x[0] = time.monotonic() - started if self.comm.Get_rank() == 0 else 0.0
        result = self.mar.allreduce(x, comm=self.comm, timeout=TIMEOUT)
        want = reference(self.members, episode, 8)
        right = bool(np.array_equal(result[1:], want[1:]))
        return (
            float(result[0]),
            right,
            {} if right else {"got": result.tolist(), "want": want.tolist(), "sent": x.tolist()},
        )

    def run(self):
        self.mar.allreduce(
            np.ones(1), comm=self.comm
        )  # (first use: the control channel of timed calls)
        started = time.monotonic()
        episode = 0
        while True:
            episode += 1
            elapsed, clock_right, wrong = self.clock(episode, started)
            self.note(
                episode=episode,
                kind="clock",
                comm=self.members,
                ok=True,
                right=clock_right,
                **wrong,
            )
            kind = self.rng.choice(KINDS)
            culprit_index = self.rng.randrange(
                1, len(self.members)
            )  # (never rank 0 of the communicator)
            if not self.killed and elapsed >= 0.6 * self.seconds and len(self.members) == 4:
                kind = "kill"
            self.episode(episode, kind, self.members[culprit_index])

    def episode(self, episode, kind, culprit):
        mar, comm, me = self.mar, self.comm, self.world
        x, want = data(me, episode), reference(self.members, episode)
        began, outcome = (
            time.monotonic(),
            {
                "episode": episode,
                "kind": kind,
                "comm": self.members,
                "comm_id": self.comm_id(),
                "culprit": None if kind in ORDINARY else culprit,
            },
        )
        try:
            right = getattr(self, "do_" + kind)(x, want, episode, culprit)
            outcome.update(ok=True, right=right)
        except Exception as error:  # noqa: BLE001 - every error is checked to name its cause, then counted
            outcome.update(
                ok=False,
                error=type(error).__name__,
                message=str(error)[:300],
                sequence=getattr(error, "sequence", None),
                named=self.names(kind, culprit, error),
            )
            if (
                kind in ORDINARY
            ):  # (nothing was injected: where it came from, for whoever reads the events)
                outcome["traceback"] = traceback.format_exc()[-3000:]
            if isinstance(error, mar.RankFailure):  # (go on with the survivors)
                outcome["failed"] = [int(r) for r in error.failed_ranks]
                from mpiallreduce.faults.recorder import world_ranks

                self.comm = mar.survivors(comm)
                self.members, self.killed = list(world_ranks(self.comm)), True
        outcome["seconds"] = time.monotonic() - began
        self.note(**outcome)

    def names(self, kind, culprit, error):
        """Whether ``error`` names the rank that caused it (in the communicator's ranks)."""
        mar, index = self.mar, self.members.index(culprit) if culprit in self.members else None
        if kind == "delay":  # (the late rank's own: its call was given up)
            return isinstance(error, mar.AllreduceTimeout) and (
                self.world == culprit or tuple(error.missing_ranks) == (index,)
            )
        if kind == "mismatch":
            return f"on rank {index}" in str(error)
        if kind == "raise":
            return (
                isinstance(error, MemoryError)
                if self.world == culprit
                else (isinstance(error, mar.AllreduceAborted) and error.failed_rank == index)
            )
        if kind == "kill":
            return isinstance(error, mar.RankFailure) and tuple(error.failed_ranks) == (index,)
        return False  # (an ordinary call raised: nothing injected, so nothing to name)

    def do_sync(self, x, want, episode, culprit):
        return bool(np.array_equal(self.mar.allreduce(x, comm=self.comm, timeout=TIMEOUT), want))

    def do_async(self, x, want, episode, culprit):
        handles = [self.mar.allreduce_async(x * k, comm=self.comm) for k in (1, 2, 3)]
        return all(
            np.array_equal(h.wait(), want * k) for h, k in zip(handles, (1, 2, 3), strict=True)
        )

    def do_prepared(self, x, want, episode, culprit):
        buffer = x.copy()
        prepared = self.mar.prepare(buffer, out=buffer, comm=self.comm, timeout=TIMEOUT)
        first = bool(np.array_equal(prepared(), want))
        buffer[...] = x
        return first and bool(np.array_equal(prepared(), want))

    def do_bucketed(self, x, want, episode, culprit):
        a, b = x.copy(), x[:1000].copy()
        sync = self.mar.GradientSync(
            comm=self.comm, bucket_bytes=64 << 10, timeout=TIMEOUT, parameters={"a": a, "b": b}
        )
        sync.ready(b, name="b")
        sync.ready(a, name="a")
        sync.wait()
        size = len(self.members)
        return bool(np.array_equal(a, want / size) and np.array_equal(b, want[:1000] / size))

    def do_threads(self, x, want, episode, culprit):
        if (
            self.thread_comms[0] is not self.comm
        ):  # (made here, in program order: after a kill, anew)
            self.thread_comms = (self.comm, [self.comm.Dup() for _ in range(THREADS)])
        comms, right, errors = self.thread_comms[1], [False] * THREADS, []

        def work(k):
            try:
                timed = self.mar.allreduce(x * (k + 1), comm=comms[k], timeout=TIMEOUT)
                untimed = self.mar.allreduce_async(x * (k + 2), comm=comms[k]).wait()
                right[k] = np.array_equal(timed, want * (k + 1)) and np.array_equal(
                    untimed, want * (k + 2)
                )
            except Exception as error:  # noqa: BLE001 - raised below, on the episode's thread
                errors.append(error)

        threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(THREADS)]
        for thread in threads if self.world % 2 == 0 else threads[::-1]:
            thread.start()
        for thread in threads:
            thread.join(
                TIMEOUT + 30
            )  # (a thread still running: the episode's seconds count a hang)
        if errors:
            raise errors[0]
        return all(right)

    def do_delay(self, x, want, episode, culprit):
        if self.world == culprit:
            time.sleep(TIMEOUT + 0.5)
        return bool(np.array_equal(self.mar.allreduce(x, comm=self.comm, timeout=TIMEOUT), want))

    def do_mismatch(self, x, want, episode, culprit):
        mine = x[:-1] if self.world == culprit else x
        return bool(np.array_equal(self.mar.allreduce(mine, comm=self.comm, timeout=TIMEOUT), want))

    def do_raise(self, x, want, episode, culprit):
        op_type = type(self.mar.OPS["sum"])
        original = op_type.reduce_local
        if self.world == culprit:

            def fail_once(op, a, b, out):
                op_type.reduce_local = original
                raise MemoryError(f"injected failure on rank {self.world}")

            op_type.reduce_local = fail_once
        try:
            return bool(
                np.array_equal(
                    self.mar.allreduce(x, comm=self.comm, algorithm="ring", timeout=TIMEOUT), want
                )
            )
        finally:
            op_type.reduce_local = original
            time.sleep(0.2)  # (the failed call's messages arrive, as the fault tests wait)

    def do_kill(self, x, want, episode, culprit):
        if self.world == culprit:
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        big = np.ones(1 << 20)
        for _ in range(1000):
            self.mar.allreduce(big, comm=self.comm, out=big, algorithm="ring")
            big[:] = 1
        return True


def drive(args):
    """Start the ranks, SIGTERM the launcher near the end, then count and analyze."""
    os.makedirs(args.output, exist_ok=True)
    for old in glob.glob(os.path.join(args.output, "events-rank*.jsonl")):
        os.remove(old)
    trace = os.path.join(args.output, "trace")
    env = dict(os.environ, MPIALLREDUCE_TRACE_ENTRIES="8192", MPIALLREDUCE_TRACE_DIR=trace)
    argv = [
        sys.executable,
        "-m",
        "mpiallreduce",
        "launch",
        "-n",
        "4",
        "--nodes",
        "2",
        "--fault-tolerant",
        "--grace",
        "10",
        "--timeout",
        str(args.minutes * 60 + 60),
        "--",
        sys.executable,
        os.path.abspath(__file__),
        "--rank-side",
        "--minutes",
        str(args.minutes),
        "--seed",
        str(args.seed),
        "--output",
        args.output,
    ]
    launcher = subprocess.Popen(argv, env=env)
    time.sleep(args.minutes * 60 * 0.95)
    launcher.send_signal(signal.SIGTERM)
    returncode = launcher.wait(timeout=120)
    from soak_report import report

    return report(args.output, trace, TIMEOUT, returncode)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", default="results/soak")
    parser.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_side:
        Ranks(args).run()
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
