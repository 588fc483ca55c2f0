"""The ``backends`` executor: each stage served as an expert backend, trained asynchronously."""
from __future__ import annotations

import copy
from typing import cast

import torch
from torch import nn

from pipexplore.cancel import check_cancelled
from pipexplore.executors.base import RunResult, StepJob, result

__all__ = ["NAME", "run"]

NAME = "backends"


def run(job: StepJob) -> RunResult:
    """Serve each stage as an :class:`ExpertBackend` and train through a :class:`BackendPipeline`.

    Each backend steps its own optimizer on each backward task (hivemind-style asynchronous
    updates); the timeline holds one row per batch the pools formed, with its size and wait. The
    loss is the first step's (its later micro-batches already see the first updates); a cancelled
    run stops between steps (:class:`~pipexplore.cancel.Cancelled`).
    """
    from pipexplore.backend import BackendPipeline, BatchTensorProto, ExpertBackend, Runtime

    model, sample, plan, warmup = job.model, job.sample, job.plan, job.warmup
    target, loss_fn = job.training.target, job.training.loss_fn

    crossing = [r for r in plan.skip_routes if r.crosses]
    if crossing:
        names = ", ".join(f"'{r.name}' ({r.stash_layer}→{r.pop_layer})" for r in crossing)
        raise ValueError(f"skip routes {names} cross stages, which expert backends cannot carry: "
                         "move the split points so that every stash and its pop share a stage")
    if not torch.is_tensor(sample):
        raise TypeError("expert backends take one tensor per stage: give a tensor sample, not a tuple")
    layers = list(cast(nn.Sequential, copy.deepcopy(model)))  # cast: a Sequential's layers (list() refuses others)
    points = [0, *plan.splits, len(layers)]
    devices = plan.stage_devices
    backends = []
    x = sample.chunk(plan.chunks)[0]
    for stage, (a, b) in enumerate(zip(points, points[1:])):
        module = nn.Sequential(*layers[a:b]).to(devices[stage])
        x = x.to(devices[stage])
        backends.append(ExpertBackend(f"stage{stage}", module, job.training.optimizer(module.parameters()),
                                      args_schema=(BatchTensorProto.from_tensor(x.detach()),),
                                      max_batch_size=max(1, int(sample.size(0)))))
        with torch.no_grad():
            x = module(x)
    pipeline = BackendPipeline(backends)
    y = target.to(devices[-1]) if torch.is_tensor(target) else target
    runtime = Runtime({b.name: b for b in backends}, stages={b.name: k for k, b in enumerate(backends)})
    steps = []
    with runtime:
        for _ in range(warmup):
            check_cancelled()
            steps.append(_mean(pipeline.step(sample.to(devices[0]), y, loss_fn, chunks=plan.chunks)))
        check_cancelled()
        # The measured step's batches are those that start after it does: a warm-up batch may be
        # recorded only after its futures were answered (and the warm-up step has returned).
        measured_from = runtime.clock()
        steps.append(_mean(pipeline.step(sample.to(devices[0]), y, loss_fn, chunks=plan.chunks)))
    check_cancelled()
    batches = runtime.timeline
    measured = batches[batches["start"] >= measured_from].reset_index(drop=True).assign(run=job.run)
    origin = measured["start"].min() if len(measured) else 0.0
    measured["start"] -= origin
    measured["end"] -= origin
    parameters = [p for backend in backends for p in backend.expert.parameters()]
    return result(plan, measured, steps[0], sample, set(devices), parameters, measured_losses=steps[-1:])


def _mean(losses: list[float]) -> float:
    return float(sum(losses) / len(losses))
