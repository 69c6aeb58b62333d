"""Horovod's PyTorch MNIST example (examples/pytorch/pytorch_mnist.py), as its users write it, on
synthetic 28x28 data, with one line changed: ``import mpiallreduce.torch as hvd``.

    mpiallreduce launch -n 2 -- python tests/scripts/horovod_mnist.py [--fp16-allreduce]
        [--batches-per-allreduce 2]

At the end it checks what Horovod promises: every rank holds the same parameters, and the metrics
averaged by hvd.allreduce are the mean of every rank's (from allgather_object). It prints
"horovod-style mnist: ok" and the final test loss.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import mpiallreduce.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--test-batch-size", type=int, default=64)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--batches-per-allreduce", type=int, default=1)
parser.add_argument("--samples", type=int, default=512)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def synthetic_mnist(samples, seed):
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(samples, 1, 28, 28, generator=generator)
    labels = (images.mean(dim=(1, 2, 3)) * 40).long() % 10  # something learnable
    return torch.utils.data.TensorDataset(images, labels)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(
        args.seed + hvd.rank()
    )  # different on each rank: broadcast_parameters fixes it
    torch.set_num_threads(1)

    train_dataset = synthetic_mnist(args.samples, args.seed)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler
    )
    test_dataset = synthetic_mnist(args.samples // 4, args.seed + 1)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler
    )

    model = Net()
    lr_scaler = args.batches_per_allreduce * hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Average,
        backward_passes_per_step=args.batches_per_allreduce,
    )
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            if batch_idx % args.batches_per_allreduce == 0:
                optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            (loss / args.batches_per_allreduce).backward()
            if (batch_idx + 1) % args.batches_per_allreduce == 0:
                optimizer.step()
        scheduler.step()
        epoch = hvd.broadcast_object(epoch, root_rank=0)

    model.eval()
    test_loss, test_accuracy = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            test_accuracy += (
                output.max(1, keepdim=True)[1]
                .eq(target.view_as(output.max(1, keepdim=True)[1]))
                .sum()
                .item()
            )
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    every_rank = hvd.allgather_object(test_loss)
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")

    # what Horovod promises: identical replicas, and metrics that are the ranks' mean
    states = hvd.allgather_object(
        {name: p.detach().clone() for name, p in model.state_dict().items()}
    )
    for name, tensor in states[0].items():
        assert all(torch.equal(tensor, state[name]) for state in states), (
            f"{name} differs between the ranks"
        )
    assert abs(test_loss - sum(every_rank) / hvd.size()) < 1e-6 * max(1.0, abs(test_loss)), (
        test_loss,
        every_rank,
    )
    if hvd.rank() == 0:
        print(
            f"horovod-style mnist: ok, {hvd.size()} ranks, test loss {test_loss:.4f}, "
            f"accuracy {100 * test_accuracy:.1f}%"
        )


if __name__ == "__main__":
    main()
