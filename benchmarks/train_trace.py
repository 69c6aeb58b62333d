"""Where a training step's time goes, per contender: forward, backward, the wait for the gradients,
the optimizer, on the same model and batches, interleaved step by step.

    make bench-trace      (both models on 2 ranks, into results/train/trace-<model>-2ranks.txt)
    mpiallreduce launch -n 2 -- python benchmarks/train_trace.py --model transformer
        --output trace.txt

    contender         forward  backward  sync  optimizer  step   (ms, median over the steps,
                                                                  slowest rank)
    none                ...
    mpiallreduce        ...    (backward: with its hooks, where it overlaps; sync:
                                optimizer.synchronize())
    mpi4py              ...    (sync: one MPI_Allreduce per gradient, in place, then the division)

"backward" of a DDP contender holds its reductions (they run in DDP's hooks); the difference to
none's backward is what the hooks and the reductions there cost. mpiallreduce-overlap and
mpiallreduce-at-wait force GradientSync's choice (mpiallreduce.training.overlap) either way;
mpiallreduce takes it by the cores each rank has. Horovod joins where it imports (make horovod),
with its own baseline none-horovod, after every other contender (its thread slows what follows).
"""

import argparse
import contextlib
import statistics
import sys
import time

import torch
from mpi4py import MPI

import mpiallreduce.torch as mt
from mpiallreduce.core.machine import cores_per_rank
from mpiallreduce.tools.train_bench import global_batch, horovod_importable, make_model, start_gloo

PHASES = ("forward", "backward", "sync", "optimizer", "step")


class Traced:
    def __init__(self, name, args, comm):
        self.name, self.comm = name, comm
        self.model = make_model(torch, args)
        optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr)
        self.forward = self.model
        named = self.model.named_parameters()
        if name.startswith("mpiallreduce"):
            overlap = {"mpiallreduce-overlap": True, "mpiallreduce-at-wait": False}.get(name)
            optimizer = mt.DistributedOptimizer(
                optimizer, named_parameters=named, comm=comm, overlap=overlap
            )
        elif name.startswith("ddp"):
            self.forward = torch.nn.parallel.DistributedDataParallel(self.model)
            if name == "ddp-mpiallreduce":
                self.forward.register_comm_hook(mt.HookState(comm=comm), mt.allreduce_hook)
        elif name == "horovod":
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named)
        self.optimizer, self.times = optimizer, []

    def step(self, args, index):
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        x, y = global_batch(
            torch, args.seed, index, args.local_batch * size, args.inputs, args.outputs
        )
        mine = slice(rank * args.local_batch, (rank + 1) * args.local_batch)
        x, y = x[mine], y[mine]
        self.comm.Barrier()
        t0 = time.perf_counter()
        self.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self.forward(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        skip = contextlib.nullcontext()
        if self.name == "mpi4py":
            for p in self.model.parameters():
                grad = p.grad.numpy()
                self.comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
                grad /= size
        elif hasattr(self.optimizer, "synchronize"):
            self.optimizer.synchronize()
            skip = self.optimizer.skip_synchronize()
        t3 = time.perf_counter()
        with skip:
            self.optimizer.step()
        t4 = time.perf_counter()
        everyone = self.comm.allgather((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0))
        self.times.append(max(everyone, key=lambda phases: phases[-1]))  # (the slowest rank's step)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["mlp", "transformer"], default="transformer")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, help="as train_bench's (transformer 128, MLP 2048)")
    parser.add_argument("--depth", type=int, help="as train_bench's (transformer 8, MLP 3)")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    width, depth = (128, 8) if args.model == "transformer" else (2048, 3)
    args.width, args.depth = args.width or width, args.depth or depth
    args.inputs, args.outputs, args.local_batch, args.lr, args.seed = 256, 16, 32, 0.01, 0
    comm = MPI.COMM_WORLD
    torch.set_num_threads(
        max(1, int(cores_per_rank(comm)))
    )  # (per machine: emulated nodes share its cores)
    start_gloo(torch, comm)
    names = [
        "none",
        "mpiallreduce",
        "mpiallreduce-overlap",
        "mpiallreduce-at-wait",
        "mpi4py",
        "ddp-gloo",
        "ddp-mpiallreduce",
    ]
    groups = [[Traced(name, args, comm) for name in names]]
    if horovod_importable():
        import horovod.torch as hvd

        groups.append(None)
    rows = {}
    for group in groups:
        if group is None:  # Horovod last: its thread runs from hvd.init() on
            hvd.init(comm=comm)
            group = [Traced(name, args, comm) for name in ("none-horovod", "horovod")]
        for index in range(args.steps + 2):
            for traced in group:
                traced.step(args, index)
        for traced in group:
            rows[traced.name] = [
                statistics.median(phase) * 1e3 for phase in zip(*traced.times[2:], strict=True)
            ]
    if comm.Get_rank() == 0:
        header = (
            f"where a step's time goes: {args.model}, {comm.Get_size()} ranks, "
            f"{torch.get_num_threads()} torch "
            f"thread(s) a rank, median of {args.steps} interleaved steps, the slowest rank's; ms"
        )
        lines = [header, f"{'contender':<22}" + "".join(f"{p:>10}" for p in PHASES)]
        lines += [f"{name:<22}" + "".join(f"{v:>10.2f}" for v in row) for name, row in rows.items()]
        text = "\n".join(lines)
        print(text, flush=True)
        if args.output:
            with open(args.output, "w") as out:
                out.write(text + "\n")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    import mpiallreduce as mar

    mar.abort_on_exception()
    sys.exit(main())
