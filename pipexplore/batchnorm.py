"""DeferredBatchNorm: running statistics per mini-batch, not per micro-batch."""
from __future__ import annotations

from typing import Optional, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from pipexplore.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm"]

T = TypeVar("T", bound=nn.Module)


class DeferredBatchNorm(_BatchNorm):
    """Batch normalization that normalizes each micro-batch but updates the running statistics
    once per mini-batch (``chunks`` micro-batches), from the sums over all of them.

    A recomputation (under checkpointing) does not count twice. The running variance is the
    unbiased estimate, as :class:`torch.nn.BatchNorm2d` keeps it.
    """

    sum: Tensor
    sum_squares: Tensor

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, chunks: int = 1) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.register_buffer("sum", torch.zeros_like(cast(Tensor, self.running_mean)))
        self.register_buffer("sum_squares", torch.zeros_like(cast(Tensor, self.running_var)))
        self.counter = 0
        self.tracked = 0
        self.chunks = chunks

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _track(self, input: Tensor) -> bool:
        dim = [0, *range(2, input.dim())]
        with torch.no_grad():
            self.sum += input.sum(dim)
            self.sum_squares += (input ** 2).sum(dim)
        self.counter += input.numel() // input.size(1)
        self.tracked += 1
        return self.tracked == self.chunks

    def _commit(self) -> None:
        assert self.num_batches_tracked is not None
        self.num_batches_tracked += 1
        if self.momentum is None:
            factor = 1.0 / float(self.num_batches_tracked)
        else:
            factor = self.momentum
        mean = self.sum / self.counter
        var = (self.sum_squares / self.counter - mean ** 2) * (self.counter / max(self.counter - 1, 1))
        running_mean, running_var = cast(Tensor, self.running_mean), cast(Tensor, self.running_var)
        running_mean.mul_(1 - factor).add_(mean * factor)
        running_var.mul_(1 - factor).add_(var * factor)
        self.sum.zero_()
        self.sum_squares.zero_()
        self.counter = 0
        self.tracked = 0

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                training=False, momentum=0.0, eps=self.eps)
        if not is_recomputing() and self._track(input):
            self._commit()
        return F.batch_norm(input, None, None, self.weight, self.bias, training=True, momentum=0.0, eps=self.eps)

    @classmethod
    def convert_deferred_batch_norm(cls, module: T, chunks: int = 1) -> T:
        """Replace every tracking ``_BatchNorm`` in ``module`` (parameters and buffers shared)."""
        if isinstance(module, DeferredBatchNorm) and module.chunks == chunks:
            return module
        output: nn.Module = module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            output = DeferredBatchNorm(module.num_features, module.eps, module.momentum, module.affine, chunks)
            if module.affine:
                output.register_parameter("weight", module.weight)
                output.register_parameter("bias", module.bias)
            output.register_buffer("running_mean", module.running_mean)
            output.register_buffer("running_var", module.running_var)
            output.register_buffer("num_batches_tracked", module.num_batches_tracked)
            output.train(module.training)
        for name, child in module.named_children():
            output.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return cast(T, output)
