"""One rank's uncaught exception or failing exit ends the whole MPI job, loudly (an opt-in).

Without it, a rank that raises, or leaves with ``sys.exit(n)``, leaves the others blocked in their
next collective (and itself in ``MPI_Finalize``, which waits for them), and the job hangs until its
time limit with nothing in the log but silence. With it, every rank ends within seconds, through
``MPI_Abort`` on ``COMM_WORLD`` (mpiexec and ``srun --kill-on-bad-exit`` report it):

- an exception that escapes (the main program or any thread): the rank prints its traceback, each
  line headed by its rank, and aborts at once, with status 1 (130 for KeyboardInterrupt) as Python;
- ``sys.exit(n)`` with n nonzero (a message: 1) that ends the program: at exit the rank aborts with
  status n instead of entering ``MPI_Finalize``, and mpiexec returns n (99, the training program's
  "checkpoint written, requeue me", comes out as 99). It first gives the others EXIT_GRACE_SECONDS
  to finish what they were doing: when every rank ends with a status (a bench that found wrong
  elements, pytest's failures), some leave while rank 0 still writes the results or the report.
  ``sys.exit(0)``, ``sys.exit()`` and the end of the program are a normal exit, and so is any
  exit of a one-rank job (no other rank to wait for it); a caught SystemExit (``pytest.raises``)
  ends nothing.

    import mpiallreduce as mar
    mar.abort_on_exception()  # or MPIALLREDUCE_ABORT_ON_EXCEPTION=1 (mpiallreduce launch sets it)

What ``python -m mpi4py`` does (less the grace), for programs that are not started that way.
Python calls no hook for a SystemExit, so this one replaces ``sys.exit``: a bare
``raise SystemExit(n)`` or ``exit(n)`` still ends through ``MPI_Finalize``. This module does not
start MPI by being imported; turning the abort on does in a rank of a launched job
(MPIALLREDUCE_ABORT_ON_EXCEPTION=1 at ``import mpiallreduce``), so that an exception before the
first call aborts the job too.
"""

import atexit
import contextlib
import os
import sys
import threading
import time
import traceback

from .world import world_rank_and_size

__all__ = ["ABORT_ENV", "abort_on_exception", "abort_on_exception_from_environment"]

ABORT_ENV = "MPIALLREDUCE_ABORT_ON_EXCEPTION"
#: exit status MPI_Abort is given for an uncaught exception: Python's (and python -m mpi4py's)
ABORT_STATUS = 1
#: ... for an uncaught KeyboardInterrupt: a shell's for SIGINT (python -m mpi4py's)
INTERRUPTED_STATUS = 130
#: what a rank whose nonzero sys.exit() ended its program gives the others before it aborts the
#: job (rank 0 writes a bench's results some milliseconds after the others have left)
EXIT_GRACE_SECONDS = 3

_python_exit = sys.exit
_exit_status = None  # the status of the nonzero sys.exit() that ended the program (_Leaving)
_quiet = None  # (exit_alike: every rank leaves alike, "said" where this one printed why)


def _rank():
    return world_rank_and_size()[0]


def _say(rank, text):
    """``text`` on stderr, each line headed by the rank, after whatever stdout holds. Where stderr
    is a buffer in memory (torch.distributed's excepthook holds the previous hook's output in
    one, to print it once that hook returns: after the abort, never), the process's own stderr."""
    text = "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    stream = sys.stderr
    try:
        stream.fileno()
    except Exception:  # (io.StringIO and the like)
        stream = sys.__stderr__ or stream
    stream.write(text)
    stream.flush()


def _abort(kind, value, tb, where="", previous=sys.__excepthook__):
    rank = _rank()
    if rank is None:  # MPI not running: nothing to abort, behave as Python does
        previous(kind, value, tb)
        return
    header = f"mpiallreduce: uncaught {kind.__name__} on rank {rank}{where}; aborting the MPI job\n"
    _say(rank, header + "".join(traceback.format_exception(kind, value, tb)))
    from .recorder import dump

    dump(f"uncaught {kind.__name__}: {value}"[:300])
    status = INTERRUPTED_STATUS if issubclass(kind, KeyboardInterrupt) else ABORT_STATUS
    sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(status)


