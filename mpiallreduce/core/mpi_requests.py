"""Whether an MPI request is done: ``request.Test()``, an error counting as done. Asked by the
waits that test their requests instead of blocking in MPI (the faults layer's PeerWatch) and by
what keeps a given-up call's buffers until its requests are over (core.signature_messages)."""

from mpi4py import MPI

__all__ = ["request_done"]


def request_done(request):
    """Whether ``request`` has completed, with its error too (an ANY_SOURCE receive would stay
    pending under ULFM after its error; the library posts none)."""
    try:
        return request.Test()
    except MPI.Exception:
        return True
