"""What a page needs to re-time a plan after a drag, without the kernel.

Moving a split keeps the stage count, so the step's graph, micro-batch sizes, devices, corrections
and executor costs stay; only each stage's sums of its layers change. :func:`retime_model` packs
what stays (the graph's arrays and each layer's costs, as :func:`pipexplore.simulate` reads them)
into plain data with binary buffers, once per plan shape; the explorer's timeline
(``widgets/retime.js``, the processor-sharing loop of ``_sharing.c`` step for step) sums the
layers of the new split, times the graph and draws it the moment a handle is released, while the
kernel predicts the same plan. A mesh plan with FSDP carries its lowering too (``fsdp``: torch's
``UNSHARD``/``REDUCE_GRAD`` per worker, :mod:`pipexplore.predict.fsdp_actions`), from which the page
places its gathers and reduce-scatters for the new split's seconds as the simulator does; a mesh
rank's model carries its collectives per layer (``collectives``), which the page draws in each
stage's collectives lane as :meth:`pipexplore.Plan.predict` does. Tests run the page's code on these
models and compare its timeline with :func:`~pipexplore.predict.simulator.simulate`'s (with a mesh,
``Plan.predict``'s).

Example::

    model = retime_model(plan.layer_table, plan.splits, **plan.simulate_options())
    model["stages"], len(model["first"]) // 4    # stages, actions
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

from pipexplore.predict.costs import COST_SOURCE, fresh_gradient_seconds, layer_seconds
from pipexplore.predict.dataflow import BACKWARD, FORWARD, INPUT_GRAD, OPTIMIZER, WEIGHT_GRAD
from pipexplore.predict.simulator import COSTED, PHASE_NAMES, loop_layout, prepare_step
from pipexplore.schedules import schedule_version, splits_backward

__all__ = ["retime_model", "retime_key"]


def retime_key(layer_table: pd.DataFrame, splits: Sequence[int], options: dict[str, Any]) -> str:
    """What a retime model depends on, as a short string: a new model is needed when it changes
    (the splits count only by their number; the table and corrections by identity, so the caller
    keeps them alive while it holds the key; a CSV schedule by its file's version too)."""
    named = sorted((k, v if isinstance(v, (int, float, str, type(None))) else repr(v))
                   for k, v in options.items() if k != "corrections")
    version = schedule_version(options.get("schedule", "gpipe"))
    text = repr((id(layer_table), len(splits), named, id(options.get("corrections")), version))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _f64(values: Any) -> bytes:
    return np.ascontiguousarray(values, dtype=np.float64).tobytes()


def _i32(values: Any) -> bytes:
    return np.ascontiguousarray(values, dtype=np.int32).tobytes()


def _fsdp_model(table: pd.DataFrame, graph: Any, microbatches: int, executor: str) -> Optional[dict[str, Any]]:
    """FSDP's part of a retime model (:func:`~pipexplore.predict.fsdp_actions.placed_fsdp`'s inputs that
    a moved split keeps): per layer ``unshard``, ``reduce_grad``, ``regather`` seconds; the lowered
    workers' steps as ``(code, value)`` pairs (``ops``, each worker's from ``ops_at[w]`` to
    ``ops_at[w + 1]``: :func:`~pipexplore.predict.fsdp_actions.lowered_steps`); the optimizer steps
    (``updates``) and the backwards that gather again (``again``) by action number. None without FSDP."""
    from pipexplore.predict.fsdp_actions import fsdp_columns, fsdp_lanes, lowered_steps, regathered

    columns = fsdp_columns(table)
    if columns is None:
        return None
    unshard, reduce_grad, regather = columns
    lowered = lowered_steps(graph, microbatches, fsdp_lanes(graph, executor))
    ops = [pair for _, steps in lowered for pair in steps]
    return {"unshard": _f64(unshard), "reduce_grad": _f64(reduce_grad), "regather": _f64(regather),
            "ops": _i32(np.asarray(ops, dtype=np.int32).reshape(-1, 2)),
            "ops_at": _i32(np.cumsum([0, *(len(steps) for _, steps in lowered)])),
            "updates": _i32(np.flatnonzero(graph.kind == OPTIMIZER)), "again": _i32(regathered(graph))}


def _collectives_model(table: pd.DataFrame, batch: int, chunks: int) -> dict[str, Any]:
    """A mesh rank's collectives as the page draws them (:func:`~pipexplore.predict.mesh_costs.collective_rows`'s
    inputs that a moved split keeps): per layer, each of ``names``
    (:func:`~pipexplore.predict.mesh_costs.collective_layers`), name-major in ``seconds``; each
    micro-batch's rows (``rows``)."""
    from pipexplore.predict.costs import microbatch_rows
    from pipexplore.predict.mesh_costs import collective_layers

    layers = collective_layers(table, batch)
    return {"names": list(layers), "seconds": _f64(np.concatenate(list(layers.values()))),
            "rows": _f64(microbatch_rows(int(batch), int(chunks)))}


def retime_model(layer_table: pd.DataFrame, splits: Sequence[int], *, samples: Optional[int] = None,
                 bubble_by: str = "stage", collectives: bool = False, **options: Any) -> dict[str, Any]:
    """The split-independent part of ``simulate(layer_table, splits, **options)`` as plain data.

    Per layer, kind (``F B R I W O``, then ``C``: a checkpointed micro-batch's forward, for
    micro-batches ``0 … stop-1``; ``O``, the optimizer step, is the same at every size, and its
    actions' micro-batch is -1) and distinct micro-batch size: ``seconds`` (the layer's cost,
    corrections applied, float64, kind-major then size then layer), and where the table has shares,
    ``raw`` (uncorrected seconds) and ``weighted`` (``raw`` × the layer's share of its device): a
    stage asks for ``Σ weighted / Σ raw`` of its layers. Per stage: ``resource`` (its device's
    number), ``share_cap``; per boundary ``copy_rates`` (seconds per byte) and per layer
    ``out_bytes``; per kind ``extra``, the seconds an action holds beyond its layers. The graph:
    per action ``first``, ``second`` (input action numbers, ``n`` = none), ``stage``, ``kind``,
    ``micro``; ``optimizer``: whether the graph ends with optimizer steps (micro-batch -1); per
    worker ``queue_len``; per stage the workers that run it (``lanes_at``,
    ``lanes``: :func:`~pipexplore.predict.sharing.loop_layout`); ``kind_names``: the phase of each kind
    number, then a copy's. ``samples``: the batch's rows (throughput); ``bubble_by``: the bubble
    per ``stage`` or per ``device`` (``bubble_key``: each stage's), as
    :func:`pipexplore.timeline.bubble_fraction` takes it. ``fsdp``: where the table costs FSDP's
    gathers and reduce-scatters, what places them as torch's lowering does (:func:`_fsdp_model`), else None.
    ``collectives``: the table is a mesh rank's, whose collectives the page draws in their lanes
    (:func:`_collectives_model`; else None), as :meth:`pipexplore.Plan.predict` has them.
    """
    if bubble_by not in ("stage", "device"):
        raise ValueError(f"bubble_by must be 'stage' or 'device', got {bubble_by!r}")
    setup = prepare_step(layer_table, splits, **options)
    table, graph = setup.layer_table, setup.graph
    corrections, executor = options.get("corrections"), setup.executor
    n, S, L = len(graph), len(setup.costs), len(table)
    seconds, raw, weighted, has_share = [], [], [], []
    for phase, corrected_as in COSTED.values():  # the graph's kinds, then a checkpointed forward
        scale = corrections.scale(executor, corrected_as) if corrections is not None else None
        column = f"share_{COST_SOURCE[phase][0]}"
        has_share.append(column in table)
        for rows in setup.distinct:
            values = layer_seconds(table, setup.layer_rows(rows), phase)
            seconds.append(values * scale if scale is not None else values)
            raw.append(values)
            weighted.append(values * table[column].to_numpy(dtype=float) if column in table else np.zeros(L))
    resource, devices, lanes_at, lanes = loop_layout(graph, setup.resource)
    out_bytes = table["output_bytes"].to_numpy(dtype=float) if "output_bytes" in table else np.zeros(L)
    fsdp = _fsdp_model(table, graph, len(setup.sizes), executor)
    batch = options.get("batch") or table.attrs.get("batch")
    if collectives and not batch:
        raise ValueError("a mesh rank's collectives scale with the batch's rows: give batch= (or a table with "
                         "attrs['batch'])")
    mesh = _collectives_model(table, int(batch), int(options["chunks"])) if collectives else None
    # What each layer's gradients cost to allocate, once a step (micro-batch 0's backward).
    fresh = fresh_gradient_seconds(table, corrections.scale(executor, "backward") if corrections is not None else None)
    return {
        "layers": L, "stages": S, "actions": n, "micro_batches": len(setup.sizes), "sizes": len(setup.distinct),
        "size_of_micro": _i32(np.searchsorted(setup.distinct, setup.sizes)),
        "seconds": _f64(np.concatenate(seconds)), "raw": _f64(np.concatenate(raw)),
        "weighted": _f64(np.concatenate(weighted)), "has_share": has_share,
        "extra": [float(setup.extra[k]) for k in COSTED], "gap": float(setup.gap),
        "handoff": float(setup.handoff), "stop": setup.stop,
        "zero_bubble": splits_backward(options.get("schedule", "gpipe")),  # the first stage's I is its whole backward
        "share_cap": _f64(setup.share_cap), "copy_rates": _f64(setup.copy_rates), "out_bytes": _f64(out_bytes),
        "fractions": _f64(setup.fractions), "fresh": _f64(fresh), "weight_grad": WEIGHT_GRAD,
        "resource": _i32(resource), "free": devices,
        "first": _i32(graph.first), "second": _i32(graph.second), "stage": _i32(graph.stage),
        "kind": np.ascontiguousarray(graph.kind, dtype=np.uint8).tobytes(), "micro": _i32(graph.micro),
        "optimizer": bool((graph.kind == OPTIMIZER).any()),
        "queue_len": _i32([len(q) for q in graph.queues]),
        "lanes_at": _i32(lanes_at), "lanes": _i32(lanes), "fsdp": fsdp, "collectives": mesh,
        "forward": FORWARD, "backward": BACKWARD, "input_grad": INPUT_GRAD, "kind_names": list(PHASE_NAMES),
        "stage_device": list(setup.stage_device), "samples": samples,
        "bubble_key": (list(range(S)) if bubble_by == "stage"
                       else [list(dict.fromkeys(setup.stage_device)).index(d) for d in setup.stage_device]),
    }
