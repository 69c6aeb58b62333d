"""mpiallreduce.torch on every rank: averaged gradients, broadcast parameters and optimizer state,
Horovod's API, and DDP's comm hooks against DDP over gloo."""

import contextlib

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
from reference import no_gpu  # noqa: E402

import mpiallreduce as mar  # noqa: E402
import mpiallreduce.torch as mt  # noqa: E402

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD


def model_on_this_rank():
    torch.manual_seed(WORLD.Get_rank())  # a different start on every rank, on purpose
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2)
    ).double()


def _on_host(tensor):
    """A copy on the host (a CPU tensor's .numpy() shares its memory: a later in-place write would
    change the 'before' we compare with)."""
    return tensor.detach().cpu().numpy().copy()


@pytest.fixture(params=["cpu", "cuda"], ids=["torch_cpu", "torch_cuda"])
def device(request):
    """Each test on CPU tensors, and on CUDA tensors (through CuPy and DLPack) where a GPU
    exists."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            no_gpu(f"torch {torch.__version__} sees no CUDA device")
        try:
            import cupy  # noqa: F401 - CUDA tensors reach the library as CuPy arrays
        except Exception as error:  # noqa: BLE001
            no_gpu(f"CuPy does not import: {type(error).__name__}: {error}")
        torch.cuda.set_device(mar.select_gpu())
    return torch.device(request.param)


@pytest.fixture(params=[True, False], ids=["overlap", "at_wait"])
def overlap(request):
    """Gradients handed over by hooks during backward (a core to spare), or all at step()."""
    return request.param


def test_broadcasts_make_replicas_and_steps_keep_them_identical(device, overlap):
    model = model_on_this_rank().to(device)
    optimizer = mt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        bucket_bytes=64,
        overlap=overlap,
    )
    assert len(optimizer._hooks) == (len(list(model.parameters())) if overlap else 0)
    mt.broadcast_parameters(model.state_dict(), root=0)
    mt.broadcast_optimizer_state(optimizer, root=0)
    arrays = {name: _on_host(p) for name, p in model.named_parameters()}
    mar.check_replicas(arrays)
    for step in range(5):
        generator = torch.Generator().manual_seed(
            100 * step + WORLD.Get_rank()
        )  # rank-dependent data
        x = torch.randn(8, 5, generator=generator, dtype=torch.float64).to(device)
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        local = {name: _on_host(p.grad) for name, p in model.named_parameters()}
        optimizer.step()  # waits for the buckets: gradients now hold the mean over the ranks
        for name, p in model.named_parameters():
            expected = np.mean(WORLD.allgather(local[name]), axis=0)
            assert np.allclose(_on_host(p.grad), expected, rtol=1e-12, atol=1e-15), name
        mar.check_replicas({name: _on_host(p) for name, p in model.named_parameters()})
    # Adam's moments are per-rank state; after a broadcast every rank holds rank 0's
    if WORLD.Get_rank() != 0:
        for state in optimizer.optimizer.state.values():
            state["exp_avg"].add_(1.0)
    mt.broadcast_optimizer_state(optimizer, root=0)
    mar.check_replicas(
        [_on_host(optimizer.optimizer.state[p]["exp_avg"]) for p in model.parameters()]
    )


def test_tensor_allreduce_new_and_in_place_against_numpy_on_the_gathered_inputs(device):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    values = (np.arange(1001, dtype=np.float64) * (rank + 1)) % 17 - 3.25 * rank
    expected = np.sum(WORLD.allgather(values), axis=0)
    tensor = torch.tensor(values, device=device, requires_grad=True)
    summed = mt.allreduce(tensor, op=mt.Sum)
    assert (
        isinstance(summed, torch.Tensor)
        and summed.device == tensor.device
        and summed.dtype == torch.float64
    )
    np.testing.assert_array_equal(_on_host(summed), expected)
    np.testing.assert_allclose(
        _on_host(mt.allreduce(tensor)), expected / size, rtol=1e-12
    )  # Horovod's default
    np.testing.assert_array_equal(_on_host(mt.allreduce(tensor, average=False)), expected)
    np.testing.assert_array_equal(_on_host(tensor), values)  # the input as it was
    metrics = torch.tensor(values, device=device, dtype=torch.float32)
    assert mt.allreduce_(metrics, op="mean") is metrics
    np.testing.assert_allclose(_on_host(metrics), expected / size, rtol=1e-6)
    digests = WORLD.allgather(_on_host(metrics).tobytes())
    assert all(d == digests[0] for d in digests)


def test_horovod_style_rank_size_and_node_local_rank_and_size():
    """Each node's local ranks are 0..local_size-1, once each (numbered as the launcher numbers
    them: Open MPI's local rank need not follow the world order)."""
    from mpiallreduce.core.topology import node_communicator

    node = node_communicator(WORLD)
    assert (mt.rank(), mt.size()) == (WORLD.Get_rank(), WORLD.Get_size())
    assert mt.local_size() == node.Get_size()
    assert sorted(node.allgather(mt.local_rank())) == list(range(node.Get_size()))


