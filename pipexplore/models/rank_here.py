"""One tensor-parallel rank of a model run here: the layer table measured on this machine, each
layer's time scaled to the share of its work a rank does, and its collectives costed over this
machine's links.

A plan for catalogue devices costs a tensor-parallel rank with the roofline of its shard (torch's
``parallelize_module`` on a fake process group counts it: :mod:`pipexplore.models.sharded`). Here the
whole model's layers are timed instead (:func:`pipexplore.models.profile.profile_model`), and the
same count says what a rank keeps of each: its forward and backward seconds scale by what the
rank's shard of the block costs over the whole block, timed here on a micro-batch
(:func:`pipexplore.models.rank_timing.timed_shares`: torch's ``DTensor`` shard run for real, once a
kind of block; on small layers it costs more than the whole block, its operators' dispatch
undivided), else by the rank's FLOPs over the whole layer's (a matmul sharded over ``tp`` ranks
does ``1/tp`` of the work; a norm kept whole does all of it); its parameters and optimizer step
scale by the bytes it holds, and the collectives ``DTensor`` runs (their bytes counted) cost
gloo's ring over loopback (:data:`pipexplore.predict.collectives.HOST_LINK`), on the critical path of their phase
(``forward_comm``, ``backward_comm``). A run here corrects what the scaling leaves out (the ranks
sharing the cores beyond what the plan's replicas count, the collectives' real cost).

Example::

    table = profile_model(model, ids, devices=["cpu"] * 4)
    rank = rank_here(model, ids, table, tp=2, microbatch_rows=2)
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pandas as pd

from pipexplore.models.experts import routed_experts
from pipexplore.models.meta import EXPERT_COLUMNS, count_layers
from pipexplore.models.inputs import first_microbatch, sample_rows
from pipexplore.models.opcount import meta_copy, to_meta
from pipexplore.models.rank_timing import timed_shares
from pipexplore.predict.collectives import HOST_LINK, Group, ops_collective_seconds
from pipexplore.training import LossFn

__all__ = ["rank_here", "with_expert_counts"]


def rank_here(model: Any, sample: Any, table: pd.DataFrame, *, tp: int, microbatch_rows: Optional[int] = None,
              tp_plan: Optional[dict[str, str]] = None, loss_fn: Optional[LossFn] = None,
              target: Any = None) -> pd.DataFrame:
    """``table`` (``model``'s, measured here) as one of ``tp`` tensor-parallel ranks runs it (the
    module docstring), counted at ``microbatch_rows`` rows (default: the whole batch); ``attrs["tp"]``,
    and ``attrs["tp_timed"]``: each block timed sharded, its rank's forward and backward over the
    whole block's.

    Raises:
        ValueError: a plan that cannot shard the model (as :func:`pipexplore.models.sharded.check_plan`
            says), or a count whose layers are not the table's.
    """
    from pipexplore.predict.roofline import _sum_by_kind

    counted = count_layers(meta_copy(model), to_meta(sample), microbatch_rows=microbatch_rows, loss_fn=loss_fn,
                           target=to_meta(target) if target is not None else None, tp=tp, tp_plan=tp_plan)
    names = [str(n) for n in table["name"]]
    if [str(n) for n in counted["name"]] != names:
        raise ValueError(f"tp={tp} here: the count's layers ({list(counted['name'])[:3]} …) are not the measured "
                         f"table's ({names[:3]} …): plan the model's blocks (granularity='blocks')")
    out = table.copy()
    shares = {}
    for phase in ("forward", "backward"):
        whole = counted[f"{phase}_flops"].to_numpy(dtype=float)
        mine = counted[f"rank_{phase}_flops"].to_numpy(dtype=float)
        shares[phase] = np.where(np.isfinite(whole) & (whole > 0), mine / np.where(whole > 0, whole, 1.0), 1.0)
    kinds = counted["kind"].to_numpy()
    divided = {name: kinds[k] for k, name in enumerate(names) if min(shares["forward"][k], shares["backward"][k]) < 1}
    timed = (timed_shares(model, _microbatch(sample, microbatch_rows), divided, tp=tp, tp_plan=tp_plan)
             if divided else {})
    for k, name in enumerate(names):
        if name in timed:
            shares["forward"][k], shares["backward"][k] = timed[name]
    for phase in ("forward", "backward"):
        for column in (f"{phase}_a", f"{phase}_b"):
            out[column] = out[column].to_numpy(dtype=float) * shares[phase]
    ops = counted.attrs["ops"]
    at = float(table.attrs.get("batch") or ops.attrs["rows"])  # the rows the table's whole-batch columns are at
    comm = _sum_by_kind(ops, ops_collective_seconds(ops, at, Group(tp, *HOST_LINK)))
    for phase in ("forward", "backward"):
        seconds = comm[phase].reindex(kinds).fillna(0.0).to_numpy() if phase in comm else np.zeros(len(out))
        out[f"{phase}_comm"] = seconds
        out[f"{phase}_b"] = out[f"{phase}_b"].to_numpy(dtype=float) + seconds / at  # on the phase's path
    for phase in ("forward", "backward"):
        if phase in out:
            out[phase] = out[f"{phase}_a"] + out[f"{phase}_b"] * at
    whole_bytes = counted["param_bytes"].to_numpy(dtype=float)
    held = counted["rank_param_bytes"].to_numpy(dtype=float)
    out["rank_param_bytes"] = held
    if "optimizer" in out:
        out["optimizer"] = out["optimizer"].to_numpy(dtype=float) * np.where(whole_bytes > 0,
                                                                              held / np.maximum(whole_bytes, 1), 1.0)
    out.attrs = {**table.attrs, "tp": int(tp), "tp_timed": timed}
    return with_expert_counts(model, sample, out, counted=counted)


def _microbatch(sample: Any, rows: Optional[int]) -> Any:
    """``sample``'s first micro-batch of ``rows`` rows (all of it where ``rows`` is None or does not
    divide it)."""
    total = sample_rows(sample)
    return first_microbatch(sample, total // rows) if rows and 0 < rows < total and total % rows == 0 else sample


def with_expert_counts(model: Any, sample: Any, table: pd.DataFrame, *, microbatch_rows: Optional[int] = None,
                       loss_fn: Optional[LossFn] = None, target: Any = None,
                       counted: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """``table`` (measured here) with what a mixture of experts' count says of its routed experts:
    :data:`~pipexplore.models.meta.EXPERT_COLUMNS` (their parameters, what each layer's token
    dispatch moves) and ``attrs["experts"]``, so that a mesh here can fold them over ``ep`` ranks:
    each rank holds ``1/ep`` of the experts and steps their share, and the dispatch and combine cost
    gloo's all-to-all over loopback (:func:`pipexplore.predict.mesh_costs.mesh_layer_table`). Under
    balanced routing a rank's experts compute its own tokens' share of the routed work, as the
    whole model did where it was timed, so the measured seconds stand. ``table`` as it is for a
    model without routed experts, or where the count's layers are not the table's. ``counted``: a
    count of the model already made (:func:`rank_here`'s)."""
    if "experts" in table.attrs or routed_experts(model) is None:
        return table
    if counted is None:
        counted = count_layers(meta_copy(model), to_meta(sample), microbatch_rows=microbatch_rows, loss_fn=loss_fn,
                               target=to_meta(target) if target is not None else None)
    if not counted.attrs.get("experts") or [str(n) for n in counted["name"]] != [str(n) for n in table["name"]]:
        return table
    out = table.copy()
    for column in [*EXPERT_COLUMNS, "rank_expert_param_bytes"]:
        if column in counted:
            out[column] = counted[column].to_numpy()
    out.attrs = {**table.attrs, "experts": counted.attrs["experts"]}
    return out
