"""Device arrays: every algorithm and path, against numpy on the gathered inputs, bits equal on
every rank.

``xp`` is the test stand-in (mpiallreduce.testing.fake_cupy: host memory behind a
``__cuda_array_interface__``, kernels queued on streams until synchronized) on every run, and real
CuPy where a GPU is present (benchmarks/gpu/device_check.sh runs those with ``-k cupy``).
"""

import functools
import time

import numpy as np
import pytest
import stalls
from mpi4py import MPI
from reference import (
    BitsAcrossRanks,
    exact_input,
    exact_reference,
    gather_inputs,
    no_gpu,
    numpy_reference,
    problems_with,
)

import mpiallreduce as mar
import mpiallreduce.testing.fake_cupy as fake_cupy
from mpiallreduce.algorithms import REGISTRY, device_to_device
from mpiallreduce.core.state import state_of
from mpiallreduce.device import arrays as device
from mpiallreduce.device import transports

pytestmark = pytest.mark.mpi


@pytest.fixture(params=["stand_in", "cupy"], scope="module")
def xp(request):
    if request.param == "stand_in":
        return fake_cupy
    from mpiallreduce.tools.gpu_info import usable_cupy

    cupy, why = usable_cupy()  # (this rank's GPU selected)
    if cupy is None:
        no_gpu(f"no usable GPU: {why}")
    return cupy


@pytest.fixture(params=["cuda_aware", "not_cuda_aware"])
def aware(request, use_settings, xp):
    wanted = request.param == "cuda_aware"
    if wanted and xp is not fake_cupy and not device.cuda_aware()[0]:
        pytest.skip(
            "this MPI is not CUDA-aware: device pointers would crash it"
        )  # the stand-in's are host memory
    use_settings(cuda_aware=wanted)
    return wanted


def needs_cuda_ipc(xp, algorithm="device_to_device"):
    """Skip a test of an algorithm that maps the peers' memory where CUDA IPC is refused (a
    sandbox): COMM_WORLD's probe, collective, agreed, so every rank skips. Called before anything is
    patched."""
    comm = MPI.COMM_WORLD
    if algorithm == "auto" or not REGISTRY[algorithm].needs_cuda_ipc or comm.Get_size() == 1:
        return
    verdict = state_of(comm).make_ready().learn_cuda_ipc(xp)
    if verdict != "works":
        pytest.skip(f"CUDA IPC is refused here, so {algorithm} never runs: {verdict}")


ALGORITHMS = [name for name in mar.ALGORITHMS if not REGISTRY[name].needs_symmetric] + [
    "auto"
]  # (numpy only)
CASES = [
    ("sum", "float32"),
    ("sum", "int32"),
    ("max", "float64"),
    ("mean", "float32"),
    ("prod", "complex64"),
    ("sum", "float16"),
]


def sizes_for(p):
    return sorted({0, 1, p + 1, 1009, (1 << 17) + 3})


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_device_arrays_match_numpy(xp, aware, algorithm, in_place):
    needs_cuda_ipc(xp, algorithm)
    comm = MPI.COMM_WORLD
    problems, bits = [], BitsAcrossRanks()
    for op, dtype in CASES:
        for count in sizes_for(comm.Get_size()):
            host = exact_input(dtype, count, comm.Get_rank(), op)
            expected = exact_reference(op, dtype, count, comm.Get_size())
            x = xp.asarray(host)
            result = mar.allreduce(x, op=op, algorithm=algorithm, out=x if in_place else None)
            case = (
                f"{op} {dtype} count={count} "
                f"plan={mar.describe_call(x, op=op, algorithm=algorithm)}"
            )
            if type(result) is not type(x):
                problems.append(f"{case}: returned {type(result).__name__}, not a device array")
                continue
            problems += problems_with(comm, xp.asnumpy(result), expected, case, bits)
            if not in_place and not np.array_equal(xp.asnumpy(x), host):
                problems.append(f"{case}: input modified")
    problems += bits.problems(comm)
    assert not problems, f"rank {comm.Get_rank()}:\n" + "\n".join(problems[:20])


