"""The Explorer: one Plan, its prediction, real runs, and export, in one widget.

It holds no pipeline logic of its own: profiles come from :func:`pipexplore.profile`, splits
are checked by :class:`~pipexplore.plan.Plan`, predictions come from :func:`pipexplore.simulate`
and runs from :func:`pipexplore.run.run_step`.
"""
from __future__ import annotations

import copy
import html
import math
import threading
import traceback
from collections import deque
from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence

import ipywidgets as W
import pandas as pd
import torch
from torch import nn

from pipexplore import validate
from pipexplore.balance import optimal_splits
from pipexplore.cancel import CancelToken, Cancelled, cancel_scope
from pipexplore.gpipe import _as_device
from pipexplore.microbatch import TensorOrTensors, batch_size
from pipexplore.plan import Plan
from pipexplore.profile import profile
from pipexplore.run import LossFn, OptimizerFactory, RunResult, run_step
from pipexplore.plan import EXECUTORS, PLAN_SCHEDULES
from pipexplore.skip.skippable import verify_skippables
from pipexplore.widgets.plots import timeline_figure, update_timeline_figure
from pipexplore.widgets.splitbar import SplitBar

__all__ = ["Explorer", "explore", "RUN_COLUMNS"]

RUN_COLUMNS = ["run", "executor", "splits", "chunks", "checkpoint", "schedule", "devices", "step_time",
               "startup_seconds", "bubble", "throughput", "peak_memory", "predicted_step_time", "prediction_error",
               "loss", "finite"]
#: What ``Explorer.update`` changes.
UPDATABLE = ("splits", "devices", "chunks", "checkpoint", "schedule", "executor", "virtual_stages")
#: Rows of the runs view (the latest runs); ``explorer.runs`` has them all.
RUNS_SHOWN = 20


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _default_devices(stages: int) -> tuple[list[str], str]:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return [f"cuda:{k % count}" for k in range(stages)], ""
    return ["cpu"] * stages, "No GPU found: the stages run on CPU devices (one worker thread each)."


