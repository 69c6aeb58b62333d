"""Horovod's SyncBatchNorm: batch normalization whose statistics are those of every rank's batch.

training:  each rank's per-channel sum, sum of squares and count ──allreduce (sum,
           differentiable: its gradient is the sum of the ranks' gradients)──> the mean and
           variance of the whole batch; the running statistics updated with them, as
           torch.nn.BatchNorm does on one process (the variance unbiased by the whole count)
eval:      the running statistics, as torch's
"""

import torch
import torch.nn.functional as F  # noqa: N812

from .horovod_allreduce import differentiable_allreduce
from .horovod_collectives import Sum
from .torch_tensors import default_comm

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """``hvd.SyncBatchNorm(num_features, eps=1e-5, momentum=0.1, affine=True,
    track_running_stats=True)``: a drop-in for torch.nn.BatchNorm1d/2d/3d across the ranks."""

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)  # fmt: skip
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        local = torch.cat(
            [
                input.sum(dims),
                (input * input).sum(dims),
                torch.tensor([input.numel() // channels], dtype=input.dtype, device=input.device),
            ]
        )
        total = differentiable_allreduce(
            local, Sum, 1.0, 1.0, "sync_batch_norm", default_comm()
        ).to(local.dtype)  # (hvd.allreduce's, as before: op Sum, no scaling, the default ranks)
        count = total[-1]
        mean = total[:channels] / count
        var = total[channels : 2 * channels] / count - mean * mean
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = (
                    1.0 / float(self.num_batches_tracked)
                    if self.momentum is None
                    else self.momentum
                )
                unbiased = var * count / torch.clamp(count - 1, min=1)
                self.running_mean.mul_(1 - momentum).add_(momentum * mean)
                self.running_var.mul_(1 - momentum).add_(momentum * unbiased)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (input - mean.reshape(shape)) / torch.sqrt(var.reshape(shape) + self.eps)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out