@pytest.mark.parametrize(
    "algorithm", ["ring", "recursive_doubling", "staged_ring", "device_to_device", "mpi"]
)
def test_strided_device_arrays_and_out(xp, algorithm):
    needs_cuda_ipc(xp, algorithm)
    comm = MPI.COMM_WORLD
    host = exact_input("float64", 6 * 5, comm.Get_rank(), "sum").reshape(6, 5)
    expected = numpy_reference("sum", gather_inputs(comm, host))
    x = xp.asarray(host)
    strided = x[::2, 1:]
    result = mar.allreduce(strided, algorithm=algorithm)
    problems = problems_with(
        comm, xp.asnumpy(result), np.ascontiguousarray(expected[::2, 1:]), "strided x"
    )
    out = xp.asarray(np.zeros((6, 5)))
    returned = mar.allreduce(x, algorithm=algorithm, out=out)
    problems += [] if returned is out else ["out not returned"]
    problems += problems_with(comm, xp.asnumpy(out), expected, "out=")
    assert not problems, problems


@pytest.mark.parametrize(
    "algorithm",
    [
        "ring",
        "recursive_doubling",
        "rabenseifner",
        "staged_ring",
        "device_to_device",
        "shared_memory",
        "mpi",
    ],
)
def test_low_precision_accumulates_in_float32(xp, algorithm):
    """1024 + 1 + 1 + ... in float16 stays 1024 step by step (spacing 1 above 1024 is 1, above 2048
    is 2); summed in float32 and rounded once it is exact. Each algorithm must give the latter."""
    needs_cuda_ipc(xp, algorithm)
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    host = np.full(4099, 0.25, dtype=np.float16)
    if comm.Get_rank() == 0:
        host[:] = 2048
    expected = gather_inputs(comm, host).astype(np.float32).sum(axis=0).astype(np.float16)
    result = xp.asnumpy(mar.allreduce(xp.asarray(host), algorithm=algorithm))
    assert np.array_equal(result, expected), (result[:3], expected[:3], p)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "shared_memory", "mpi"])
def test_bfloat16_on_the_host(algorithm):
    """ml_dtypes' bfloat16 (no MPI datatype for it): summed in float32, rounded once."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    comm = MPI.COMM_WORLD
    x = (np.arange(1000) % 7 + comm.Get_rank() / 8).astype(ml_dtypes.bfloat16)
    expected = gather_inputs(comm, x).astype(np.float32).sum(axis=0).astype(ml_dtypes.bfloat16)
    result = mar.allreduce(x, algorithm=algorithm)
    assert result.dtype == x.dtype
    if (
        algorithm == "mpi"
    ):  # MPI's own order of bfloat16 additions (a user-defined op): close, not exact
        assert np.allclose(result.astype(np.float32), expected.astype(np.float32), rtol=2e-2)
    else:
        assert np.array_equal(result.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("algorithm", ["ring", "mpi", "shared_memory", "device_to_device"])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_bfloat16_words_on_the_device(xp, algorithm, op):
    """A CUDA bfloat16 tensor reaches the library as its 16-bit words (CuPy has no bfloat16),
    reduced with Bfloat16Bits (mpiallreduce.torch): widened exactly, reduced in float32, rounded
    once to nearest even. Expected: ml_dtypes on the gathered values (their float32 sums are
    exact)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    needs_cuda_ipc(xp, algorithm)
    from mpiallreduce.core.ops import OPS, Bfloat16Bits

    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    index = np.arange(1001)
    values = ((index % 7 - 3) * (1 + rank / 8) + index * 2.0**-9).astype(ml_dtypes.bfloat16)
    values[:3] = [np.inf if rank == 0 else 1, -0.0, np.nan if rank == p - 1 else 2]
    wide = gather_inputs(comm, values).astype(np.float32)
    ufunc = (
        np.maximum if op == "max" else np.add
    )  # (in rank order, IEEE's: -0.0 + -0.0 is -0.0, as in MPI)
    reduced = functools.reduce(ufunc, wide) / np.float32(p if op == "mean" else 1)
    expected = reduced.astype(ml_dtypes.bfloat16)
    words = xp.asarray(values.view(np.uint16))
    result = xp.asnumpy(mar.allreduce(words, op=Bfloat16Bits(OPS[op]), algorithm=algorithm))
    assert result.dtype == np.uint16
    got = result.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(expected.astype(np.float32)))
    finite = ~np.isnan(got)
    assert np.array_equal(result[finite], expected.view(np.uint16)[finite]), (
        result[:8],
        expected[:8].view(np.uint16),
    )


