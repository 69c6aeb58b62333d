"""mpiallreduce.torch on every rank: averaged gradients, broadcast parameters and optimizer state."""
import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import mpiallreduce as mar  # noqa: E402
import mpiallreduce.torch as mt  # noqa: E402

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD


def model_on_this_rank():
    torch.manual_seed(WORLD.Get_rank())  # a different start on every rank, on purpose
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2)).double()


def _on_host(tensor):
    return tensor.detach().cpu().numpy()


@pytest.fixture(params=["cpu", "cuda"], ids=["torch_cpu", "torch_cuda"])
def device(request):
    """Each test on CPU tensors, and on CUDA tensors (through CuPy and DLPack) where a GPU exists."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        pytest.importorskip("cupy")
        torch.cuda.set_device(mar.select_gpu())
    return torch.device(request.param)


def test_broadcasts_make_replicas_and_steps_keep_them_identical(device):
    model = model_on_this_rank().to(device)
    optimizer = mt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters(), bucket_bytes=64)
    mt.broadcast_parameters(model.state_dict(), root=0)
    mt.broadcast_optimizer_state(optimizer, root=0)
    arrays = {name: _on_host(p) for name, p in model.named_parameters()}
    mar.check_replicas(arrays)
    for step in range(5):
        generator = torch.Generator().manual_seed(100 * step + WORLD.Get_rank())  # rank-dependent data
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
    mar.check_replicas([_on_host(optimizer.optimizer.state[p]["exp_avg"]) for p in model.parameters()])


def test_tensor_allreduce_new_and_in_place_against_numpy_on_the_gathered_inputs(device):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    values = (np.arange(1001, dtype=np.float64) * (rank + 1)) % 17 - 3.25 * rank
    expected = np.sum(WORLD.allgather(values), axis=0)
    tensor = torch.tensor(values, device=device, requires_grad=True)
    summed = mt.allreduce(tensor)
    assert isinstance(summed, torch.Tensor) and summed.device == tensor.device and summed.dtype == torch.float64
    np.testing.assert_array_equal(_on_host(summed), expected)
    np.testing.assert_array_equal(_on_host(tensor), values)  # the input as it was
    metrics = torch.tensor(values, device=device, dtype=torch.float32)
    assert mt.allreduce_(metrics, op="mean") is metrics
    np.testing.assert_allclose(_on_host(metrics), expected / size, rtol=1e-6)
    digests = WORLD.allgather(_on_host(metrics).tobytes())
    assert all(d == digests[0] for d in digests)


def test_horovod_style_rank_size_and_node_local_rank_and_size():
    """Each node's local ranks are 0..local_size-1, once each (numbered as the launcher numbers
    them: Open MPI's local rank need not follow the world order)."""
    from mpiallreduce.topology import node_communicator
    node = node_communicator(WORLD)
    assert (mt.rank(), mt.size()) == (WORLD.Get_rank(), WORLD.Get_size())
    assert mt.local_size() == node.Get_size()
    assert sorted(node.allgather(mt.local_rank())) == list(range(node.Get_size()))


def test_a_tensor_given_to_the_array_api_gets_a_message_that_says_what_it_is():
    with pytest.raises(TypeError, match=r"x is a torch.Tensor \(cpu\); use mpiallreduce.torch.allreduce\(x\), "
                                        r"or pass x.numpy\(\)"):
        mar.allreduce(torch.ones(3))
