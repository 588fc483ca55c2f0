"""What an optimizer step costs per layer: the ``optimizer`` column of a layer table.

A training step ends with the optimizer's pass over parameters, gradients and states; each stage
steps its own (:class:`pipexplore.executors.base.StageOptimizers`), so a stage's update costs the
sum of its layers'. :func:`optimizer_seconds` times the user's optimizer (default
:data:`pipexplore.training.default_optimizer`, as the executors make it) on copies of each layer's
parameters with gradients set, so the model is never changed: one untimed step (a first step
allocates the states: Adam's moments, SGD's momentum), then a few timed ones, the median kept.
Layers whose parameters have the same shapes, dtypes and devices are timed once (a model's
repeated blocks). The first ``torch.optim`` optimizer of a process imports ``torch._dynamo``
(~1 s, see :mod:`pipexplore.executors.probe`): it is made before anything is timed, and paid once
per process.

Example::

    table["optimizer"] = optimizer_seconds(list(model), lambda p: torch.optim.Adam(p, lr=1e-3))
"""
from __future__ import annotations

import statistics
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from pipexplore.profiling.timing import Timer
from pipexplore.training import OptimizerFactory, Training

__all__ = ["optimizer_seconds"]


def _key(params: Sequence[nn.Parameter]) -> tuple:
    return tuple((tuple(p.shape), p.dtype, str(p.device)) for p in params)


def optimizer_seconds(modules: Sequence[nn.Module], optimizer: Optional[OptimizerFactory] = None,
                      *, repeats: int = 3, same_work_once: bool = True) -> np.ndarray:
    """Seconds of one ``optimizer(parameters).step()`` over each module's trainable parameters
    (0 for a module without any), timed on copies of them with gradients set.

    ``optimizer``: the factory a run uses (default :data:`pipexplore.training.default_optimizer`,
    resolved by :meth:`pipexplore.training.Training.of`); ``repeats`` timed
    steps after an untimed one, the median kept; ``same_work_once``: modules whose parameters have
    the same shapes, dtypes and devices share one timing.
    """
    factory = Training.of(optimizer=optimizer).optimizer
    known: dict[tuple, float] = {}
    out = np.zeros(len(modules))
    for k, module in enumerate(modules):
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            continue
        key = _key(params)
        if same_work_once and key in known:
            out[k] = known[key]
            continue
        out[k] = known[key] = _time_steps(params, factory, max(1, repeats))
    return out


def _time_steps(params: Sequence[nn.Parameter], factory: OptimizerFactory, repeats: int) -> float:
    """The median seconds of ``repeats`` steps (after an untimed one) on copies of ``params``."""
    with torch.no_grad():
        copies = [nn.Parameter(p.detach().clone()) for p in params]
        for c in copies:
            # A small constant gradient: no draw from the random generator (a profile must not move
            # the user's random stream), and finite updates whatever the optimizer.
            c.grad = torch.full_like(c, 1e-3)
    optimizer = factory(copies)
    timer = Timer(copies[0].device)
    optimizer.step()  # untimed: the states are allocated on the first step
    for _ in range(repeats):
        timer(optimizer.step)
    return float(statistics.median(timer.wall))