def _input_written_by_a_kernel(xp, count, rank):
    """x = a + a, computed on the current stream: on a GPU (and in the stand-in) not finished
    until the stream is synchronized."""
    a = xp.asarray(np.full(count, rank + 1, dtype=np.float32))
    x = xp.empty(count, np.float32)
    xp.add(a, a, out=x)
    return x


@pytest.mark.parametrize("algorithm", ["ring", "mpi", "device_to_device"])
def test_a_missing_stream_synchronization_is_caught(algorithm, monkeypatch, use_settings):
    """With the synchronization before MPI removed, the stand-in's queued kernel has not run when
    MPI reads the buffer and the result is wrong on some rank; with it, right everywhere."""
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    if p == 1:
        pytest.skip("one rank does not communicate")
    needs_cuda_ipc(fake_cupy, algorithm)
    use_settings(cuda_aware=True)
    expected = np.full(1000, float(p * (p + 1)), dtype=np.float32)

    def run():
        x = _input_written_by_a_kernel(fake_cupy, 1000, comm.Get_rank())
        result = mar.allreduce(x, algorithm=algorithm)
        right = np.array_equal(result.get(), expected)
        return comm.allreduce(int(not right))  # how many ranks got a wrong answer

    assert run() == 0
    monkeypatch.setattr(transports, "synchronize", lambda xp: None)
    monkeypatch.setattr(device_to_device, "synchronize", lambda xp: None)
    if algorithm == "device_to_device" and comm.Get_rank() > 0:
        # device_to_device reads peers' memory in kernels, which the stand-in runs when the
        # mappings are closed at the call's end: there, let rank 0 read before the others' queued
        # kernels (their inputs' too) run (on a GPU the race goes either way)
        close = device_to_device.PeerMappings.close

        def close_later(self):
            time.sleep(0.5)
            close(self)

        monkeypatch.setattr(device_to_device.PeerMappings, "close", close_later)
    wrong_without = run()
    fake_cupy.synchronize_all()
    assert wrong_without > 0, "skipping the stream synchronization went unnoticed"


@pytest.mark.one_node("device to device maps the peers' device memory on one node")
def test_pinned_buffers_are_reused_and_ipc_mappings_closed(xp, use_settings):
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        pytest.skip("one rank does not communicate")
    use_settings(cuda_aware=False)
    x = xp.asarray(np.ones(5000, np.float32))
    out = xp.empty(5000, np.float32)
    mar.allreduce(x, algorithm="staged_ring", out=out)
    pinned_before = {key: id(entry[0]) for key, entry in transports._pinned_pool.buffers.items()}
    mar.allreduce(x, algorithm="staged_ring", out=out)
    assert pinned_before == {
        key: id(entry[0]) for key, entry in transports._pinned_pool.buffers.items()
    }

    if xp is not fake_cupy:
        return
    needs_cuda_ipc(xp)
    before = dict(fake_cupy.counts)
    for _ in range(3):
        mar.allreduce(x, algorithm="device_to_device", out=out)
        # closed before the call's last barrier: no peer's memory stays mapped once a call returns
        assert fake_cupy.open_ipc_mappings() == 0
    done = {key: fake_cupy.counts[key] - before[key] for key in before}
    peers = comm.Get_size() - 1
    assert done == {
        "ipc_opened": 3 * 2 * peers,
        "ipc_closed": 3 * 2 * peers,  # x and out: 2 allocations
        "pointer_queries": 0,  # each mapping's device id came with its handle
        "elementwise_launches": 3,
    }  # one p-input kernel per call
    assert np.array_equal(xp.asnumpy(out), np.full(5000, comm.Get_size(), np.float32))


