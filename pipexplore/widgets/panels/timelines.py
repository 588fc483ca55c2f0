"""Predicted and measured timelines on one time axis with the memory panel, or the shown run's
residuals; the memory cap; what the page needs to re-time a moved split itself; and the plan's
schedule as a grid of actions per rank (filled when opened), whose cell a hovered block lights."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import ipywidgets as W

from pipexplore import background
from pipexplore import timeline as tl
from pipexplore.samples import batch_size
from pipexplore.predict.costs import stage_bounds
from pipexplore.widgets.header import format_bytes, parse_bytes, plan_difference, short_plan_text
from pipexplore.widgets.panels.controls import COMPACT, FieldMessages
from pipexplore.widgets.timeline_figure import TimelineView
from pipexplore.widgets.protocol import DrawnMessage
from pipexplore.widgets.residual_view import ResidualCanvas
from pipexplore.widgets.schedule_grid import ScheduleGrid, schedule_rows
from pipexplore.widgets.state import ExplorerState

__all__ = ["TimelinesPanel", "stage_layers"]


def stage_layers(splits: Sequence[int], layers: int) -> list[tuple[int, int]]:
    """Each stage's first and last layer."""
    return [(a, b - 1) for a, b in stage_bounds(splits, layers)]


class TimelinesPanel:
    """The timelines (canvas), their mode (timelines or residuals) and the memory cap field."""

    def __init__(self, state: ExplorerState, fields: FieldMessages, group: str) -> None:
        self.state = state
        # Planned devices: nothing is measured here, the devices are the catalogue's.
        empty = ("planned devices: nothing measured here; export the plan and run it there (ex.export('torchrun'))"
                 if state.plan.planned else "no run yet: press Run step to measure this plan")
        self.timelines = TimelineView(state.plan.predicted, None, batch_size(state.sample),
                                      memory_cap=state.memory_cap, measured_empty=empty)
        self.figure = self.timelines.figure
        self.figure.group = group
        self.drawn = False  # the page has drawn the first timeline
        self._retime_for: tuple[Any, ...] = ("",)  # the key the page's re-timing model has, and what it names
        self.figure.on_msg(self.on_figure_message)
        self.w_mode = W.ToggleButtons(options=[("timelines", "timelines"), ("residuals", "residuals")],
                                      value="timelines",
                                      tooltips=["predicted and measured steps, one time axis",
                                                "each action's prediction error, stage × micro-batch"],
                                      style={"button_width": "80px"})
        cap = state.memory_cap
        self.w_memory_cap = W.Text(value="" if cap is None else format_bytes(cap), description="memory cap",
                                   placeholder="e.g. 2 GiB", continuous_update=False, style=COMPACT,
                                   layout=W.Layout(width="190px"))
        self.w_memory_cap.observe(fields.field_handler(state, "memory_cap", self._set_cap), names="value")
        self.w_timeline_box = W.VBox([self.figure])
        self.w_residuals = W.VBox([], layout=W.Layout(display="none"))
        self.residual_figure: Optional[ResidualCanvas] = None
        self.w_mode.observe(lambda change: self.refresh_residuals(), names="value")
        self.tools = W.HBox([self.w_mode, self.w_memory_cap, fields["memory_cap"]])
        self.tools.add_class("pipexplore-controls")
        # The schedule, a row of actions per rank: drawn when opened (a large plan has ~100k).
        self.schedule_grid = ScheduleGrid()
        self._grid_link = W.jsdlink((self.figure, "hovered"), (self.schedule_grid, "hover"))
        self.w_schedule_grid = W.Accordion(children=[self.schedule_grid], selected_index=None)
        self.w_schedule_grid.set_title(0, "schedule: the actions each rank runs, in order (hover a block to find it)")
        self.w_schedule_grid.observe(lambda change: self.refresh_schedule(), names="selected_index")
        self.refresh_timelines()

    def refresh_schedule(self) -> None:
        """The grid shows the current plan's schedule while it is open (emptied when closed)."""
        if self.w_schedule_grid.selected_index is None:
            self.schedule_grid.rows, self.schedule_grid.labels, self.schedule_grid.note = [], [], ""
            return
        try:
            labels, rows, note = schedule_rows(self.state.plan)
        except (ValueError, OSError) as exc:  # a schedule the plan's shape cannot run, a CSV file gone
            labels, rows, note = [], [], str(exc)
        with self.schedule_grid.hold_sync():
            self.schedule_grid.labels, self.schedule_grid.rows, self.schedule_grid.note = labels, rows, note

    def _set_cap(self, value: str) -> str:
        self.state.memory_cap = value.strip() or None
        return ""

    def on_figure_message(self, widget: Any, content: Any, buffers: Any) -> None:
        """The page drew the explorer's first timeline: now import what a first run needs besides
        (torch's pipelining helpers: ~1 s) in the background, while the explorer is looked at; a
        run waits for it. Not before: beside the import, the kernel would put the
        explorer on the screen ~1 s later. ``content``: a :class:`~pipexplore.widgets.protocol.DrawnMessage`
        (its keys exactly; anything else is ignored)."""
        if isinstance(content, dict) and content.keys() == DrawnMessage.__required_keys__ \
                and content["event"] == "drawn":
            from pipexplore.widgets.timeline_figure import warm_up_runs

            background.start(warm_up_runs, "pipexplore-warm-up-runs")
            with self.state.lock:
                self.drawn = True
                self.send_retime()

    def send_retime(self) -> None:
        """Name the current plan's shape to the timeline, and give the page what it needs to
        re-time a moved split itself (:mod:`pipexplore.predict.retime`; FSDP's gathers and
        reduce-scatters too, placed as torch's lowering places them, and a mesh's collectives)
        when that shape or the costs changed since it was last given. Not before the first picture is drawn: the model
        is about as large as a scene, and the page waits for the kernel until it has one."""
        from pipexplore.predict.retime import retime_key, retime_model
        from pipexplore.widgets.timeline_canvas import lane_of

        plan = self.state.plan
        options = plan.simulate_options()
        table = plan.rank_table  # a mesh's pipeline rank's costs (the layer table's without one)
        if "replicas" in options:  # replicas sharing this machine: the kernel re-times them
            self.timelines.retime("")
            return
        try:
            key = retime_key(table, plan.splits, options)
        except OSError:  # a CSV schedule's file gone: the page waits for the kernel, which says so
            self.timelines.retime("")
            return
        self.timelines.retime(key)  # scenes name the shape; the page re-times with a model of the same
        if not self.drawn or key == self._retime_for[0]:
            return
        try:
            model = retime_model(table, list(plan.splits), samples=batch_size(self.state.sample),
                                 bubble_by=tl.bubble_by(plan.schedule), collectives=plan.mesh is not None, **options)
        except Exception:  # nothing the page can re-time: it waits for the kernel's scenes
            self.timelines.retime("")
            return
        # (the table and corrections are held with the key, which names them by identity)
        self._retime_for = (key, table, options["corrections"])
        self.timelines.retime(key, {**model, "key": key}, lane_of(plan.predicted)[0])

    def refresh_timelines(self) -> None:
        """The predicted panel shows the current plan; the measured one the shown run, titled with
        its plan and flagged when that is not the current plan."""
        state = self.state
        plan = state.plan
        layers = len(state.layer_table)
        result = state.log.shown_result()
        measured: dict[str, Any] = {"clear_measured": True}
        if result is not None:
            measured = dict(measured=result.timeline, measured_title=f"run {state.log.run_number(result)} · "
                            f"{short_plan_text(result.plan)}", measured_warning=plan_difference(state.plan, result.plan),
                            measured_prediction=result.predicted,
                            measured_stage_layers=stage_layers(result.plan.splits, layers))
        self.send_retime()  # before the scene, which names it
        figures = state.figures()
        numbers = (f"step {figures['predicted_step_time'] * 1e3:.1f} ms · bubble {figures['bubble'] * 100:.1f} %"
                   + (f" · {figures['throughput']:,.0f} samples/s" if not math.isnan(figures["throughput"]) else ""))
        self.timelines.show(predicted=plan.predicted, splits=plan.splits, predicted_title="the current plan",
                            predicted_summary=numbers, stage_layers=stage_layers(plan.splits, layers),
                            memory_cap=state.memory_cap, **measured)

    def refresh_residuals(self) -> None:
        """In residuals mode: the shown run's error per action, stage × micro-batch, in place of the timelines."""
        residual_mode = self.w_mode.value == "residuals"
        self.w_residuals.layout.display = "" if residual_mode else "none"
        self.w_timeline_box.layout.display = "none" if residual_mode else ""
        if not residual_mode:
            return
        from pipexplore.predict.residuals import residuals

        state = self.state
        result = state.log.shown_result()
        table = residuals(result.predicted, result.timeline) if result is not None else None
        title = f"run {state.log.run_number(result)}" if result is not None else ""
        if self.residual_figure is None:
            self.residual_figure = ResidualCanvas()
            self.w_residuals.children = [self.residual_figure]
        self.residual_figure.show(table, title)

    def refresh(self, change: str) -> None:
        if change in ("plan", "runs", "shown"):
            self.refresh_timelines()
        if change == "plan":
            self.refresh_schedule()
        if change in ("runs", "shown"):
            self.refresh_residuals()
        if change == "shown":
            cap = self.state.memory_cap
            if parse_bytes(self.w_memory_cap.value or None, "memory_cap", strict=False) != cap:
                self.w_memory_cap.value = "" if cap is None else format_bytes(cap)
