"""The explorer's page: built once from a complete state, redrawn panel by panel on its changes.

::

    ┌ header ─────────────────────────────────────────────┐  StatusPanel
    │ stages chunks checkpoint schedule executor devices ▶│  ControlsPanel
    │ cell widths · balance           ┌ split strip ┐     │  StagesPanel
    │ stage view                                           │
    │ mode · memory cap   predicted / measured timelines   │  TimelinesPanel
    │ schedule: a grid of actions per rank (when opened)   │
    │ progress · notes · status                            │  StatusPanel
    │ runs: show · restore · compare · sort, table         │  RunsPanel
    │ export: kind · Export, code                          │  ExportPanel
    └──────────────────────────────────────────────────────┘
"""
from __future__ import annotations

from typing import Any, Optional

import ipywidgets as W

from pipexplore.widgets.header import plan_text
from pipexplore.widgets.panels.controls import ControlsPanel, FieldMessages
from pipexplore.widgets.panels.export import ExportPanel
from pipexplore.widgets.panels.runs import RunsPanel
from pipexplore.widgets.panels.stages import StagesPanel
from pipexplore.widgets.panels.status import StatusPanel
from pipexplore.widgets.panels.timelines import TimelinesPanel
from pipexplore.widgets.state import ExplorerState
from pipexplore.widgets.style import style_tag

__all__ = ["ExplorerView"]


class ExplorerView:
    """The widgets of one explorer, subscribed to its state. ``widget`` is the page."""

    def __init__(self, state: ExplorerState) -> None:
        self.state = state
        self.fields = FieldMessages()
        group = f"pipexplore-{id(state):x}"  # the strip whose moves the timeline re-times in the page
        self.status = StatusPanel(state)
        self.controls = ControlsPanel(state, self.fields)
        self.timelines = TimelinesPanel(state, self.fields, group)
        self.stages = StagesPanel(state, self.fields, group, on_hover=self._highlight)
        self.runs = RunsPanel(state)
        self.export = ExportPanel(state, self.fields, self.write_report)
        self.widget = W.VBox([
            W.HTML(style_tag(), layout=W.Layout(display="none")), self.status.w_header, self.controls.box,
            self.stages.tools, self.stages.bar, self.stages.w_stages, self.timelines.tools,
            self.timelines.w_timeline_box, self.timelines.w_residuals, self.timelines.w_schedule_grid,
            self.status.box,
            W.HTML("<div class='pipexplore-section'>runs</div>"), self.runs.tools, self.runs.w_runs,
            self.runs.w_compare_box,
            W.HTML("<div class='pipexplore-section'>export</div>"), self.export.tools, self.export.w_code,
        ], layout=W.Layout(max_width="100%"))
        self.widget.add_class("pipexplore-explorer")
        self._unsubscribe = state.subscribe(self.refresh)

    def close(self) -> None:
        """Close every widget of the page (ipywidgets keeps each one, and through its handlers the
        state and the model, until it is closed) and stop redrawing on the state's changes."""
        self._unsubscribe()
        seen: set[int] = set()
        pending: list[Any] = [self.widget]
        for panel in (self.status, self.controls, self.timelines, self.stages, self.runs, self.export, self.fields):
            pending += list(vars(panel).values())
        while pending:
            item = pending.pop()
            if isinstance(item, (list, tuple)):
                pending += list(item)
            elif isinstance(item, dict):
                pending += list(item.values())
            elif isinstance(item, W.Widget) and id(item) not in seen:
                seen.add(id(item))
                for name in item.keys:  # its children, layout and style: widgets, not the data it draws
                    value = getattr(item, name, None)
                    pending += [v for v in (value if isinstance(value, (list, tuple)) else [value])
                                if isinstance(v, W.Widget)]
                item.close()

    def refresh(self, change: str) -> None:
        """Redraw what ``change`` touches; the picture first (the page draws it while the tables follow)."""
        self.controls.refresh(change)
        self.timelines.refresh(change)
        self.stages.refresh(change)
        self.status.refresh(change)
        self.runs.refresh(change)

    def _highlight(self, stage: Optional[int]) -> None:
        """A layer of the strip hovered: its stage's lanes shaded in the timelines (None: none)."""
        with self.state.lock:
            self.timelines.timelines.highlight(stage)

    def write_report(self, path: Any) -> Any:
        from pipexplore.widgets.report import write_report

        return write_report(self.state, path, strip_view=self.stages.w_view.value)

    def report_html(self) -> str:
        """The page's HTML report (what :meth:`write_report` writes), its strip as the page shows it."""
        from pipexplore.widgets.report import report_html

        return report_html(self.state, strip_view=self.stages.w_view.value)

    def static_html(self) -> str:
        """The page as static HTML (no JavaScript): header, strip, stage view, predicted and
        measured timelines on one scale, runs. What a notebook keeps for viewers without a kernel."""
        from pipexplore.widgets.static import strip_svg, timeline_svg

        state, bar = self.state, self.stages.bar
        result = state.log.shown_result()
        measured = result.timeline if result is not None else None
        x_max = self.timelines.timelines.x_range[1]
        splits = list(state.plan.splits)
        return (f"<div class='pipexplore-report pipexplore-static'>{style_tag()}{self.status.w_header.value}"
                + strip_svg(bar.layers, splits, bar.skips, bar.view, bar.stage_totals)
                + self.stages.w_stages.value
                + "<div class='pipexplore-timeline' data-splits='" + ",".join(map(str, splits)) + "'>"
                + timeline_svg(state.plan.predicted, "predicted: " + plan_text(state.plan), x_max_ms=x_max)
                + timeline_svg(measured, "measured" + (f": run {state.log.run_number(result)} · {plan_text(result.plan)}"
                                                       if result is not None else ""), x_max_ms=x_max)
                + "</div>" + self.runs.w_runs.value + "</div>")