@pytest.mark.one_node("device to device maps the peers' device memory on one node")
@pytest.mark.parametrize(
    "op, dtype",
    [
        ("max", "float32"),
        ("min", "float32"),
        ("sum", "float32"),
        ("prod", "float32"),
        ("max", "float16"),
        ("min", "float16"),
        ("max", "float64"),
    ],
)
def test_device_to_device_kernel_follows_numpy_in_rank_order(xp, op, dtype):
    """The one p-input kernel: NaN wins min and max, -0.0 and 0.0 tie as numpy's maximum/minimum
    decide, sums and products in rank order, infinities; bit for bit numpy's ufunc applied left to
    right over the gathered inputs. A NaN the op makes itself (inf + -inf, 0 * inf; no input NaN
    there) is any NaN: the GPU makes 0x7fffffff where x86 makes 0xffc00000 (the H200 check,
    2026-12-04); it is the same on every rank either way."""
    needs_cuda_ipc(xp)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    values = np.array(
        [np.nan, -0.0, 0.0, np.inf, -np.inf, 1.0, -1.0, 3.5, 1e30, -2.0], np.float32
    ).astype(dtype)
    host = np.roll(values, rank)
    host[rank % 7] = -0.0 if rank % 2 else 0.0
    gathered = gather_inputs(comm, host)
    ufunc = {"max": np.maximum, "min": np.minimum, "sum": np.add, "prod": np.multiply}[op]
    expected = gathered[0].copy()
    with np.errstate(all="ignore"):
        for row in gathered[1:]:
            ufunc(expected, row, out=expected)
    result = xp.asnumpy(mar.allreduce(xp.asarray(host), op=op, algorithm="device_to_device"))
    bits = np.dtype(f"uint{8 * expected.itemsize}")
    made = np.isnan(expected) & ~np.isnan(np.asarray(gathered)).any(
        axis=0
    )  # (a NaN of the op's own)
    assert np.isnan(result[made]).all(), (result, expected)
    assert np.array_equal(result[~made].view(bits), expected[~made].view(bits)), (result, expected)


def test_host_round_trip_waits_for_the_copy_still_reading_its_pinned_buffer(
    xp, use_settings, monkeypatch
):
    """The host round trip copies its result from a pinned buffer to the device asynchronously, on
    the caller's stream. A second call on another stream must not overwrite that buffer before the
    first copy has read it: with the event guard both results are right; without it (stand-in) the
    first call's result is the second's."""
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    if p == 1:
        pytest.skip("one rank does not communicate")
    use_settings(cuda_aware=False)
    first_stream, second_stream = (
        xp.cuda.Stream(non_blocking=True),
        xp.cuda.Stream(non_blocking=True),
    )

    def two_calls():  # (each input written on the stream that reads it: non-blocking streams do not
        with first_stream:  # wait for the legacy stream)
            first_input = xp.asarray(np.full(3000, comm.Get_rank() + 1, np.float64))
            first = mar.allreduce(first_input, algorithm="mpi")  # host round trip (not CUDA-aware)
        with second_stream:
            second_input = xp.asarray(np.full(3000, 100.0 * (comm.Get_rank() + 1), np.float64))
            second = mar.allreduce(second_input, algorithm="mpi")
        first_stream.synchronize()
        second_stream.synchronize()
        right = np.all(xp.asnumpy(first) == p * (p + 1) / 2) and np.all(
            xp.asnumpy(second) == 100.0 * p * (p + 1) / 2
        )
        return comm.allreduce(int(not right))

    assert two_calls() == 0
    if xp is fake_cupy:
        monkeypatch.setattr(transports, "pinned_in_use", lambda xp, slot, stream: None)
        assert two_calls() > 0, "reusing a pinned buffer under a pending copy went unnoticed"


