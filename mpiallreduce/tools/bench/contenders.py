"""The contenders: small adapters that each perform one allreduce of ``send`` into ``out``, and
where the buffers live (host or device memory)."""

from mpi4py import MPI

from ...algorithms import REGISTRY
from ...api import allreduce, empty, prepare, prepare_at
from ...core.buffers import aligned_empty, array_module, mpi_datatype
from ...core.node_rank import select_gpu
from ...core.ops import get_op
from ...core.state import state_of
from ...core.tuning import PERSISTENT as OURS_PERSISTENT
from ...device.arrays import cuda_aware, synchronize
from ...device.transports import device_path, run_on_device
from ..openmpi_tuned import (
    TUNED_ALLREDUCE_ALGORITHMS,
    forced_allreduce_communicator,
    han_off_communicator,
)

__all__ = [
    "BASELINE",
    "FORCED_PREFIX",
    "DEVICE_ALGORITHMS",
    "REPRODUCIBLE",
    "REPRODUCIBLE_SYMMETRIC",
    "PLAIN",
    "AUTO_PLAIN",
    "PERSISTENT",
    "OURS_PERSISTENT",
    "OURS_BLOCKING",
    "HostMemory",
    "DeviceMemory",
    "device_memory",
    "contenders",
    "Prepared",
    "OnSymmetricBuffers",
]

BASELINE = "openmpi"
FORCED_PREFIX = "openmpi:"
DEVICE_ALGORITHMS = ("staged_ring", "device_to_device", "ring", "auto")
MPI_ALLREDUCE = REGISTRY["mpi"]
#: the contender ``allreduce(..., reproducible=True)`` (auto: the direct route)
REPRODUCIBLE = "reproducible"
#: the same on symmetric buffers (mpiallreduce.empty), as GradientSync's buckets: single_copy on one
#: node
REPRODUCIBLE_SYMMETRIC = "reproducible:symmetric"


class HostMemory:
    """Where the benchmark's buffers live: numpy arrays (page-aligned)."""

    name = "cpu"

    def array(self, values):
        data = aligned_empty(values.size, values.dtype)
        data[:] = values
        return data

    def empty(self, count, dtype):
        return aligned_empty(count, dtype)

    def copy(self, destination, source):
        destination[:] = source

    def to_host(self, a):
        return a

    def finish(self):
        """Wait until every call made so far has finished (device work is asynchronous)."""


class DeviceMemory(HostMemory):
    """CuPy arrays (or the test stand-in's) on this rank's GPU."""

    name = "gpu"

    def __init__(self, xp):
        self.xp = xp

    def array(self, values):
        return self.xp.asarray(values)

    def empty(self, count, dtype):
        return self.xp.empty(count, dtype)

    def copy(self, destination, source):
        self.xp.copyto(destination, source)

    def to_host(self, a):
        return self.xp.asnumpy(a)

    def finish(self):
        synchronize(self.xp)


def device_memory(kind):
    """HostMemory() for "cpu"; DeviceMemory for "gpu" (CuPy, this rank's GPU selected) or
    "fake-gpu"."""
    if kind == "cpu":
        return HostMemory()
    if kind == "fake-gpu":
        from ...testing import fake_cupy

        return DeviceMemory(fake_cupy)
    import cupy

    select_gpu(xp=cupy)
    return DeviceMemory(cupy)


def _mpi_allreduce(op, comm_to_use=None):
    """Adapter: Open MPI's MPI_Allreduce, through the same algorithm module our ``mpi`` runs
    (algorithms/mpi.py), on the caller's communicator (or ``comm_to_use``: a forced-algorithm
    one)."""
    reduce_op = get_op(op)

    def call(send, out, comm):
        c = comm_to_use or comm
        MPI_ALLREDUCE.run(
            c, None if send is out else send, out, reduce_op, mpi_datatype(send.dtype)
        )
        reduce_op.finish(out, c.Get_size())

    return call


def _mpi_allreduce_of_device_memory(op, xp):
    """Adapter: Open MPI's path for device buffers, as mpiallreduce.transports carries ``mpi``: the
    pointers themselves to a CUDA-aware MPI, else a round trip through pinned host buffers
    (allocated once) around MPI_Allreduce."""
    reduce_op = get_op(op)

    def call(send, out, comm):
        run_on_device(
            device_path(MPI_ALLREDUCE, cuda_aware()[0]),
            MPI_ALLREDUCE,
            comm,
            None if send is out else send,
            out,
            reduce_op,
            mpi_datatype(send.dtype),
            xp,
        )
        reduce_op.finish(out, comm.Get_size())

    return call


class Prepared:
    """Adapter: a call prepared once per pair of buffers (``make(send, out, comm)``, collective: at
    each size and mode's warm-up, every rank, in the contenders' order), then run: what training
    runs (GradientSync's buckets are prepared calls). In place when ``send`` is ``out``."""

    def __init__(self, make):
        self.make, self.key, self.run = make, None, None

    def __call__(self, send, out, comm):
        if self.key != (id(send), id(out)):  # (the run made holds both: their ids stay theirs)
            self.Free()
            self.key, self.run = (id(send), id(out)), self.make(send, out, comm)
        self.run()

    def Free(self):
        """Let the persistent request go (compare frees every contender that has this)."""
        request, self.run = getattr(self.run, "request", None), None
        if request is not None:
            request.Free()


def _persistent(op):
    """Open MPI's MPI_Allreduce_init, started and waited for each call (MPI-4 persistent)."""
    reduce_op = get_op(op)

    def make(send, out, comm):
        request = comm.Allreduce_init(
            MPI.IN_PLACE if send is out else send, out, reduce_op.mpi_op(out.dtype)
        )

        def run():
            request.Start()
            request.Wait()
            reduce_op.finish(out, comm.Get_size())

        run.request = request
        return run

    return Prepared(make)


