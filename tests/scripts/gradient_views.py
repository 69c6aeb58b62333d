"""GradientSync(write_back=False), on one node (symmetric buffers) and across nodes: results handed
over as views of a bucket's two buffers, used in turn; and DistributedOptimizer, which points its
gradients at them (``grad.set_``). Every value is an integer, or an integer sum divided once: the
references are computed here, in float32, from the formula. Prints ``rank R views ok`` and ``rank R
torch ok``."""

import numpy as np
from mpi4py import MPI

import mpiallreduce as mar

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
SHAPES = {
    "a": ((300,), np.float32),
    "b": ((64, 64), np.float32),
    "c": ((1000,), np.float32),
    "h": ((50,), np.float16),
    "big": ((1 << 19,), np.float32),
}  # h: widened; big: 2 MiB, on its own
#: five gradients just under 1 MiB: one fused bucket of 4.6 MiB, whose mean across nodes auto may
#: run by another algorithm than a sum (mpiallreduce.core.overrides.MEAN_ACROSS_NODES_FROM)
MEDIUM = {f"m{i}": ((250_000 - i,), np.float32) for i in range(5)}


def gradient(name, r, step):
    shape, dtype = {**SHAPES, **MEDIUM}[name]
    n = int(np.prod(shape))
    return ((np.arange(n) % 97) * (r + 1) + step + len(name)).astype(dtype).reshape(shape)


def mean(name, step):
    total = sum(
        gradient(name, r, step).astype(np.float64) for r in range(size)
    )  # (exact: integers)
    return (total.astype(np.float32) / np.float32(size)).astype(
        {**SHAPES, **MEDIUM}[name][1]
    )  # (one rounding)


def run_step(sync, step, overlap_order=False, wrong=False):
    grads = {name: gradient(name, rank, step) for name in SHAPES}
    given = {name: grad.copy() for name, grad in grads.items()}
    for name in reversed(list(SHAPES)) if overlap_order else SHAPES:
        grad = grads[name] if not (wrong and rank == 0 and name == "c") else grads[name][:10]
        sync.ready(grad, name=name)
    return grads, given, sync.wait()


def run_named(sync, names, step, given=None):
    for name in names:
        sync.ready(gradient(name, rank, step) if given is None else given[name], name=name)
    return sync.wait()


def numpy_views(overlap):
    sync = mar.GradientSync(
        comm=comm,
        parameters={n: np.empty(s, d) for n, (s, d) in SHAPES.items()},
        bucket_bytes=8000,
        overlap=overlap,
        write_back=False,
        rebuild_buckets=False,
    )
    handed = []
    for step in range(3):
        grads, given, results = run_step(sync, step, overlap_order=overlap)
        assert set(results) == {"a", "b", "c"}, sorted(
            results
        )  # (h is float16, big is reduced on its own)
        for name in ("a", "b", "c"):
            assert np.array_equal(grads[name], given[name]), name  # (not written: handed over)
            assert np.array_equal(results[name], mean(name, step)), (name, step)
        for name in ("h", "big"):
            assert np.array_equal(grads[name], mean(name, step)), (name, step)
        handed.append(results)
    # the two buffers in turn: step 2 refilled step 0's, step 1's results are intact
    assert not any(np.shares_memory(handed[0][n], handed[1][n]) for n in "abc")
    assert all(np.shares_memory(handed[0][n], handed[2][n]) for n in "abc")
    assert all(np.array_equal(handed[1][n], mean(n, 1)) for n in "abc")
    # a step that fails on every rank (rank 0's c has another shape) changes nothing handed over
    try:
        run_step(sync, 3, wrong=True)
        raise AssertionError("a mismatched step did not raise")
    except ValueError as error:
        assert "'c'" in str(error), error
    assert all(np.array_equal(handed[2][n], mean(n, 2)) for n in "abc")
    grads, given, results = run_step(sync, 4)  # the failed step's turn again: not step 2's buffer
    assert all(
        np.array_equal(results[n], mean(n, 4)) and not np.shares_memory(results[n], handed[2][n])
        for n in "abc"
    )
    assert all(np.array_equal(handed[2][n], mean(n, 2)) for n in "abc")
    try:
        sync.synchronize([grads[n] for n in SHAPES])
        raise AssertionError("synchronize() with write_back=False did not raise")
    except ValueError as error:
        assert "write_back=False" in str(error), error
    large = mar.GradientSync(
        comm=comm,
        parameters={n: np.empty(s, d) for n, (s, d) in MEDIUM.items()},
        overlap=overlap,
        write_back=False,
    )
    handed = []
    for step in range(3):
        for name in reversed(list(MEDIUM)):
            large.ready(gradient(name, rank, step), name=name)
        handed.append(large.wait())
        assert all(np.array_equal(handed[-1][n], mean(n, step)) for n in MEDIUM), step
    assert all(
        np.shares_memory(handed[0][n], handed[2][n])
        and not np.shares_memory(handed[0][n], handed[1][n])
        for n in MEDIUM
    )
    # a changed step (a gradient more, undeclared gradients) plans anew: the old plan's buffers,
    # where the last results live, stay until two steps on; here the changed step's gradients are
    # those results
    free = mar.GradientSync(comm=comm, bucket_bytes=8000, overlap=overlap, write_back=False)
    for step in range(2):
        kept = run_named(free, ("a", "c"), step)
    for step in range(2, 5):
        given = (
            {"a": kept["a"], "c": kept["c"], "b": gradient("b", rank, step)} if step == 2 else None
        )
        results = run_named(free, ("a", "c", "b"), step, given)
        assert np.array_equal(results["b"], mean("b", step)), step
        for name in "ac":  # (step 2: the mean of step 1's means, alike on every rank: step 1's)
            assert np.array_equal(results[name], mean(name, 1 if step == 2 else step)), (name, step)
            if step == 2:
                assert np.array_equal(kept[name], mean(name, 1)), name  # (read, not freed)
    # with a timeout, a step may fail on some ranks only: on one node (symmetric buffers, which must
    # lie at the same place everywhere) the results are then written back; across nodes still handed
    # over
    one_node = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size() == size
    timed = mar.GradientSync(
        comm=comm,
        parameters={n: np.empty(s, d) for n, (s, d) in SHAPES.items()},
        bucket_bytes=8000,
        overlap=overlap,
        write_back=False,
        timeout=120,
    )
    grads, _, results = run_step(timed, 5)
    assert set(results) == (set() if one_node else {"a", "b", "c"}), (one_node, sorted(results))
    assert all(np.array_equal(results[n] if n in results else grads[n], mean(n, 5)) for n in SHAPES)
    print(f"rank {rank} views ok overlap={overlap}", flush=True)


