"""What if: the explorer's plan swept over stages, chunks, schedules and checkpointing, searched for
the fastest plan that fits, and a row of either applied.

Functions of an explorer's state (:class:`pipexplore.widgets.state.ExplorerState`); the predicting
is :func:`pipexplore.predict.sweep.sweep`'s and :func:`pipexplore.predict.search.search`'s.

Example::

    table = sweep_state(state, stages=[2, 4], chunks=[4, 8])
    apply(state, table.iloc[0])
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import pandas as pd

from pipexplore.devices import Mesh, planned_devices
from pipexplore.plan import Plan
from pipexplore.predict.mesh_search import mesh_search
from pipexplore.predict.search import search as search_plans
from pipexplore.predict.sweep import sweep as sweep_plans
from pipexplore.schedules import splits_backward
from pipexplore.widgets.header import parse_bytes

if TYPE_CHECKING:  # pragma: no cover
    from pipexplore.widgets.state import ExplorerState

__all__ = ["sweep_state", "search_state", "apply"]


def _starting_plan(state: ExplorerState, schedules: Sequence[str]) -> tuple[Plan, Optional[Callable[[int], Any]]]:
    """The plan a sweep or search starts from (its table with the input/weight-gradient split
    measured where a schedule asked for splits the backward), and the devices for ``n`` stages
    where they are planned: more GPUs of the kind, never two stages on one (None: the sweep's own)."""
    if any(map(splits_backward, schedules)) and state.with_backward_split() is not state.plan.layer_table:
        state.change_plan(lambda plan: replace(plan, layer_table=state.layer_table))
    plan = state.plan
    if not plan.planned:
        return plan, None
    kind = plan.devices[0].split(":")[0]
    return plan, lambda n: planned_devices([kind] * n, plan.gpus_per_node)


def sweep_state(state: ExplorerState, *, stages: Sequence[int] = (), chunks: Sequence[int] = (),
                schedules: Sequence[str] = (), checkpoint: Sequence[str] = (), measure: int = 0) -> pd.DataFrame:
    """Predict every combination (each with its balanced split), ranked by predicted step time;
    with ``measure=k`` the top ``k`` rows are also run, and the plan put back afterwards."""
    if state.plan.mesh is not None:  # its stages are pipeline ranks: the devices left replicate the pipeline
        return _on_the_mesh(state, stages, chunks, schedules, checkpoint, None)
    plan, more_gpus = _starting_plan(state, schedules)
    table = sweep_plans(plan, stages=stages, chunks=chunks, schedules=schedules, checkpoint=checkpoint,
                        devices_for=more_gpus)
    if measure > 0 and not table.empty:
        previous = state.plan
        measured = []
        try:
            for _, row in table.head(measure).iterrows():
                apply(state, row)
                measured.append(float(state.runner.run()["step_time"]))
        finally:
            state.change_plan(lambda plan: previous.with_options(corrections=plan.corrections))
        table["measured_step_time"] = measured + [math.nan] * (len(table) - len(measured))
        order = pd.Series(measured).rank(method="first").astype(int).tolist()
        table["measured_rank"] = order + [pd.NA] * (len(table) - len(measured))
    return table


def search_state(state: ExplorerState, *, memory_cap: Any = None, stages: Sequence[int] = (),
                 chunks: Sequence[int] = (), schedules: Sequence[str] = (), checkpoint: Sequence[str] = (),
                 virtual_stages: Sequence[int] = (), workers: Optional[int] = None, mesh: Optional[str] = None,
                 data_parallel: Sequence[str] = (), microbatch_rows: Sequence[int] = (), cp: Sequence[int] = (),
                 ep: Sequence[int] = (), etp: Sequence[int] = ()) -> pd.DataFrame:
    """Every combination with the fastest split whose every device holds the plan within
    ``memory_cap`` (bytes or text such as ``'80 GiB'``; None: each device's memory), predicted.
    ``mesh="auto"``: every mesh of the plan's devices instead (tp × pp × dp with each of
    ``data_parallel``, ``microbatch_rows``, ``schedules``, ``checkpoint`` and ``cp``, a mixture of
    experts' every folding, or the ``ep`` and ``etp`` asked for, at the plan's ``capacity_factor``: the
    global batch kept; :func:`pipexplore.predict.mesh_search.mesh_search`).

    Raises:
        ValueError: a bad ``memory_cap`` or ``mesh``; nothing fits (the closest plan named, and by
            how many bytes it is over).
    """
    cap = parse_bytes(memory_cap, "memory_cap")
    if mesh is not None:
        if mesh != "auto":
            raise ValueError(f"mesh: search every mesh with mesh='auto' (a given mesh is planned with set_mesh), "
                             f"got {mesh!r}")
        if not state.planned:
            raise ValueError("mesh='auto' searches meshes of devices from the catalogue; this explorer runs here")
        return mesh_search(state.plan, state.table_for_tp, memory_cap=cap, data_parallel=data_parallel,
                           microbatch_rows=microbatch_rows, schedules=schedules, checkpoint=checkpoint,
                           optimizer=state.training.optimizer, mixed_precision=state.mixed_precision, cp=cp,
                           ep=ep, etp=etp)
    if state.plan.mesh is not None:
        return _on_the_mesh(state, stages, chunks, schedules, checkpoint, cap)
    plan, more_gpus = _starting_plan(state, schedules)
    return search_plans(plan, memory_cap=cap, stages=stages, chunks=chunks, schedules=schedules,
                        checkpoint=checkpoint, virtual_stages=virtual_stages, devices_for=more_gpus,
                        optimizer=state.training.optimizer, mixed_precision=state.mixed_precision, workers=workers)


def apply(state: ExplorerState, row: Any) -> Plan:
    """Make a row of :func:`sweep_state` or :func:`search_state` the current plan; or a mapping of some of
    their plan columns (``splits``, ``chunks``, ``schedule``, ``checkpoint``, ``devices``,
    ``virtual_stages``), the others kept from the current plan: ``apply(state, {"splits": [2, 4]})``.

    Raises:
        ValueError: a mapping with none of those columns, or a plan they make that is refused.
    """
    if "tp" in row and "pp" in row and "dp" in row:  # a row of the mesh search: its mesh, then its plan
        return _apply_mesh(state, row)
    now = state.plan
    current = {"splits": now.splits, "chunks": now.chunks, "schedule": now.schedule, "checkpoint": now.checkpoint,
               "devices": now.devices, "virtual_stages": now.virtual_stages}
    given = [key for key in current if key in row]
    if not given:
        raise ValueError(f"apply takes a row of sweep() or search(), or a mapping of some of "
                         f"{', '.join(current)}; got {list(row.keys())}")
    values: dict[str, Any] = {key: row[key] if key in given else current[key] for key in current}
    devices = values["devices"]
    devices = str(devices).split(",") if isinstance(devices, str) else list(devices)
    virtual = int(values["virtual_stages"] or 1)
    more = {"virtual_stages": virtual} if virtual > 1 else {}
    plan = now.with_options(splits=tuple(int(s) for s in values["splits"]), chunks=int(values["chunks"]),
                            schedule=str(values["schedule"]), checkpoint=str(values["checkpoint"]),
                            devices=tuple(devices), **more)
    if plan.executor == "autograd" and plan.schedule != "gpipe":
        plan = plan.with_options(executor="threads")
    return state.change_plan(lambda _: plan)


def _apply_mesh(state: ExplorerState, row: Any) -> Plan:
    """A row of the mesh search made the plan: its mesh and data parallelism (the rank's table
    counted for its ``tp``), then its split, micro-batches, rows a replica, schedule and checkpointing."""
    previous = state.plan
    state.set_mesh({"tp": int(row["tp"]), "pp": int(row["pp"]), "dp": int(row["dp"]), "cp": int(row.get("cp", 1)),
                    "ep": int(row.get("ep", 1)), "etp": int(row.get("etp", 1))},
                   data_parallel=str(row["data_parallel"]))
    chunks = int(row["chunks"])
    try:
        return state.change_plan(lambda plan: plan.with_options(
            splits=tuple(int(s) for s in row["splits"]), chunks=chunks, batch=chunks * int(row["microbatch_rows"]),
            schedule=str(row["schedule"]), checkpoint=str(row["checkpoint"])))
    except ValueError:
        state.change_plan(lambda _: previous)
        raise


def _on_the_mesh(state: ExplorerState, stages: Sequence[int], chunks: Sequence[int], schedules: Sequence[str],
                 checkpoint: Sequence[str], cap: Optional[float]) -> pd.DataFrame:
    """A sweep or search of a plan with a mesh: ``stages`` are pipeline ranks (the mesh's tensor
    parallelism kept, the devices left replicating the pipeline), ``chunks`` a replica's
    micro-batches; the global batch kept (:func:`pipexplore.predict.mesh_search.mesh_search`)."""
    plan = state.plan
    mesh = plan.mesh
    assert mesh is not None
    count = len(plan.devices)
    meshes = [Mesh(tp=mesh.tp, pp=n, dp=count // (mesh.tp * mesh.cp * n), cp=mesh.cp, ep=mesh.ep, etp=mesh.etp)
              for n in (stages or [mesh.pp])  # the experts folded as they are, where they still fold
              if n >= 1 and count % (mesh.tp * mesh.cp * n) == 0 and (count // n) % (mesh.ep * mesh.etp) == 0]
    if not meshes:
        raise ValueError(f"stages {list(stages)}: none leaves a whole number of replicas of tp={mesh.tp} on "
                         f"{count} devices")
    batch = int(plan.step_batch)  # type: ignore[arg-type]
    rows = sorted({batch // m for m in chunks if m >= 1 and batch % m == 0}) if chunks else []
    return mesh_search(plan, state.table_for_tp, memory_cap=cap, data_parallel=[plan.data_parallel],
                       microbatch_rows=rows, schedules=schedules, checkpoint=checkpoint,
                       optimizer=state.training.optimizer, mixed_precision=state.mixed_precision, meshes=meshes)
