"""What every executor shares: the job (its training parts resolved once: :class:`pipexplore.training.Training`),
the measured result and its metrics."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

import pandas as pd
import torch
from torch import nn

from pipexplore import timeline as tl
from pipexplore.cancel import check_cancelled
from pipexplore.host import StealMeter, sharing_cores, stage_threads
from pipexplore.executors.tied import own_parameters
from pipexplore.samples import Sample, batch_size
from pipexplore.plan import Plan
from pipexplore.predict.basis import prediction_basis
from pipexplore.training import OptimizerFactory, Training

__all__ = ["StepJob", "RunResult", "Measured", "result", "measure", "train_and_measure", "StageOptimizers",
           "all_finite"]


class StageOptimizers:
    """One optimizer per stage (``factory`` applied to each stage's parameters), stepped in stage
    order, each step recorded as the stage's ``optimizer`` event (micro-batch -1) on its device
    with the recorder of the enclosing :func:`pipexplore.record` (CUDA events on a GPU, the host
    clock on the CPU): the step a training loop times ends at the last update.

    For optimizers that treat each parameter on its own (SGD, momentum, Adam, AdamW, …) this is
    the same update as one optimizer over all the parameters. An optimizer that couples parameters
    across stages (a global gradient-norm clip inside it, LAMB-style trust ratios over groups
    spanning stages) is stepped per stage, as pipeline engines step theirs (each stage, or rank,
    owns its parameters' optimizer). A stage without parameters gets no optimizer, but its (empty)
    step is still recorded; a parameter shared by several stages is stepped by the first.

    Example::

        optimizers = StageOptimizers(lambda p: torch.optim.Adam(p), executor.stage_parameters(),
                                     executor.stage_devices)
        optimizers.zero_grad(); executor.step(x); optimizers.step()
    """

    def __init__(self, factory: OptimizerFactory, stage_parameters: Sequence[Sequence[torch.nn.Parameter]],
                 devices: Sequence[Any]) -> None:
        if len(stage_parameters) != len(devices):
            raise ValueError(f"{len(stage_parameters)} stages' parameters, but {len(devices)} devices")
        owned = own_parameters(list(stage_parameters))
        self.devices = [torch.device(d) for d in devices]
        self.optimizers = [factory(params) if params else None for params in owned]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """Step every stage's optimizer in stage order, each recorded as its stage's ``optimizer`` event."""
        recorder = tl.active_recorder()
        for stage, (optimizer, device) in enumerate(zip(self.optimizers, self.devices)):
            start = recorder.mark(device) if recorder is not None else None
            if optimizer is not None:
                optimizer.step()
            if recorder is not None and start is not None:  # (start is marked where there is a recorder)
                recorder.add(stage, device, tl.OPTIMIZER_MICROBATCH, "optimizer", start, recorder.mark(device))


@dataclass
class StepJob:
    """One measured step to run: the model (never changed: executors train a copy), one
    mini-batch, the plan, and what it trains on (the loss, optimizer and target, resolved)."""

    model: nn.Module
    sample: Sample
    plan: Plan
    training: Training = field(default_factory=Training.of)
    warmup: int = 1
    run: Any = 0
    repeats: int = 3
    timeout: Optional[float] = None


@dataclass
class RunResult:
    """A measured step: its timeline, loss and metrics (one row of the runs table).

    ``loss`` is the first step's (the first warm-up step's: at the plan's weights, before any
    optimizer step, so it equals the unsplit model's loss on the same batch); ``measured_losses``
    are the losses of the measured steps, each after as many optimizer steps as came before it.
    """

    plan: Plan
    timeline: pd.DataFrame
    loss: float
    predicted: pd.DataFrame
    metrics: dict[str, Any] = field(default_factory=dict)
    measured_losses: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {
            "splits": list(self.plan.splits), "chunks": self.plan.chunks, "checkpoint": self.plan.checkpoint,
            "schedule": self.plan.schedule, "executor": self.plan.executor,
            "devices": ",".join(self.plan.devices[: self.plan.num_devices]),
            "mesh": f"{self.plan.mesh.describe()} ({self.plan.data_parallel})" if self.plan.mesh is not None else "",
            **self.metrics,
        }


class Measured(NamedTuple):
    """What :func:`measure` gives: the median step's timeline, the first step's loss, the measured steps' losses."""

    timeline: pd.DataFrame
    loss: float
    measured_losses: list[float]


def measure(step: Callable[[], float], warmup: int, run: Any, repeats: int = 3,
            devices: Sequence[Any] = ()) -> Measured:
    """Run ``warmup`` steps, then ``repeats`` more under :func:`pipexplore.record`, with the CPU
    stages on ``devices`` (one worker each) sharing the host's cores (:mod:`pipexplore.host`).

    Gives the timeline of the measured step whose time is the median (one step alone is at the
    mercy of the machine's noise), the loss of the first step (warm-up or not: at the weights the
    run started from, so that it equals the unsplit model's loss, and two runs of the same plan
    report the same loss) and the measured steps' losses. The timeline's ``attrs["host_steal"]``:
    the share of the host's CPU time the hypervisor gave other guests while the steps were measured
    (:class:`~pipexplore.host.StealMeter`). A cancelled run
    (:func:`pipexplore.cancel.check_cancelled`) stops between steps with
    :class:`~pipexplore.cancel.Cancelled`, and is never returned."""
    measured, losses = [], []
    with sharing_cores(stage_threads(devices)):
        for _ in range(warmup):
            check_cancelled()
            losses.append(step())
        meter = StealMeter()
        for _ in range(max(1, repeats)):
            check_cancelled()
            with tl.record(run=run) as rec:
                losses.append(step())
            measured.append((tl.step_time(rec.timeline), rec.timeline))
        check_cancelled()
    measured_losses = losses[len(losses) - len(measured):]
    measured.sort(key=lambda item: item[0])
    _, timeline = measured[len(measured) // 2]
    timeline.attrs["host_steal"] = meter.share()
    return Measured(timeline, losses[0], measured_losses)


def train_and_measure(executor: Any, plan: Plan, sample: Any, training: Training, *, warmup: int = 1, run: Any = 0,
                      repeats: int = 3, after_backward: Optional[Callable[[], None]] = None) -> RunResult:
    """Train an in-process executor's stages (its ``step``, ``parameters``, ``stage_parameters``,
    ``stage_devices`` and ``worker_devices``; its loss is ``training.loss_fn``) on ``sample`` and
    ``training.target``: ``warmup`` steps, then ``repeats`` measured ones (:func:`measure`: the
    median step's timeline, the first step's loss), each ending with one optimizer step per stage
    (``training.optimizer(stage parameters)``: a :class:`StageOptimizers`, stepped in stage order
    once the workers are done, each recorded as the stage's ``optimizer`` event);
    ``after_backward()`` runs before them.

    Example::

        result = train_and_measure(ScheduleExecutor(model, [2, 2], chunks=4), plan, x, Training.of(), repeats=3)
    """
    opt = StageOptimizers(training.optimizer, executor.stage_parameters(), executor.stage_devices)
    target = training.target

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = float(executor.step(sample, target).loss)
        if after_backward is not None:
            after_backward()
        opt.step()
        return loss

    timeline, loss, measured_losses = measure(step, warmup, run, repeats, executor.worker_devices)
    return result(plan, timeline, loss, sample, {str(d) for d in executor.stage_devices}, executor.parameters(),
                  measured_losses)


def all_finite(parameters: Any) -> bool:
    """Whether every parameter and every gradient it holds is finite (no NaN, no inf).

    Example::

        all_finite(model.parameters())     # False once a NaN loss reached the weights
    """
    with torch.no_grad():
        return all(bool(torch.isfinite(t).all()) for p in parameters
                   for t in (p, p.grad) if t is not None and t.is_floating_point())


def result(plan: Plan, measured: pd.DataFrame, loss: float, sample: Sample, used: set[str],
           parameters: Any = None, measured_losses: Sequence[float] = (), executor: Optional[str] = None) -> RunResult:
    """A measured step with its metrics and the plan's prediction beside it: ``loss`` the first
    step's, ``measured_losses`` the measured steps' (``metrics['measured_losses']`` too); ``finite``
    says whether every loss (and, given ``parameters``, their values and gradients) is finite.
    ``executor``: what ran it where not the plan's own (``'torchrun'``), for the benchmarks' error
    said beside the prediction (:func:`~pipexplore.predict.basis.prediction_basis`)."""
    measured_losses = [float(x) for x in measured_losses]
    predicted = plan.predicted
    basis = prediction_basis(plan, executor)
    step_seconds = tl.step_time(measured)
    predicted_seconds = tl.step_time(predicted)
    peak = measured.attrs.get("peak_memory", {})
    metrics = {
        "step_time": step_seconds,
        "bubble": tl.bubble_fraction(measured),
        "throughput": tl.throughput(measured, batch_size(sample)),
        "peak_bytes": max((v for d, v in peak.items() if d in used), default=math.nan),
        "predicted_step_time": predicted_seconds,
        "prediction_error": predicted_seconds / step_seconds - 1 if step_seconds > 0 else math.nan,
        # the host's CPU time the hypervisor gave other guests while the steps were measured
        "host_steal": measured.attrs.get("host_steal", math.nan),
        # what the prediction rested on, and the error the benchmarks measured for that kind
        "prediction_basis": basis.kind,
        "benchmark_error": math.nan if basis.median is None else basis.median,
        "loss": loss,
        "measured_losses": measured_losses,
        "finite": all(map(math.isfinite, [loss, *measured_losses])) and (parameters is None or all_finite(parameters)),
    }
    return RunResult(plan, measured, loss, predicted, metrics, measured_losses)
