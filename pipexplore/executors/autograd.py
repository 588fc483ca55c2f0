"""The ``autograd`` executor: the ``GPipe`` module, one ``backward()`` call per step."""
from __future__ import annotations

import copy
from typing import cast

from torch import nn

from pipexplore.executors.base import RunResult, StageOptimizers, StepJob, measure, result
from pipexplore import validate
from pipexplore.gpipe import GPipe
from pipexplore.samples import to_device

__all__ = ["NAME", "run"]

NAME = "autograd"


def run(job: StepJob) -> RunResult:
    """Train a copy of the model through ``GPipe(...)`` as the plan says; measure."""
    plan = job.plan
    model = cast(nn.Sequential, copy.deepcopy(job.model))  # cast: executor_for sends only an nn.Sequential here
    pipe = GPipe(model, plan.balance, devices=list(plan.devices[: plan.num_stages]),
                 chunks=plan.chunks, checkpoint=plan.checkpoint)
    pipe.train()
    loss_fn = job.training.loss_fn
    # One optimizer per partition, stepped in stage order after backward() (each step recorded).
    optimizer = StageOptimizers(job.training.optimizer, [list(p.parameters()) for p in pipe.partitions], pipe.devices)
    x = to_device(job.sample, pipe.devices[0])
    y = to_device(job.training.target, pipe.devices[-1])

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = validate.loss_value(loss_fn(pipe(x), y))
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    timeline, loss, measured_losses = measure(step, job.warmup, job.run, job.repeats, pipe.devices)
    return result(plan, timeline, loss, job.sample, {str(d) for d in pipe.devices}, list(pipe.parameters()),
                  measured_losses)