def test_a_tensor_given_to_the_array_api_gets_a_message_that_says_what_it_is():
    with pytest.raises(
        TypeError,
        match=r"x is a torch.Tensor \(cpu\); use mpiallreduce.torch.allreduce\(x\), "
        r"or pass x.numpy\(\)",
    ):
        mar.allreduce(torch.ones(3))


class TwoBranches(torch.nn.Module):
    """A trunk, then one of two heads: a rank whose data takes only one head leaves the other
    unused."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.left, self.right = (
            torch.nn.Linear(4, 6),
            torch.nn.Linear(6, 1),
            torch.nn.Linear(6, 1),
        )

    def forward(self, x, head):
        return (self.left if head == "left" else self.right)(torch.tanh(self.trunk(x)))


def test_a_branch_used_only_on_some_ranks_with_find_unused_gets_the_mean_with_zeros_there(
    device, overlap
):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    model = TwoBranches().double().to(device)
    optimizer = mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        overlap=overlap,
        named_parameters=model.named_parameters(),
        find_unused=True,
        bucket_bytes=100,
    )
    head = (
        "right" if rank == size - 1 and size > 1 else "left"
    )  # the last rank never takes the left head
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64).to(
        device
    )
    optimizer.zero_grad()
    model(x, head).pow(2).sum().backward()
    local = {
        name: (_on_host(p.grad) if p.grad is not None else np.zeros(tuple(p.shape)))
        for name, p in model.named_parameters()
    }
    optimizer.synchronize()
    for name, p in model.named_parameters():
        expected = np.mean(
            WORLD.allgather(local[name]), axis=0
        )  # zeros where a rank did not use it
        used_anywhere = any(WORLD.allgather(bool(np.any(local[name]))))
        if not used_anywhere:
            assert p.grad is None or not np.any(_on_host(p.grad)), name
            continue
        assert p.grad is not None, name
        np.testing.assert_allclose(_on_host(p.grad), expected, rtol=1e-12, atol=1e-15, err_msg=name)


def test_a_backward_after_a_synchronize_without_a_step_is_reduced_at_the_next_step(device, overlap):
    """synchronize(), then no step (a non-finite check said skip), then a new backward: step()
    reduces the new gradients (with hooks they say so; without, their versions do), on every rank
    alike."""
    model = model_on_this_rank().to(device)
    mt.broadcast_parameters(model.state_dict(), root=0)
    optimizer = mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        overlap=overlap,
        named_parameters=model.named_parameters(),
    )
    for step in range(2):
        x = torch.randn(
            4,
            5,
            generator=torch.Generator().manual_seed(10 * WORLD.Get_rank() + step),
            dtype=torch.float64,
        ).to(device)
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        local = {name: _on_host(p.grad) for name, p in model.named_parameters()}
        if step == 0:
            optimizer.synchronize()  # ... and no step()
            continue
        optimizer.step()
        for name, p in model.named_parameters():
            np.testing.assert_allclose(
                _on_host(p.grad),
                np.mean(WORLD.allgather(local[name]), axis=0),
                rtol=1e-12,
                err_msg=name,
            )
    mar.check_replicas({name: _on_host(p) for name, p in model.named_parameters()})


def test_a_bfloat16_gradient_unused_on_one_rank_gets_the_others_mean_there(overlap):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    used, unused = (torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)) for _ in range(2))
    optimizer = mt.DistributedOptimizer(
        torch.optim.SGD([used, unused], lr=0.0),
        overlap=overlap,
        find_unused=True,
        named_parameters=[("used", used), ("unused", unused)],
    )
    scale = torch.tensor([1.0, 2.0, 4.0], dtype=torch.bfloat16) * (rank + 1)
    loss = (used * scale).sum() + ((unused * scale).sum() if rank != size - 1 or size == 1 else 0)
    loss.backward()
    optimizer.synchronize()
    given = [np.array([1.0, 2.0, 4.0]) * (r + 1) for r in range(size)]
    for p, contributions in (
        (used, given),
        (unused, given[:-1] + [np.zeros(3)] if size > 1 else given),
    ):
        expected = torch.tensor(np.sum(contributions, axis=0, dtype=np.float32) / size).to(
            torch.bfloat16
        )
        assert (
            p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, expected)
        )


@pytest.mark.parametrize("made_bfloat16", ["before", "after_wrapping"])
def test_bfloat16_gradients_are_summed_in_float32_and_rounded_once(device, made_bfloat16):
    """(after_wrapping: the model made bfloat16 once the optimizer wraps it, as model.to(bfloat16)
    does: each gradient's own dtype decides how it is handed over, not the parameter's at
    wrapping)"""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    weight = torch.nn.Parameter(
        torch.ones(
            64, dtype=torch.bfloat16 if made_bfloat16 == "before" else torch.float32, device=device
        )
    )
    optimizer = mt.DistributedOptimizer(
        torch.optim.SGD([weight], lr=0.0), named_parameters=[("w", weight)]
    )
    weight.data = weight.data.to(torch.bfloat16)
    # d(loss)/dw = 1 + rank * 2^-7 + index * 2^-6: exact in bfloat16, their sum is not
    scale = torch.tensor(
        1.0 + rank * 2.0**-7 + np.arange(64) * 2.0**-6, dtype=torch.bfloat16, device=device
    )
    (weight * scale).sum().backward()
    contributions = np.array(WORLD.allgather(_on_host(weight.grad.float())), dtype=np.float32)
    optimizer.step()
    assert weight.grad.dtype == torch.bfloat16
    expected = torch.tensor(contributions.sum(axis=0) / size).to(torch.bfloat16)  # rounded once
    assert torch.equal(weight.grad.cpu(), expected)
    summed = mt.allreduce(scale, op=mt.Sum)  # the tensor allreduce, too
    assert summed.dtype == torch.bfloat16
    assert torch.equal(
        summed.cpu(),
        torch.tensor(
            np.array(WORLD.allgather(_on_host(scale.float()))).sum(axis=0).astype(np.float32)
        ).to(torch.bfloat16),
    )


@pytest.mark.parametrize("how", ["no_sync", "backward_passes_per_step"])
def test_no_sync_accumulates_locally_then_reduces_once(device, how, overlap):
    """DDP's no_sync() around the first micro-batches, or Horovod's backward_passes_per_step=4."""
    model = model_on_this_rank().to(device)
    optimizer = mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        overlap=overlap,
        named_parameters=model.named_parameters(),
        backward_passes_per_step=4 if how == "backward_passes_per_step" else 1,
    )
    batches = [
        torch.randn(
            4,
            5,
            generator=torch.Generator().manual_seed(10 * WORLD.Get_rank() + i),
            dtype=torch.float64,
        ).to(device)
        for i in range(4)
    ]
    optimizer.zero_grad()
    with optimizer.no_sync() if how == "no_sync" else contextlib.nullcontext():
        for x in batches[:3]:
            model(x).pow(2).sum().backward()
    model(batches[3]).pow(2).sum().backward()
    local = {
        name: _on_host(p.grad) for name, p in model.named_parameters()
    }  # the 4 micro-batches' sum
    optimizer.synchronize()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(
            _on_host(p.grad),
            np.mean(WORLD.allgather(local[name]), axis=0),
            rtol=1e-12,
            err_msg=name,
        )


def test_horovod_api_async_objects_and_op_rules():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    mt.init()
    values = torch.arange(10, dtype=torch.float64) * (rank + 1)
    expected = np.sum(WORLD.allgather(values.numpy().copy()), axis=0)
    handles = [
        mt.allreduce_async(values, op=mt.Sum),
        mt.allreduce_async_(values.clone(), average=True),
    ]
    assert torch.equal(mt.synchronize(handles[0]), torch.tensor(expected))
    np.testing.assert_allclose(mt.synchronize(handles[1]).numpy(), expected / size, rtol=1e-12)
    assert mt.poll(handles[0])
    np.testing.assert_array_equal(
        values.numpy(), np.arange(10) * (rank + 1)
    )  # out of place left it alone
    with pytest.raises(ValueError, match="op= or average=, not both"):
        mt.allreduce(values, average=True, op=mt.Sum)
    with pytest.raises(RuntimeError, match="Adasum"):
        mt.allreduce(values, op=mt.Adasum)
    scaled = mt.allreduce(
        values,
        op=mt.Sum,
        prescale_factor=0.5,
        postscale_factor=4.0,
        compression=mt.Compression.fp16,
    )
    assert scaled.dtype == torch.float64
    np.testing.assert_allclose(
        scaled.numpy(), expected * 2.0, rtol=2e-3
    )  # (fp16 on the way: 11 bits)
    assert mt.broadcast_object({"epoch": rank}, root_rank=size - 1) == {"epoch": size - 1}
    assert mt.allgather_object(rank * 10) == [r * 10 for r in range(size)]
    np.testing.assert_array_equal(mt.broadcast(values, root_rank=0).numpy(), np.arange(10.0))
    leaf = torch.full((3,), float(rank + 1), dtype=torch.float64, requires_grad=True)
    (mt.allreduce(leaf, op=mt.Sum) * 2.0).sum().backward()  # differentiable, as Horovod's
    np.testing.assert_array_equal(leaf.grad.numpy(), np.full(3, 2.0 * size))


@pytest.mark.parametrize("scaled", [{"prescale_factor": 2.0}, {"compression": mt.Compression.fp16}])
def test_hvd_allreduce_of_a_tensor_that_requires_grad_on_some_ranks_only(scaled):
    """A metric that requires grad on rank 0 only: its allreduce (differentiable there) and the
    others' make one plan (both out of place), and every rank gets the sum."""
    torch = pytest.importorskip("torch")
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    t = torch.full((1000,), float(rank + 1), requires_grad=rank == 0)
    result = mt.allreduce(t, op=mt.Sum, **scaled)
    factor = scaled.get("prescale_factor", 1.0)
    assert torch.equal(result.detach(), torch.full((1000,), factor * size * (size + 1) / 2))


