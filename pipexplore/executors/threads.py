"""The ``threads`` executor: the schedule executor, each stage's F/B/I/W actions in its own worker."""
from __future__ import annotations

import copy
from typing import cast

from torch import nn

from pipexplore.executors.base import RunResult, StepJob, train_and_measure

__all__ = ["NAME", "run"]

NAME = "threads"


def run(job: StepJob) -> RunResult:
    """One step of the plan's schedule through :class:`pipexplore.executors.sequential.ScheduleExecutor`; measure."""
    from pipexplore.executors.sequential import ScheduleExecutor

    plan = job.plan
    model = cast(nn.Sequential, copy.deepcopy(job.model))  # cast: executor_for sends only an nn.Sequential here
    executor = ScheduleExecutor(model, plan.balance, devices=list(plan.devices[: plan.num_devices]),
                                chunks=plan.chunks, schedule=plan.schedule, checkpoint=plan.checkpoint,
                                loss_fn=job.training.loss_fn)
    return train_and_measure(executor, plan, job.sample, job.training, warmup=job.warmup, run=job.run,
                             repeats=job.repeats)