def _abort_from_thread(args):
    if issubclass(
        args.exc_type, SystemExit
    ):  # it ends its thread, not the program (as Python has it)
        return
    _abort(
        args.exc_type,
        args.exc_value,
        args.exc_traceback,
        f" in thread {args.thread.name if args.thread else '?'}",
    )


class _Leaving:
    """Rides on the SystemExit of a nonzero ``sys.exit()`` and learns, when Python frees it, whether
    it ended the program: one that reached the top is freed just before Python exits, with no Python
    frame left running; a caught one goes while the program runs on (or later, at shutdown)."""

    def __init__(self, status):
        self.status = status

    def __del__(self):
        global _exit_status
        if sys._getframe().f_back is None:
            _exit_status = self.status


def _exit(status=None):
    """``sys.exit`` while abort_on_exception is on: the same, and a nonzero exit of the main thread
    carries a _Leaving (in another thread, SystemExit only ends that thread)."""
    try:
        _python_exit(status)
    except SystemExit as leaving:
        code = leaving.code
        exit_status = (
            0 if code is None else code if isinstance(code, int) else 1
        )  # as Python computes it
        if exit_status and threading.current_thread() is threading.main_thread():
            leaving.mpiallreduce_leaving = _Leaving(exit_status)
        raise


def exit_alike(status, said):
    """``sys.exit(status)`` where every rank leaves alike at this point (a usage error: each parsed
    the same arguments), so saying that this rank ends the job would only repeat the reason once
    per rank. The rank that ``said`` why (it printed the error) ends the job at once; the others
    wait the grace first, so that their abort does not cut that line off."""
    global _quiet
    _quiet = "said" if said else "silent"
    sys.exit(status)


def exit_status():
    """The status of the nonzero ``sys.exit`` that is ending this rank's program (with
    abort_on_exception), else None: the job is about to be aborted, nothing collective may start."""
    return _exit_status


def _abort_after_exit():
    """At exit (before mpi4py's MPI_Finalize): if a nonzero sys.exit() ended the program, abort the
    job with its status rather than wait in MPI_Finalize for ranks that may be waiting for this
    one."""
    rank = _rank()
    if _exit_status is None or rank is None:
        return
    world = sys.modules["mpi4py.MPI"].COMM_WORLD
    if world.Get_size() == 1:  # no other rank to wait for this one: MPI_Finalize returns
        return
    if not _quiet:
        _say(
            rank,
            f"mpiallreduce: rank {rank} exits with status {_exit_status}; aborting the MPI job "
            f"with it in {EXIT_GRACE_SECONDS} s",
        )
    from .recorder import dump

    dump(f"sys.exit({_exit_status})")
    if _quiet != "said":  # (exit_alike: the rank that said why ends it at once)
        time.sleep(EXIT_GRACE_SECONDS)
    world.Abort(_exit_status)


def abort_on_exception(enable=True):
    """From now on, an exception that escapes (the main program or any thread) on any rank prints
    that rank's traceback and aborts the whole MPI job, and so does a ``sys.exit(n)``, n nonzero,
    that ends a rank's program (with status n); ``enable=False`` restores Python's hooks."""
    atexit.unregister(_abort_after_exit)
    if not enable:
        sys.excepthook = sys.__excepthook__
        threading.excepthook = threading.__excepthook__
        sys.exit = _python_exit
        return
    if (
        "PMIX_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ
    ):  # (a rank of a launched job)
        # MPI starts now if it has not (``import mpiallreduce`` does not start it): an exception or
        # a sys.exit(n) before this rank's first call must reach MPI_Abort too; a rank that leaves
        # alone while the others are in MPI_Init or a collective can leave them there for ever
        from mpi4py import MPI  # noqa: F401
    sys.excepthook = _abort
    threading.excepthook = _abort_from_thread
    from .recorder import recorder
    from .recorder_signals import install_signal_handlers

    if (
        recorder() is not None
    ):  # (SIGTERM, as the launcher sends it: the recorder's dump, then the end)
        install_signal_handlers(terminate=True)
    sys.exit = _exit
    atexit.register(_abort_after_exit)


def abort_on_exception_from_environment():
    if os.environ.get(ABORT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
        abort_on_exception()
