"""Horovod's allreduce of one tensor as autograd sees it: the gradient is the same reduction of the
gradients that reach the result. What ``hvd.allreduce`` (training.horovod) runs once it has chosen
the op, the communicator and the compression, and what ``hvd.SyncBatchNorm``
(training.horovod_sync_batch_norm) sums its statistics with."""

import torch

from .horovod_collectives import allreduce_op, run

__all__ = ["Allreduce", "differentiable_allreduce"]


class Allreduce(torch.autograd.Function):
    """allreduce as autograd sees it (Horovod's): the gradient is the same reduction of the
    gradients that reach the result."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, comm):
        ctx.options = (op, prescale, postscale, comm)
        return run(allreduce_op(tensor, op, prescale, postscale), comm=comm)

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, comm = ctx.options
        return run(allreduce_op(grad, op, prescale, postscale), comm=comm), None, None, None, None


def differentiable_allreduce(tensor, op, prescale, postscale, name, comm):
    """``tensor`` reduced over ``comm``'s ranks, a new tensor: through autograd (Allreduce) where a
    gradient will be asked of it, else as the negotiated op named ``name``."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return Allreduce.apply(tensor, op, prescale, postscale, comm)
    return run(allreduce_op(tensor, op, prescale, postscale), name, comm)
