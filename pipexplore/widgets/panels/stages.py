"""The split strip (drag, add and remove splits; balance) and the stage view under it."""
from __future__ import annotations

import html
import math
from typing import Any, Callable, Optional

import ipywidgets as W
import pandas as pd

from pipexplore.devices import node_of
from pipexplore.plan import Plan
from pipexplore.predict.memory import activation_peaks
from pipexplore.widgets.header import format_bytes
from pipexplore.widgets.panels.controls import FieldMessages
from pipexplore.widgets.timeline_figure import STAGE_COLORS
from pipexplore.widgets.protocol import StripLayer, StripSkip
from pipexplore.widgets.splitbar import SplitBar
from pipexplore.widgets.state import ExplorerState

__all__ = ["StagesPanel", "layer_cells", "skip_arcs", "stage_nodes", "stage_totals", "stages_html", "memory_bar",
           "MEMORY_KINDS"]

HINT = ("drag a handle (or focus it and use ←/→) · double-click a layer boundary to add a split · "
        "Delete (or drag it off the strip) removes one")


def layer_cells(table: pd.DataFrame) -> list[StripLayer]:
    """The strip's cells: a layer's name, type, time, parameter and activation bytes, and its label."""
    rows: list[StripLayer] = []
    for row in table.itertuples(index=False):
        seconds = float(row.forward + row.backward)
        rows.append({"name": str(row.name), "type": str(row.type), "time": seconds,
                     "params": float(row.param_bytes), "memory": float(row.output_bytes),
                     "label": f"{seconds * 1e3:.3f} ms · params {format_bytes(row.param_bytes)} · "
                              f"activations {format_bytes(row.output_bytes)}"})
    return rows


def skip_arcs(plan: Plan) -> list[StripSkip]:
    """The strip's arcs: each skip route from its stash layer to its pop layer."""
    return [{"name": r.name, "from": r.stash_layer, "to": r.pop_layer} for r in plan.skip_routes]


def stage_nodes(plan: Plan) -> list[int]:
    """The node of each stage's device where the plan is for planned devices (else none)."""
    return [node_of(d, plan.gpus_per_node) for d in plan.stage_devices] if plan.planned else []


def stage_totals(plan: Plan, view: str) -> list[str]:
    """Each stage's total under the strip, for the cell widths ``view`` (time, params, memory: the
    activations it holds at its peak, on one GPU, as the header and the stage table say them)."""
    stages = plan.stages
    if view == "params":
        return [f"{format_bytes(v)} params" for v in stages["param_bytes"]]
    if view == "memory":
        return [f"{format_bytes(v)} peak act." for v in activation_peaks(plan.predicted, plan.num_stages)]
    return [f"{(f + b) * 1e3:.2f} ms" for f, b in zip(stages["forward"], stages["backward"])]


#: The kinds of training memory a GPU holds, as the stage view stacks them, with their colours.
MEMORY_KINDS = (("param_bytes", "parameters", "#4c78a8"), ("grad_bytes", "gradients", "#f58518"),
                ("optimizer_bytes", "optimizer", "#54a24b"), ("gathered_bytes", "gathered", "#b279a2"),
                ("activation_bytes", "activations", "#e45756"))


def memory_bar(row: Any, scale: float) -> str:
    """One GPU's training memory stacked by kind (:data:`MEMORY_KINDS`), its width ``peak / scale``
    of the cell, each part titled with its kind and bytes."""
    parts = []
    for column, label, colour in MEMORY_KINDS:
        value = float(getattr(row, column))
        if value > 0 and scale > 0:
            parts.append(f"<span class='pipexplore-memory-part' title='{label} {format_bytes(value)}' "
                         f"style='display:inline-block;height:10px;width:{100 * value / scale:.2f}%;"
                         f"background:{colour}'></span>")
    return f"<div class='pipexplore-memory-bar' style='width:160px;white-space:nowrap'>{''.join(parts)}</div>"