def edge_values():
    """Where the mean is divided on the way in (a power-of-two rank count: FusedBuffers.in_scale): a
    sum that would overflow gives a finite mean there (as DDP's), inf elsewhere; complex buckets
    keep the call of the mean, so the signs of their zeros are a mean's (identical inputs: the
    input)."""
    x = np.array([3e38, 1.0, -0.0, 5.0], np.float32)
    z = np.array(
        [complex(-0.0, -1), complex(-0.0, 1), complex(-0.0, -0.0), complex(0.0, 0.0)], np.complex64
    )
    sync = mar.GradientSync(
        comm=comm, parameters={"x": x, "z": z}, write_back=False, rebuild_buckets=False
    )
    sync.ready(x.copy(), name="x")
    sync.ready(z.copy(), name="z")
    results = sync.wait()
    finite = size & (size - 1) == 0  # (2, 4 ranks: divided first)
    assert results["x"][0] == (np.float32(3e38) if finite else np.inf), (size, results["x"])
    assert np.array_equal(results["x"][1:], x[1:]) and np.signbit(results["x"][2]), results["x"]
    expected = (
        z.copy()
    )  # (numpy's sum, rank after rank, then its division; sum() would start from +0)
    for _ in range(size - 1):
        expected = expected + z
    expected = expected / np.complex64(size)
    assert np.array_equal(results["z"], expected), results["z"]
    assert np.array_equal(
        np.signbit(results["z"].real), np.signbit(expected.real)
    ) and np.array_equal(np.signbit(results["z"].imag), np.signbit(expected.imag)), (
        results["z"],
        expected,
    )
    print(f"rank {rank} edges ok", flush=True)


def torch_views(overlap):
    import torch

    import mpiallreduce.torch as mt

    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 4))

    def integers(
        step,
    ):  # (integer weights and inputs: every gradient an integer, exact in any order)
        with torch.no_grad():
            for k, p in enumerate(model.parameters()):
                p.copy_(torch.arange(p.numel()).reshape(p.shape) % 5 - 2 + k + step)

    optimizer = mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=2.0**-10),
        named_parameters=model.named_parameters(),
        comm=comm,
        overlap=overlap,
        find_unused=False,  # (strict: Horovod's default, True, counts a missing one as zeros)
    )

    def backward(step, only_last=False):
        x = (torch.arange(8 * 16).reshape(8, 16) % (rank + step + 3) - 1).float()
        out = model[1](model[0](x).detach() if only_last else model[0](x))
        (out * (torch.arange(4) + rank + 1)).sum().backward()

    for step in range(4):
        integers(step)
        optimizer.zero_grad(
            set_to_none=step != 2
        )  # (step 2: into the gradients handed over at step 1)
        backward(step)
        raw = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
        before = {name: id(p.grad) for name, p in model.named_parameters()}
        everyone = comm.allgather(raw)
        optimizer.synchronize()
        for name, p in model.named_parameters():
            total = sum(theirs[name].astype(np.float64) for theirs in everyone)
            assert np.array_equal(p.grad.numpy(), total.astype(np.float32) / np.float32(size)), (
                name,
                step,
            )
            assert id(p.grad) == before[name], name  # (the same tensor: set_, as Horovod's)
        with optimizer.skip_synchronize():
            optimizer.step()
    optimizer.zero_grad(set_to_none=rank == 0)  # elsewhere into the views handed over at step 3
    backward(9, only_last=rank == 0)  # rank 0: no gradient for the first layer
    given = {
        name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()
    }
    try:
        optimizer.synchronize()
        raise AssertionError("a step with a gradient missing on rank 0 did not raise")
    except ValueError as error:
        assert "not marked ready" in str(error), error
    for name, p in model.named_parameters():  # (as given, on every rank)
        assert (p.grad is None and given[name] is None) or torch.equal(p.grad, given[name]), name
    parameters = [p.detach().numpy().copy() for p in model.parameters()]
    assert all(
        all(np.array_equal(a, b) for a, b in zip(parameters, theirs, strict=True))
        for theirs in comm.allgather(parameters)
    )
    print(f"rank {rank} torch ok overlap={overlap}", flush=True)


numpy_views(overlap=False)
numpy_views(overlap=True)
edge_values()
try:
    import torch  # noqa: F401
except ImportError:
    print(f"rank {rank} torch missing", flush=True)
else:
    torch_views(overlap=False)
    torch_views(overlap=True)  # (the gradients handed over from backward's hooks)
