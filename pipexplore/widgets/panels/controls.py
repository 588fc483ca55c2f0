"""The plan's fields in one row (stages, chunks, checkpoint, schedule, executor, devices), the
Run step / Cancel button and where it runs (the plan's executor, or torchrun node agents here),
and the messages shown beside fields."""
from __future__ import annotations

import html
import re
from typing import Any, Callable

import ipywidgets as W

from pipexplore.devices.mesh import DIMS
from pipexplore.plan import EXECUTORS, PLAN_SCHEDULES, Plan
from pipexplore.predict.memory import DATA_PARALLEL
from pipexplore.schedules import is_csv
from pipexplore.widgets.header import plan_devices_text
from pipexplore.widgets.state import ExplorerState

__all__ = ["FieldMessages", "ControlsPanel", "COMPACT"]

COMPACT = {"description_width": "initial"}
RUN_TOOLTIP = "train 1 warm-up + 3 measured steps of this plan"


def _schedules(current: str) -> list[str]:
    """The schedule menu: every named schedule, and the plan's CSV schedule file where it has one."""
    return list(PLAN_SCHEDULES) + ([current] if is_csv(current) else [])


def _mesh_value(plan: Plan) -> str:
    """The mesh field's text: ``'tp 4 pp 8 dp 2'`` ('' without a mesh)."""
    mesh = plan.mesh
    if mesh is None:
        return ""
    return mesh.describe(" ")


def parse_mesh(text: str) -> dict[str, int]:
    """``'tp 4 pp 8 dp 2'`` (or ``'tp=4, pp=8, dp=2'``) as ``{"tp": 4, "pp": 8, "dp": 2}``.

    Raises:
        ValueError: text that is not dimensions and sizes.
    """
    words = re.findall(r"([a-z]+)\s*[=:]?\s*(\d+)", str(text).lower())
    rest = re.sub(r"([a-z]+)\s*[=:]?\s*(\d+)|[\s,·×x*]", "", str(text).lower())
    if not words or rest:
        raise ValueError(f"mesh: write its dimensions and sizes, 'tp 4 pp 8 dp 2' ({', '.join(DIMS)}), got {text!r}")
    return {dim: int(size) for dim, size in words}


class FieldMessages:
    """A message beside each field (hidden while empty): what was refused, or what followed."""

    NAMES = ("stages", "chunks", "checkpoint", "schedule", "executor", "devices", "mesh", "data_parallel",
             "memory_cap", "export")

    def __init__(self) -> None:
        self.boxes = {name: W.HTML("", layout=W.Layout(display="none")).add_class("pipexplore-field-error")
                      for name in self.NAMES}

    def __getitem__(self, name: str) -> W.HTML:
        return self.boxes[name]

    def set(self, name: str, text: str, *, error: bool = True) -> None:
        box = self.boxes[name]
        box.value = html.escape(text) if error else f"<span class='pipexplore-field-note'>{html.escape(text)}</span>"
        box.layout.display = "" if text else "none"

    def field_handler(self, state: ExplorerState, name: str,
                      apply: Callable[[Any], str]) -> Callable[[dict[str, Any]], None]:
        """An observer of field ``name`` that applies its value (``apply`` returns a note to show
        beside it); a refusal is shown beside the field, and what was typed stays there."""
        def handler(change: dict[str, Any]) -> None:
            try:
                note = apply(change["new"])
                state.last_error = ""
                self.set(name, note, error=False)
            except Exception as exc:
                state.last_error = f"{type(exc).__name__}: {exc}"
                self.set(name, str(exc))
        return handler


#: The "run on" choices: the plan's executor here, or its torchrun script under 1 or 2 node agents.
RUN_ON = [("its executor", ""), ("torchrun, 1 node", "1"), ("torchrun, 2 nodes", "2")]


