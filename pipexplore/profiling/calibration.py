"""The layers of a profile scaled to the whole model: a layer timed alone runs with its weights
and inputs hot in cache, so the per-layer times add up to less than a pass through the whole
model, which :func:`calibrate_to_whole_model` times and scales them to — its backward as a
step's micro-batches after the first run it (accumulating into the gradients), and what a step's
first pays beyond that (allocating them) as ``fresh_grads``, once a step."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import pandas as pd
import torch
from torch import nn

from pipexplore.samples import TensorOrTensors, tensors_in
from pipexplore.profiling.timing import Timer as _Timer
from pipexplore.profiling.timing import detach as _detach
from pipexplore.skip.tracker import SkipTracker, use_skip_tracker

__all__ = ["whole_model_seconds", "calibrate_to_whole_model"]


def whole_model_seconds(module: nn.Sequential, value: TensorOrTensors, target: torch.device,
                         repeats: int, flush: Optional[Callable[[], None]] = None) -> tuple[float, float, float]:
    """Median forward and backward seconds of the whole model, run as one chain (after one
    warm-up): ``(forward, backward with fresh gradients, backward accumulating into them)``.

    A step allocates its parameters' gradients once, in each stage's first backward (after
    ``zero_grad(set_to_none=True)``), and its later micro-batches accumulate into them: a round
    runs one forward and two backwards through its graph (kept for the second), the first after
    the gradients are set to None, the second adding to them. On
    a CPU the fresh ones are fresh pages (12 linear layers of 512 at 16 rows: 1.2 ms a layer so,
    0.55 ms accumulating), which a layer timed alone hides: its freed gradient is reused at once.
    ``flush``: called before each timed pass (a :class:`pipexplore.profiling.timing.CacheFlush`)."""
    forward, fresh, accumulating = _Timer(target, flush), _Timer(target, flush), _Timer(target, flush)
    module.zero_grad(set_to_none=True)
    for k in range(repeats + 1):
        with use_skip_tracker(SkipTracker()), torch.enable_grad():
            output = forward(lambda: module(_detach(value)))
            outs = [t for t in tensors_in(output) if t.requires_grad]
            if outs:  # one forward, its graph kept for a second backward that accumulates
                grads = [torch.ones_like(t) for t in outs]
                fresh(lambda: torch.autograd.backward(outs, grads, retain_graph=True))
                try:
                    accumulating(lambda: torch.autograd.backward(outs, grads))
                except RuntimeError:  # a layer whose graph cannot be walked twice: a forward of its own
                    again = [t for t in tensors_in(module(_detach(value))) if t.requires_grad]
                    accumulating(lambda: torch.autograd.backward(again, [torch.ones_like(t) for t in again]))
        module.zero_grad(set_to_none=True)
        if k == 0:
            for timer in (forward, fresh, accumulating):
                timer.wall.clear()
    return forward.median, fresh.median, accumulating.median


def calibrate_to_whole_model(table: pd.DataFrame, module: nn.Sequential, value: TensorOrTensors,
                             target: torch.device, repeats: int, flush: Optional[Callable[[], None]] = None) -> None:
    """Scale ``table``'s ``forward`` and ``backward`` (one row per layer of ``module``, timed on
    ``value``) so that the layers add up to the whole model's forward and accumulating backward
    (:func:`whole_model_seconds`), and set ``fresh_grads``: what allocating the gradients afresh
    adds to the whole backward (never below 0), shared by the layers' gradient bytes."""
    whole_forward, whole_fresh, whole_backward = whole_model_seconds(module, value, target, repeats, flush)
    for column, whole in (("forward", whole_forward), ("backward", whole_backward)):
        layers_total = float(table[column].sum())
        if layers_total > 0 and whole > 0:
            table[column] = table[column] * (whole / layers_total)
    grads = np.array([sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
                      for layer in module], dtype=float)
    if grads.sum() > 0:
        table["fresh_grads"] = max(0.0, whole_fresh - whole_backward) * grads / grads.sum()
