"""The ``processes`` executor: one process per stage with ``torch.distributed.pipelining``."""
from __future__ import annotations

from pipexplore.executors.base import RunResult, StepJob

__all__ = ["NAME", "run"]

NAME = "processes"


def run(job: StepJob) -> RunResult:
    """Run the plan's schedule in one process per device (see :func:`pipexplore.executors.distributed.run_processes`)."""
    from pipexplore.executors.distributed import run_processes

    return run_processes(job.model, job.sample, job.plan, **job.training.keywords(), run=job.run, warmup=job.warmup,
                         repeats=job.repeats, timeout=job.timeout)
