"""The stage table: per pipeline stage, what it holds, what it takes, and whether it fits its device.

Example::

    stage_table(plan, peaks)      # one row per stage: device, layers, time, memory, fits
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import pandas as pd

from pipexplore.devices import device_memory
from pipexplore.plan import Plan
from pipexplore.predict.memory import MEMORY_COLUMNS, microbatch_activations, stage_memory

__all__ = ["stage_table"]


def stage_table(plan: Plan, peaks: Sequence[float], *, measured: Mapping[str, float], optimizer: Any = None,
                mixed_precision: bool = False, memory_cap: Optional[float] = None) -> pd.DataFrame:
    """Per stage of ``plan``: ``device``, ``layers``, ``compute_seconds`` (its forward and backward a
    step), ``microbatch_activation_bytes`` (one micro-batch's activations on one GPU, the largest
    micro-batch's: what the stage's layers keep for its backward, on a mesh the rank's shard;
    :func:`pipexplore.predict.memory.microbatch_activations`, never more than ``activation_bytes``),
    the training memory that decides whether it fits (:func:`pipexplore.predict.memory.stage_memory`):
    ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` (the user's optimizer), ``activation_bytes``
    (``peaks``: the peak the schedule holds on one GPU, the plan's predicted timeline's
    :func:`pipexplore.predict.memory.activation_peaks`, the page's figure), ``peak_bytes``, the
    device's ``capacity`` and ``fits`` (within it, and activations within ``memory_cap`` where one
    is set); and ``measured_peak_bytes``, its device's peak in a run (``measured``, by device, where
    the device reports it). Bytes and seconds, as every
    table of pipexplore gives them (:meth:`pipexplore.widgets.explorer.Explorer.search`'s ``peak_bytes``
    is this table's largest). With a mesh, a row is one GPU of its pipeline rank: its shard of the
    training state, as the mesh and ``data_parallel`` hold it."""
    stages = plan.stages
    mesh = plan.mesh_or_pipeline
    memory = stage_memory(plan.layer_table, plan.splits, peak_activations=peaks, optimizer=optimizer,
                          mixed_precision=mixed_precision, capacity=[device_memory(d) for d in stages["device"]],
                          tp=mesh.tp, dp=mesh.dp, cp=mesh.cp, ep=mesh.ep, etp=mesh.etp,
                          data_parallel=plan.data_parallel,
                          sequence_parallel=plan.sequence_parallel, reshard_after_forward=plan.reshard_after_forward)
    if memory_cap is not None:
        memory["fits"] &= memory["activation_bytes"] <= memory_cap
    return pd.DataFrame({
        "stage": stages["stage"], "device": stages["device"],
        "layers": [f"{a}–{b}" for a, b in zip(stages["first_layer"], stages["last_layer"])],
        "compute_seconds": stages["forward"] + stages["backward"],
        "microbatch_activation_bytes": microbatch_activations(plan.predicted, plan.num_stages),
        **{column: memory[column].to_numpy() for column in MEMORY_COLUMNS},
        "measured_peak_bytes": [float(measured.get(str(d), math.nan)) for d in stages["device"]],
    })
