r"""Training end to end, the Deep Speech 2 way: the same model, data and steps through each gradient
synchronization, with what allreduce costs a training epoch.

    mpiallreduce launch -n 2 -- python -m mpiallreduce.tools.train_bench \
        --output results/train/2ranks
    mpiallreduce launch -n 2 --nodes 2 -- python -m mpiallreduce.tools.train_bench  (emulated nodes)
    mpiallreduce launch -n 4 -- python -m mpiallreduce.tools.train_bench --device cuda
        (GPU = local rank % GPUs)

Contenders (each trains its own copy of the model from the same start, on the same batches):

    none               no gradient synchronization: the compute alone, the baseline of the others
    mpiallreduce       mpiallreduce.torch.DistributedOptimizer: fixed buckets (25 MiB), allreduced
                       during backward where a rank has a core to spare, else at step()
    mpiallreduce-fp16  the same, with compression="fp16" (16 bits on the wire, summed in float32)
    mpi4py             what a user writes by hand: after backward, one MPI_Allreduce per gradient
                       (mpi4py, in place; CUDA gradients through a host copy), then a division by
                       the rank count
    mpi4py-fused       the same loop fused by hand, as short as it gets: after backward, every
                       gradient copied into one buffer (torch.cat), one MPI_Allreduce in place, a
                       division of the buffer, and the gradients pointed at views of it (no check,
                       nothing kept for a failed step: about the least a fused sync can cost; CUDA
                       buffers through a host copy)
    ddp-gloo           torch.nn.parallel.DistributedDataParallel over gloo (torch's CPU choice; it
                       also takes CUDA tensors, where NCCL refuses ranks that share one GPU)
    ddp-mpiallreduce   the same DDP, its buckets reduced through mpiallreduce.torch.allreduce_hook
    horovod            horovod.torch.DistributedOptimizer (make horovod builds it), last: from
                       hvd.init() on, its thread calls MPI every 1 ms and slows compute, so it has
                       rounds and a baseline of its own, none-horovod (no sync, that thread on)

They run interleaved: --rounds rounds of --steps-per-round steps each, contender after contender,
so that the machine's drift touches them alike; the step time is the median over the rounds of the
slowest rank's mean step. "comm/step" is the median over the rounds of the step time less the
baseline's in that round: the communication that training waits for (what overlaps with backward
is free); "vs own ms" is against the contender's own baseline (none-horovod for horovod, none for
the others). Per epoch, that is --epoch-samples samples. Last, rank 0 trains one process on the
whole batch for the same steps, and each contender's parameters are compared with it (max
|difference|; float32, so the summation order shows at ~1e-7).
"""

import argparse
import importlib
import json
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

from ..core.machine import cores_per_rank  # (per machine: emulated nodes share its cores)
from .train_table import table

__all__ = ["main"]

CONTENDERS = (
    "none",
    "mpiallreduce",
    "mpiallreduce-fp16",
    "mpi4py",
    "mpi4py-fused",
    "ddp-gloo",
    "ddp-mpiallreduce",
    "horovod",
)


def horovod_importable():
    try:
        return bool(importlib.import_module("horovod.torch"))
    except Exception:  # noqa: BLE001 - not built here (make horovod), or built against another torch
        return False


def make_model(torch, args):
    """--model mlp: a few large layers (8 gradients of up to 16 MiB: buckets hardly matter).
    --model transformer: a small transformer encoder on --inputs features read as 16 tokens, about
    100 parameter tensors of mixed sizes (where buckets and fusion matter). No dropout: each
    contender must end where one process on the whole batch ends."""
    torch.manual_seed(args.seed)
    if args.model == "transformer":
        return tiny_transformer(torch, args)
    layers, size = [], args.inputs
    for _ in range(args.depth):
        layers += [torch.nn.Linear(size, args.width), torch.nn.ReLU()]
        size = args.width
    layers.append(torch.nn.Linear(size, args.outputs))
    return torch.nn.Sequential(*layers)