class Explorer:
    """See and tune the pipeline split of an ``nn.Sequential`` (or, traced, of any model).

    With ``calibrate`` (the default), each run teaches the predictions the executor's own cost per
    action (``plan.action_overhead``), so later predictions of small models come closer.

    Every argument is checked on entry (a ``ValueError``/``TypeError`` naming it); ``chunks``
    (default 4, fewer for a smaller batch) must split the sample into exactly that many
    micro-batches. The explorer keeps a summary row for every run (:attr:`runs`) and the full
    timelines of the last ``keep_timelines`` (20); :meth:`clear_runs` forgets them and
    :meth:`cancel` stops a background run. A run whose loss or gradients are not finite is
    marked (``finite`` column, a warning) and does not calibrate predictions.

    Example::

        explorer = pipexplore.explore(model, sample, chunks=8)
        explorer.splits = [4, 9]            # or drag the handles
        explorer.run()                      # a real step; a row in explorer.runs
        print(explorer.export("gpipe"))
    """

    def __init__(self, model: nn.Sequential, sample: TensorOrTensors, *, target: Any = None,
                 loss_fn: Optional[LossFn] = None, optimizer: Optional[OptimizerFactory] = None,
                 devices: Optional[Sequence[str]] = None, chunks: Optional[int] = None,
                 checkpoint: str = "except_last",
                 schedule: str = "gpipe", splits: Optional[Sequence[int]] = None,
                 layer_table: Optional[pd.DataFrame] = None, profile_repeats: int = 3,
                 executor: str = "threads", calibrate: bool = True, granularity: str = "blocks",
                 keep_timelines: int = 20) -> None:
        # An nn.Sequential is split by layers and runs in any executor; any other model is split at
        # candidate modules (``granularity``: blocks, or their children) by torch's tracer, and runs
        # its traced stages in this process (threads) or in processes (torch.distributed.pipelining).
        self.traced = not isinstance(model, nn.Sequential)
        if not self.traced:
            if len(model) == 0:
                raise ValueError("the model has no layers to split")
            verify_skippables(model)
        elif not isinstance(model, nn.Module):
            raise TypeError(f"the explorer needs an nn.Module, got {type(model).__name__}")
        # Every argument is checked here, before anything is profiled.
        validate.sample(sample)
        validate.target(target, batch_size(sample))
        validate.optional_callable(loss_fn, "loss_fn", "loss_fn(output, target)")
        validate.optional_callable(optimizer, "optimizer", "optimizer(parameters) returning a torch.optim.Optimizer")
        if devices is not None:
            devices = list(validate.devices(devices))
        if chunks is None:  # 4, or the most a small batch splits into exactly
            chunks = max(c for c in validate.valid_chunks(batch_size(sample), 4) if c <= 4)
        chunks = validate.chunks(chunks, batch=batch_size(sample))
        validate.checkpoint(checkpoint)
        validate.schedule(schedule, PLAN_SCHEDULES)
        validate.executor(executor, EXECUTORS)
        if splits is not None and not self.traced:
            splits = validate.splits(splits, len(model))
        if layer_table is not None and not isinstance(layer_table, pd.DataFrame):
            raise TypeError(f"layer_table must be a pandas DataFrame (from pipexplore.profile) or None, got "
                            f"{type(layer_table).__name__}")
        profile_repeats = validate.integer(profile_repeats, "profile_repeats", minimum=1)
        validate.boolean(calibrate, "calibrate")
        keep_timelines = validate.integer(keep_timelines, "keep_timelines", minimum=0)
        self.model = model
        self.sample = sample
        self.calibrate = calibrate
        self.target = target
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.notes: list[str] = []
        if loss_fn is None:
            self.notes.append("No loss_fn given: runs time a synthetic loss (the mean of the squared outputs).")
        if layer_table is None and self.traced:
            from pipexplore.trace import candidates

            if isinstance(sample, Mapping):  # keyword inputs (a tokenizer's BatchEncoding too) as a plain dict
                self.sample = sample = dict(sample)
            layer_table = candidates(copy.deepcopy(model), sample, granularity=granularity, loss_fn=loss_fn,
                                     target=target, repeats=profile_repeats)
            self.notes.append(f"{type(model).__name__} is not an nn.Sequential: its candidate split points are its "
                              f"{granularity} (by FQN), split by torch.distributed.pipelining's tracer; runs execute "
                              "the traced stages in this process (threads) or one process per stage (processes).")
        if layer_table is None:
            # Costs as a line in the micro-batch rows, from the plan's micro-batch and the whole batch.
            batch = batch_size(sample)
            rows = sorted({max(1, -(-batch // chunks)) if chunks > 1 else max(1, batch // 2), batch})
            profile_device = (devices[0] if devices else "cuda:0" if torch.cuda.is_available() else "cpu")
            profiled = copy.deepcopy(model)
            with validate.naming_failing_layer(profiled, sample):  # a sample that does not fit: which layer says so
                layer_table = profile(profiled, sample, repeats=profile_repeats, microbatch_rows=rows,
                                      device=_as_device(profile_device))
        self.layer_table = layer_table
        n = len(self.layer_table)
        if splits is not None:
            splits = validate.splits(splits, n)
        if splits is None:
            stages = min(n, len(devices) if devices else (max(2, torch.cuda.device_count())))
            splits = self._balanced(stages, "time")
        stages = len(splits) + 1
        if devices is None:
            devices, note = _default_devices(stages)
            if note:
                self.notes.append(note)
        self._plan = self._with_executor_costs(Plan(self.layer_table, tuple(splits), tuple(devices), chunks,
                                                    checkpoint, schedule, executor=executor,
                                                    batch=batch_size(sample)))
        self._runs: list[dict[str, Any]] = []  # a summary row for every run
        self.keep_timelines = keep_timelines
        self._results: deque[RunResult] = deque(maxlen=keep_timelines)  # full timelines of the latest runs
        self._run_rows_html: deque[str] = deque(maxlen=RUNS_SHOWN)
        self._next_run = 0
        self._lock = threading.Lock()  # one run at a time
        # Plan changes, run completion and view refreshes happen under this lock, from any thread.
        self._plan_lock = threading.RLock()
        self._thread: Optional[threading.Thread] = None
        self._cancel_token: Optional[CancelToken] = None
        self.last_error = ""
        self._build_widget()

    # ---- the plan ---------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def splits(self) -> list[int]:
        return list(self._plan.splits)

    @splits.setter
    def splits(self, value: Sequence[int]) -> None:
        self._change_plan(lambda plan: plan.with_options(splits=value))

    def update(self, **changes: Any) -> Plan:
        """Change ``chunks``, ``checkpoint``, ``schedule``, ``executor``, ``devices``, ``splits`` or
        ``virtual_stages``; checked first.

        A bad value raises a ``ValueError``/``TypeError`` that names it and the plan stays as it
        was. ``devices`` is a list, or a comma-separated string (``'cpu,cpu'``); ``chunks`` must
        split the sample into exactly that many micro-batches. A change made while a run is in
        progress stays: the finishing run does not replace it.

        Example::

            explorer.update(chunks=8, schedule="1f1b")
        """
        unknown = sorted(set(changes) - set(UPDATABLE))
        if unknown:
            raise TypeError(f"update() cannot change {', '.join(map(repr, unknown))}: it changes "
                            f"{', '.join(UPDATABLE)}")
        if "devices" in changes:
            changes["devices"] = validate.devices(changes["devices"])
        return self._change_plan(lambda plan: plan.with_options(**changes))

    def _with_executor_costs(self, plan: Plan) -> Plan:
        """``plan`` with its executor's own cost per action, probed once per executor (see
        :func:`pipexplore.executors.probe`), so that even a first prediction includes it."""
        executor = plan.predict_executor
        if not self.calibrate or executor in plan.corrections.overheads or plan.executor == "processes" \
                or plan.schedule == "async-backends":
            return plan
        from pipexplore.executors import probe

        overhead, gap, transfer = probe(plan)
        gap = plan.corrections.gaps.get(executor, gap)  # what a real run taught wins
        transfer = plan.corrections.transfers.get(executor, transfer)
        return plan.with_options(corrections=plan.corrections.with_executor_costs(executor, overhead, gap, transfer))

    def _change_plan(self, change: Callable[[Plan], Plan]) -> Plan:
        """Apply ``change`` to the current plan and show it, atomically with respect to runs finishing."""
        with self._plan_lock:
            plan = self._with_executor_costs(change(self._plan))
            _ = plan.predicted  # a plan that cannot be predicted is refused before it replaces the old one
            self._plan = plan
            self._refresh()
            return plan

    def _set_plan(self, plan: Plan) -> None:
        self._change_plan(lambda _: plan)

    def _balanced(self, stages: int, by: str) -> list[int]:
        if by == "time":
            costs = (self.layer_table["forward"] + self.layer_table["backward"]).tolist()
        else:
            costs = (self.layer_table["output_bytes"] + 2.0 * self.layer_table["param_bytes"]).tolist()
        return optimal_splits(costs, stages)

    def balance(self, by: str = "time") -> list[int]:
        """Set the splits that minimise the most expensive stage (``by`` ``'time'`` or ``'size'``)."""
        if by not in ("time", "size"):
            raise ValueError(f"balance by 'time' or 'size', not {by!r}")
        self.splits = self._balanced(self._plan.num_stages, by)
        return self.splits

    # ---- timelines and runs -----------------------------------------------------------
    def timeline(self, kind: str = "predicted", run: Optional[int] = None) -> pd.DataFrame:
        """``'predicted'``: the current plan's; ``'measured'``: the latest run's, or run ``run``'s
        while it is among the last ``keep_timelines`` runs."""
        if kind == "predicted":
            return self._plan.predicted
        if kind != "measured":
            raise ValueError(f"timeline kind is 'predicted' or 'measured', not {kind!r}")
        results = list(self._results)
        if run is None:
            if results:
                return results[-1].timeline
            if not self._runs:
                raise LookupError("no run yet: call explorer.run() or press 'Run step'")
            raise LookupError(f"no timeline is kept (keep_timelines={self.keep_timelines}); explorer.runs has the "
                              "summary rows")
        for result in results:
            if result.timeline["run"].eq(run).any():
                return result.timeline
        kept = sorted({str(r.timeline["run"].iloc[0]) for r in results if len(r.timeline)})
        raise LookupError(f"run {run!r}'s timeline is not kept: the explorer keeps the last {self.keep_timelines} "
                          f"(keep_timelines), now runs {', '.join(map(str, kept)) or 'none'}")

    @property
    def runs(self) -> pd.DataFrame:
        """One row per run: the plan, what was measured, the prediction's error, and whether the
        loss and gradients were ``finite``."""
        return pd.DataFrame(self._runs, columns=RUN_COLUMNS)

    def clear_runs(self) -> None:
        """Forget every run (rows and timelines); the plan and what calibration taught it stay.

        Example::

            explorer.clear_runs()
            explorer.runs.empty        # True
        """
        with self._plan_lock:
            self._runs.clear()
            self._results.clear()
            self._run_rows_html.clear()
            self._refresh_runs()

    def run(self, executor: Optional[str] = None, *, timeout: Optional[float] = None) -> pd.Series:
        """Run a real training step of the current plan (blocking) and add it to :attr:`runs`.

        ``executor``: ``'threads'`` (default: the schedule executor, in this process),
        ``'autograd'`` (the ``GPipe`` module) or ``'processes'`` (one process per stage with
        ``torch.distributed.pipelining``); it becomes the plan's. Errors (a bad device, out of
        memory, a layer that raises, a crashed worker) propagate; the plan and earlier runs are kept.
        ``timeout`` (seconds, ``'processes'`` only; default derived from the predicted step) bounds
        the step in the worker processes; their start-up shows apart, as ``startup_seconds``.
        """
        if executor is not None and executor != self._plan.executor:
            self.update(executor=executor)
        with self._lock:
            with self._plan_lock:
                plan, number = self._plan, self._next_run
            result = run_step(self.model, self.sample, plan, target=self.target, loss_fn=self.loss_fn,
                              optimizer=self.optimizer, run=number, timeout=timeout)
            row = {"run": number, **result.row()}
            if plan.schedule == "async-backends":
                row["executor"] = "backends"
            loss = row.get("loss", math.nan)
            row["finite"] = bool(row.get("finite", True)) and isinstance(loss, float) and math.isfinite(loss)
            with self._plan_lock:  # atomic with update(): a plan changed meanwhile is never replaced
                self._next_run = number + 1
                self._runs.append(row)
                self._results.append(result)
                self._run_rows_html.append(_run_row_html(row))
                if row["finite"] and self.calibrate and plan.schedule != "async-backends" and self._plan == plan:
                    # Later predictions include the executor's own cost per action, as this run measured it.
                    self._plan = plan.calibrated(result.timeline)
                self._refresh()
                self._refresh_runs()
                self._set_status(_run_summary(row), error=not row["finite"])
        return pd.Series(row)

    def run_async(self) -> threading.Thread:
        """Start :meth:`run` in a background thread (what the button does); returns the thread.
        :meth:`cancel` stops it."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a run is already in progress")
        self._set_status("running a training step…", busy=True)
        self._cancel_token = token = CancelToken()
        self._thread = threading.Thread(target=self._run_in_background, args=(token,), name="pipexplore-run",
                                        daemon=True)
        self._thread.start()
        return self._thread

    def cancel(self, timeout: float = 60.0) -> bool:
        """Stop the background run: its workers stop after their current action and are joined;
        nothing of it is recorded, the plan and earlier runs are kept. Returns whether a run was
        in progress (and has ended within ``timeout`` seconds).

        Example::

            explorer.run_async()
            explorer.cancel()          # True; explorer.runs as before
        """
        thread, token = self._thread, self._cancel_token
        if thread is None or token is None or not thread.is_alive():
            return False
        token.cancel()
        thread.join(timeout)
        return not thread.is_alive()

    def _run_in_background(self, token: CancelToken) -> None:
        try:
            with cancel_scope(token):
                self.run()
        except Cancelled:
            with self._plan_lock:
                self._set_status("run cancelled: the plan and earlier runs are kept")
        except BaseException as exc:  # shown in the widget; the plan and the runs stay
            with self._plan_lock:
                self._show_error(exc)
        finally:
            self.w_run.disabled = False

    def export(self, kind: str = "gpipe", *, hooks: str = "train_hooks", steps: int = 1) -> str:
        """Code that reproduces the current split.

        ``'gpipe'``: a ``GPipe(...)`` (``nn.Sequential`` models); ``'pipelining'``: a
        ``torch.distributed.pipelining`` split spec and schedule; ``'torchrun'``: a standalone
        script for ``torchrun --nproc-per-node N`` that imports ``build_model()``,
        ``get_batch()`` and ``loss_fn()`` from the ``hooks`` module.
        """
        if kind == "torchrun":
            from pipexplore.trace import torchrun_script

            schedule = self._plan.schedule if self._plan.schedule != "async-backends" else "gpipe"
            return torchrun_script(self.layer_table, list(self._plan.splits), hooks=hooks, chunks=self._plan.chunks,
                                   schedule=schedule, devices=self._plan.num_devices, steps=steps)
        if kind == "gpipe" and self.traced:
            raise ValueError(f"GPipe takes an nn.Sequential; {type(self.model).__name__} exports as 'pipelining' "
                             "or 'torchrun'")
        return self._plan.to_code(kind)

    @property
    def module_fqns_per_model_part(self) -> list[list[str]]:
        """The current split as torchtitan's ``module_fqns_per_model_part``."""
        from pipexplore.trace import module_fqns_per_model_part

        return module_fqns_per_model_part(self.layer_table, list(self._plan.splits))

    # ---- what-if and residuals ----------------------------------------------------------
    def sweep(self, *, stages: Sequence[int] = (), chunks: Sequence[int] = (), schedules: Sequence[str] = (),
              checkpoint: Sequence[str] = (), measure: int = 0) -> pd.DataFrame:
        """Predict every combination (each with its balanced split), ranked by predicted step time.

        Empty choices keep the current plan's. With ``measure=k`` the top ``k`` rows are also run
        (added to :attr:`runs`) and get ``measured_step_time`` and ``measured_rank`` columns, to
        show how far the ranking holds. Apply a row with :meth:`apply`.

        Example::

            table = explorer.sweep(stages=[2, 3, 4], chunks=[4, 8], schedules=["gpipe", "1f1b"], measure=3)
            explorer.apply(table.iloc[0])
        """
        from pipexplore.sweep import sweep

        table = sweep(self._plan, stages=stages, chunks=chunks, schedules=schedules, checkpoint=checkpoint)
        if measure > 0 and not table.empty:
            previous = self._plan
            measured = []
            try:
                for _, row in table.head(measure).iterrows():
                    self.apply(row)
                    measured.append(float(self.run()["step_time"]))
            finally:
                self._set_plan(previous.with_options(corrections=self._plan.corrections))
            table["measured_step_time"] = measured + [math.nan] * (len(table) - len(measured))
            order = pd.Series(measured).rank(method="first").astype(int).tolist()
            table["measured_rank"] = order + [pd.NA] * (len(table) - len(measured))
        return table

    def apply(self, row: Any) -> Plan:
        """Make a row of :meth:`sweep` (or any mapping with its columns) the current plan."""
        devices = str(row["devices"]).split(",") if isinstance(row["devices"], str) else list(row["devices"])
        plan = self._plan.with_options(splits=tuple(int(s) for s in row["splits"]), chunks=int(row["chunks"]),
                                       schedule=str(row["schedule"]), checkpoint=str(row["checkpoint"]),
                                       devices=tuple(devices))
        if plan.executor == "autograd" and plan.schedule != "gpipe":
            plan = plan.with_options(executor="threads")
        self._set_plan(plan)
        return self._plan

    def residuals(self, run: int = -1) -> pd.DataFrame:
        """Each action of a run (default: the latest) against its prediction: predicted and measured
        span and ``error`` (see :func:`pipexplore.residuals.residuals`)."""
        from pipexplore.residuals import residuals

        if not self._results:
            raise LookupError("no run yet: call explorer.run() or press 'Run step'")
        result = self._results[run]
        return residuals(result.predicted, result.timeline)

    # ---- the widget ---------------------------------------------------------------------
    def _build_widget(self) -> None:
        plan = self._plan
        self.bar = SplitBar(layers=self._layer_dicts(), splits=list(plan.splits), skips=self._skip_dicts(),
                            view="time", stage_totals=self._stage_totals("time"))
        self.bar.observe(self._on_bar_splits, names="splits")
        self.w_chunks = W.BoundedIntText(value=plan.chunks, min=1, max=4096, description="chunks",
                                         layout=W.Layout(width="150px"))
        self.w_checkpoint = W.Dropdown(options=["always", "except_last", "never"], value=plan.checkpoint,
                                       description="checkpoint", layout=W.Layout(width="230px"))
        self.w_schedule = W.Dropdown(options=list(PLAN_SCHEDULES), value=plan.schedule, description="schedule",
                                     layout=W.Layout(width="220px"))
        self.w_executor = W.Dropdown(options=list(EXECUTORS), value=plan.executor, description="executor",
                                     layout=W.Layout(width="220px"))
        self.w_devices = W.Text(value=",".join(plan.devices), description="devices", continuous_update=False,
                                layout=W.Layout(width="320px"))
        self.w_view = W.ToggleButtons(options=[("time", "time"), ("parameters", "params"), ("activations", "memory")],
                                      value="time", description="cost", style={"button_width": "90px"})
        self.w_balance_time = W.Button(description="Balance by time", icon="balance-scale")
        self.w_balance_size = W.Button(description="Balance by size", icon="balance-scale")
        self.w_run = W.Button(description="Run step", button_style="primary", icon="play")
        self.w_export_kind = W.Dropdown(options=[("GPipe", "gpipe"), ("torch pipelining", "pipelining")],
                                        value="gpipe", layout=W.Layout(width="170px"))
        self.w_export = W.Button(description="Export", icon="code")
        self.w_status = W.HTML(self._notes_html())
        self.w_stages = W.HTML()
        self.w_runs = W.HTML()
        self.w_code = W.HTML()
        self.figure = timeline_figure(plan.predicted, None, batch_size(self.sample))

        for control, name in ((self.w_chunks, "chunks"), (self.w_checkpoint, "checkpoint"),
                              (self.w_schedule, "schedule"), (self.w_devices, "devices"),
                              (self.w_executor, "executor")):
            control.observe(self._on_control(name), names="value")
        self.w_view.observe(lambda change: self._refresh_bar(), names="value")
        self.w_balance_time.on_click(lambda _: self._guard(lambda: self.balance("time")))
        self.w_balance_size.on_click(lambda _: self._guard(lambda: self.balance("size")))
        self.w_run.on_click(self._on_run_clicked)
        self.w_export.on_click(lambda _: self._show_code(self.export(self.w_export_kind.value)))

        self.widget = W.VBox([
            W.HTML(f"<b>pipexplore</b> · {len(self.layer_table)} layers · batch {batch_size(self.sample)}"),
            W.HBox([self.w_chunks, self.w_checkpoint, self.w_schedule, self.w_devices]),
            W.HBox([self.w_executor, self.w_view, self.w_balance_time, self.w_balance_size]),
            self.bar, self.w_stages, self.figure,
            W.HBox([self.w_run, self.w_export_kind, self.w_export]),
            self.w_status, self.w_runs, self.w_code,
        ])
        self.widget.add_class("pipexplore-explorer")
        self._refresh_stages()
        self._refresh_runs()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _layer_dicts(self) -> list[dict[str, Any]]:
        rows = []
        for row in self.layer_table.itertuples(index=False):
            time = float(row.forward + row.backward)
            rows.append({"name": str(row.name), "type": str(row.type), "time": time,
                         "params": float(row.param_bytes), "memory": float(row.output_bytes),
                         "label": f"{time * 1e3:.3f} ms · params {_fmt_bytes(row.param_bytes)} · "
                                  f"activations {_fmt_bytes(row.output_bytes)}"})
        return rows

    def _skip_dicts(self) -> list[dict[str, Any]]:
        return [{"name": r.name, "from": r.stash_layer, "to": r.pop_layer} for r in self._plan.skip_routes]

    def _stage_totals(self, view: str) -> list[str]:
        stages = self._plan.stages
        if view == "params":
            return [f"{_fmt_bytes(v)} params" for v in stages["param_bytes"]]
        if view == "memory":
            return [f"{_fmt_bytes(v)} act." for v in stages["activation_bytes"]]
        return [f"{(f + b) * 1e3:.2f} ms" for f, b in zip(stages["forward"], stages["backward"])]

    def _notes_html(self) -> str:
        return "".join(f"<div class='pipexplore-note'>{html.escape(n)}</div>" for n in self.notes)

    def _refresh(self) -> None:
        if not hasattr(self, "bar"):
            return
        self._sync_controls()
        self._refresh_bar()
        self._refresh_stages()
        update_timeline_figure(self.figure, self._plan.predicted, None, batch_size(self.sample), rows=(1,))

    def _refresh_bar(self) -> None:
        with self.bar.hold_sync():
            self.bar.splits = list(self._plan.splits)
            self.bar.view = self.w_view.value
            self.bar.stage_totals = self._stage_totals(self.w_view.value)
            self.bar.error = self.last_error

    def stage_table(self) -> pd.DataFrame:
        """Per stage: device, layers, time, parameters, activations, predicted peak activation
        memory, and the measured peak of its device in the latest run (where the device reports it)."""
        stages = self._plan.stages
        predicted = self._plan.predicted
        peak_predicted = predicted.groupby("stage")["memory"].max() if "memory" in predicted else pd.Series(dtype=float)
        measured = self._results[-1].timeline.attrs.get("peak_memory", {}) if self._results else {}
        return pd.DataFrame({
            "stage": stages["stage"], "device": stages["device"],
            "layers": [f"{a}–{b}" for a, b in zip(stages["first_layer"], stages["last_layer"])],
            "fwd+bwd": stages["forward"] + stages["backward"], "params": stages["param_bytes"],
            "activations": stages["activation_bytes"],
            "peak activations (predicted)": [float(peak_predicted.get(s, math.nan)) for s in stages["stage"]],
            "peak memory (measured)": [float(measured.get(str(d), math.nan)) for d in stages["device"]],
        })

    def _refresh_stages(self) -> None:
        table = self.stage_table()
        crossing = [r for r in self._plan.skip_routes if r.crosses]

        def size(v: float) -> str:
            return "–" if math.isnan(v) else _fmt_bytes(v)

        rows = "".join(
            f"<tr><td>{stage}</td><td>{device}</td><td>{layers}</td><td>{seconds * 1e3:.2f} ms</td>"
            f"<td>{size(params)}</td><td>{size(act)}</td><td>{size(peak)}</td><td>{size(measured)}</td></tr>"
            for stage, device, layers, seconds, params, act, peak, measured in table.itertuples(index=False, name=None))
        skips = (f"{len(crossing)} of {len(self._plan.skip_routes)} skip routes cross stages (copied)"
                 if self._plan.skip_routes else "no skip routes")
        shared = self.shared_parameters()
        if shared:
            skips += "<br>⚠ parameters used by several stages: " + ", ".join(
                f"{html.escape(name)} (stages {', '.join(map(str, stages_))})" for name, stages_ in shared.items())
        self.w_stages.value = (
            "<table class='pipexplore-stages'><tr><th>stage</th><th>device</th><th>layers</th><th>fwd+bwd</th>"
            "<th>params</th><th>activations</th><th>peak act. (predicted)</th><th>peak memory (measured)</th></tr>"
            + rows + f"</table><div>{skips}</div>")

    def shared_parameters(self) -> dict[str, list[int]]:
        """Parameters used by blocks of more than one stage (tied weights), with those stages."""
        if "shared" not in self.layer_table:
            return {}
        stage_of = [sum(1 for s in self._plan.splits if s <= k) for k in range(len(self.layer_table))]
        users: dict[str, set[int]] = {}
        for k, names in enumerate(self.layer_table["shared"]):
            for name in filter(None, str(names).split(",")):
                users.setdefault(name, set()).add(stage_of[k])
        return {name: sorted(st) for name, st in users.items() if len(st) > 1}

    def _refresh_runs(self) -> None:
        """The runs view: the last :data:`RUNS_SHOWN` rows, each formatted once when its run ended
        (constant time per run, however many runs the session has)."""
        if not hasattr(self, "w_runs"):
            return
        if not self._runs:
            self.w_runs.value = "<div class='pipexplore-runs'>no runs yet</div>"
            return
        earlier = len(self._runs) - len(self._run_rows_html)
        note = (f"<div class='pipexplore-runs-earlier'>{earlier} earlier runs in explorer.runs</div>"
                if earlier else "")
        self.w_runs.value = ("<div class='pipexplore-runs'>" + note + "<table class='dataframe'><thead>"
                             + _RUNS_HEADER + "</thead><tbody>" + "".join(self._run_rows_html)
                             + "</tbody></table></div>")
        if self._results:
            update_timeline_figure(self.figure, None, self._results[-1].timeline, batch_size(self.sample), rows=(2,))
            self._refresh_stages()

    def _set_status(self, text: str, *, busy: bool = False, error: bool = False) -> None:
        color = "#b00020" if error else "#333"
        prefix = "⏳ " if busy else ""
        self.w_status.value = self._notes_html() + (
            f"<div class='pipexplore-status' style='color:{color}'>{prefix}{html.escape(text)}</div>")

    def _show_error(self, exc: BaseException) -> None:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            text = (f"out of memory: {exc}. Try more chunks, checkpoint='always', or more stages; "
                    "the plan and earlier runs are kept")
            torch.cuda.empty_cache()
        else:
            text = f"{type(exc).__name__}: {exc}"
        self.last_error = text
        self._set_status(text, error=True)
        self.w_status.value += ("<details><summary>traceback</summary><pre>" +
                                html.escape("".join(traceback.format_exception(exc))) + "</pre></details>")

    def _guard(self, action: Callable[[], Any]) -> None:
        with self._plan_lock:
            try:
                action()
                self.last_error = ""
                self._set_status("")
            except Exception as exc:  # a bad value from a control: show it, keep the plan
                self._show_error(exc)
            self._refresh_bar()

    def _on_bar_splits(self, change: dict[str, Any]) -> None:
        if list(change["new"]) == list(self._plan.splits):
            return
        self._guard(lambda: setattr(self, "splits", change["new"]))

    def _on_control(self, name: str) -> Callable[[dict[str, Any]], None]:
        def handler(change: dict[str, Any]) -> None:
            value = change["new"]
            if name == "devices":
                value = [d for d in str(value).split(",")]

            def apply() -> None:
                try:
                    self.update(**{name: value})
                except Exception:
                    self._sync_controls()
                    raise

            self._guard(apply)
        return handler

    def _sync_controls(self) -> None:
        plan = self._plan
        for control, value in ((self.w_chunks, plan.chunks), (self.w_checkpoint, plan.checkpoint),
                               (self.w_schedule, plan.schedule), (self.w_devices, ",".join(plan.devices)),
                               (self.w_executor, plan.executor)):
            if control.value != value:
                control.value = value

    def _on_run_clicked(self, _: Any) -> None:
        self.w_run.disabled = True
        try:
            self.run_async()
        except Exception as exc:
            self.w_run.disabled = False
            self._show_error(exc)

    def _show_code(self, code: str) -> None:
        self.w_code.value = f"<pre class='pipexplore-code'>{html.escape(code)}</pre>"


_RUNS_SHOWN_COLUMNS = [("run", "run"), ("executor", "executor"), ("splits", "splits"), ("chunks", "chunks"),
                       ("checkpoint", "checkpoint"), ("schedule", "schedule"), ("devices", "devices"),
                       ("step_time", "step ms"), ("startup_seconds", "startup s"), ("bubble", "bubble %"),
                       ("throughput", "throughput"), ("peak_memory", "peak_memory"),
                       ("predicted_step_time", "predicted ms"), ("prediction_error", "error %"), ("loss", "loss"),
                       ("finite", "finite")]
_RUNS_HEADER = "<tr>" + "".join(f"<th>{label}</th>" for _, label in _RUNS_SHOWN_COLUMNS) + "</tr>"


def _number(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
        return ""
    return f"{value * scale:.{digits}f}"


def _run_row_html(row: dict[str, Any]) -> str:
    """One row of the runs view, formatted once."""
    cells = {
        "step_time": _number(row.get("step_time"), 1e3), "startup_seconds": _number(row.get("startup_seconds")),
        "bubble": _number(row.get("bubble"), 100, 1), "throughput": _number(row.get("throughput"), 1, 1),
        "peak_memory": "" if not isinstance(row.get("peak_memory"), float) or math.isnan(row["peak_memory"])
        else _fmt_bytes(row["peak_memory"]),
        "predicted_step_time": _number(row.get("predicted_step_time"), 1e3),
        "prediction_error": _number(row.get("prediction_error"), 100, 1), "loss": _number(row.get("loss"), 1, 5)
        if row.get("finite", True) else str(row.get("loss")),
        "finite": "yes" if row.get("finite", True) else "⚠ no",
    }
    return "<tr>" + "".join(f"<td>{html.escape(str(cells.get(key, row.get(key, ''))))}</td>"
                            for key, _ in _RUNS_SHOWN_COLUMNS) + "</tr>"


def _run_summary(row: dict[str, Any]) -> str:
    """The status line after a run; a run whose loss or gradients are not finite says so."""
    text = (f"run {row['run']}: step {row['step_time'] * 1e3:.1f} ms, bubble {row['bubble'] * 100:.1f} %, "
            f"loss {row['loss']:.4f}")
    if not row.get("finite", True):
        text += (" ⚠ the loss or a gradient is not finite (NaN or inf): this run does not calibrate predictions; "
                 "check the model, the learning rate and the data")
    return text


def explore(model: nn.Module, sample: TensorOrTensors, **options: Any) -> Explorer:
    """Build an :class:`Explorer` for ``model`` on ``sample`` (one mini-batch); display it by returning it.

    Takes every option :class:`Explorer` takes (``target``, ``loss_fn``, ``optimizer``, ``devices``,
    ``chunks``, ``checkpoint``, ``schedule``, ``splits``, ``executor``, ``calibrate``,
    ``layer_table``, …). ``loss_fn(output, target)`` defines the training step (default: the mean
    of the squared outputs, for timing); ``optimizer(parameters)`` makes the optimizer (default SGD).

    Example::

        explorer = pipexplore.explore(model, sample, chunks=8, schedule="1f1b")
    """
    return Explorer(model, sample, **options)