class ControlsPanel:
    """The plan's fields and the Run step button; typed values are applied to the state."""

    def __init__(self, state: ExplorerState, fields: FieldMessages) -> None:
        self.state, self.fields = state, fields
        self._syncing = False  # while the fields are written back from the plan
        plan = state.plan
        self.w_stage_count = W.IntText(value=plan.num_stages, description="stages", style=COMPACT,
                                       layout=W.Layout(width="92px"))
        self.w_chunks = W.IntText(value=plan.chunks, description="chunks", style=COMPACT, layout=W.Layout(width="92px"))
        self.w_checkpoint = W.Dropdown(options=["always", "except_last", "never"], value=plan.checkpoint,
                                       description="checkpoint", style=COMPACT, layout=W.Layout(width="190px"))
        self.w_schedule = W.Dropdown(options=_schedules(plan.schedule), value=plan.schedule, description="schedule",
                                     style=COMPACT, layout=W.Layout(width="180px"))
        self.w_executor = W.Dropdown(options=list(EXECUTORS), value=plan.executor, description="executor",
                                     style=COMPACT, layout=W.Layout(width="150px"))
        self.w_devices = W.Text(value=plan_devices_text(plan), description="devices", continuous_update=False,
                                style=COMPACT, layout=W.Layout(width="210px"))
        # The mesh over planned devices: tensor × pipeline × data parallelism and how replicas share state.
        shown = W.Layout(width="170px", display="" if plan.planned else "none")
        self.w_mesh = W.Text(value=_mesh_value(plan), description="mesh", continuous_update=False, style=COMPACT,
                             layout=shown, placeholder="tp 4 pp 8 dp 2",
                             tooltip="tensor × pipeline × data parallelism over the devices: 'tp 8 pp 4 dp 2'")
        self.w_data_parallel = W.Dropdown(options=list(DATA_PARALLEL), value=plan.data_parallel,
                                          description="data parallel", style=COMPACT,
                                          layout=W.Layout(width="190px", display="" if plan.planned else "none"))
        self.w_run = W.Button(description="Run step", button_style="primary", icon="play", tooltip=RUN_TOOLTIP,
                              layout=W.Layout(width="110px"))
        # Where the step runs: the plan's executor, or the exported script under torchrun node
        # agents on this machine (the path a cluster takes; the run comes back as any run).
        self.w_run_on = W.Dropdown(options=RUN_ON, value="", description="run on", style=COMPACT,
                                   layout=W.Layout(width="220px"),
                                   tooltip="where Run step runs the plan: its executor here, or the exported "
                                           "torchrun script under node agents on this machine")
        for control, name in self._fields():
            control.observe(fields.field_handler(state, name, self._applier(name)), names="value")
        self.w_run.on_click(self._on_run_clicked)
        if plan.planned:  # catalogue devices are not here: nothing to run
            self.w_run.disabled = self.w_run_on.disabled = True
            self.w_run.tooltip = ("the plan is for planned devices, not this machine's: export it "
                                  "(ex.export('torchrun')) and run it there")
        self.box = W.HBox([self.w_stage_count, fields["stages"], self.w_chunks, fields["chunks"], self.w_checkpoint,
                           fields["checkpoint"], self.w_schedule, fields["schedule"], self.w_executor,
                           fields["executor"], self.w_devices, fields["devices"], self.w_mesh, fields["mesh"],
                           self.w_data_parallel, fields["data_parallel"], self.w_run, self.w_run_on])
        self.box.add_class("pipexplore-controls")

    def _fields(self) -> list[tuple[W.ValueWidget, str]]:
        return [(self.w_stage_count, "stages"), (self.w_chunks, "chunks"), (self.w_checkpoint, "checkpoint"),
                (self.w_schedule, "schedule"), (self.w_executor, "executor"), (self.w_devices, "devices"),
                (self.w_mesh, "mesh"), (self.w_data_parallel, "data_parallel")]

    def _current(self, name: str) -> Any:
        plan = self.state.plan
        return {"chunks": plan.chunks, "checkpoint": plan.checkpoint, "schedule": plan.schedule,
                "executor": plan.executor, "devices": plan_devices_text(plan), "stages": plan.num_stages,
                "mesh": _mesh_value(plan), "data_parallel": plan.data_parallel}[name]

    def _applier(self, name: str) -> Callable[[Any], str]:
        state = self.state

        def apply(value: Any) -> str:
            if self._syncing:  # the field written back from the plan (its options too): nothing to do
                return ""
            current = self._current(name)
            if value == current or (name == "devices" and str(value).replace(" ", "") == current):
                return ""  # the plan's own value, written back: nothing to do
            if name == "stages":
                self.fields.set("devices", state.set_stage_count(value), error=False)
                return ""
            if name == "mesh":
                state.set_mesh(parse_mesh(value))
                return "; ".join(state.plan.mesh_or_pipeline.notes(state.gpus_per_node))
            if name == "data_parallel":
                if state.plan.mesh is None:
                    raise ValueError("data parallel: give the plan a mesh first (mesh 'tp 1 pp 4 dp 2')")
                state.set_mesh(state.plan.mesh, data_parallel=value)
                return ""
            state.update(**{name: value})
            plan = state.plan
            if name == "devices" and len(plan.devices) > plan.num_devices:
                return f"{', '.join(plan.devices[plan.num_devices:])} not used: {plan.num_stages} stages"
            return ""
        return apply

    def refresh(self, change: str) -> None:
        if change == "plan":
            self._syncing = True  # (new options move a dropdown to its first value: not a choice of the user's)
            try:
                for control, name in self._fields():
                    value = self._current(name)
                    if name == "schedule" and value not in control.options:  # a CSV schedule file, set in code
                        control.options = _schedules(value)
                    if control.value != value:
                        control.value = value
                        self.fields.set(name, "")
            finally:
                self._syncing = False
        elif change == "status":
            running = self.state.runner.running
            if running and self.w_run.description != "Cancel":
                self.w_run.description, self.w_run.icon, self.w_run.button_style = "Cancel", "stop", "danger"
                self.w_run.tooltip = ("stop the run: its workers stop after their current action; "
                                      "the plan and runs stay")
            elif not running and self.w_run.description == "Cancel":
                self.w_run.description, self.w_run.icon, self.w_run.button_style = "Run step", "play", "primary"
                self.w_run.tooltip = RUN_TOOLTIP
            self.w_run.disabled = self.state.plan.planned
            self.w_run_on.disabled = self.state.runner.running or self.state.plan.planned

    def _on_run_clicked(self, _: Any) -> None:
        state = self.state
        if state.runner.running:
            state.say("cancelling: the workers stop after their current action…", busy=True)
            state.runner.cancel(timeout=0)
            return
        nodes = self.w_run_on.value
        try:
            if nodes:
                state.runner.run_async("torchrun", nodes=int(nodes))
            else:
                state.runner.run_async()
        except Exception as exc:
            state.show_error(exc)