def tiny_transformer(torch, args, tokens=16, heads=4):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            layer = torch.nn.TransformerEncoderLayer(
                args.width, heads, 4 * args.width, dropout=0.0, batch_first=True
            )
            self.embed = torch.nn.Linear(args.inputs // tokens, args.width)
            self.encoder = torch.nn.TransformerEncoder(
                layer, args.depth, enable_nested_tensor=False
            )
            self.head = torch.nn.Linear(args.width, args.outputs)

        def forward(self, x):
            h = self.encoder(self.embed(x.reshape(x.shape[0], tokens, -1)))
            return self.head(h.mean(dim=1))

    return Model()


def describe_model(args, model):
    tensors = sum(1 for _ in model.parameters())
    if args.model == "transformer":
        return f"transformer {args.depth} layers x {args.width} wide ({tensors} parameter tensors)"
    return f"MLP {args.depth}x{args.width} ({tensors} parameter tensors)"


def global_batch(torch, seed, step, samples, inputs, outputs):
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(samples, inputs, generator=generator)
    return x, torch.sin(x[:, :outputs] * 3.0)


class Contender:
    """One way of synchronizing gradients, with its own model and optimizer."""

    def __init__(self, name, torch, args, comm, device):
        import mpiallreduce.torch as mt

        self.name, self.torch, self.comm, self.device = name, torch, comm, device
        self.model = make_model(torch, args).to(device)
        optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr)
        self.forward = self.model
        if name.startswith("mpiallreduce"):
            optimizer = mt.DistributedOptimizer(
                optimizer,
                named_parameters=self.model.named_parameters(),
                comm=comm,
                bucket_bytes=args.bucket_bytes,
                compression="fp16" if name.endswith("fp16") else None,
            )
        elif name.startswith("ddp"):
            self.forward = torch.nn.parallel.DistributedDataParallel(
                self.model, bucket_cap_mb=args.bucket_bytes / 2**20
            )
            if name == "ddp-mpiallreduce":
                self.forward.register_comm_hook(mt.HookState(comm=comm), mt.allreduce_hook)
        elif name == "horovod":
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(
                optimizer, named_parameters=self.model.named_parameters()
            )
        self.optimizer = optimizer
        self.step_seconds, self.steps = [], 0
        if (
            name == "mpi4py-fused"
        ):  # (one buffer for every gradient, and each gradient's view of it)
            self.flat = torch.empty(
                sum(p.numel() for p in self.model.parameters()),
                dtype=next(self.model.parameters()).dtype,
                device=device,
            )
            self.views = [
                view.view(p.shape)
                for view, p in zip(
                    torch.split(self.flat, [p.numel() for p in self.model.parameters()]),
                    self.model.parameters(),
                    strict=True,
                )
            ]

    def fused_by_hand(self, size):
        """mpi4py-fused's sync: one copy in, one MPI_Allreduce in place, a division, views out."""
        torch, parameters = self.torch, list(self.model.parameters())
        torch.cat(
            [
                torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1)
                for p in parameters
            ],
            out=self.flat,
        )  # (set_to_none: the gradients are not views of flat here)
        host = self.flat.numpy() if self.flat.device.type == "cpu" else self.flat.cpu().numpy()
        self.comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        if self.flat.device.type != "cpu":
            self.flat.copy_(torch.from_numpy(host))
        self.flat.div_(size)
        for p, view in zip(parameters, self.views, strict=False):
            p.grad = view

    def train(self, args, rank, size, steps):
        torch, comm = self.torch, self.comm
        b = args.local_batch
        comm.Barrier()
        begin = time.perf_counter()
        for _ in range(steps):
            x, y = global_batch(torch, args.seed, self.steps, b * size, args.inputs, args.outputs)
            x, y = (
                x[rank * b : (rank + 1) * b].to(self.device),
                y[rank * b : (rank + 1) * b].to(self.device),
            )
            self.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self.forward(x), y)
            loss.backward()
            if self.name == "mpi4py":
                for p in self.model.parameters():
                    grad = p.grad.cpu().numpy()  # (the gradient itself on the CPU)
                    comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
                    grad /= size
                    if p.grad.device.type != "cpu":
                        p.grad.copy_(torch.from_numpy(grad))
            elif self.name == "mpi4py-fused":
                self.fused_by_hand(size)
            self.optimizer.step()
            self.steps += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        mean = (time.perf_counter() - begin) / steps
        self.step_seconds.append(comm.allreduce(mean, op=MPI.MAX))

    def parameters(self):
        return [p.detach().cpu().numpy().copy() for p in self.model.parameters()]


