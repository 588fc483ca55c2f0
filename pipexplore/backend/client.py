"""BackendPipeline: chain stage backends into an asynchronous pipeline of micro-batches."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch

from pipexplore import validate
from pipexplore.backend.expert import ExpertBackend
from pipexplore.cancel import check_cancelled
from pipexplore.training import LossFn, Training

__all__ = ["BackendPipeline"]


class BackendPipeline:
    """Micro-batches flow forward through each stage's ``forward_pool`` and their gradients back
    through the ``backward_pool``s; every backend steps its own optimizer on backward (as in
    hivemind). Micro-batches run concurrently, one client thread each, so their tasks meet in
    the pools and are batched together.

    Example::

        pipeline = BackendPipeline([stage0, stage1])
        with Runtime({"s0": stage0, "s1": stage1}):
            losses = pipeline.step(x, target, loss_fn, chunks=4)
    """

    def __init__(self, backends: Sequence[ExpertBackend]) -> None:
        if not backends:
            raise ValueError("a pipeline needs at least one backend")
        self.backends = list(backends)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Inference through every stage (no gradients, no updates)."""
        for backend in self.backends:
            (x,) = backend.forward_pool.submit_task(x).result()
        return x

    def _train_one(self, x: torch.Tensor, target: Any, loss_fn: LossFn) -> float:
        inputs = [x]
        for backend in self.backends:
            (x,) = backend.forward_pool.submit_task(x).result()
            inputs.append(x)
        check_cancelled()
        output = inputs[-1].detach().requires_grad_()
        loss = validate.loss_value(loss_fn(output, target))
        loss.backward()
        grad = output.grad
        assert grad is not None
        for k in reversed(range(len(self.backends))):
            (grad,) = self.backends[k].backward_pool.submit_task(inputs[k], grad).result()
        return float(loss.detach())

    def step(self, x: torch.Tensor, target: Any = None, loss_fn: Optional[LossFn] = None,
             chunks: int = 1) -> list[float]:
        """Train on ``x`` split into ``chunks`` micro-batches; returns each micro-batch's loss
        (``loss_fn`` default: :func:`pipexplore.training.synthetic_loss`; each backend steps its own
        optimizer)."""
        chunks = validate.chunks(chunks, batch=int(x.size(0)))
        loss_fn = Training.of(loss_fn, target=target, rows=int(x.size(0))).loss_fn
        micro_x = x.chunk(chunks)
        micro_t = target.chunk(chunks) if torch.is_tensor(target) else [target] * len(micro_x)
        with ThreadPoolExecutor(max_workers=len(micro_x), thread_name_prefix="pipexplore-client") as pool:
            futures = [pool.submit(self._train_one, xi, ti, loss_fn) for xi, ti in zip(micro_x, micro_t)]
            return [f.result() for f in futures]
