"""One rank's uncaught exception ends the whole MPI job, loudly (an opt-in).

Without it, a rank that raises leaves the others blocked in their next collective, and the job
hangs until its time limit with nothing in the log but silence. With it, the rank prints its
traceback (headed by its rank) and calls ``MPI_Abort`` on ``COMM_WORLD``, which ends every rank
(mpiexec and ``srun --kill-on-bad-exit`` report it), within a second or so.

    import mpiallreduce as mar
    mar.abort_on_exception()            # or MPIALLREDUCE_ABORT_ON_EXCEPTION=1 in the environment

The same as running under ``python -m mpi4py``, for programs that are not started that way; also
covers exceptions that escape a thread. This module does not start MPI by being imported.
"""
import os
import sys
import threading
import traceback

__all__ = ["ABORT_ENV", "abort_on_exception", "abort_on_exception_from_environment"]

ABORT_ENV = "MPIALLREDUCE_ABORT_ON_EXCEPTION"
#: exit status MPI_Abort is given
ABORT_STATUS = 13


def _rank():
    mpi4py = sys.modules.get("mpi4py.MPI")
    if mpi4py is None or not mpi4py.Is_initialized() or mpi4py.Is_finalized():
        return None
    return mpi4py.COMM_WORLD.Get_rank()


def _abort(kind, value, tb, where="", previous=sys.__excepthook__):
    rank = _rank()
    if rank is None:  # MPI not running: nothing to abort, behave as Python does
        previous(kind, value, tb)
        return
    header = f"mpiallreduce: uncaught {kind.__name__} on rank {rank}{where}; aborting the MPI job\n"
    text = header + "".join(traceback.format_exception(kind, value, tb))
    text = "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))
    try:
        sys.stdout.flush()
    except Exception:
        pass
    sys.stderr.write(text)
    sys.stderr.flush()
    sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(ABORT_STATUS)


def abort_on_exception(enable=True):
    """From now on, an exception that escapes (the main program or any thread) on any rank prints
    that rank's traceback and aborts the whole MPI job; ``enable=False`` restores Python's hooks."""
    if not enable:
        sys.excepthook = sys.__excepthook__
        threading.excepthook = threading.__excepthook__
        return
    sys.excepthook = _abort
    threading.excepthook = lambda args: _abort(args.exc_type, args.exc_value, args.exc_traceback,
                                               f" in thread {args.thread.name if args.thread else '?'}")


def abort_on_exception_from_environment():
    if os.environ.get(ABORT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
        abort_on_exception()
