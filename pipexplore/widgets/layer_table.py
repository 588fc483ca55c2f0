"""The explorer's layer table: balanced into stages, and what the page says of how it was costed.

The table itself comes from :func:`pipexplore.models.profile.profile_model`.
"""
from __future__ import annotations

import pandas as pd
import torch

from pipexplore.balance import optimal_splits
from pipexplore.devices import device_spec
from pipexplore.devices.placement import Placement
from pipexplore.host import stage_threads
from pipexplore.plan import Plan
from pipexplore.splits import first_runnable_layer

__all__ = ["balanced_splits", "thread_note", "planned_note"]


def planned_note(placement: Placement) -> str:
    """What the page says of a plan on catalogue devices."""
    spec = device_spec(placement.devices[0])
    nodes = placement.nodes
    where = f"{nodes} node{'s' if nodes > 1 else ''} of {placement.gpus_per_node}" if nodes > 1 else "one node"
    return (f"Planned: {len(set(placement.devices))} × {spec.name} ({where}). Times are the catalogue's roofline of "
            f"counted FLOPs and bytes ({spec.flops_efficiency:.0%} of peak FLOP/s, {spec.bandwidth_efficiency:.0%} of "
            "memory bandwidth, links between stages by node), not measurements: export the plan "
            "(ex.export('torchrun')) and run it there.")


def balanced_splits(table: pd.DataFrame, stages: int, by: str, executor: str = "threads") -> list[int]:
    """The splits into ``stages`` stages that minimise the most expensive one, ``by`` ``'time'``
    (forward + backward) or ``'size'`` (activations + twice the parameters), among those
    ``executor`` can run (:func:`pipexplore.splits.first_runnable_layer`).

    Raises:
        ValueError: ``by`` is neither.
    """
    if by == "time":
        costs = (table["forward"] + table["backward"]).tolist()
    elif by == "size":
        costs = (table["output_bytes"] + 2.0 * table["param_bytes"]).tolist()
    else:
        raise ValueError(f"balance by 'time' or 'size', not {by!r}")
    return optimal_splits(costs, stages, first=first_runnable_layer(table, executor, stages))


def thread_note(table: pd.DataFrame, plan: Plan) -> str:
    """What to say when the costs were timed with other intra-op threads than the plan's CPU
    stages run with (``''`` when they agree)."""
    profiled = table.attrs.get("threads")
    if profiled is None:
        return ""
    runs_with = stage_threads(plan.devices[: plan.num_devices]) or torch.get_num_threads()
    if runs_with == profiled:
        return ""
    return (f"Costs were timed with {profiled} intra-op thread(s); this plan's CPU stages run with {runs_with} "
            "each (the cores are shared among the stages): ex.reprofile() times them again.")
