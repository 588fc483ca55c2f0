"""Run one real training step of a Plan and measure it."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pandas as pd
import torch
from torch import nn

from pipexplore import timeline as tl
from pipexplore.gpipe import GPipe
from pipexplore.microbatch import TensorOrTensors, batch_size, to_device
from pipexplore.plan import Plan

__all__ = ["RunResult", "run_step", "synthetic_loss"]

LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def synthetic_loss(output: Any, target: Any = None) -> torch.Tensor:
    """Mean of the squared outputs: a loss for timing when the model has no real one."""
    outputs = output if isinstance(output, tuple) else (output,)
    return sum(o.float().pow(2).mean() for o in outputs if torch.is_tensor(o) and o.is_floating_point())  # type: ignore[return-value]


def _measure(step: Callable[[], float], warmup: int, run: Any, repeats: int = 3) -> tuple[pd.DataFrame, float]:
    """Run ``warmup`` steps, then ``repeats`` more under :func:`pipexplore.record`: the timeline and
    loss of the step whose time is the median (one step alone is at the mercy of the machine's noise)."""
    for _ in range(warmup):
        step()
    measured = []
    for _ in range(max(1, repeats)):
        with tl.record(run=run) as rec:
            loss = step()
        measured.append((tl.step_time(rec.timeline), rec.timeline, loss))
    measured.sort(key=lambda item: item[0])
    _, timeline, loss = measured[len(measured) // 2]
    return timeline, loss


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


def run_step(model: nn.Sequential, sample: TensorOrTensors, plan: Plan, *, target: Any = None,
             loss_fn: Optional[LossFn] = None, optimizer: Optional[OptimizerFactory] = None,
             warmup: int = 1, run: Any = 0) -> RunResult:
    """Train a copy of ``model`` for ``warmup`` + 1 steps as ``plan`` says; measure the last.

    ``plan.executor`` picks how: ``threads`` (the schedule executor, any schedule), ``autograd``
    (the ``GPipe`` module) or ``processes`` (one process per stage, ``torch.distributed.pipelining``);
    schedule ``async-backends`` serves the stages as expert backends. The user's model is never
    changed: the step runs on a deep copy placed on the plan's devices. ``loss_fn(output, target)`` defines the loss (default: :func:`synthetic_loss`);
    ``optimizer(parameters)`` makes the optimizer (default: SGD, lr=0.01).
    """
    if not isinstance(model, nn.Sequential):
        if plan.executor != "processes":
            raise ValueError(f"{type(model).__name__} is not an nn.Sequential: it runs split by torch's tracer in "
                             "processes; choose executor='processes'")
        from pipexplore.distributed import run_processes
        from pipexplore.trace import split

        names = [str(n) for n in plan.layer_table["name"]]
        batch = batch_size(sample)
        # Trace here first: a model that cannot be traced fails fast and clearly, before any process starts.
        split(copy.deepcopy(model), (sample[: batch // plan.chunks],), [names[s] for s in plan.splits])
        return run_processes(model, sample, plan, target=target, loss_fn=loss_fn, optimizer=optimizer, run=run)
    if plan.schedule == "async-backends":
        return _run_backends(model, sample, plan, target=target, loss_fn=loss_fn, optimizer=optimizer,
                             warmup=warmup, run=run)
    if plan.executor == "threads":
        return _run_schedule(model, sample, plan, target=target, loss_fn=loss_fn, optimizer=optimizer,
                             warmup=warmup, run=run)
    if plan.executor == "processes":
        from pipexplore.distributed import run_processes

        return run_processes(model, sample, plan, target=target, loss_fn=loss_fn, run=run)
    pipe = GPipe(copy.deepcopy(model), plan.balance, devices=list(plan.devices[: plan.num_stages]),
                 chunks=plan.chunks, checkpoint=plan.checkpoint)
    pipe.train()
    loss_fn = loss_fn or synthetic_loss
    opt = (optimizer or (lambda params: torch.optim.SGD(params, lr=0.01)))(pipe.parameters())
    x = to_device(sample, pipe.devices[0])
    y = to_device(target, pipe.devices[-1])

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(pipe(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    timeline, loss = _measure(step, warmup, run)
    return _result(plan, timeline, loss, sample, {str(d) for d in pipe.devices})


def _result(plan: Plan, measured: pd.DataFrame, loss: float, sample: TensorOrTensors, used: set[str]) -> RunResult:
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
    }
    return RunResult(plan, measured, loss, predicted, metrics)


def _run_schedule(model: nn.Sequential, sample: TensorOrTensors, plan: Plan, *, target: Any,
                  loss_fn: Optional[LossFn], optimizer: Optional[OptimizerFactory], warmup: int, run: Any) -> RunResult:
    """One step through the schedule executor: the plan's schedule, a worker per stage."""
    from pipexplore.schedule import ScheduleExecutor

    executor = ScheduleExecutor(copy.deepcopy(model), plan.balance, devices=list(plan.devices[: plan.num_devices]),
                                chunks=plan.chunks, schedule=plan.schedule, checkpoint=plan.checkpoint,
                                loss_fn=loss_fn or synthetic_loss)
    opt = (optimizer or (lambda params: torch.optim.SGD(params, lr=0.01)))(executor.parameters())

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = executor.step(sample, target).loss
        opt.step()
        return loss

    timeline, loss = _measure(step, warmup, run)
    return _result(plan, timeline, loss, sample, {str(d) for d in executor.stage_devices})


def _run_backends(model: nn.Sequential, sample: TensorOrTensors, plan: Plan, *, target: Any,
                  loss_fn: Optional[LossFn], optimizer: Optional[OptimizerFactory], warmup: int, run: Any) -> RunResult:
    """Serve each stage as an :class:`ExpertBackend` and train through a :class:`BackendPipeline`.

    Each backend steps its own optimizer on each backward task (hivemind-style asynchronous
    updates); the timeline holds one row per batch the pools formed, with its size and wait.
    """
    from pipexplore.backend import BackendPipeline, BatchTensorProto, ExpertBackend, Runtime

    crossing = [r for r in plan.skip_routes if r.crosses]
    if crossing:
        names = ", ".join(f"'{r.name}' ({r.stash_layer}→{r.pop_layer})" for r in crossing)
        raise ValueError(f"skip routes {names} cross stages, which expert backends cannot carry: "
                         "move the split points so that every stash and its pop share a stage")
    if not torch.is_tensor(sample):
        raise TypeError("expert backends take one tensor per stage: give a tensor sample, not a tuple")
    layers = list(copy.deepcopy(model))
    points = [0, *plan.splits, len(layers)]
    devices = plan.stage_devices
    factory = optimizer or (lambda params: torch.optim.SGD(params, lr=0.01))
    backends = []
    x = sample.chunk(plan.chunks)[0]
    for stage, (a, b) in enumerate(zip(points, points[1:])):
        module = nn.Sequential(*layers[a:b]).to(devices[stage])
        x = x.to(devices[stage])
        backends.append(ExpertBackend(f"stage{stage}", module, factory(module.parameters()),
                                      args_schema=(BatchTensorProto.from_tensor(x.detach()),),
                                      max_batch_size=max(1, int(sample.size(0)))))
        with torch.no_grad():
            x = module(x)
    pipeline = BackendPipeline(backends)
    y = target.to(devices[-1]) if torch.is_tensor(target) else target
    runtime = Runtime({b.name: b for b in backends}, stages={b.name: k for k, b in enumerate(backends)})
    with runtime:
        for _ in range(warmup):
            pipeline.step(sample.to(devices[0]), y, loss_fn, chunks=plan.chunks)
        warm_batches = len(runtime.timeline)
        losses = pipeline.step(sample.to(devices[0]), y, loss_fn, chunks=plan.chunks)
    measured = runtime.timeline.iloc[warm_batches:].reset_index(drop=True).assign(run=run)
    origin = measured["start"].min() if len(measured) else 0.0
    measured["start"] -= origin
    measured["end"] -= origin
    return _result(plan, measured, float(sum(losses) / len(losses)), sample, set(devices))
