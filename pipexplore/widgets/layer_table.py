"""The explorer's layer table: profiled as the plan will run, measured again on demand, balanced.

Functions of a model and its sample; the explorer's state calls them and keeps the table.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import pandas as pd
import torch
from torch import nn

from pipexplore import validate
from pipexplore.balance import optimal_splits
from pipexplore.devices import as_device
from pipexplore.host import sharing_cores, stage_threads
from pipexplore.microbatch import TensorOrTensors, batch_size
from pipexplore.plan import Plan
from pipexplore.predict.profiler import backward_split, profile
from pipexplore.widgets.progress import profile_progress

__all__ = ["profile_layers", "profile_device", "with_backward_split", "balanced_splits",
           "thread_note"]


def profile_device(options: Mapping[str, Any]) -> torch.device:
    """Where layers are timed (``options``: ``granularity`` for traced models, ``repeats``, ``device``): the first stage's device, else the first GPU, else the CPU."""
    return as_device(options["device"] or ("cuda:0" if torch.cuda.is_available() else "cpu"))


def profile_layers(model: nn.Module, sample: TensorOrTensors, options: Mapping[str, Any], *, chunks: int,
                   devices: Sequence[Any], split_backward: bool = True, loss_fn: Any = None,
                   target: Any = None) -> pd.DataFrame:
    """Time every layer (or traced candidate) of a copy of ``model`` on ``sample``, at the
    micro-batch of ``chunks`` and at the whole batch, with the intra-op threads each CPU stage on
    ``devices`` runs with (the host's cores shared among the stages that run at once), so that
    what is predicted is what runs.

    Raises:
        ValueError: the sample does not fit the model (naming the layer that refused it).
    """
    threads = stage_threads(devices)
    if not isinstance(model, nn.Sequential):
        from pipexplore.models.trace import candidates_in_rows

        with sharing_cores(threads):
            table = candidates_in_rows(copy.deepcopy(model), sample, chunks=chunks or 1,
                                       granularity=options["granularity"], loss_fn=loss_fn, target=target,
                                       repeats=options["repeats"])
        table.attrs["threads"] = threads or torch.get_num_threads()
        return table
    batch = batch_size(sample)
    rows = sorted({max(1, -(-batch // chunks)) if chunks > 1 else max(1, batch // 2), batch})
    profiled = copy.deepcopy(model)
    with validate.naming_failing_layer(profiled, sample), profile_progress() as progress:
        # a sample that does not fit: which layer says so; in a notebook, a bar counts the layers
        return profile(profiled, sample, repeats=options["repeats"], microbatch_rows=rows,
                       device=profile_device(options), progress=progress, threads=threads,
                       split_backward=split_backward)


def with_backward_split(model: nn.Module, sample: TensorOrTensors, table: pd.DataFrame,
                        options: Mapping[str, Any]) -> pd.DataFrame:
    """``table`` with its input/weight-gradient split measured (zero-bubble runs its backward as
    those two passes); ``table`` itself where it has one, or for traced models."""
    if table.attrs.get("backward_split", True) or not isinstance(model, nn.Sequential):
        return table
    profiled = copy.deepcopy(model).to(profile_device(options))
    return backward_split(profiled, sample, table, repeats=options["repeats"])


def balanced_splits(table: pd.DataFrame, stages: int, by: str) -> list[int]:
    """The splits into ``stages`` stages that minimise the most expensive one, ``by`` ``'time'``
    (forward + backward) or ``'size'`` (activations + twice the parameters).

    Raises:
        ValueError: ``by`` is neither.
    """
    if by == "time":
        costs = (table["forward"] + table["backward"]).tolist()
    elif by == "size":
        costs = (table["output_bytes"] + 2.0 * table["param_bytes"]).tolist()
    else:
        raise ValueError(f"balance by 'time' or 'size', not {by!r}")
    return optimal_splits(costs, stages)


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