#: NAME + PLAIN: our plain call of NAME (its price per call: the general path's checks; the others
#: are prepared); auto's is in make bench, each algorithm's in tune (mpiallreduce.tools.plain_price)
PLAIN = ":plain"
AUTO_PLAIN = "auto" + PLAIN
#: Open MPI's persistent allreduce, among its forced algorithms (the stronger of the two is
#: "strongest")
PERSISTENT = FORCED_PREFIX + "persistent"
#: our prepared call of MPI's own, bound as a persistent request wherever it can be
#: ("mpi:persistent") and as the blocking call: tune's per-size measurement of the two
#: (mpiallreduce.tools.persistent_rules)
OURS_BLOCKING = "mpi:blocking"


def _ours(algorithm, op, memory):
    exact = algorithm == REPRODUCIBLE
    plain = algorithm.endswith(PLAIN)
    if algorithm in (OURS_PERSISTENT, OURS_BLOCKING):
        persistent = "always" if algorithm == OURS_PERSISTENT else False
        return Prepared(
            lambda send, out, comm: (
                prepare_at(
                    "", send, op=op, algorithm="mpi", comm=comm, out=out, persistent=persistent
                ).run
            )
        )
    name = "auto" if exact else algorithm[: -len(PLAIN)] if plain else algorithm
    if plain or isinstance(
        memory, DeviceMemory
    ):  # (plain calls: device arrays run no prepared call)
        return lambda send, out, comm: allreduce(
            send, op=op, algorithm=name, comm=comm, out=out, reproducible=exact
        )
    return Prepared(
        lambda send, out, comm: (
            prepare(send, op=op, algorithm=name, comm=comm, out=out, reproducible=exact).run
        )
    )


class OnSymmetricBuffers:
    """Adapter for an algorithm that runs on symmetric buffers only (single_copy): buffers of its
    own (``mpiallreduce.empty``, made once for the largest size, every rank at once), each size and
    mode a prepared call on views of them, as a user of symmetric buffers runs it. ``buffers`` gives
    the timing loop the (send, out) to run it on."""

    def __init__(self, algorithm, op, largest, reproducible=False):
        self.algorithm, self.op, self.largest, self.reproducible = (
            algorithm,
            op,
            largest,
            reproducible,
        )
        self.memory, self.key, self.prepared = None, None, None

    def buffers(self, count, dtype, in_place, comm):
        nbytes = count * dtype.itemsize
        if self.memory is None:  # (collective: the first size's warm-up, on every rank)
            self.memory = tuple(
                empty(max(self.largest, nbytes), "uint8", comm=comm) for _ in range(2)
            )
        out = self.memory[0][:nbytes].view(dtype)
        send = out if in_place else self.memory[1][:nbytes].view(dtype)
        if self.key != (count, dtype.str, in_place):  # (collective, in the same turn on every rank)
            self.key = (count, dtype.str, in_place)
            self.prepared = prepare(
                send,
                op=self.op,
                algorithm=self.algorithm,
                comm=comm,
                out=out,
                reproducible=self.reproducible,
            )
        return send, out

    def __call__(self, send, out, comm):
        self.prepared()


def _planted_wrong(call):
    """For tests of the checker: the contender's result with one element changed on rank 0."""

    def wrong(send, out, comm):
        call(send, out, comm)
        if comm.Get_rank() == 0 and out.size:
            first = out[:1]
            array_module(out).add(first, 1, out=first)  # (numpy, CuPy or the stand-in alike)

    wrong.buffers = getattr(call, "buffers", None)
    return wrong


def contenders(comm, names, op, forced, plant_wrong=None, memory=None, largest=0):
    """(name -> adapter, communicators to free); ``largest``: the largest size in bytes (the
    symmetric buffers' of OnSymmetricBuffers)."""
    if isinstance(memory, DeviceMemory):
        found = {BASELINE: _mpi_allreduce_of_device_memory(op, memory.xp)}
        forced = ()  # Open MPI's forced algorithms would all take the same host round trip
    else:
        found = {BASELINE: _mpi_allreduce(op)}
    made = []
    if (
        forced and state_of(comm).make_ready().spans_nodes
    ):  # Open MPI's default there is coll/han: also time it without
        han_off = han_off_communicator(comm)
        if han_off is not None:
            made.append(han_off)
            found[FORCED_PREFIX + "han_off"] = _mpi_allreduce(op, han_off)
    for number in forced:
        forced_comm = forced_allreduce_communicator(comm, number)
        if forced_comm is not None:
            made.append(forced_comm)
            found[FORCED_PREFIX + TUNED_ALLREDUCE_ALGORITHMS[number]] = _mpi_allreduce(
                op, forced_comm
            )
    if forced and hasattr(comm, "Allreduce_init"):  # (host memory: device runs force nothing)
        found[PERSISTENT] = _persistent(op)
        made.append(found[PERSISTENT])
    for name in names:
        symmetric = name in REGISTRY and REGISTRY[name].needs_symmetric
        if name == REPRODUCIBLE_SYMMETRIC:
            found[name] = OnSymmetricBuffers("auto", op, largest, reproducible=True)
        else:
            found[name] = (
                OnSymmetricBuffers(name, op, largest) if symmetric else _ours(name, op, memory)
            )
        if isinstance(found[name], Prepared):
            made.append(found[name])
    if plant_wrong:
        found[plant_wrong] = _planted_wrong(found[plant_wrong])
    return found, made
