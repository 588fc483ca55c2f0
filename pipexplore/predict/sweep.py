"""What-if sweeps: predict every combination of stages, chunks, schedules and checkpoint modes.

This module imports no plan: ``plan`` is any object with :class:`pipexplore.plan.Plan`'s methods.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Optional, Sequence

import pandas as pd

from pipexplore import timeline as tl
from pipexplore.balance import optimal_splits
from pipexplore.predict.costs import layer_times
from pipexplore.predict.memory import activation_peaks
from pipexplore.schedules import is_csv, is_multi_stage, ranks_of, refusal
from pipexplore.splits import first_runnable_layer
from pipexplore.validate import splits_exactly

__all__ = ["sweep", "plan_balanced_splits", "SWEEP_COLUMNS"]

SWEEP_COLUMNS = ["rank", "stages", "splits", "chunks", "schedule", "checkpoint", "devices", "predicted_step_time",
                 "bubble", "throughput", "activation_bytes", "activation_bytes_per_stage"]


def plan_balanced_splits(plan: Any, stages: int) -> list[int]:
    """The split into ``stages`` that minimises the slowest stage, by the plan's own corrected
    per-layer costs at its micro-batch size (forward + backward, and recompute where its runs
    recompute: :func:`pipexplore.predict.costs.layer_times`), among those its executor can run
    (:func:`pipexplore.splits.first_runnable_layer`)."""
    first = first_runnable_layer(plan.layer_table, plan.executor, stages)
    return optimal_splits(layer_times(plan).tolist(), stages, first=first)


def sweep(plan: Any, *, stages: Sequence[int] = (), chunks: Sequence[int] = (), schedules: Sequence[str] = (),
          checkpoint: Sequence[str] = (), devices_for: Optional[Callable[[int], Sequence[str]]] = None) -> pd.DataFrame:
    """Predict every combination, each with its balanced split, ranked by predicted step time.

    Empty choices keep the plan's own value. ``devices_for(n)`` gives the devices for ``n``
    devices (default: the plan's devices, repeated round-robin). The multi-stage schedules
    (``interleaved``, ``zbv``, …) put ``plan.virtual_stages`` stages on each device, so they need a
    stage count that is a multiple of it (``interleaved`` chunks a multiple of the devices; the
    others what torch asks); a CSV schedule file runs only its own stages and chunks, on its ranks.
    Combinations a schedule cannot run, or with more stages than layers or chunks the batch's rows
    do not split into exactly (``torch.chunk``: 5 rows in 4 chunks make 3), are left out.

    Columns: :data:`SWEEP_COLUMNS` (seconds, bytes, samples per second); ``activation_bytes`` is
    the largest stage's predicted peak of activations held, ``activation_bytes_per_stage`` each stage's.

    Example::

        table = sweep(plan, stages=[2, 3, 4], chunks=[4, 8, 16], schedules=["gpipe", "1f1b", "zero-bubble"])
        best = table.iloc[0]
    """
    batch = plan.step_batch
    own_devices = list(plan.devices) or ["cpu"]

    def default_devices(n: int) -> list[str]:
        return [own_devices[k % len(own_devices)] for k in range(n)]

    devices_for = devices_for or default_devices
    rows = []
    for n, m, schedule, mode in itertools.product(stages or [plan.num_stages], chunks or [plan.chunks],
                                                   schedules or [plan.schedule], checkpoint or [plan.checkpoint]):
        if n < 1 or n > plan.num_layers or (batch and not splits_exactly(batch, m)) or schedule == "async-backends":
            continue
        csv_file = is_csv(schedule)
        multi = is_multi_stage(schedule) and not csv_file
        devices_needed = n // plan.virtual_stages if multi else n
        if multi and (n % plan.virtual_stages or devices_needed < 1):
            continue
        if schedule == "interleaved" and m % devices_needed:
            continue
        if (multi or csv_file) and schedule != "interleaved" and refusal(schedule, n, m, plan.virtual_stages):
            continue  # e.g. DualPipeV with fewer micro-batches than stages, as torch refuses it; a file's other shape
        if csv_file:
            devices_needed = ranks_of(schedule, n, plan.virtual_stages)
        executor = plan.executor if not (plan.executor == "autograd" and schedule != "gpipe") else "threads"
        # (A CSV schedule fits only its own stage count: the balanced split is found on a one-stage plan first.)
        candidate = plan.with_options(chunks=m, schedule="gpipe" if csv_file else schedule, checkpoint=mode,
                                      executor=executor, splits=(), devices=tuple(devices_for(devices_needed)))
        splits = tuple(plan_balanced_splits(candidate, n)) if n > 1 else ()
        candidate = candidate.with_options(schedule=schedule, splits=splits)
        predicted = candidate.predicted
        step = tl.step_time(predicted)
        peaks = activation_peaks(predicted, candidate.num_stages)
        rows.append({
            "stages": n, "splits": list(candidate.splits), "chunks": m, "schedule": schedule, "checkpoint": mode,
            "devices": ",".join(candidate.devices[: candidate.num_devices]), "predicted_step_time": step,
            "bubble": tl.bubble_fraction(predicted, by=tl.bubble_by(schedule)),
            "throughput": (batch / step) if batch and step > 0 else math.nan,
            "activation_bytes": max(peaks) if peaks else math.nan,
            "activation_bytes_per_stage": peaks,
        })
    table = pd.DataFrame(rows, columns=SWEEP_COLUMNS[1:])
    table = table.sort_values(["predicted_step_time", "activation_bytes"], kind="stable").reset_index(drop=True)
    table.insert(0, "rank", range(1, len(table) + 1))
    return table