def test_only_cupy_arrays_are_device_arrays():
    """A type from one of CuPy's modules that is not a cupy.ndarray (a cupyx.scipy.sparse matrix,
    say) is not taken for a device array: a TypeError names it, instead of CuPy calls failing on it
    later."""

    class SparseMatrix:
        __cuda_array_interface__ = property(
            lambda self: {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}
        )
        dtype = np.dtype(np.float32)
        shape = (4,)

    SparseMatrix.__module__ = "cupyx.scipy.sparse._csr"
    assert device.namespace(SparseMatrix()) is None
    with pytest.raises(TypeError, match="cupyx.scipy.sparse._csr.*SparseMatrix"):
        mar.allreduce(SparseMatrix())

    class MyDeviceArray(fake_cupy.ndarray):  # a subclass of the array type is one
        pass

    assert device.namespace(MyDeviceArray((3,), np.float32)) is fake_cupy


def test_select_gpu_by_node_local_rank(monkeypatch):
    comm = MPI.COMM_WORLD
    node_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    monkeypatch.setenv(
        "CUDA_VISIBLE_DEVICES", "3,5"
    )  # two visible devices, numbered 0 and 1 by CUDA
    assert mar.select_gpu(comm, xp=fake_cupy) == node_rank % 2
    assert fake_cupy.cuda.runtime.getDevice() == node_rank % 2
    assert device.gpu_for_local_rank(7, 4) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        mar.select_gpu(comm, xp=fake_cupy)

    def no_driver():  # (what CuPy raises where it is installed and no driver is)
        raise RuntimeError(
            "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime "
            "version"
        )

    monkeypatch.setattr(fake_cupy.cuda.runtime, "getDeviceCount", no_driver)
    with pytest.raises(
        RuntimeError,
        match=r"is installed but no GPU is usable here: RuntimeError: "
        r"cudaErrorInsufficientDriver.*`mpiallreduce info` says which",
    ):
        mar.select_gpu(comm, xp=fake_cupy)


def test_device_argument_errors():
    x = fake_cupy.asarray(np.ones(4, np.float32))
    with pytest.raises(TypeError, match="same kind as x"):
        mar.allreduce(x, out=np.empty(4, np.float32))
    with pytest.raises(TypeError, match="runs on device"):
        mar.allreduce(np.ones(4, np.float32), algorithm="device_to_device")

    class TorchLikeCudaTensor:  # any device memory that is not CuPy's
        __cuda_array_interface__ = property(lambda self: x.__cuda_array_interface__)

    with pytest.raises(TypeError, match="cupy.from_dlpack"):
        mar.allreduce(TorchLikeCudaTensor())


def test_mixed_host_and_device_calls_are_named_with_check():
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    host = np.ones(4, np.float32)
    x = fake_cupy.asarray(host) if comm.Get_rank() == 0 else host
    with pytest.raises(ValueError, match="memory differs: 'device' on rank 0"):
        mar.allreduce(x, check=True)


