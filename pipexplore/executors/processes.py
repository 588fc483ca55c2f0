"""The ``processes`` executor: one process per stage with ``torch.distributed.pipelining``."""
from __future__ import annotations

import copy
import inspect

from torch import nn

from pipexplore.executors.base import RunResult, StepJob
from pipexplore.microbatch import batch_size

__all__ = ["NAME", "run"]

NAME = "processes"


def run(job: StepJob) -> RunResult:
    """Run the plan's schedule in one process per device (see :func:`pipexplore.distributed.run_processes`)."""
    from pipexplore.distributed import run_processes

    plan = job.plan
    if not isinstance(job.model, nn.Sequential):
        from pipexplore.trace import split

        names = [str(n) for n in plan.layer_table["name"]]
        rows = max(1, batch_size(job.sample) // plan.chunks)
        # Trace here first: a model that cannot be traced fails fast and clearly, before any process starts.
        split(copy.deepcopy(job.model), (job.sample[:rows],), [names[s] for s in plan.splits])  # type: ignore[index]
    options = dict(target=job.target, loss_fn=job.loss_fn, optimizer=job.optimizer, run=job.run, warmup=job.warmup)
    if job.timeout is not None and "timeout" in inspect.signature(run_processes).parameters:
        options["timeout"] = job.timeout
    return run_processes(job.model, job.sample, plan, **options)
