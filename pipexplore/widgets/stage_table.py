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
from pipexplore.predict.memory import MEMORY_COLUMNS, stage_memory

__all__ = ["stage_table", "shared_parameters"]


def stage_table(plan: Plan, peaks: Sequence[float], *, measured: Mapping[str, float], optimizer: Any = None,
                mixed_precision: bool = False, memory_cap: Optional[float] = None) -> pd.DataFrame:
    """Per stage of ``plan``: device, layers, time, parameters, activations, predicted peak activation
    memory (``peaks``, a stage's), the measured peak of its device (``measured``, by device, where the
    device reports it), and the training memory that decides whether it fits
    (:func:`pipexplore.predict.memory.stage_memory`): ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``
    (the user's optimizer), peak ``activation_bytes`` as the schedule holds them, ``peak_bytes``, the
    device's ``capacity`` and ``fits`` (within it, and activations within ``memory_cap`` where one is set).
    """
    stages = plan.stages
    memory = stage_memory(plan.layer_table, plan.splits, peak_activations=peaks, optimizer=optimizer,
                          mixed_precision=mixed_precision, capacity=[device_memory(d) for d in stages["device"]])
    if memory_cap is not None:
        memory["fits"] &= memory["activation_bytes"] <= memory_cap
    return pd.DataFrame({
        "stage": stages["stage"], "device": stages["device"],
        "layers": [f"{a}–{b}" for a, b in zip(stages["first_layer"], stages["last_layer"])],
        "fwd+bwd": stages["forward"] + stages["backward"], "params": stages["param_bytes"],
        "activations": stages["activation_bytes"], "peak activations (predicted)": peaks,
        "peak memory (measured)": [float(measured.get(str(d), math.nan)) for d in stages["device"]],
        **{column: memory[column].to_numpy() for column in MEMORY_COLUMNS},
    })


def shared_parameters(layer_table: pd.DataFrame, splits: Sequence[int]) -> dict[str, list[int]]:
    """Parameters used by blocks of more than one stage (tied weights), with those stages."""
    if "shared" not in layer_table:
        return {}
    stage_of = [sum(1 for s in splits if s <= k) for k in range(len(layer_table))]
    users: dict[str, set[int]] = {}
    for k, names in enumerate(layer_table["shared"]):
        for name in filter(None, str(names).split(",")):
            users.setdefault(name, set()).add(stage_of[k])
    return {name: sorted(st) for name, st in users.items() if len(st) > 1}
