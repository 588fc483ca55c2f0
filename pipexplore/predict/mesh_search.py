"""The mesh that fits and is fastest: every factorisation of the devices into tensor × pipeline ×
data parallelism (and, for a mixture of experts, every folding of its experts over them), each with
its data parallelism, micro-batch, schedule and checkpointing, predicted and ranked.

The global batch stays the plan's (``dp`` replicas of its ``batch`` rows): a mesh of ``dp'``
replicas runs ``global / dp'`` rows a replica (it must divide), in micro-batches of the rows asked
for. ``tp`` runs over the divisors of ``gpus_per_node`` (a tensor-parallel group inside a node; what
the model refuses — heads ``tp`` does not divide, no plan — is left out, named), ``pp`` over what
leaves a whole ``dp``, at most one stage a layer. Each candidate is split by time (its rank's costs,
:func:`pipexplore.balance.optimal_splits`), predicted (:meth:`pipexplore.plan.Plan.predict`) and its
memory a GPU counted as the stage table counts it (:func:`pipexplore.predict.memory.stage_memory`:
the mesh's shards, the schedule's activations at their peak); ``fits`` where every GPU holds it
within ``memory_cap`` (default: the device's memory). Fitting meshes first, each group by predicted
step; ``pareto`` marks the meshes no other beats on both step and memory.

A mixture of experts (the layer table's ``attrs['experts']``) is searched over its folding too:
``etp`` 1 and ``tp`` (torchtitan's two; Megatron-Core's common ones) and every ``ep`` that divides
the experts and a stage's ``tp · cp · dp / etp`` GPUs (or the ``ep`` and ``etp`` asked for), each
at the plan's routing imbalance (its ``capacity_factor``, kept as it is, never clamped: a folding
whose ``ep`` is below it cannot have a rank that busy, and is left out, named, as any candidate the
plan refuses). A candidate whose training state alone (parameters, gradients, optimizer state: no
activations) does not fit ``memory_cap`` is left out, named, before it is predicted.

This module imports no plan: ``plan`` is any object with :class:`pipexplore.plan.Plan`'s methods.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import pandas as pd

from pipexplore import timeline as tl
from pipexplore.balance import optimal_splits
from pipexplore.devices import device_memory
from pipexplore.devices.mesh import Mesh
from pipexplore.predict.memory import activation_peaks, stage_memory
from pipexplore.predict.search import pareto_front, ranked
from pipexplore.schedules import is_multi_stage

__all__ = ["mesh_search", "MESH_SEARCH_COLUMNS", "factorisations"]

#: The columns of :func:`mesh_search`: the mesh, its pipeline's stages and its options, the predicted
#: step (seconds) for the global batch, its bubble, ``throughput`` (global rows a second),
#: ``peak_bytes`` (the fullest GPU's training memory), ``fits``, ``pareto``, and ``notes`` (what
#: the mesh does that large runs avoid).
MESH_SEARCH_COLUMNS = ["rank", "tp", "pp", "dp", "cp", "ep", "etp", "stages", "data_parallel", "microbatch_rows",
                       "chunks",
                       "schedule", "checkpoint", "splits", "predicted_step_time", "bubble", "throughput", "peak_bytes",
                       "peak_bytes_per_stage", "fits", "pareto", "notes"]


def factorisations(devices: int, gpus_per_node: int, layers: int, cp: Sequence[int] = (1,),
                   experts: Optional[int] = None, ep: Sequence[int] = (), etp: Sequence[int] = ()) -> list[Mesh]:
    """Every mesh of ``devices`` ranks with ``tp`` dividing ``gpus_per_node``, each of ``cp`` (context
    parallelism: as asked) and at most ``layers`` pipeline stages (tp fastest, then cp, pp, dp: the
    fewest pipeline stages first); for a model of ``experts`` routed experts, each with every
    folding of them (the module docstring: ``etp`` of ``etp`` or 1 and ``tp``, ``ep`` of ``ep`` or
    every degree that divides the experts and ``tp · cp · dp / etp``)."""
    meshes = []
    for tp in (d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0 and devices % d == 0):
        for context in (c for c in cp if c >= 1 and devices % (tp * c) == 0):
            rest = devices // (tp * context)
            for pp in (p for p in range(1, min(rest, layers) + 1) if rest % p == 0):
                dense = Mesh(tp=tp, pp=pp, dp=rest // pp, cp=context)
                meshes += _foldings(dense, experts, ep, etp) if experts and experts > 1 else [dense]
    return meshes


def _foldings(dense: Mesh, experts: int, ep: Sequence[int], etp: Sequence[int]) -> list[Mesh]:
    """``dense`` with each folding of ``experts`` routed experts over a stage's GPUs."""
    stage = dense.tp * dense.cp * dense.dp
    found = []
    for tensor in sorted(set(etp) if etp else {1, dense.tp}):
        if tensor < 1 or stage % tensor:
            continue
        for parallel in (ep or [e for e in range(1, stage // tensor + 1) if (stage // tensor) % e == 0]):
            if parallel >= 1 and experts % parallel == 0 and (stage // tensor) % parallel == 0:
                found.append(replace(dense, ep=parallel, etp=tensor))
    return found


def _balanced(table: pd.DataFrame, stages: int) -> list[int]:
    costs = (table["forward"] + table["backward"]).to_numpy(dtype=float)
    return optimal_splits(costs.tolist(), stages) if stages > 1 else []


def mesh_search(plan: Any, table_for: Callable[[int], pd.DataFrame], *, memory_cap: Optional[float] = None,
                data_parallel: Sequence[str] = (), microbatch_rows: Sequence[int] = (), schedules: Sequence[str] = (),
                checkpoint: Sequence[str] = (), optimizer: Optional[Callable[[Any], Any]] = None,
                mixed_precision: bool = False, meshes: Sequence[Mesh] = (), cp: Sequence[int] = (),
                ep: Sequence[int] = (), etp: Sequence[int] = ()) -> pd.DataFrame:
    """Every mesh of the plan's devices (the module docstring; ``meshes``: these only) with each
    choice, predicted and ranked. Empty choices keep the plan's own (its micro-batch rows:
    ``batch / chunks``; its mesh's ``cp``); for a mixture of experts ``ep`` and ``etp`` are the
    degrees tried (empty: every folding, :func:`factorisations`), each at the plan's ``capacity_factor``
    (a mesh whose ``ep`` is below it left out).
    ``table_for(tp)``: the layer table of one tensor-parallel rank of ``tp`` (it may refuse with a
    ``ValueError``). Left out, each with why, in ``table.attrs['left_out']``.

    Columns: :data:`MESH_SEARCH_COLUMNS`.

    Raises:
        ValueError: nothing can run; or nothing fits (the closest mesh named, with its peak); ``ep``
            or ``etp`` above 1 for a model without routed experts.
    """
    current = plan.mesh_or_pipeline
    experts = int((plan.layer_table.attrs.get("experts") or {}).get("count", 0))
    if not experts and any(d > 1 for d in (*ep, *etp)):
        raise ValueError(f"ep {list(ep)}, etp {list(etp)}: expert parallelism folds a mixture of experts' routed "
                         "experts, and this model has none")
    batch = int(plan.step_batch)  # type: ignore[arg-type]
    global_rows = batch * current.dp
    devices = list(plan.devices)
    rows_choices = list(microbatch_rows) or [max(1, batch // plan.chunks)]
    left_out: list[str] = []
    tables: dict[int, Optional[pd.DataFrame]] = {}
    rows = []
    smallest = (math.inf, "")  # the candidate left out whose training state is the least over the cap
    balanced: dict[tuple[int, int], tuple[int, ...]] = {}
    for mesh in meshes or factorisations(len(devices), plan.gpus_per_node, plan.num_layers, cp or [current.cp],
                                         experts=experts, ep=ep, etp=etp):
        if mesh.tp not in tables:
            try:
                tables[mesh.tp] = table_for(mesh.tp)
            except ValueError as error:
                tables[mesh.tp] = None
                left_out.append(f"tp={mesh.tp}: {str(error).splitlines()[0]}")
        table = tables[mesh.tp]
        if table is None:
            continue
        if global_rows % mesh.dp:
            left_out.append(f"{mesh.describe()}: the global batch of {global_rows} rows does not split into {mesh.dp} "
                            "replicas")
            continue
        replica = global_rows // mesh.dp
        for dp_kind, mb, schedule, mode in itertools.product(data_parallel or [plan.data_parallel], rows_choices,
                                                             schedules or [plan.schedule],
                                                             checkpoint or [plan.checkpoint]):
            name = f"{mesh.describe()}, {dp_kind}, micro-batches of {mb} rows, {schedule}, checkpoint {mode}"
            if replica % mb:
                left_out.append(f"{name}: {replica} rows a replica do not split into micro-batches of {mb}")
                continue
            stages = mesh.pp * (plan.virtual_stages if is_multi_stage(schedule) else 1)
            if stages > len(table):
                left_out.append(f"{name}: {stages} stages for {len(table)} layers")
                continue
            if (mesh.tp, stages) not in balanced:  # (the same for every mesh of this tp and these stages)
                balanced[mesh.tp, stages] = tuple(_balanced(table, stages))
            try:
                candidate = plan.with_options(layer_table=table, splits=balanced[mesh.tp, stages], mesh=mesh,
                                              data_parallel=dp_kind, chunks=replica // mb, batch=replica,
                                              schedule=schedule, checkpoint=mode)
                state = _state_bytes(candidate, mesh, memory_cap, optimizer, mixed_precision)
                if state is not None:
                    left_out.append(f"{name}: its training state alone is {state / 2**30:.1f} GiB a GPU, over the cap")
                    smallest = min(smallest, (state, name))
                    continue
                predicted = candidate.predict()
            except ValueError as error:  # the plan or the simulator refuses it
                left_out.append(f"{name}: {str(error).splitlines()[0]}")
                continue
            rows.append(_row(candidate, predicted, mesh, mb, global_rows, memory_cap, optimizer, mixed_precision))
    result = pd.DataFrame(rows, columns=MESH_SEARCH_COLUMNS[1:])
    if result.empty and smallest[1]:
        raise ValueError(f"no mesh fits: the smallest is {smallest[1]}, whose training state alone is "
                         f"{smallest[0] / 2**30:.1f} GiB a GPU")
    if result.empty:
        raise ValueError("no mesh can run: " + "; ".join(left_out[:5]))
    result["pareto"] = pareto_front(result["predicted_step_time"].to_numpy(dtype=float),
                                    result["peak_bytes"].to_numpy(dtype=float))
    if not result["fits"].any():
        closest = result.loc[result["peak_bytes"].idxmin()]
        folded = f" ep={closest['ep']} etp={closest['etp']}" if closest["ep"] * closest["etp"] > 1 else ""
        raise ValueError(f"no mesh fits: the smallest is tp={closest['tp']} pp={closest['pp']} dp={closest['dp']}"
                         f"{folded} ({closest['data_parallel']}) at {closest['peak_bytes'] / 2**30:.1f} GiB a GPU")
    return ranked(result, left_out, memory_cap)


def _memory(candidate: Any, mesh: Mesh, peaks: Sequence[float], memory_cap: Optional[float], optimizer: Any,
            mixed_precision: bool) -> tuple[pd.DataFrame, list[float]]:
    """A GPU's memory by stage of ``candidate`` (with activations ``peaks``), and each stage's capacity."""
    capacity = [float(memory_cap) if memory_cap is not None else device_memory(d) for d in candidate.stage_devices]
    held = stage_memory(candidate.layer_table, list(candidate.splits), peak_activations=peaks, optimizer=optimizer,
                        mixed_precision=mixed_precision, capacity=capacity, tp=mesh.tp, dp=mesh.dp, cp=mesh.cp,
                        ep=mesh.ep, etp=mesh.etp, data_parallel=candidate.data_parallel,
                        sequence_parallel=candidate.sequence_parallel,
                        reshard_after_forward=candidate.reshard_after_forward)
    return held, capacity


def _per_device(candidate: Any, held: pd.DataFrame) -> dict[str, float]:
    per_device: dict[str, float] = {}
    for device, peak in zip(candidate.stage_devices, held["peak_bytes"]):
        per_device[device] = per_device.get(device, 0.0) + float(peak)  # an interleaved rank holds its stages
    return per_device


def _state_bytes(candidate: Any, mesh: Mesh, memory_cap: Optional[float], optimizer: Any,
                 mixed_precision: bool) -> Optional[float]:
    """The fullest GPU's training state (no activations) where it is over its capacity, else None."""
    held, capacity = _memory(candidate, mesh, [0.0] * candidate.num_stages, memory_cap, optimizer, mixed_precision)
    per_device = _per_device(candidate, held)
    over = [per_device[d] for d, cap in zip(candidate.stage_devices, capacity) if per_device[d] > cap]
    return max(over) if over else None


def _row(candidate: Any, predicted: pd.DataFrame, mesh: Mesh, mb: int, global_rows: int,
         memory_cap: Optional[float], optimizer: Any, mixed_precision: bool) -> dict[str, Any]:
    """One candidate's figures: its step and bubble, its memory a GPU and whether it fits."""
    step = tl.step_time(predicted)
    peaks = activation_peaks(predicted, candidate.num_stages)
    held, capacity = _memory(candidate, mesh, peaks, memory_cap, optimizer, mixed_precision)
    per_device = _per_device(candidate, held)
    fits = all(per_device[d] <= cap or math.isnan(cap) for d, cap in zip(candidate.stage_devices, capacity))
    return {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp, "cp": mesh.cp, "ep": mesh.ep, "etp": mesh.etp,
            "stages": candidate.num_stages,
            "data_parallel": candidate.data_parallel,
            "microbatch_rows": mb, "chunks": candidate.chunks, "schedule": candidate.schedule,
            "checkpoint": candidate.checkpoint, "splits": list(candidate.splits), "predicted_step_time": step,
            "bubble": tl.bubble_fraction(predicted, by=tl.bubble_by(candidate.schedule)),
            "throughput": global_rows / step if step > 0 else math.nan, "peak_bytes": max(per_device.values()),
            "peak_bytes_per_stage": held["peak_bytes"].tolist(), "fits": bool(fits),
            "notes": "; ".join(mesh.notes(candidate.gpus_per_node))}