def test_gradient_sync_broadcast_and_replica_check_on_device_arrays(xp):
    """Device gradients in device buckets (tiny ones, one larger than a bucket, float16 summed in
    float32): the same as one allreduce of each, computed by numpy on the gathered inputs."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    shapes = [(3,), (1000,), (7, 9), (1,), (5000,), (2, 2)]
    dtypes = ["float32", "float32", "float64", "float32", "float32", "float16"]
    hosts = [
        exact_input(dtype, int(np.prod(shape)), rank, "sum").reshape(shape)
        for shape, dtype in zip(shapes, dtypes, strict=True)
    ]
    grads = [xp.asarray(h) for h in hosts]
    mar.GradientSync(bucket_bytes=4096, op="sum").synchronize(grads)
    problems = []
    for i, (host, grad) in enumerate(zip(hosts, grads, strict=True)):
        expected = gather_inputs(comm, host).astype(np.float64).sum(axis=0).astype(host.dtype)
        problems += problems_with(comm, xp.asnumpy(grad), expected, f"gradient {i} {host.dtype}")
    mar.check_replicas(grads)

    handle = mar.allreduce_async(xp.asarray(hosts[1]), op="max")
    problems += problems_with(
        comm,
        xp.asnumpy(handle.wait(timeout=60)),
        numpy_reference("max", gather_inputs(comm, hosts[1])),
        "allreduce_async",
    )

    params = {
        "w": xp.asarray(np.full((4, 3), rank, np.float32)),
        "b": xp.asarray(np.arange(5.0) + rank),
    }
    if comm.Get_size() > 1:
        with pytest.raises(ValueError, match="replicas differ"):
            mar.check_replicas(params)
    mar.broadcast_parameters(params, root=comm.Get_size() - 1)
    mar.check_replicas(params)
    problems += (
        [] if np.all(xp.asnumpy(params["w"]) == comm.Get_size() - 1) else ["broadcast_parameters"]
    )
    assert not problems, problems


@pytest.mark.one_node("device to device maps the peers' device memory on one node")
@pytest.mark.parametrize("step", ["export", "open", "close"])
def test_device_to_device_failing_on_one_rank_raises_on_every_rank(step, monkeypatch):
    """Exporting, mapping or unmapping device memory that fails on the last rank only: every rank
    raises, naming it, instead of the others going on into the next collective; the next call
    works."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        pytest.skip("one rank reduces alone")
    needs_cuda_ipc(fake_cupy)
    last = comm.Get_size() - 1
    x = fake_cupy.asarray(np.ones(5000, np.float32))
    if comm.Get_rank() == last:

        def refuse(*args):
            raise RuntimeError("cudaErrorMapBufferObjectFailed (injected)")

        if step == "export":
            monkeypatch.setattr(device_to_device, "allocation_range", refuse)
        elif step == "open":
            monkeypatch.setattr(fake_cupy.cuda.runtime, "ipcOpenMemHandle", refuse)
        else:
            close = fake_cupy.cuda.runtime.ipcCloseMemHandle

            def close_then_refuse(
                ptr,
            ):  # (the mapping goes, as on a driver that reports an error late)
                close(ptr)
                refuse()

            monkeypatch.setattr(fake_cupy.cuda.runtime, "ipcCloseMemHandle", close_then_refuse)
    with pytest.raises(
        RuntimeError,
        match=rf"failed on rank {last} of {comm.Get_size()}:\n  rank {last}: "
        r"RuntimeError: cudaErrorMapBufferObjectFailed \(injected\)",
    ):
        mar.allreduce(x, algorithm="device_to_device")
    monkeypatch.undo()
    result = mar.allreduce(x, algorithm="device_to_device")
    assert np.array_equal(fake_cupy.asnumpy(result), np.full(5000, comm.Get_size(), np.float32))


