"""The Horovod drop-in (``import mpiallreduce.torch as hvd``) on every rank: each collective against
numpy on the gathered inputs (mpi4py's own allgather), Horovod's semantics (ops matched by name,
join, integer means, scaling, gradients), and its errors: the same on every rank, and the next call
pairs up after them."""

import json
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
import mpiallreduce.torch as hvd  # noqa: E402
from mpiallreduce.core.consistency import SignatureMismatch  # noqa: E402

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD


def _gathered(tensor):
    """Every rank's copy of ``tensor``, as numpy, by mpi4py (the reference)."""
    return WORLD.allgather(tensor.detach().numpy().copy())


def _several_ranks():
    if WORLD.Get_size() == 1:
        pytest.skip("needs 2 ranks or more")


def _rows(rank, columns=3, dtype=torch.float64):
    """rank + 1 rows whose values depend on the rank and the index."""
    return torch.arange((rank + 1) * columns, dtype=dtype).reshape(rank + 1, columns) + 100 * rank


def _pairs_up_after():
    """A sum on every rank: the call after an error pairs up right."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    total = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum)
    assert total.item() == size * (size - 1) / 2


def test_allgather_of_each_ranks_own_rows_async_and_its_gradient():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    mine = _rows(rank).requires_grad_()
    expected = np.concatenate(_gathered(mine))
    gathered = hvd.allgather(mine)
    np.testing.assert_array_equal(gathered.detach().numpy(), expected)
    np.testing.assert_array_equal(hvd.synchronize(hvd.allgather_async(mine)).numpy(), expected)
    weights = torch.arange(gathered.numel(), dtype=torch.float64).reshape(gathered.shape)
    (gathered * weights * (rank + 1)).sum().backward()
    # Horovod's gradient: the ranks' gradients averaged, this rank's rows of it
    first = sum(r + 1 for r in range(rank))
    mean = weights.numpy() * np.mean([r + 1 for r in range(size)])
    np.testing.assert_allclose(mine.grad.numpy(), mean[first : first + rank + 1], rtol=1e-12)


def test_alltoall_by_splits_gives_the_received_splits_and_its_gradient_goes_back():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    splits = [peer + 1 for peer in range(size)]  # to each peer, peer + 1 rows
    rows = sum(splits)
    mine = (
        torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 1000 * rank
    ).requires_grad_()
    received, received_splits = hvd.alltoall(mine, splits=torch.tensor(splits, dtype=torch.int32))
    everyone = _gathered(mine)
    start = sum(splits[:rank])
    expected = np.concatenate([everyone[r][start : start + rank + 1] for r in range(size)])
    np.testing.assert_array_equal(received.detach().numpy(), expected)
    assert received_splits.tolist() == [rank + 1] * size
    (received * (rank + 1)).sum().backward()
    # each row's gradient comes back from the rank it went to
    expected_grad = np.concatenate([np.full((peer + 1, 2), peer + 1.0) for peer in range(size)])
    np.testing.assert_array_equal(mine.grad.numpy(), expected_grad)
    if size > 1:  # splits that do not sum to the rows: refused on every rank
        with pytest.raises(RuntimeError, match=f"rank {size - 1} cannot make its alltoall"):
            bad = splits if rank != size - 1 else [rows] * size
            hvd.alltoall(mine.detach(), splits=bad)
        _pairs_up_after()


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_reducescatter_gives_each_rank_its_rows_of_uneven_ones_and_its_gradient(op):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    rows = 2 * size + 1
    mine = (
        torch.arange(rows * 2, dtype=torch.float64).reshape(rows, 2) * (rank + 1)
    ).requires_grad_()
    everyone = np.stack(_gathered(mine))
    whole = everyone.sum(axis=0) if op == "Sum" else everyone.mean(axis=0)
    parts = np.array_split(np.arange(rows), size)
    part = hvd.reducescatter(mine, op=getattr(hvd, op))
    np.testing.assert_allclose(part.detach().numpy(), whole[parts[rank]], rtol=1e-12)
    handle = hvd.reducescatter_async(mine.detach(), op=getattr(hvd, op), name=f"rs.{op}")
    np.testing.assert_allclose(hvd.synchronize(handle).numpy(), whole[parts[rank]], rtol=1e-12)
    (part * (rank + 1)).sum().backward()
    # Horovod's gradient: the ranks' gradients gathered, then reduced by the op over the ranks
    gathered = np.concatenate([np.full((len(parts[r]), 2), r + 1.0) for r in range(size)])
    expected = gathered * size if op == "Sum" else gathered
    np.testing.assert_allclose(mine.grad.numpy(), expected, rtol=1e-12)


def test_broadcast_async_in_place_and_its_gradient_is_the_mean_at_the_root():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    root = size - 1
    mine = torch.arange(6, dtype=torch.float64) + 10 * rank
    expected = _gathered(mine)[root]
    np.testing.assert_array_equal(
        hvd.synchronize(hvd.broadcast_async(mine, root_rank=root)).numpy(), expected
    )
    in_place = mine.clone()
    assert hvd.synchronize(hvd.broadcast_async_(in_place, root_rank=root)) is in_place
    np.testing.assert_array_equal(in_place.numpy(), expected)
    leaf = mine.clone().requires_grad_()
    (hvd.broadcast(leaf, root_rank=root) * (rank + 1)).sum().backward()
    mean = np.mean([r + 1.0 for r in range(size)])
    np.testing.assert_array_equal(leaf.grad.numpy(), np.full(6, mean if rank == root else 0.0))


def test_integer_means_truncate_and_prescale_scales_each_input_first():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    mine = torch.tensor([-7, -1, 5, 9], dtype=torch.int32) * (rank + 1) + rank
    everyone = np.stack(_gathered(mine)).astype(np.int64)
    np.testing.assert_array_equal(
        hvd.allreduce(mine, op=hvd.Average).numpy(), np.trunc(everyone.sum(0) / size)
    )
    # each rank's input times 1.5 in float64, back to int32 (truncated), then the sum
    scaled = np.trunc(everyone * 1.5).sum(axis=0)
    np.testing.assert_array_equal(
        hvd.allreduce(mine, op=hvd.Sum, prescale_factor=1.5).numpy(), scaled
    )
    np.testing.assert_array_equal(
        hvd.allreduce(mine, op=hvd.Sum, postscale_factor=0.5).numpy(),
        np.trunc(everyone.sum(axis=0) * 0.5),
    )


def test_grouped_allreduce_forms_reduce_each_tensor():
    rank = WORLD.Get_rank()
    tensors = [torch.arange(n, dtype=torch.float64) * (rank + 1) + n for n in (1, 5, 9)]
    expected = [np.sum(_gathered(t), axis=0) for t in tensors]
    for result, want in zip(hvd.grouped_allreduce(tensors, op=hvd.Sum), expected, strict=True):
        np.testing.assert_array_equal(result.numpy(), want)
    handle = hvd.grouped_allreduce_async(tensors, op=hvd.Sum, name="grouped")
    for result, want in zip(hvd.synchronize(handle), expected, strict=True):
        np.testing.assert_array_equal(result.numpy(), want)
    copies = [t.clone() for t in tensors]
    hvd.grouped_allreduce_(copies, op=hvd.Sum)
    for result, want in zip(copies, expected, strict=True):
        np.testing.assert_array_equal(result.numpy(), want)


def test_mismatched_collectives_raise_a_runtime_error_on_every_rank_then_the_next_pairs_up():
    _several_ranks()
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    last = rank == size - 1
    cases = [
        lambda: hvd.allreduce(torch.zeros(4 if not last else 5)),  # a shape
        lambda: hvd.allreduce(torch.zeros(4, dtype=torch.float32 if not last else torch.int32)),
        lambda: hvd.broadcast(torch.zeros(3), root_rank=0 if not last else 1),  # the root
        lambda: hvd.allgather(torch.zeros(2, 3 if not last else 4)),
        lambda: hvd.allreduce(torch.zeros(2)) if not last else hvd.allgather(torch.zeros(2)),
    ]
    for case in cases:
        with pytest.raises(RuntimeError, match="differ") as raised:
            case()
        assert isinstance(raised.value, SignatureMismatch)  # (the project's own contract too)
        assert f"rank {size - 1}:" in str(raised.value)
        _pairs_up_after()
    with pytest.raises(RuntimeError, match=f"root_rank {size} is not a rank"):
        hvd.broadcast(torch.zeros(3), root_rank=0 if not last else size)
    _pairs_up_after()


def test_ops_match_by_name_and_a_name_in_flight_is_refused_at_submission():
    _several_ranks()
    rank = WORLD.Get_rank()
    a, b = torch.full((3,), rank + 1.0), torch.full((5,), 10.0 * rank)
    names = ["a", "b"] if rank == 0 else ["b", "a"]  # submitted in another order on rank 0

    def submit():
        return {name: hvd.allreduce_async({"a": a, "b": b}[name], name=name, op=hvd.Sum)
                for name in names}  # fmt: skip

    if rank == 0:  # (the others submit after this rank's check: "a" cannot have finished yet)
        handles = submit()
        with pytest.raises(ValueError, match="named 'a' is still in flight"):
            hvd.allreduce_async(a, name="a")
        WORLD.Barrier()
    else:
        WORLD.Barrier()
        handles = submit()
    np.testing.assert_array_equal(hvd.synchronize(handles["a"]).numpy(), np.sum(_gathered(a), 0))
    np.testing.assert_array_equal(hvd.synchronize(handles["b"]).numpy(), np.sum(_gathered(b), 0))
    # a rank may submit, wait in a barrier its peers reach first, and be met after it
    late = torch.arange(4.0) * (rank + 1)
    early = hvd.allreduce_async(late, name="after the barrier", op=hvd.Sum) if rank == 0 else None
    hvd.barrier()
    if rank != 0:
        early = hvd.allreduce_async(late, name="after the barrier", op=hvd.Sum)
    np.testing.assert_array_equal(hvd.synchronize(early).numpy(), np.sum(_gathered(late), 0))
    _pairs_up_after()


def test_join_gives_zeros_to_the_others_allreduces_and_returns_the_last_rank():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    for first in range(size):
        mine = torch.arange(6, dtype=torch.float64) * (rank + 1)
        contributions = [c if r != first else np.zeros(6) for r, c in enumerate(_gathered(mine))]
        if rank == first:
            last = hvd.join()
        else:
            mean = hvd.allreduce(mine, name="joined", op=hvd.Average)
            np.testing.assert_allclose(mean.numpy(), np.sum(contributions, 0) / size, rtol=1e-12)
            if size > 2:  # (an unnamed one: numbered alike after)
                total = hvd.allreduce(mine, op=hvd.Sum)
                np.testing.assert_array_equal(total.numpy(), np.sum(contributions, 0))
            if size > 1:
                with pytest.raises(RuntimeError, match="only allreduce takes part in join"):
                    hvd.allgather(mine.reshape(2, 3))
            last = hvd.join()
        assert WORLD.allgather(last) == [last] * size
        assert last != first or size == 1
        _pairs_up_after()


def test_an_op_no_peer_submits_fails_after_the_timeout_and_later_submitters_fail_alike(
    use_settings,
):
    _several_ranks()
    rank = WORLD.Get_rank()
    use_settings(timeout=1.5)
    hvd.barrier()
    if rank == 0:
        handle = hvd.allreduce_async(torch.ones(2), name="lonely")
        with pytest.raises(RuntimeError, match=r"lonely waited 1.5 s: rank\(s\) \[0\] submitted"):
            hvd.synchronize(handle)
    else:
        time.sleep(1.0)  # (the barrier below outlives rank 0's wait)
    hvd.barrier()
    if rank != 0:  # the others submit it now: it fails at once, as it did on rank 0
        with pytest.raises(RuntimeError, match="lonely waited"):
            hvd.allreduce(torch.ones(2), name="lonely")
    _pairs_up_after()


def test_process_sets_are_communicators_of_their_ranks():
    _several_ranks()
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    evens = hvd.add_process_set(list(range(0, size, 2)))
    try:
        assert evens.included() == (rank % 2 == 0)
        if evens.included():
            mine = torch.tensor([float(rank)])
            total = hvd.allreduce(mine, op=hvd.Sum, process_set=evens)
            assert total.item() == sum(range(0, size, 2))
        total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=hvd.global_process_set)
        assert total.item() == size
    finally:
        assert hvd.remove_process_set(evens)
    _pairs_up_after()


def test_the_timeline_is_a_chrome_trace_of_each_ops_negotiation_and_move(tmp_path):
    rank = WORLD.Get_rank()
    path = WORLD.bcast(str(tmp_path / "timeline.json"))
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.arange(3.0), name="traced")
    hvd.stop_timeline()
    if rank == 0:
        with open(path) as trace:
            document = json.load(trace)
        rows = {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["ph"] == "M"}
        spans = [(rows[e["pid"]], e["name"], e["ph"]) for e in document["traceEvents"]
                 if e["ph"] in "BE"]  # fmt: skip
        for phase in ("B", "E"):
            assert ("allreduce.traced", "NEGOTIATE_ALLREDUCE", phase) in spans, spans
            assert ("allreduce.traced", "ALLREDUCE", phase) in spans, spans
        assert any(e["name"] == "CYCLE_START" for e in document["traceEvents"])
    WORLD.Barrier()
    if rank == 0:
        os.remove(path)


def test_sync_batch_norm_normalizes_by_every_ranks_batch():
    rank = WORLD.Get_rank()
    torch.manual_seed(7)
    batch = torch.randn(4 + rank, 3, dtype=torch.float64) * (rank + 1) + rank
    synced = hvd.SyncBatchNorm(3).double()
    output = synced(batch)
    whole = torch.tensor(np.concatenate(_gathered(batch)))
    alone = torch.nn.BatchNorm1d(3).double()
    expected = alone(whole)
    first = sum(4 + r for r in range(rank))
    np.testing.assert_allclose(
        output.detach().numpy(), expected[first : first + 4 + rank].detach().numpy(), rtol=1e-9
    )
    np.testing.assert_allclose(synced.running_mean.numpy(), alone.running_mean.numpy(), rtol=1e-9)
    np.testing.assert_allclose(synced.running_var.numpy(), alone.running_var.numpy(), rtol=1e-9)


def test_broadcast_optimizer_state_makes_the_state_first_and_unused_parameters_get_zeros():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    torch.manual_seed(rank)
    used, unused = (torch.nn.Parameter(torch.randn(3, dtype=torch.float64)) for _ in range(2))
    optimizer = torch.optim.Adam([used, unused], lr=0.1 * (rank + 1))
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # no .grad yet: a zero step first
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    assert all("exp_avg" in optimizer.state[p] for p in (used, unused))
    hvd.broadcast_parameters([("used", used), ("unused", unused)], root_rank=0)
    distributed = hvd.DistributedOptimizer(
        optimizer, named_parameters=[("used", used), ("unused", unused)]
    )
    scale = float(rank + 1)
    loss = (used * scale).sum() + ((unused * scale).sum() if rank != size - 1 else 0.0)
    loss.backward()
    distributed.synchronize()
    given = [r + 1.0 for r in range(size)]
    np.testing.assert_allclose(used.grad.numpy(), np.full(3, np.mean(given)), rtol=1e-12)
    unused_here = [g if r != size - 1 else 0.0 for r, g in enumerate(given)]
    np.testing.assert_allclose(unused.grad.numpy(), np.full(3, np.mean(unused_here)), rtol=1e-12)


def test_distributed_optimizer_naming_mistakes_raise_on_every_rank():
    _several_ranks()
    rank = WORLD.Get_rank()
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    named = [*first.named_parameters(), *second.named_parameters()]  # weight, bias twice
    renamed = [(f"{i}.{name}", p) for i, (name, p) in enumerate(named)]
    given = named if rank == 0 else renamed  # only rank 0 repeats names; every rank raises
    with pytest.raises(ValueError, match="rank 0: the names in named_parameters must be unique"):
        hvd.DistributedOptimizer(optimizer, named_parameters=given)
    with pytest.raises(ValueError, match="are not in it"):
        hvd.DistributedOptimizer(optimizer, named_parameters=list(first.named_parameters()))
    _pairs_up_after()


def test_sparse_allreduce_and_sparse_gradients_reduce_as_their_dense_sum():
    rank = WORLD.Get_rank()
    dense = torch.zeros(6, 2, dtype=torch.float64)
    dense[rank % 6] = rank + 1.0
    dense[(rank + 3) % 6, 1] = -2.0 * rank
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse", op=hvd.Sum)
    np.testing.assert_array_equal(handle().to_dense().numpy(), np.sum(_gathered(dense), 0))
    embedding = torch.nn.Embedding(6, 2, sparse=True).double()
    hvd.broadcast_parameters(embedding.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1),
        named_parameters=embedding.named_parameters(),
    )
    indices = torch.tensor([rank % 6, (rank + 1) % 6, (rank + 1) % 6])
    (embedding(indices) * (rank + 1)).sum().backward()
    local = embedding.weight.grad.to_dense().clone()
    optimizer.synchronize()
    assert embedding.weight.grad.is_sparse
    np.testing.assert_allclose(
        embedding.weight.grad.to_dense().numpy(), np.mean(_gathered(local), 0), rtol=1e-12
    )
    with optimizer.skip_synchronize():
        optimizer.step()


def test_horovod_flags_compression_and_the_nodes():
    assert hvd.mpi_enabled() and hvd.mpi_built()
    assert not hvd.gloo_enabled() and not hvd.ccl_built()
    compressed, context = hvd.Compression.fp16.compress(torch.arange(4, dtype=torch.float64))
    assert compressed.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(compressed, context).dtype == torch.float64
    integers = torch.arange(4)
    assert hvd.Compression.fp16.compress(integers)[0] is integers
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.Get_rank())
    leaders = WORLD.allgather(WORLD.Get_rank() if node.Get_rank() == 0 else None)
    node_leader = node.bcast(WORLD.Get_rank(), root=0)
    node.Free()
    leaders = [r for r in leaders if r is not None]
    assert hvd.cross_size() == len(leaders)
    assert hvd.cross_rank() == leaders.index(node_leader)
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_an_op_submitted_just_before_join_runs_with_the_joined_ranks_zeros():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    mine = torch.arange(4, dtype=torch.float64) + rank
    if rank == 0:  # the op and the join reach one round together
        handle = hvd.allreduce_async(mine, op=hvd.Sum, name="before join")
        last = hvd.join()
        assert hvd.poll(handle)
        np.testing.assert_array_equal(hvd.synchronize(handle).numpy(), np.arange(4.0))
    else:
        last = hvd.join()
    assert WORLD.allgather(last) == [last] * size
    _pairs_up_after()


def test_a_named_op_refused_on_one_rank_raises_on_every_rank_at_once():
    _several_ranks()
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    rows = torch.arange(2.0 * size).reshape(size, 2)
    bad = [1] * size if rank != size - 1 else [size + 1] * size
    with pytest.raises(RuntimeError, match=f"rank {size - 1} cannot make its alltoall"):
        hvd.alltoall(rows, splits=bad, name="splits")
    received, _ = hvd.alltoall(rows, splits=[1] * size, name="splits")  # the name pairs up again
    np.testing.assert_array_equal(received.numpy()[:, 0], [2.0 * rank] * size)


def test_broadcast_optimizer_state_leaves_the_weights_where_gradients_were_left_over():
    rank = WORLD.Get_rank()
    weight = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    weight.grad = torch.full((3,), 1.0 if rank % 2 else -1.0, dtype=torch.float64)
    optimizer = torch.optim.Adam([weight], lr=0.1)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    np.testing.assert_array_equal(weight.detach().numpy(), np.ones(3))  # a zero step: no move
    assert weight.grad[0].item() == (1.0 if rank % 2 else -1.0)  # the leftover kept


def test_a_rank_outside_the_optimizers_process_set_steps_on_its_own_gradients():
    _several_ranks()
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    members = list(range(size - 1))  # every rank but the last
    some = hvd.add_process_set(members)
    try:
        weight = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD([weight], lr=1.0), named_parameters=[("w", weight)], process_set=some
        )
        assert isinstance(optimizer, torch.optim.Optimizer)
        (weight * (rank + 1.0)).sum().backward()
        optimizer.step()
        mean = np.mean([r + 1.0 for r in members]) if rank in members else rank + 1.0
        np.testing.assert_array_equal(weight.detach().numpy(), [-mean] * 2)
    finally:
        hvd.remove_process_set(some)
    with pytest.raises(ValueError, match="was not added"):  # (not silently local)
        hvd.DistributedOptimizer(torch.optim.SGD([weight], lr=1.0), process_set=hvd.ProcessSet([0]))
    _pairs_up_after()


def test_a_join_outlives_the_timeout_while_the_others_make_progress(use_settings):
    _several_ranks()
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    use_settings(timeout=1.0)
    hvd.barrier()
    if rank == 0:  # uneven data: rank 0 is done at once, the others go on for about 1.5 s
        last = hvd.join()
    else:
        started = time.monotonic()
        while time.monotonic() - started < 1.5:
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == size - 1
            time.sleep(0.02)
        last = hvd.join()
    assert WORLD.allgather(last) == [last] * size and last != 0


def test_shutdown_fails_what_is_in_flight_and_init_starts_afresh():
    _several_ranks()
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    hvd.init()
    subset = hvd.add_process_set(list(range(size)))
    waiting = hvd.allreduce_async(torch.ones(1), name="never met") if rank == 0 else None
    WORLD.Barrier()
    hvd.shutdown()
    if rank == 0:
        with pytest.raises(RuntimeError, match="shut down"):
            hvd.synchronize(waiting)
    assert subset.process_set_id is None  # (forgotten: added again after init)
    hvd.init()
    subset = hvd.add_process_set(list(range(size)))
    try:
        if rank == 0:  # the set's engine was made at add_process_set: this call does not wait
            handle = hvd.allreduce_async(torch.ones(1), op=hvd.Sum, process_set=subset)
            hvd.barrier()
        else:
            hvd.barrier()
            handle = hvd.allreduce_async(torch.ones(1), op=hvd.Sum, process_set=subset)
        assert hvd.synchronize(handle).item() == size
    finally:
        hvd.remove_process_set(subset)
    _pairs_up_after()
