"""The runs table (sortable, the latest runs), which run is shown, restoring its plan, and two
runs compared side by side."""
from __future__ import annotations

import html
from typing import Any, Mapping, Optional

import ipywidgets as W
import pandas as pd

from pipexplore.samples import batch_size
from pipexplore.widgets.header import short_plan_text
from pipexplore.widgets.panels.controls import COMPACT
from pipexplore.widgets.timeline_figure import TimelineView
from pipexplore.widgets.run_log import RUN_COLUMNS
from pipexplore.widgets.runs_view import runs_html
from pipexplore.widgets.state import ExplorerState

__all__ = ["RunsPanel", "RUNS_SHOWN", "compare_table"]

#: Rows of the runs view (the latest runs); ``explorer.runs`` has them all.
RUNS_SHOWN = 20
_COMPARED = ["step_time", "predicted_step_time", "prediction_error", "bubble", "throughput", "splits", "chunks",
             "schedule", "checkpoint", "executor", "devices"]


def _cell(row: Mapping[str, Any], key: str) -> str:
    value = row.get(key, "")
    if key in ("step_time", "predicted_step_time"):
        return f"{value * 1e3:.2f} ms"
    if key == "prediction_error":
        return f"{value * 100:+.1f} %"
    if key == "bubble":
        return f"{value * 100:.1f} %"
    if key == "throughput":
        return f"{value:,.0f} samples/s"
    return html.escape(str(value))


def compare_table(first: Mapping[str, Any], second: Mapping[str, Any]) -> str:
    """Two runs' figures and plans, a row each."""
    body = "".join(f"<tr><th>{key.replace('_', ' ')}</th><td>{_cell(first, key)}</td><td>{_cell(second, key)}</td>"
                   "</tr>" for key in _COMPARED)
    return (f"<table class='pipexplore-compare-table'><tr><th></th><th>run {first.get('run')}</th>"
            f"<th>run {second.get('run')}</th></tr>{body}</table>")


class RunsPanel:
    """The latest :data:`RUNS_SHOWN` runs, the run choosers, Restore, and the comparison."""

    def __init__(self, state: ExplorerState) -> None:
        self.state = state
        self.sort = "run"
        self._uuid = f"pipexplore-runs-{id(state):x}"
        self._choosing = False  # the choosers are being refilled: not a choice of the user
        self.w_runs = W.HTML()
        self.w_show_run = W.Dropdown(options=[("latest", -1)], value=-1, description="show run", style=COMPACT,
                                     layout=W.Layout(width="150px"))
        self.w_restore = W.Button(description="Restore this plan", icon="undo", disabled=True,
                                  layout=W.Layout(width="auto"))
        self.w_compare = W.Dropdown(options=[("—", -1)], value=-1, description="compare with", style=COMPACT,
                                    layout=W.Layout(width="180px"))
        self.w_sort = W.Dropdown(options=[("run", "run"), ("step time", "step_time"), ("|error|", "prediction_error"),
                                          ("bubble", "bubble"), ("throughput", "throughput")],
                                 value="run", description="sort by", style=COMPACT, layout=W.Layout(width="170px"))
        self.w_compare_box = W.VBox([])
        self._compare_view: Optional[TimelineView] = None  # made on the first comparison, redrawn after
        self.w_show_run.observe(self._on_show_run, names="value")
        self.w_compare.observe(self._on_compare, names="value")
        self.w_sort.observe(self._on_sort, names="value")
        self.w_restore.on_click(lambda _: state.attempt(lambda: state.restore(state.log.run_number(state.log.shown_result()))))
        self.tools = W.HBox([self.w_show_run, self.w_restore, self.w_compare, self.w_sort])
        self.tools.add_class("pipexplore-controls")
        self.refresh("runs")

    def _on_show_run(self, change: dict[str, Any]) -> None:
        if not self._choosing:
            self.state.show(None if change["new"] == -1 else int(change["new"]))

    def _on_compare(self, change: dict[str, Any]) -> None:
        if not self._choosing:
            self.state.show(self.state.log.shown_run, compare=None if change["new"] == -1 else int(change["new"]))

    def _on_sort(self, change: dict[str, Any]) -> None:
        self.sort = str(change["new"])
        self._refresh_table()

    def _refresh_table(self) -> None:
        rows = self.state.log.rows()
        shown = self.state.log.run_number(self.state.log.shown_result())
        latest = rows[-RUNS_SHOWN:]
        self.w_runs.value = runs_html(pd.DataFrame(latest, columns=RUN_COLUMNS), earlier=len(rows) - len(latest),
                                      sort_by=self.sort, descending=self.sort == "throughput", shown_run=shown,
                                      uuid=self._uuid)

    def refresh(self, change: str) -> None:
        if change not in ("runs", "shown"):
            return
        state = self.state
        self._refresh_table()
        kept = state.log.kept_runs()
        self._choosing = True
        try:
            self.w_show_run.options = [("latest", -1)] + [(f"run {n}", n) for n in reversed(kept)]
            self.w_show_run.value = state.log.shown_run if state.log.shown_run in kept else -1
            self.w_compare.options = [("—", -1)] + [(f"run {n}", n) for n in reversed(kept)]
            self.w_compare.value = state.log.compare_run if state.log.compare_run in kept else -1
        finally:
            self._choosing = False
        shown = state.log.run_number(state.log.shown_result())
        self.w_restore.disabled = shown is None
        self.w_restore.description = "Restore this plan" if shown is None else f"Restore run {shown}'s plan"
        self._refresh_compare()

    def _refresh_compare(self) -> None:
        """Two runs side by side: their figures and plans in a table, their timelines on one time axis."""
        state = self.state
        a, b = state.log.shown_result(), state.log.result_of(state.log.compare_run)
        if a is None or b is None or a is b:
            self.w_compare_box.children = []
            return
        rows = {row["run"]: row for row in state.log.rows()}
        first, second = rows.get(state.log.run_number(a), {}), rows.get(state.log.run_number(b), {})
        view = self._compare_view
        if view is None:  # one view for every comparison: its widget is redrawn, not replaced
            view = self._compare_view = TimelineView(samples=batch_size(state.sample), memory=False)
        view.names = (f"run {first.get('run')}", f"run {second.get('run')}")
        view.show(predicted=a.timeline, measured=b.timeline, predicted_title=short_plan_text(a.plan),
                  measured_title=short_plan_text(b.plan))
        self.w_compare_box.children = [W.HTML("<div class='pipexplore-section'>compared</div>"),
                                       W.HTML(compare_table(first, second)), view.figure]
