"""What an executor itself costs per action, measured on layers that cost next to nothing."""
from __future__ import annotations

import statistics

import pandas as pd
import torch
from torch import nn

from pipexplore.costs import PHASE_SOURCE, handoff_gaps
from pipexplore.executors.base import StepJob
from pipexplore.plan import Plan

__all__ = ["probe"]


def probe(plan: Plan, repeats: int = 3) -> tuple[float, float, float]:
    """Run ``plan``'s executor, schedule, devices and chunks on one ``Linear(1, 1)`` per stage
    and measure ``(overhead, gap)``: the median seconds of an action's span (what the executor
    records around a layer that does nothing: its bookkeeping, autograd set-up, recording) and
    the median seconds a worker spends between actions whose inputs are there (dispatch).

    Executors that start processes or serve backends are not probed: ``(0.0, 0.0)``.

    Example::

        overhead, gap = probe(plan)      # e.g. 60 µs and 25 µs for the threads executor on a CPU
    """
    from pipexplore.executors import autograd, threads

    module = {"threads": threads, "autograd": autograd}.get(plan.executor)
    if module is None or plan.schedule == "async-backends":
        return 0.0, 0.0, 0.0
    stages = plan.num_stages
    tiny = nn.Sequential(*[nn.Linear(1, 1) for _ in range(stages)])
    table = pd.DataFrame({"name": [str(k) for k in range(stages)], "forward": 0.0, "backward": 0.0,
                          "output_bytes": 0.0, "param_bytes": 8.0})
    tiny_plan = Plan(table, splits=tuple(range(1, stages)), devices=plan.devices, chunks=plan.chunks,
                     checkpoint=plan.checkpoint, schedule=plan.schedule, virtual_stages=plan.virtual_stages,
                     executor=plan.executor, batch=plan.chunks)
    measured = module.run(StepJob(tiny, torch.randn(plan.chunks, 1), tiny_plan, warmup=1, repeats=repeats)).timeline
    compute = measured[measured["phase"].isin(list(PHASE_SOURCE))]
    spans = (compute["end"] - compute["start"]).tolist()
    overhead = statistics.median(spans) if spans else 0.0
    gap, transfer = handoff_gaps(measured)
    return float(overhead), float(gap or 0.0), float(transfer or 0.0)
