"""What every executor shares: the job, the measured result and its metrics, the default loss."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import pandas as pd
import torch
from torch import nn

from pipexplore import timeline as tl
from pipexplore.host import sharing_cores, stage_threads
from pipexplore.microbatch import TensorOrTensors, batch_size
from pipexplore.plan import Plan

__all__ = ["LossFn", "OptimizerFactory", "StepJob", "RunResult", "result", "measure", "synthetic_loss",
           "make_optimizer", "all_finite"]

LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def synthetic_loss(output: Any, target: Any = None) -> torch.Tensor:
    """Mean of the squared outputs: a loss for timing when the model has no real one."""
    outputs = output if isinstance(output, tuple) else (output,)
    return sum(o.float().pow(2).mean() for o in outputs if torch.is_tensor(o) and o.is_floating_point())  # type: ignore[return-value]


def make_optimizer(factory: Optional[OptimizerFactory], parameters: Any) -> torch.optim.Optimizer:
    """The user's optimizer on ``parameters``, or SGD (lr 0.01)."""
    return (factory or (lambda params: torch.optim.SGD(params, lr=0.01)))(parameters)


@dataclass
class StepJob:
    """One measured step to run: the model (never changed: executors train a copy), one
    mini-batch, the plan, and how to train."""

    model: nn.Module
    sample: TensorOrTensors
    plan: Plan
    target: Any = None
    loss_fn: Optional[LossFn] = None
    optimizer: Optional[OptimizerFactory] = None
    warmup: int = 1
    run: Any = 0
    repeats: int = 3
    timeout: Optional[float] = None


@dataclass
class RunResult:
    """A measured step: its timeline, loss and metrics (one row of the runs table)."""

    plan: Plan
    timeline: pd.DataFrame
    loss: float
    predicted: pd.DataFrame
    metrics: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {
            "splits": list(self.plan.splits), "chunks": self.plan.chunks, "checkpoint": self.plan.checkpoint,
            "schedule": self.plan.schedule, "executor": self.plan.executor,
            "devices": ",".join(self.plan.devices[: self.plan.num_devices]),
            **self.metrics,
        }


def measure(step: Callable[[], float], warmup: int, run: Any, repeats: int = 3,
            devices: Sequence[Any] = ()) -> tuple[pd.DataFrame, float]:
    """Run ``warmup`` steps, then ``repeats`` more under :func:`pipexplore.record`, with the CPU
    stages on ``devices`` (one worker each) sharing the host's cores (:mod:`pipexplore.host`): the timeline of
    the step whose time is the median (one step alone is at the mercy of the machine's noise), and
    the loss of the first recorded step (so that two runs of the same plan report the same loss,
    whichever step was the median). A non-finite loss in any recorded step is the loss reported."""
    measured, losses = [], []
    with sharing_cores(stage_threads(devices)):
        for _ in range(warmup):
            step()
        for _ in range(max(1, repeats)):
            with tl.record(run=run) as rec:
                losses.append(step())
            measured.append((tl.step_time(rec.timeline), rec.timeline))
    measured.sort(key=lambda item: item[0])
    _, timeline = measured[len(measured) // 2]
    bad = [loss for loss in losses if not math.isfinite(loss)]
    return timeline, bad[0] if bad else losses[0]


def all_finite(parameters: Any) -> bool:
    """Whether every parameter and every gradient it holds is finite (no NaN, no inf).

    Example::

        all_finite(model.parameters())     # False once a NaN loss reached the weights
    """
    with torch.no_grad():
        return all(bool(torch.isfinite(t).all()) for p in parameters
                   for t in (p, p.grad) if t is not None and t.is_floating_point())


def result(plan: Plan, measured: pd.DataFrame, loss: float, sample: TensorOrTensors, used: set[str],
           parameters: Any = None) -> RunResult:
    """A measured step with its metrics and the plan's prediction beside it; ``finite`` says whether
    the loss (and, given ``parameters``, their values and gradients) are finite."""
    predicted = plan.predicted
    step_seconds = tl.step_time(measured)
    predicted_seconds = tl.step_time(predicted)
    peak = measured.attrs.get("peak_memory", {})
    metrics = {
        "step_time": step_seconds,
        "bubble": tl.bubble_fraction(measured),
        "throughput": tl.throughput(measured, batch_size(sample)),
        "peak_memory": max((v for d, v in peak.items() if d in used), default=math.nan),
        "predicted_step_time": predicted_seconds,
        "prediction_error": predicted_seconds / step_seconds - 1 if step_seconds > 0 else math.nan,
        "loss": loss,
        "finite": math.isfinite(loss) and (parameters is None or all_finite(parameters)),
    }
    return RunResult(plan, measured, loss, predicted, metrics)
