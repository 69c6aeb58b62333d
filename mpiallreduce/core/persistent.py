"""A prepared call of MPI's own allreduce as a persistent request (MPI-4's MPI_Allreduce_init).

    prepare(x, ...)       MPI_Allreduce_init on its buffers, once (every rank makes its prepared
                          calls in one order: they are agreed on when made)
    each run              MPI_Start, MPI_Wait
    the prepared call     MPI_Request_free, when it is collected (an inactive request: local)
    collected

Which prepared calls do is the plan's (``persistent``: the tuning table's persistent rules, where
Open MPI's persistent allreduce beat its blocking one, mpiallreduce.core.tuning.choose_persistent);
the executor binds it (Execution.bound).
"""

import contextlib
import weakref

from mpi4py import MPI

__all__ = ["bind_persistent"]


def bind_persistent(library, source, target, mpi_op, failed, then=None):
    """``run(sequence)``: a persistent allreduce of ``source`` into ``target`` on ``library``
    started and waited for, then ``then()`` if given (a mean's division); ``failed(error,
    sequence)`` raises what an error means. None where this MPI has no persistent collectives."""
    if not hasattr(library, "Allreduce_init"):
        return None
    request = library.Allreduce_init(source, target, mpi_op)

    def run(sequence):
        try:
            request.Start()
            request.Wait()
            if then is not None:
                then()
        except BaseException as error:
            failed(error, sequence)

    weakref.finalize(run, _free, request)
    run.persistent = True

    def failed_compiled(
        error, sequence
    ):  # (the compiled run's: an MPI error code, or what then() raised)
        failed(MPI.Exception(error) if isinstance(error, int) else error, sequence)

    #: what the compiled run (mpiallreduce.core.compiled) binds: the request, then, failed
    run.compiled = (request, then, failed_compiled)
    return run


def _free(request):
    if not MPI.Is_finalized():
        # (left active by a run that failed: MPI_Finalize or the abort takes it)
        with contextlib.suppress(MPI.Exception):
            request.Free()
