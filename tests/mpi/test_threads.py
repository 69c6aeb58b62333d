"""Threads on communicators of their own (issue 54, item 2): MPI allows collectives on different
communicators from different threads (the library asks for MPI_THREAD_MULTIPLE), so every entry
must too. Each thread runs a mix of plain, asynchronous, prepared and timed calls, and first-time
set-ups (the library's duplicate, shared windows, symmetric arrays), on its own duplicate of
COMM_WORLD; the ranks start the threads' calls in different orders. Before the fix one process-wide
worker queue and one lock put every communicator's calls in one order, which differed between the
ranks: every run hung, or a timed call named a rank that had arrived.

Expected values come from numpy over every rank's input, made here (tests/mpi/reference.py)."""

import threading
import time

import numpy as np
import pytest
from mpi4py import MPI
from reference import every_ranks, exact_input, numpy_reference, values_equal

import mpiallreduce as mar

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
#: how long the threads are given to end: a hang fails the test here, on every rank
JOIN_SECONDS = 120


def _input(rank, thread, step, count=1000):
    return exact_input("float64", count, rank, "sum") * (thread + 1) + step


def _want(thread, step, count=1000):
    inputs = every_ranks(lambda rank: _input(rank, thread, step, count), WORLD.Get_size())
    return numpy_reference("sum", inputs)


def _skew(rank, thread, step):
    """A pause that differs by rank: the threads' calls start in a different order on each rank."""
    time.sleep(0.002 * ((rank + thread + step) % 3))


def _mix(comm, thread, steps, one_node, failures):
    """What one thread runs on ``comm``: every kind of call, its first use timed on odd threads."""
    rank = comm.Get_rank()
    try:
        first = dict(timeout=60) if thread % 2 else {}
        assert values_equal(
            mar.allreduce(_input(rank, thread, 0), comm=comm, **first), _want(thread, 0)
        )
        prepared_input = _input(rank, thread, 0)
        prepared = mar.prepare(prepared_input, comm=comm)
        for step in range(1, steps + 1):
            x, want = _input(rank, thread, step), _want(thread, step)
            _skew(rank, thread, step)
            assert values_equal(mar.allreduce(x, comm=comm), want)
            _skew(rank, thread, step + 1)
            assert values_equal(mar.allreduce_async(x, comm=comm).wait(timeout=JOIN_SECONDS), want)
            assert values_equal(mar.allreduce_async(x, comm=comm, timeout=60).wait(), want)
            assert values_equal(mar.allreduce(x, comm=comm, timeout=60), want)
            prepared_input[...] = x
            assert values_equal(prepared(), want)
            if one_node:  # a shared window that grows each step, made on this thread
                count = 1000 * (1 << step)
                big = _input(rank, thread, step, count)
                assert values_equal(
                    mar.allreduce(big, comm=comm, algorithm="shared_memory"),
                    _want(thread, step, count),
                )
        if one_node:  # a symmetric array and its single copy, set up on this thread
            symmetric = mar.zeros(4096, np.float64, comm=comm)
            symmetric[...] = _input(rank, thread, 7, 4096)
            assert values_equal(
                mar.allreduce(symmetric, out=symmetric, comm=comm, algorithm="single_copy"),
                _want(thread, 7, 4096),
            )
    except BaseException as error:  # (reported by the main thread, on every rank)
        failures.append(f"thread {thread}: {type(error).__name__}: {error}")


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_threads_on_their_own_communicators_never_wait_on_each_other(threads):
    if WORLD.Get_size() == 1:
        pytest.skip("one rank: no peer to wait on")
    from mpiallreduce.core.state import state_of

    one_node = not state_of(WORLD).make_ready().spans_nodes
    comms = [
        WORLD.Dup() for _ in range(threads)
    ]  # (made here: the threads must not Dup WORLD at once)
    failures = []
    workers = [
        threading.Thread(target=_mix, args=(comm, k, 3, one_node, failures), daemon=True)
        for k, comm in enumerate(comms)
    ]
    order = workers if WORLD.Get_rank() % 2 == 0 else workers[::-1]
    for worker in order:
        worker.start()
    deadline = time.monotonic() + JOIN_SECONDS
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    hung = [k for k, worker in enumerate(workers) if worker.is_alive()]
    assert not hung, f"rank {WORLD.Get_rank()}: threads {hung} still running after {JOIN_SECONDS} s"
    assert not failures, "\n".join(failures)
    for comm in comms:
        comm.Free()


def test_a_blocked_call_on_one_communicator_does_not_hold_up_another():
    """Rank 0's thread A waits in a call on its communicator that rank 1 enters only after thread
    B's calls on another communicator have all finished: B must not wait behind A."""
    if WORLD.Get_size() == 1:
        pytest.skip("one rank: no peer to wait on")
    rank = WORLD.Get_rank()
    a, b = WORLD.Dup(), WORLD.Dup()
    for comm in (a, b):  # (first uses here: the library's duplicates)
        mar.allreduce(np.zeros(1), comm=comm)
    b_done = threading.Event()
    failures = []

    def on_a():
        try:
            if rank != 0:
                assert b_done.wait(JOIN_SECONDS), "B did not finish"
            handle = mar.allreduce_async(_input(rank, 0, 1), comm=a)
            assert values_equal(handle.wait(), _want(0, 1))
        except BaseException as error:
            failures.append(f"A: {type(error).__name__}: {error}")

    def on_b():
        try:
            for step in range(5):
                assert values_equal(
                    mar.allreduce_async(_input(rank, 1, step), comm=b).wait(), _want(1, step)
                )
                assert values_equal(mar.allreduce(_input(rank, 1, step), comm=b), _want(1, step))
        except BaseException as error:
            failures.append(f"B: {type(error).__name__}: {error}")
        finally:
            b_done.set()

    threads = [
        threading.Thread(target=on_a, daemon=True),
        threading.Thread(target=on_b, daemon=True),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_SECONDS)
    assert not any(thread.is_alive() for thread in threads), f"rank {rank}: a thread hung"
    assert not failures, "\n".join(failures)
    a.Free()
    b.Free()
