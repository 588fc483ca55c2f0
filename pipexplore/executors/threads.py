"""The ``threads`` executor: the schedule executor, each stage's F/B/I/W actions in its own worker."""
from __future__ import annotations

import copy

from pipexplore.executors.base import RunResult, StepJob, make_optimizer, measure, result, synthetic_loss

__all__ = ["NAME", "run"]

NAME = "threads"


def run(job: StepJob) -> RunResult:
    """One step of the plan's schedule through :class:`pipexplore.schedule.ScheduleExecutor`; measure."""
    from pipexplore.executors.sequential import ScheduleExecutor

    plan = job.plan
    executor = ScheduleExecutor(copy.deepcopy(job.model), plan.balance, devices=list(plan.devices[: plan.num_devices]),
                                chunks=plan.chunks, schedule=plan.schedule, checkpoint=plan.checkpoint,
                                loss_fn=job.loss_fn or synthetic_loss)
    optimizer = make_optimizer(job.optimizer, executor.parameters())

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = executor.step(job.sample, job.target).loss
        optimizer.step()
        return loss

    timeline, loss = measure(step, job.warmup, job.run, job.repeats, executor.worker_devices)
    return result(plan, timeline, loss, job.sample, {str(d) for d in executor.stage_devices}, executor.parameters())
