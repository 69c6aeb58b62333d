"""What handing a bucket's results over as views saves a training step, side by side in one run.

    mpiallreduce launch -n 2 --nodes 2 -- python benchmarks/views_price.py [--model transformer]
        [--steps 40]
    mpiallreduce launch -n 2 -- python benchmarks/views_price.py      (one node: symmetric buffers,
                                                                       single_copy)

The same model (train_bench's), batches and optimizer three times over, one step of each in turn,
synchronize() timed from a barrier after backward (the slowest rank's time, median over --steps):

- copied back: DistributedOptimizer(gradient_as_bucket_view=False): each fused gradient is copied
  into its bucket, the bucket summed in place (auto: the table's choice), and the sum divided into
  the gradient on the way back;
- views: the default: the bucket's mean in place, the gradients pointed at it (grad.set_), no copy
  back (on one node the buckets are symmetric buffers, reduced by single_copy). On a power-of-two
  rank count each gradient is copied in times 1/p and the bucket summed (auto: the table's choice
  for a sum); on others the call is the mean itself (auto: overrides.MEAN_ACROSS_NODES from 4 MiB);
- views, mpi: the same with algorithm="mpi": MPI's own sum (on other rank counts then a pass that
  divides; on one node too: MPI's own copies the symmetric buffers as it would any others).

Prints each in ms and views / copied back, with the parameters' largest difference between the three
after the steps (0: the same bits).
"""

import argparse

import numpy as np
import torch
from mpi4py import MPI
from reproducible_cost import print_medians, timed  # (benchmarks/reproducible_cost.py)

import mpiallreduce.torch as mt
from mpiallreduce.tools.train_bench import global_batch, make_model

COMM = MPI.COMM_WORLD
CONTENDERS = {
    "copied back": dict(gradient_as_bucket_view=False),
    "views": {},
    "views, mpi": dict(algorithm="mpi"),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["mlp", "transformer"], default="transformer")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    width, depth = (128, 8) if args.model == "transformer" else (2048, 3)
    args.width, args.depth, args.inputs, args.outputs, args.seed = width, depth, 256, 16, 0
    torch.set_num_threads(1)
    rank, size, batch = COMM.Get_rank(), COMM.Get_size(), 32
    runs = {}
    for name, options in CONTENDERS.items():
        model = make_model(torch, args)
        optimizer = mt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            comm=COMM,
            overlap=False,
            named_parameters=model.named_parameters(),
            **options,
        )
        runs[name] = (model, optimizer, [])
    for step in range(args.steps + 3):
        x, y = global_batch(torch, args.seed, step, batch * size, args.inputs, args.outputs)
        x, y = x[rank * batch : (rank + 1) * batch], y[rank * batch : (rank + 1) * batch]
        for model, optimizer, times in runs.values():
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            took = timed(optimizer.synchronize)
            with optimizer.skip_synchronize():
                optimizer.step()
            if step >= 3:  # (the first steps plan, and make the buffers)
                times.append(took)
    params = {
        name: [p.detach().numpy() for p in model.parameters()]
        for name, (model, _, _) in runs.items()
    }
    first = params["copied back"]
    diff = max(
        float(np.max(np.abs(a - b)))
        for other in params.values()
        for a, b in zip(first, other, strict=True)
    )
    if rank == 0:
        ms = print_medians(
            f"# {args.model}, {size} ranks; synchronize() after backward, median of {args.steps} "
            "interleaved steps, slowest rank, ms",
            {name: times for name, (_, _, times) in runs.items()},
        )
        print(
            f"views / copied back: {ms['views'] / ms['copied back']:.2f}x; views / views, mpi: "
            f"{ms['views'] / ms['views, mpi']:.2f}x; parameters' largest difference: {diff:g}"
        )


if __name__ == "__main__":
    main()