def test_horovod_init_with_a_communicator_makes_it_every_calls_ranks():
    """hvd.init(comm): rank(), size(), allreduce and DistributedOptimizer are that
    communicator's."""
    rank = WORLD.Get_rank()
    half = WORLD.Split(rank % 2, rank)
    mt.init(half)
    try:
        assert (mt.rank(), mt.size()) == (half.Get_rank(), half.Get_size())
        weight = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        optimizer = mt.DistributedOptimizer(
            torch.optim.SGD([weight], lr=0.0), named_parameters=[("w", weight)]
        )
        (weight * float(rank)).sum().backward()
        optimizer.step()
        expected = np.mean(half.allgather(float(rank)))
        np.testing.assert_array_equal(weight.grad.numpy(), [expected, expected])
        np.testing.assert_array_equal(mt.allreduce(torch.tensor([float(rank)])).numpy(), [expected])
        optimizer.zero_grad()
        with pytest.warns(
            UserWarning, match="called without optimizer.skip_synchronize"
        ):  # synchronize(), then step(): once
            (weight * 1.0).sum().backward()
            optimizer.synchronize()
            optimizer.step()
        np.testing.assert_array_equal(weight.grad.numpy(), [1.0, 1.0])
    finally:
        mt.shutdown()


class Branchy(torch.nn.Module):
    """Two heads; odd ranks never use the second (DDP's find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.head, self.extra = (
            torch.nn.Linear(6, 16),
            torch.nn.Linear(16, 3),
            torch.nn.Linear(16, 3),
        )

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.head(h) + (self.extra(h) if WORLD.Get_rank() % 2 == 0 else 0)


@pytest.fixture(scope="module")
def gloo():
    """torch.distributed over gloo on the world's ranks (DDP needs a process group for its
    setup)."""
    if not torch.distributed.is_initialized():
        mt.init_process_group("gloo")
    return torch.distributed


@pytest.mark.parametrize(
    "hook, rtol",
    [
        ("allreduce_hook", 1e-6),
        ("reproducible_hook", 1e-6),
        ("fp16_compress_hook", 2e-3),
        ("bf16_compress_hook", 2e-2),
    ],
)
def test_ddp_with_our_hook_trains_as_ddp_over_gloo(gloo, hook, rtol):
    """The same DDP model (no_sync micro-batches, find_unused_parameters, a bucket cap that makes
    several buckets) with our comm hook and over gloo alone: the same parameters after 4 steps,
    within float32 rounding (16-bit hooks: within their rounding)."""
    rank = WORLD.Get_rank()
    ours, theirs = (
        torch.nn.parallel.DistributedDataParallel(
            Branchy(), find_unused_parameters=True, bucket_cap_mb=0.0005
        )
        for _ in range(2)
    )
    ours.register_comm_hook(mt.HookState(), getattr(mt, hook))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (ours, theirs)]
    for step in range(4):
        batches = [
            torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + 10 * rank + i))
            for i in range(2)
        ]
        for model, optimizer in zip((ours, theirs), optimizers, strict=True):
            optimizer.zero_grad()
            with model.no_sync():
                model(batches[0]).pow(2).mean().backward()
            model(batches[1]).pow(2).mean().backward()
            optimizer.step()
    for (name, a), (_, b) in zip(
        ours.module.named_parameters(), theirs.module.named_parameters(), strict=True
    ):
        np.testing.assert_allclose(
            a.detach().numpy(), b.detach().numpy(), rtol=rtol, atol=rtol * 1e-2, err_msg=name
        )
    mar.check_replicas([p.detach().numpy() for p in ours.parameters()])


def test_ddp_with_our_hook_and_a_model_that_differs_on_one_rank_raises_everywhere(gloo):
    """Issue 54, item 5: the last rank's model holds float64 parameters where the others' hold
    float32 (DDP compares the parameters' shapes when it is made, not their dtypes): our hook's
    allreduce compares its bucket, so every rank's backward raises, naming the dtype and that rank,
    and no parameter changes; the next call pairs up on every rank."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    if size == 1:
        pytest.skip("one rank cannot differ from itself")
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    if rank == size - 1:
        model = model.double()
    ddp = torch.nn.parallel.DistributedDataParallel(model, init_sync=False)
    ddp.register_comm_hook(mt.HookState(), mt.allreduce_hook)
    before = [_on_host(p) for p in model.parameters()]
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank)).to(model.weight.dtype)
    with pytest.raises(Exception, match=rf"dtype differs: .*on rank {size - 1}") as raised:
        ddp(x).pow(2).mean().backward()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.step()
    assert "SignatureMismatch" in repr(raised.value) or isinstance(
        raised.value, mar.SignatureMismatch
    )
    for p, b in zip(model.parameters(), before, strict=True):
        np.testing.assert_array_equal(_on_host(p), b)
    total = mar.allreduce(np.array([rank + 1.0]))
    assert total[0] == size * (size + 1) / 2


def test_the_optimizer_is_a_torch_optimizer_to_lr_schedulers_and_skip_synchronize_waits_once():
    model = model_on_this_rank()
    optimizer = mt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0)
    )  # (named by place)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with optimizer.skip_synchronize():
        optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5