def single_process_parameters(torch, args, size, steps, device):
    """One process, the whole batch (p * b samples), the same steps: what data parallelism must
    match."""
    model = make_model(torch, args).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(steps):
        x, y = global_batch(
            torch, args.seed, step, args.local_batch * size, args.inputs, args.outputs
        )
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def start_gloo(torch, comm):
    """torch.distributed over gloo (its rendezvous given out through MPI: mpiallreduce.torch)."""
    from ..training.ddp_hooks import init_process_group

    init_process_group("gloo", comm)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m mpiallreduce.tools.train_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--contenders",
        default=None,
        help=f"comma-separated, from {', '.join(CONTENDERS)} (none is always run; default: all, "
        "horovod where it imports)",
    )
    parser.add_argument("--model", choices=["mlp", "transformer"], default="mlp")
    parser.add_argument(
        "--width", type=int, default=None, help="MLP: 2048 (default); transformer: 128"
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=None,
        help="MLP: hidden layers (width x width each after the first; 3); transformer: layers (8)",
    )
    for flag, default in (
        ("--inputs", 256),
        ("--outputs", 16),
        ("--local-batch", 32),
        ("--seed", 0),
        ("--bucket-bytes", 25 * 2**20),
        ("--rounds", 25),
        ("--steps-per-round", 3),
        ("--epoch-samples", 50_000),
    ):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per rank (default: its share of its machine's cores, at least 1)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model trains: cuda puts rank r on GPU (node-local rank %% GPUs)",
    )
    parser.add_argument("--output", help="folder for train.json and train.txt")
    args = parser.parse_args(argv)
    args.width = args.width or (128 if args.model == "transformer" else 2048)
    args.depth = args.depth or (8 if args.model == "transformer" else 3)
    horovod = all(MPI.COMM_WORLD.allgather(horovod_importable()))  # (every rank, or none)
    asked = (
        args.contenders.split(",")
        if args.contenders
        else [n for n in CONTENDERS if n != "horovod" or horovod]
    )
    names = ["none"] + [n for n in asked if n and n != "none"]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    if "horovod" in names and not horovod:
        parser.error(
            "horovod: horovod.torch does not import on every rank; `make horovod` builds it into "
            "the venv"
        )

    import torch

    import mpiallreduce as mar

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    nodes = comm.allreduce(1 if node.Get_rank() == 0 else 0)
    torch.set_num_threads(args.threads or max(1, int(cores_per_rank(comm))))
    device = torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("train_bench --device cuda: torch sees no CUDA device")
        from ..device.arrays import gpu_for_local_rank

        device = torch.device(
            "cuda", gpu_for_local_rank(node.Get_rank(), torch.cuda.device_count())
        )
        torch.cuda.set_device(device)
    ddp = any(name.startswith("ddp") for name in names)
    if ddp:
        start_gloo(torch, comm)
    if rank == 0 and not args.contenders and "horovod" not in names:
        print(
            "train_bench: Horovod does not import here; `make horovod` builds it into the venv "
            "(benchmarks/horovod/build.sh)",
            flush=True,
        )
    contenders = [Contender(name, torch, args, comm, device) for name in names if name != "horovod"]
    gradient_bytes = sum(p.numel() * 4 for p in contenders[0].model.parameters())
    run_rounds(contenders, args, rank, size)
    if (
        "horovod" in names
    ):  # last: once started, Horovod's thread slows whatever runs in the process
        import horovod.torch as hvd

        hvd.init(comm=comm)
        last = [Contender(name, torch, args, comm, device) for name in ("none-horovod", "horovod")]
        run_rounds(last, args, rank, size)
        contenders += last
    total_steps = 1 + args.rounds * args.steps_per_round
    for contender in (c for c in contenders if not c.name.startswith("none")):
        mar.check_replicas(
            contender.parameters(), comm=comm
        )  # every contender keeps replicas identical
    reference = (
        single_process_parameters(torch, args, size, total_steps, device) if rank == 0 else None
    )
    rows = {}
    for contender in contenders:
        row = {
            "step_s": statistics.median(contender.step_seconds),
            "rounds_step_s": contender.step_seconds,
        }
        if rank == 0:
            row["max_abs_difference"] = max(
                float(np.max(np.abs(a - b)))
                for a, b in zip(contender.parameters(), reference, strict=False)
            )
        rows[contender.name] = row
    if rank == 0:
        text = table(
            rows, args, size, nodes, gradient_bytes, describe_model(args, contenders[0].model)
        )
        print(text, flush=True)
        if args.output:
            os.makedirs(args.output, exist_ok=True)
            with open(os.path.join(args.output, "train.txt"), "w") as out:
                out.write(text + "\n")
            with open(os.path.join(args.output, "train.json"), "w") as out:
                json.dump(
                    {
                        "ranks": size,
                        "nodes": nodes,
                        "gradient_bytes": gradient_bytes,
                        "steps": total_steps,
                        "arguments": vars(args),
                        "rows": rows,
                    },
                    out,
                    indent=1,
                )
    if ddp:
        torch.distributed.destroy_process_group()
    if "horovod" in names:
        hvd.shutdown()
    return 0


def run_rounds(contenders, args, rank, size):
    """A first step each, untimed (allocations, bucket preparation), then --rounds interleaved
    rounds."""
    for contender in contenders:
        contender.train(args, rank, size, 1)
        contender.step_seconds.clear()
    for _ in range(args.rounds):
        for contender in contenders:
            contender.train(args, rank, size, args.steps_per_round)


if __name__ == "__main__":
    import mpiallreduce as mar

    mar.abort_on_exception()
    raise SystemExit(main())