@pytest.mark.one_node("device to device maps the peers' device memory on one node")
def test_refused_cuda_ipc_is_probed_once_and_never_planned_again():
    """A machine that refuses CUDA IPC (the stand-in refuses on request): the first call that would
    run device_to_device probes it (every rank, after the signature check), then runs the device
    table's choice across nodes instead, right; describe_call says why; asked for by name it is a
    ValueError on every rank; a prepared call falls back the same way. Other communicators keep
    theirs."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        pytest.skip("one rank maps no peer's memory")
    comm = world.Dup()
    host = exact_input(
        "float32", 1 << 21, comm.Get_rank(), "sum"
    )  # (8 MiB: where the shipped device table runs device_to_device)
    expected = numpy_reference("sum", gather_inputs(comm, host))
    x = fake_cupy.asarray(host)
    fake_cupy.refuse_ipc(True)
    try:
        before = mar.describe_call(x, comm=comm)
        assert before.startswith("device_to_device") and "CUDA IPC not yet probed" in before, before
        problems = problems_with(
            comm, fake_cupy.asnumpy(mar.allreduce(x, comm=comm)), expected, "auto, probing"
        )
        after = mar.describe_call(x, comm=comm)
        assert (
            after.startswith("staged_ring")
            and "not device_to_device, which needs CUDA IPC, refused" in after
        ), after
        assert "cudaErrorMapBufferObjectFailed" in after, after
        with pytest.raises(
            ValueError,
            match=r"the device_to_device algorithm maps the peers' device memory "
            r"\(CUDA IPC\), which this machine refused",
        ):
            mar.allreduce(x, comm=comm, algorithm="device_to_device")
        problems += problems_with(
            comm, fake_cupy.asnumpy(mar.allreduce(x, comm=comm)), expected, "auto, after"
        )
        fresh = comm.Dup()
        prepared = mar.prepare(
            x, comm=fresh
        )  # (planned before the probe: it probes at its first run)
        assert prepared.plan.ipc_probe is not None
        for _ in range(2):
            problems += problems_with(fresh, fake_cupy.asnumpy(prepared()), expected, "prepared")
        assert mar.describe_call(x, comm=fresh).startswith("staged_ring")
        fresh.Free()
        mixed = (
            comm.Dup()
        )  # rank 0 by name, the others "auto": both plans say device_to_device until the probe
        with pytest.raises(
            ValueError,
            match=r"allreduce arguments rejected on rank 0 of \d+:\n  rank 0: ValueError: "
            r"the device_to_device algorithm maps the peers' device memory",
        ):
            mar.allreduce(
                x, comm=mixed, algorithm="device_to_device" if comm.Get_rank() == 0 else "auto"
            )
        problems += problems_with(
            mixed, fake_cupy.asnumpy(mar.allreduce(x, comm=mixed)), expected, "after a mismatch"
        )
        mixed.Free()
    finally:
        fake_cupy.refuse_ipc(False)
    assert not problems, problems
    assert mar.describe_call(x, comm=world).startswith(
        "device_to_device"
    )  # (probed apart: it works there)
    comm.Free()


@pytest.mark.parametrize(
    "algorithm, aware",
    [("mpi", True), ("mpi", False), ("device_to_device", False)],
    ids=["mpi-cuda_aware", "mpi-not_cuda_aware", "device_to_device"],
)
def test_a_timed_call_on_device_arrays_is_bounded_when_a_peer_stalls(
    xp, algorithm, aware, monkeypatch, use_settings
):
    """Issue 54, item 3, on device arrays: a timed call runs nothing a timeout cannot bound. Not
    device_to_device (it maps the peers' memory, which a rank that gave up may free: the table's
    choice across nodes instead), and MPI's own collectives in their nonblocking forms through
    host memory, never a CUDA-aware MPI's (Open MPI takes no device buffers in nonblocking
    collectives). The last rank stalls past the timeout and its grace before the data moves:
    every rank raises within timeout + grace, the device output is not written, and the next
    calls, timed and untimed, are right. Before, the others waited in MPI_Allreduce (or the
    mappings' agreement) until the stalled rank came, then returned the sum."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != 3:
        pytest.skip("a timing test (sleeps on purpose): at 3 ranks")
    if aware and xp is not fake_cupy and not device.cuda_aware()[0]:
        pytest.skip("this MPI is not CUDA-aware: device pointers would crash it")
    needs_cuda_ipc(xp, algorithm)  # (the untimed calls after it)
    use_settings(cuda_aware=aware)
    host = exact_input("float32", 5000, rank, "sum")
    x, out = xp.asarray(host), xp.asarray(np.full(5000, -7.0, np.float32))
    timed = mar.describe_call(x, algorithm=algorithm, timeout=0.5)
    if algorithm == "mpi":
        assert timed.startswith("mpi") and "host round trip" in timed, timed
    else:
        assert timed.startswith("staged_ring") and "timed: staged_ring instead" in timed, timed
    mar.allreduce(np.ones(4), timeout=30)  # (first use: the control channel)
    stalls.shorten_the_grace(monkeypatch)
    stalls.before_the_data_moves(monkeypatch, size - 1, stalls.stall)
    stalls.ended_alike_within_the_bound(
        lambda: mar.allreduce(x, out=out, algorithm=algorithm, timeout=stalls.TIMEOUT)
    )
    assert (xp.asnumpy(out) == -7.0).all(), f"rank {rank}: written by a call that raised"
    time.sleep(0.2)
    want = numpy_reference("sum", gather_inputs(comm, host))
    for timed_out in (30, None, 30):
        result = mar.allreduce(x, algorithm=algorithm, timeout=timed_out)
        assert not problems_with(comm, xp.asnumpy(result), want, f"timeout={timed_out}")