def stages_html(state: ExplorerState) -> str:
    """The stage view: a row per stage with its training memory (parameters, gradients, optimizer
    state, peak activations, their sum against the device's memory: stages that do not fit
    flagged), skip routes that cross stages, and parameters several stages share. Figures a run
    would measure say "planned" on catalogue devices."""
    table = state.stage_table()
    plan = state.plan
    crossing = [r for r in plan.skip_routes if r.crosses]
    measured_known = table["measured_peak_bytes"].notna().any()
    nodes = plan.gpus_per_node if plan.planned else None
    gathered = bool((table["gathered_bytes"] > 0).any())
    capacity = table["capacity"].to_numpy(dtype=float)
    scale = float(capacity.max()) if plan.planned and (capacity == capacity).all() else float(table["peak_bytes"].max())

    def size(v: float) -> str:
        return "–" if math.isnan(v) else format_bytes(v)

    rows = []
    for row in table.itertuples(index=False):
        stage, device = int(row.stage), str(row.device)
        over = not row.fits
        swatch = ("<span class='pipexplore-stage-swatch' "
                  f"style='background:{STAGE_COLORS[stage % len(STAGE_COLORS)]}'></span>")
        node = (f" <span class='pipexplore-note'>node {node_of(device, nodes)}</span>" if nodes else "")
        of = "" if math.isnan(row.capacity) else f" / {format_bytes(row.capacity)}"
        rows.append(f"<tr class='{'pipexplore-over' if over else ''}'><td>{swatch}{stage}</td>"
                    f"<td>{html.escape(device)}{node}</td><td>{row.layers}</td>"
                    f"<td>{row.compute_seconds * 1e3:.2f} ms{' (planned)' if nodes else ''}</td><td>{size(row.param_bytes)}</td>"
                    f"<td>{size(row.grad_bytes)}</td><td>{size(row.optimizer_bytes)}</td>"
                    + (f"<td>{size(row.gathered_bytes)}</td>" if gathered else "")
                    + f"<td>{size(row.activation_bytes)}</td>"
                    f"<td class='{'pipexplore-over' if over else ''}'>{'⚠ ' if over else ''}{size(row.peak_bytes)}{of}"
                    f"{' does not fit' if over else ''}</td>"
                    + (f"<td>{memory_bar(row, scale)}</td>" if nodes else "")
                    + (f"<td>{size(row.measured_peak_bytes)}</td>" if measured_known else "") + "</tr>")
    skips = (f"{len(crossing)} of {len(plan.skip_routes)} skip routes cross stages (copied)"
             if plan.skip_routes else "no skip routes")
    shared = state.shared_parameters()
    if shared:
        skips += "<br>⚠ parameters used by several stages: " + ", ".join(
            f"{html.escape(name)} (stages {', '.join(map(str, stages_))})" for name, stages_ in shared.items())
    misfits = int((~table["fits"]).sum())
    if misfits:
        skips = (f"⚠ {misfits} stage{'s' if misfits > 1 else ''} do{'' if misfits > 1 else 'es'} not fit "
                 "(parameters + gradients + optimizer state + peak activations): more stages, checkpointing or "
                 "fewer micro-batches in flight<br>" + skips)
    return ("<div class='pipexplore-stages-view'><table class='pipexplore-stages'><thead><tr><th>stage</th>"
            "<th>device</th><th>layers</th><th>fwd+bwd</th><th>params</th><th>grads</th><th>optimizer</th>"
            + ("<th>gathered (FSDP)</th>" if gathered else "")
            + "<th>peak act. (predicted)</th><th>peak memory (predicted)</th>"
            + ("<th>a GPU, by kind: " + " ".join(f"<span style='color:{c}'>■</span> {label}"
                                                for _, label, c in MEMORY_KINDS) + "</th>" if nodes else "")
            + ("<th>peak memory (measured)</th>" if measured_known else "")
            + "</tr></thead><tbody>" + "".join(rows)
            + f"</tbody></table></div><div class='pipexplore-note'>{skips}</div>")


class StagesPanel:
    """The strip with its tools (cell widths, balance) and the stage view.

    A moved, added or removed split is applied to the state; a refused one puts the plan's splits
    back and the strip says why (``bar.error``). ``on_hover(stage)`` hears the hovered layer's stage.
    """

    def __init__(self, state: ExplorerState, fields: FieldMessages, group: str,
                 on_hover: Callable[[Optional[int]], None]) -> None:
        self.state, self.fields = state, fields
        plan = state.plan
        self.strip_error = ""
        self.bar = SplitBar(layers=layer_cells(state.layer_table), splits=list(plan.splits), skips=skip_arcs(plan),
                            view="time", stage_totals=stage_totals(plan, "time"), group=group,
                            nodes=stage_nodes(plan))
        self.bar.observe(self._on_splits, names="splits")
        self.bar.observe(lambda change: on_hover(None if change["new"] is None or change["new"] < 0
                                                 else int(change["new"])), names="hovered")
        self.w_view = W.ToggleButtons(options=[("time", "time"), ("params", "params"), ("act.", "memory")],
                                      value="time", tooltips=["cell widths: forward + backward time",
                                                              "cell widths: parameter bytes",
                                                              "cell widths: activation bytes"],
                                      style={"button_width": "74px"})
        self.w_balance_time = W.Button(description="Balance by time", layout=W.Layout(width="130px"),
                                       tooltip="splits that minimise the slowest stage")
        self.w_balance_size = W.Button(description="Balance by size", layout=W.Layout(width="130px"),
                                       tooltip="splits that minimise the largest stage (parameters and activations)")
        self.w_view.observe(lambda change: self.refresh_bar(), names="value")
        self.w_balance_time.on_click(lambda _: self._balance("time"))
        self.w_balance_size.on_click(lambda _: self._balance("size"))
        self.tools = W.HBox([self.w_view, self.w_balance_time, self.w_balance_size,
                             W.HTML(f"<span class='pipexplore-note'>{HINT}</span>")])
        self.tools.add_class("pipexplore-controls")
        self.w_stages = W.HTML(stages_html(state))

    def _balance(self, by: str) -> None:
        if self.state.attempt(lambda: self.state.balance(by)):
            self.strip_error = ""
        self.refresh_bar()

    def _on_splits(self, change: dict[str, Any]) -> None:
        proposed = list(change["new"])
        if proposed == list(self.state.plan.splits):
            return
        stages_change = len(proposed) != len(self.state.plan.splits)
        try:
            note = self.state.set_splits(proposed)
            if stages_change:
                self.fields.set("devices", note, error=False)
            self.strip_error = ""
        except Exception as exc:  # refused: the strip shows the plan's splits and says why
            self.strip_error = f"{type(exc).__name__}: {exc}"
            self.state.last_error = self.strip_error
        self.refresh_bar()

    def refresh_bar(self) -> None:
        plan = self.state.plan
        with self.bar.hold_sync():
            self.bar.splits = list(plan.splits)
            self.bar.view = self.w_view.value
            self.bar.stage_totals = stage_totals(plan, self.w_view.value)
            self.bar.nodes = stage_nodes(plan)
            self.bar.error = self.strip_error

    def refresh(self, change: str) -> None:
        if change == "plan":
            self.refresh_bar()
        if change in ("plan", "runs", "shown"):
            self.w_stages.value = stages_html(self.state)
