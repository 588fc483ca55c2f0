"""The Explorer: one Plan, its prediction, real runs, and export, in one widget.

It holds no pipeline logic of its own: profiles come from :func:`pipexplore.profile`, splits
are checked by :class:`~pipexplore.plan.Plan`, predictions come from :func:`pipexplore.simulate`
and runs from :func:`pipexplore.run.run_step`.
"""
from __future__ import annotations

import asyncio
from dataclasses import replace
import copy
import html
import json
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence

import ipywidgets as W
import pandas as pd
import torch
from torch import nn

from pipexplore import background
from pipexplore import timeline as tl
from pipexplore import validate
from pipexplore.balance import optimal_splits
from pipexplore.cancel import CancelToken, Cancelled, cancel_scope
from pipexplore.predict.costs import Corrections, stage_bounds
from pipexplore.gpipe import _as_device
from pipexplore.microbatch import TensorOrTensors, batch_size
from pipexplore.host import sharing_cores, stage_threads
from pipexplore.plan import Plan
from pipexplore.predict.profiler import profile
from pipexplore.executors.step import LossFn, OptimizerFactory, RunResult, run_step
from pipexplore.plan import EXECUTORS, PLAN_SCHEDULES
from pipexplore.skip.skippable import verify_skippables
from pipexplore.widgets.codeview import CodeView
from pipexplore.widgets.header import (header_html, parse_bytes, plan_figures, plan_text, short_plan_text,
                                       splits_text)
from pipexplore.widgets.plots import STAGE_COLORS, TimelineView
from pipexplore.widgets.progress import profile_progress
from pipexplore.widgets.residual_view import ResidualCanvas
from pipexplore.widgets.runs_view import runs_html
from pipexplore.widgets.splitbar import SplitBar
from pipexplore.widgets.style import style_tag

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
                 keep_timelines: int = 20, memory_cap: Any = None) -> None:
        self._memory_cap = parse_bytes(memory_cap, "memory_cap")  # a view setting: bytes a stage may hold
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
            raise TypeError(f"layer_table must be a pandas DataFrame (from pipexplore.predict.profiler) or None, got "
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
        self._profile_options = dict(granularity=granularity, repeats=profile_repeats,
                                     device=devices[0] if devices else None)
        if layer_table is None:
            if self.traced and isinstance(sample, Mapping):  # keyword inputs (a BatchEncoding too) as a dict
                self.sample = sample = dict(sample)
            planned = devices or _default_devices(max(2, torch.cuda.device_count()))[0]
            # The input/weight-gradient split is measured when a zero-bubble plan first needs it.
            layer_table = self._profile_layers(chunks, planned, split_backward=schedule == "zero-bubble")
        if self.traced:
            self.notes.append(f"{type(model).__name__} is not an nn.Sequential: its candidate split points are its "
                              f"{granularity} (by FQN), split by torch.distributed.pipelining's tracer; runs execute "
                              "the traced stages in this process (threads) or one process per stage (processes).")
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
        self._next_run = 0
        self._lock = threading.Lock()  # one run at a time
        # Plan changes, run completion and view refreshes happen under this lock, from any thread.
        self._plan_lock = threading.RLock()
        self._thread: Optional[threading.Thread] = None
        self._counter: Optional[tl.ActionCounter] = None  # actions done per stage by the run in progress
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
        if "memory_cap" in changes:  # not part of the plan: the cap drawn on the memory panel
            cap = parse_bytes(changes.pop("memory_cap"), "memory_cap")
            plan = self.update(**changes) if changes else self._plan
            self.memory_cap = cap
            return plan
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

    def _profile_layers(self, chunks: int, devices: Sequence[Any], split_backward: bool = True) -> pd.DataFrame:
        """Time every layer (or traced candidate) on the sample, at the micro-batch of ``chunks`` and
        at the whole batch, with the intra-op threads each CPU stage on ``devices`` runs with (the
        host's cores shared among the stages that run at once), so that what is predicted is what
        runs."""
        threads = stage_threads(devices)
        options = self._profile_options
        if self.traced:
            from pipexplore.models.trace import candidates_in_rows

            with sharing_cores(threads):
                table = candidates_in_rows(copy.deepcopy(self.model), self.sample, chunks=chunks or 1,
                                           granularity=options["granularity"], loss_fn=self.loss_fn,
                                           target=self.target, repeats=options["repeats"])
            table.attrs["threads"] = threads or torch.get_num_threads()
            return table
        batch = batch_size(self.sample)
        rows = sorted({max(1, -(-batch // chunks)) if chunks > 1 else max(1, batch // 2), batch})
        profiled = copy.deepcopy(self.model)
        with validate.naming_failing_layer(profiled, self.sample), profile_progress() as progress:
            # a sample that does not fit: which layer says so; in a notebook, a bar counts the layers
            return profile(profiled, self.sample, repeats=options["repeats"], microbatch_rows=rows,
                           device=self._profile_device(), progress=progress, threads=threads,
                           split_backward=split_backward)

    def _profile_device(self) -> torch.device:
        """Where layers are timed: the first stage's device, else the first GPU, else the CPU."""
        return _as_device(self._profile_options["device"] or ("cuda:0" if torch.cuda.is_available() else "cpu"))

    def reprofile(self) -> pd.DataFrame:
        """Time every layer again, for the current plan: its micro-batch size and the intra-op
        threads its CPU stages run with (which change with the number of CPU stages). Predictions
        then start from the new table: what runs taught (relative to the old one) is dropped, and
        the executor is probed again. Returns the new layer table.

        Example::

            explorer.update(devices="cpu,cpu,cpu,cpu")   # 4 CPU stages: fewer threads each
            explorer.reprofile()
        """
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a run is in progress: re-profile once it has finished (or cancel it)")
        plan = self._plan
        table = self._profile_layers(plan.chunks, plan.devices[: plan.num_devices],
                                     split_backward=plan.schedule == "zero-bubble")
        if len(table) != len(self.layer_table):
            raise RuntimeError(f"the model now has {len(table)} layers, not {len(self.layer_table)}: "
                               "start a new explorer for it")
        with self._plan_lock:
            self.layer_table = table
            self._set_plan(replace(plan, layer_table=table, corrections=Corrections()))
        return table

    def _thread_note(self) -> str:
        """What to say when the costs were timed with other intra-op threads than the plan's CPU
        stages run with ('' when they agree)."""
        plan = self._plan
        profiled = self.layer_table.attrs.get("threads")
        if profiled is None:
            return ""
        runs_with = stage_threads(plan.devices[: plan.num_devices]) or torch.get_num_threads()
        if runs_with == profiled:
            return ""
        return (f"Costs were timed with {profiled} intra-op thread(s); this plan's CPU stages run with {runs_with} "
                "each (the cores are shared among the stages): ex.reprofile() times them again.")

    def _change_plan(self, change: Callable[[Plan], Plan]) -> Plan:
        """Apply ``change`` to the current plan and show it, atomically with respect to runs finishing."""
        with self._plan_lock:
            plan = change(self._plan)
            if plan.schedule == "zero-bubble" and self._with_backward_split() is not plan.layer_table:
                plan = replace(plan, layer_table=self.layer_table)
            plan = self._with_executor_costs(plan)
            _ = plan.predicted  # a plan that cannot be predicted is refused before it replaces the old one
            self._plan = plan
            self._refresh()
            return plan

    def _on_figure_message(self, widget: Any, content: Any, buffers: Any) -> None:
        """The page drew the explorer's first timeline: now import what a first run needs (torch's
        optimizers, the pipelining helpers: ~1.5 s) in the background, while the explorer is
        looked at; a run waits for it (nothing is timed beside an import). Not before: beside the
        import, the kernel would put the explorer on the screen ~1 s later."""
        if isinstance(content, dict) and content.get("event") == "drawn":
            from pipexplore.widgets.plots import warm_up_runs

            background.start(warm_up_runs, "pipexplore-warm-up-runs")
            with self._plan_lock:
                self._drawn = True
                self._send_retime()

    def _send_retime(self) -> None:
        """Name the current plan's shape to the timeline, and give the page what it needs to
        re-time a moved split itself (:mod:`pipexplore.retime`) when that shape or the costs
        changed since it was last given. Not before the first picture is drawn: the model is
        about as large as a scene, and the page waits for the kernel until it has one."""
        from pipexplore.predict.retime import retime_key, retime_model
        from pipexplore.widgets.timeline_canvas import lane_of

        plan = self._plan
        options = plan.simulate_options()
        key = retime_key(plan.layer_table, plan.splits, options)
        self.timelines.retime(key)  # scenes name the shape; the page re-times with a model of the same
        if not self._drawn or key == self._retime_for[0]:
            return
        try:
            model = retime_model(plan.layer_table, list(plan.splits), samples=batch_size(self.sample),
                                 bubble_by=tl.bubble_by(plan.schedule), **options)
        except Exception:  # nothing the page can re-time: it waits for the kernel's scenes
            self.timelines.retime("")
            return
        # (the table and corrections are held with the key, which names them by identity)
        self._retime_for = (key, plan.layer_table, plan.corrections)
        self.timelines.retime(key, {**model, "key": key}, [stage for stage, _ in lane_of(plan.predicted)[0]])

    def _with_backward_split(self) -> pd.DataFrame:
        """The layer table with its input/weight-gradient split measured (zero-bubble runs its
        backward as those two passes): measured once, the first time a plan needs it."""
        if self.layer_table.attrs.get("backward_split", True) or self.traced:
            return self.layer_table
        from pipexplore.predict.profiler import backward_split

        profiled = copy.deepcopy(self.model).to(self._profile_device())
        self.layer_table = backward_split(profiled, self.sample, self.layer_table,
                                          repeats=self._profile_options["repeats"])
        return self.layer_table

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
            with cancel_scope(token), tl.counting_actions() as counter:
                self._counter = counter
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
            from pipexplore.export.torchrun import torchrun_script

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
        from pipexplore.export.torchrun import module_fqns_per_model_part

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

        # zero-bubble rows are predicted from the measured input/weight-gradient split
        if "zero-bubble" in schedules and self._with_backward_split() is not self._plan.layer_table:
            with self._plan_lock:
                self._set_plan(replace(self._plan, layer_table=self.layer_table))
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
        from pipexplore.predict.residuals import residuals

        if not self._results:
            raise LookupError("no run yet: call explorer.run() or press 'Run step'")
        result = self._results[run]
        return residuals(result.predicted, result.timeline)

    # ---- the widget ---------------------------------------------------------------------
    def _build_widget(self) -> None:
        plan = self._plan
        self._shown_run: Optional[int] = None  # the run the measured panel shows (None: the latest)
        self._compare_run: Optional[int] = None
        self._compare_view: Optional[TimelineView] = None  # made on the first comparison, redrawn after
        self._runs_sort = "run"
        self._strip_error = ""
        self._running_text = ""
        self._run_started = 0.0
        self._figures_of: tuple[Optional[Plan], dict[str, Any]] = (None, {})
        self._memory_cap = getattr(self, "_memory_cap", None)
        self._uuid = f"pipexplore-runs-{id(self):x}"
        self._choosing = False  # the run choosers are being refilled: not a choice of the user
        group = f"pipexplore-{id(self):x}"  # the strip whose moves the timeline re-times in the page
        self.bar = SplitBar(layers=self._layer_dicts(), splits=list(plan.splits), skips=self._skip_dicts(),
                            view="time", stage_totals=self._stage_totals("time"), group=group)
        self.bar.observe(self._on_bar_splits, names="splits")
        self.bar.observe(self._on_bar_hover, names="hovered")
        compact = {"description_width": "initial"}
        self.w_stage_count = W.IntText(value=plan.num_stages, description="stages", style=compact,
                                       layout=W.Layout(width="92px"))
        self.w_chunks = W.IntText(value=plan.chunks, description="chunks", style=compact, layout=W.Layout(width="92px"))
        self.w_checkpoint = W.Dropdown(options=["always", "except_last", "never"], value=plan.checkpoint,
                                       description="checkpoint", style=compact, layout=W.Layout(width="190px"))
        self.w_schedule = W.Dropdown(options=list(PLAN_SCHEDULES), value=plan.schedule, description="schedule",
                                     style=compact, layout=W.Layout(width="180px"))
        self.w_executor = W.Dropdown(options=list(EXECUTORS), value=plan.executor, description="executor",
                                     style=compact, layout=W.Layout(width="150px"))
        self.w_devices = W.Text(value=",".join(plan.devices), description="devices", continuous_update=False,
                                style=compact, layout=W.Layout(width="210px"))
        self.w_run = W.Button(description="Run step", button_style="primary", icon="play",
                              tooltip="train 1 warm-up + 3 measured steps of this plan", layout=W.Layout(width="110px"))
        self.w_view = W.ToggleButtons(options=[("time", "time"), ("params", "params"), ("act.", "memory")],
                                      value="time", tooltips=["cell widths: forward + backward time",
                                                              "cell widths: parameter bytes",
                                                              "cell widths: activation bytes"],
                                      style={"button_width": "74px"})
        self.w_balance_time = W.Button(description="Balance by time", layout=W.Layout(width="130px"),
                                       tooltip="splits that minimise the slowest stage")
        self.w_balance_size = W.Button(description="Balance by size", layout=W.Layout(width="130px"),
                                       tooltip="splits that minimise the largest stage (parameters and activations)")
        self.w_mode = W.ToggleButtons(options=[("timelines", "timelines"), ("residuals", "residuals")],
                                      value="timelines",
                                      tooltips=["predicted and measured steps, one time axis",
                                                "each action's prediction error, stage × micro-batch"],
                                      style={"button_width": "80px"})
        self.w_memory_cap = W.Text(value="" if self._memory_cap is None else _fmt_bytes(self._memory_cap),
                                   description="memory cap", placeholder="e.g. 2 GiB", continuous_update=False,
                                   style=compact, layout=W.Layout(width="190px"))
        self.w_progress = W.FloatProgress(value=0.0, min=0.0, max=1.0, layout=W.Layout(width="160px", display="none"))
        self.w_status = W.HTML(self._notes_html())
        self.w_header = W.HTML()
        self.w_stages = W.HTML()
        self.w_runs = W.HTML()
        self.w_show_run = W.Dropdown(options=[("latest", -1)], value=-1, description="show run", style=compact,
                                     layout=W.Layout(width="150px"))
        self.w_restore = W.Button(description="Restore this plan", icon="undo", disabled=True,
                                  layout=W.Layout(width="auto"))
        self.w_compare = W.Dropdown(options=[("—", -1)], value=-1, description="compare with", style=compact,
                                    layout=W.Layout(width="180px"))
        self.w_sort = W.Dropdown(options=[("run", "run"), ("step time", "step_time"), ("|error|", "prediction_error"),
                                          ("bubble", "bubble"), ("throughput", "throughput")],
                                 value="run", description="sort by", style=compact, layout=W.Layout(width="170px"))
        self.w_compare_box = W.VBox([])
        kinds = [("GPipe", "gpipe"), ("torch pipelining", "pipelining"), ("torchrun script", "torchrun"),
                 ("Chrome trace", "chrome-trace"), ("HTML report", "html")]
        self.w_export_kind = W.Dropdown(options=[k for k in kinds if not (self.traced and k[1] == "gpipe")],
                                        layout=W.Layout(width="170px"))
        self.w_export = W.Button(description="Export", icon="code", layout=W.Layout(width="100px"))
        self.w_code = CodeView()
        self.w_errors = {name: W.HTML("", layout=W.Layout(display="none")).add_class("pipexplore-field-error")
                         for name in ("stages", "chunks", "checkpoint", "schedule", "executor", "devices",
                                      "memory_cap", "export")}
        self.timelines = TimelineView(plan.predicted, None, batch_size(self.sample), memory_cap=self._memory_cap)
        self.figure = self.timelines.figure
        self.figure.group = group
        self._drawn = False  # the page has drawn the first timeline
        self._retime_for: tuple[Any, ...] = ("",)  # the key the page's re-timing model has, and what it names
        self.figure.on_msg(self._on_figure_message)
        self.w_timeline_box = W.VBox([self.figure])
        self.w_residuals = W.VBox([], layout=W.Layout(display="none"))
        self.residual_figure: Any = None

        for control, name in ((self.w_chunks, "chunks"), (self.w_checkpoint, "checkpoint"),
                              (self.w_schedule, "schedule"), (self.w_devices, "devices"),
                              (self.w_executor, "executor"), (self.w_stage_count, "stages"),
                              (self.w_memory_cap, "memory_cap")):
            control.observe(self._on_control(name), names="value")
        self.w_view.observe(lambda change: self._refresh_bar(), names="value")
        self.w_balance_time.on_click(lambda _: self._guard(lambda: self.balance("time")))
        self.w_balance_size.on_click(lambda _: self._guard(lambda: self.balance("size")))
        self.w_run.on_click(self._on_run_clicked)
        self.w_export.on_click(self._on_export)
        self.w_mode.observe(lambda change: self._refresh_residuals(), names="value")
        self.w_show_run.observe(self._on_show_run, names="value")
        self.w_compare.observe(self._on_compare, names="value")
        self.w_sort.observe(self._on_sort, names="value")
        self.w_restore.on_click(lambda _: self._guard(lambda: self.restore(self._shown_run_number())))

        errors = self.w_errors
        controls = W.HBox([self.w_stage_count, errors["stages"], self.w_chunks, errors["chunks"], self.w_checkpoint,
                           errors["checkpoint"], self.w_schedule, errors["schedule"], self.w_executor,
                           errors["executor"], self.w_devices, errors["devices"], self.w_run])
        strip_tools = W.HBox([self.w_view, self.w_balance_time, self.w_balance_size, W.HTML(
            "<span class='pipexplore-note'>drag a handle (or focus it and use ←/→) · double-click a layer boundary to "
            "add a split · Delete (or drag it off the strip) removes one</span>")])
        timeline_tools = W.HBox([self.w_mode, self.w_memory_cap, errors["memory_cap"]])
        run_tools = W.HBox([self.w_show_run, self.w_restore, self.w_compare, self.w_sort])
        export_tools = W.HBox([self.w_export_kind, self.w_export, errors["export"]])
        for box in (controls, strip_tools, timeline_tools, run_tools, export_tools):
            box.add_class("pipexplore-controls")
        self.widget = W.VBox([
            W.HTML(style_tag(), layout=W.Layout(display="none")), self.w_header, controls, strip_tools, self.bar,
            self.w_stages, timeline_tools, self.w_timeline_box, self.w_residuals,
            W.HBox([self.w_progress, self.w_status]),
            W.HTML("<div class='pipexplore-section'>runs</div>"), run_tools, self.w_runs, self.w_compare_box,
            W.HTML("<div class='pipexplore-section'>export</div>"), export_tools, self.w_code,
        ], layout=W.Layout(max_width="100%"))
        self.widget.add_class("pipexplore-explorer")
        self._refresh_header()
        self._refresh_timelines()
        self._refresh_stages()
        self._refresh_runs()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(bundle, dict):
            # A static view beside the live one: a reload without the kernel, nbviewer or GitHub show it.
            bundle["text/html"] = self.static_html()
        return bundle

    def static_html(self) -> str:
        """The explorer as static HTML (no JavaScript): header, strip, stage view, predicted and
        measured timelines on one scale, runs. What a notebook keeps for viewers without a kernel.

        Example::

            pathlib.Path("explorer.html").write_text(explorer.static_html())
        """
        from pipexplore.widgets.static import strip_svg, timeline_svg

        result = self._shown_result()
        measured = result.timeline if result is not None else None
        x_max = self.timelines.x_range[1]
        return (f"<div class='pipexplore-report pipexplore-static'>{style_tag()}{self.w_header.value}"
                + strip_svg(self.bar.layers, self.splits, self.bar.skips, self.bar.view, self.bar.stage_totals)
                + self.w_stages.value
                + "<div class='pipexplore-timeline' data-splits='" + ",".join(map(str, self.splits)) + "'>"
                + timeline_svg(self._plan.predicted, "predicted: " + plan_text(self._plan), x_max_ms=x_max)
                + timeline_svg(measured, "measured" + (f": run {self._run_number(result)} · {plan_text(result.plan)}"
                                                       if result is not None else ""), x_max_ms=x_max)
                + "</div>" + self.w_runs.value + "</div>")

    def to_html(self, path: Any = "pipexplore-report.html") -> Any:
        """Write one self-contained HTML page of the explorer (strip as SVG, stage view, timelines,
        memory and residuals drawn by the page's own canvas widgets with their JavaScript embedded,
        runs table, the exported code) that opens in a browser with no kernel and no network.
        Returns its path.

        Example::

            explorer.to_html("report.html")
        """
        from pipexplore.widgets.report import write_report

        return write_report(self, path)

    @property
    def memory_cap(self) -> Optional[float]:
        """Bytes of activation memory a stage may hold (drawn on the memory panel; stages over it
        are flagged), or None."""
        return getattr(self, "_memory_cap", None)

    @memory_cap.setter
    def memory_cap(self, value: Any) -> None:
        self._memory_cap = parse_bytes(value, "memory_cap")
        if hasattr(self, "w_memory_cap"):
            text = "" if self._memory_cap is None else _fmt_bytes(self._memory_cap)
            if parse_bytes(self.w_memory_cap.value or None, "memory_cap", strict=False) != self._memory_cap:
                self.w_memory_cap.value = text
            self._refresh_header()
            self._refresh_timelines()
            self._refresh_stages()

    def restore(self, run: int) -> Plan:
        """Make the plan of run ``run`` (its number in :attr:`runs`) the current plan again; what
        calibration learnt since is kept.

        Example::

            explorer.restore(2)
        """
        rows = [row for row in self._runs if row["run"] == run]
        if not rows:
            known = ", ".join(str(row["run"]) for row in self._runs[-10:]) or "none yet"
            raise LookupError(f"run {run!r} is not in explorer.runs (latest runs: {known}): pass a number from the "
                              "'run' column")
        row = rows[0]
        result = self._result_of(run)
        if result is not None:
            old = result.plan
            options = dict(splits=old.splits, devices=old.devices, chunks=old.chunks, checkpoint=old.checkpoint,
                           schedule=old.schedule, executor=old.executor, virtual_stages=old.virtual_stages)
        else:
            executor = row["executor"] if row["executor"] in EXECUTORS else self._plan.executor
            options = dict(splits=tuple(row["splits"]), devices=tuple(str(row["devices"]).split(",")),
                           chunks=int(row["chunks"]), checkpoint=str(row["checkpoint"]), schedule=str(row["schedule"]),
                           executor=executor)
        plan = self._change_plan(lambda plan: plan.with_options(**options))
        self._set_status(f"restored the plan of run {run}: {plan_text(plan)}")
        return plan

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


    def _notes_html(self) -> str:
        notes = [*self.notes, self._thread_note()] if hasattr(self, "_plan") else self.notes
        return "".join(f"<div class='pipexplore-note'>{html.escape(n)}</div>" for n in notes if n)


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


    def _stage_totals(self, view: str) -> list[str]:
        stages = self._plan.stages
        if view == "params":
            return [f"{_fmt_bytes(v)} params" for v in stages["param_bytes"]]
        if view == "memory":
            return [f"{_fmt_bytes(v)} act." for v in stages["activation_bytes"]]
        return [f"{(f + b) * 1e3:.2f} ms" for f, b in zip(stages["forward"], stages["backward"])]

    def _refresh(self) -> None:
        if not hasattr(self, "bar"):
            return
        self._sync_controls()
        self._refresh_bar()
        self._refresh_timelines()  # the picture first: the page draws it while the tables follow
        self._refresh_header()
        self._refresh_stages()

    def _refresh_bar(self) -> None:
        with self.bar.hold_sync():
            self.bar.splits = list(self._plan.splits)
            self.bar.view = self.w_view.value
            self.bar.stage_totals = self._stage_totals(self.w_view.value)
            self.bar.error = self._strip_error

    def _plan_figures(self) -> dict[str, Any]:
        """The current plan's predicted figures, computed once per plan."""
        plan, figures = self._figures_of
        if plan is not self._plan:
            figures = plan_figures(self._plan, batch_size(self.sample))
            self._figures_of = (self._plan, figures)
        return figures

    def _on_bar_hover(self, change: dict) -> None:
        """A layer of the strip hovered: its stage's lanes shaded in the timelines (-1: none)."""
        stage = change["new"]
        with self._plan_lock:
            if hasattr(self, "timelines"):
                self.timelines.highlight(None if stage is None or stage < 0 else int(stage))

    def _refresh_header(self) -> None:
        if not hasattr(self, "w_header"):
            return
        title = f"{len(self.layer_table)} layers · batch {batch_size(self.sample)} · {plan_text(self._plan)}"
        last = self._runs[-1] if self._runs else None
        self.w_header.value = header_html(title, self._plan_figures(), last, self._memory_cap)

    def _refresh_timelines(self) -> None:
        """The predicted panel shows the current plan; the measured one the chosen run (the latest
        by default), titled with its plan and flagged when that is not the current plan."""
        if not hasattr(self, "timelines"):
            return
        plan = self._plan
        result = self._shown_result()
        measured: dict[str, Any] = {"clear_measured": True}
        if result is not None:
            difference = self._plan_difference(result.plan)
            measured = dict(measured=result.timeline, measured_title=f"run {self._run_number(result)} · "
                            f"{short_plan_text(result.plan)}", measured_warning=difference,
                            measured_prediction=result.predicted,
                            measured_stage_layers=_stage_layers(result.plan.splits, len(self.layer_table)))
        self._send_retime()  # before the scene, which names it
        figures = self._plan_figures()
        numbers = (f"step {figures['step_time'] * 1e3:.1f} ms · bubble {figures['bubble'] * 100:.1f} %"
                   + (f" · {figures['throughput']:,.0f} samples/s" if not math.isnan(figures["throughput"]) else ""))
        self.timelines.show(predicted=plan.predicted, splits=plan.splits, predicted_title="the current plan",
                            predicted_summary=numbers, stage_layers=_stage_layers(plan.splits, len(self.layer_table)),
                            memory_cap=self._memory_cap, **measured)

    def _plan_difference(self, other: Plan) -> str:
        """'' when ``other`` is the current plan, else what differs (for the measured panel's title)."""
        plan = self._plan
        changes = [f"{name} {theirs} → {ours}" for name, theirs, ours in (
            ("splits", splits_text(other.splits), splits_text(plan.splits)), ("chunks", other.chunks, plan.chunks),
            ("schedule", other.schedule, plan.schedule), ("checkpoint", other.checkpoint, plan.checkpoint),
            ("executor", other.executor, plan.executor),
            ("devices", ",".join(other.devices[: other.num_devices]), ",".join(plan.devices[: plan.num_devices])))
            if theirs != ours]
        return ("not the current plan: " + ", ".join(changes)) if changes else ""

    def _run_number(self, result: Optional[RunResult]) -> Optional[int]:
        if result is None or result.timeline.empty:
            return None
        return int(result.timeline["run"].iloc[0])

    def _result_of(self, run: Optional[int]) -> Optional[RunResult]:
        for result in reversed(self._results):
            if self._run_number(result) == run:
                return result
        return None

    def _shown_result(self) -> Optional[RunResult]:
        if not self._results:
            return None
        if getattr(self, "_shown_run", None) is None:
            return self._results[-1]
        return self._result_of(self._shown_run) or self._results[-1]

    def _shown_run_number(self) -> Optional[int]:
        return self._run_number(self._shown_result())

    def stage_table(self) -> pd.DataFrame:
        """Per stage: device, layers, time, parameters, activations, predicted peak activation
        memory, and the measured peak of its device in the latest run (where the device reports it)."""
        stages = self._plan.stages
        peaks = self._plan_figures()["peak_memory_per_stage"] if hasattr(self, "w_header") else None
        if peaks is None:
            predicted = self._plan.predicted
            by_stage = predicted.groupby("stage")["memory"].max() if "memory" in predicted else pd.Series(dtype=float)
            peaks = [float(by_stage.get(s, math.nan)) for s in stages["stage"]]
        result = self._shown_result() if hasattr(self, "_shown_run") else (self._results[-1] if self._results else None)
        measured = result.timeline.attrs.get("peak_memory", {}) if result is not None else {}
        return pd.DataFrame({
            "stage": stages["stage"], "device": stages["device"],
            "layers": [f"{a}–{b}" for a, b in zip(stages["first_layer"], stages["last_layer"])],
            "fwd+bwd": stages["forward"] + stages["backward"], "params": stages["param_bytes"],
            "activations": stages["activation_bytes"],
            "peak activations (predicted)": peaks,
            "peak memory (measured)": [float(measured.get(str(d), math.nan)) for d in stages["device"]],
        })

    def _refresh_stages(self) -> None:
        if not hasattr(self, "w_stages"):
            return
        table = self.stage_table()
        crossing = [r for r in self._plan.skip_routes if r.crosses]
        cap = self._memory_cap
        measured_known = table["peak memory (measured)"].notna().any()

        def size(v: float) -> str:
            return "–" if math.isnan(v) else _fmt_bytes(v)

        rows = []
        for stage, device, layers, seconds, params, act, peak, measured in table.itertuples(index=False, name=None):
            over = cap is not None and peak > cap
            swatch = ("<span class='pipexplore-stage-swatch' "
                      f"style='background:{STAGE_COLORS[stage % len(STAGE_COLORS)]}'></span>")
            rows.append(f"<tr><td>{swatch}{stage}</td><td>{html.escape(str(device))}</td><td>{layers}</td>"
                        f"<td>{seconds * 1e3:.2f} ms</td><td>{size(params)}</td><td>{size(act)}</td>"
                        f"<td class='{'pipexplore-over' if over else ''}'>{'⚠ ' if over else ''}{size(peak)}</td>"
                        + (f"<td>{size(measured)}</td>" if measured_known else "") + "</tr>")
        skips = (f"{len(crossing)} of {len(self._plan.skip_routes)} skip routes cross stages (copied)"
                 if self._plan.skip_routes else "no skip routes")
        shared = self.shared_parameters()
        if shared:
            skips += "<br>⚠ parameters used by several stages: " + ", ".join(
                f"{html.escape(name)} (stages {', '.join(map(str, stages_))})" for name, stages_ in shared.items())
        self.w_stages.value = (
            "<div class='pipexplore-stages-view'><table class='pipexplore-stages'><thead><tr><th>stage</th>"
            "<th>device</th><th>layers</th><th>fwd+bwd</th><th>params</th><th>activations</th>"
            "<th>peak act. (predicted)</th>" + ("<th>peak memory (measured)</th>" if measured_known else "")
            + "</tr></thead><tbody>" + "".join(rows)
            + f"</tbody></table></div><div class='pipexplore-note'>{skips}</div>")

    def _refresh_runs(self) -> None:
        """The runs table (the latest :data:`RUNS_SHOWN` runs, pandas Styler), the run choosers,
        and what shows the chosen run: measured panel, header, stage view, residuals, comparison."""
        if not hasattr(self, "w_runs"):
            return
        rows = self._runs[-RUNS_SHOWN:]
        shown = self._shown_run_number()
        self.w_runs.value = runs_html(pd.DataFrame(rows, columns=RUN_COLUMNS), earlier=len(self._runs) - len(rows),
                                      sort_by=self._runs_sort, descending=self._runs_sort == "throughput",
                                      shown_run=shown, uuid=self._uuid)
        kept = [n for n in (self._run_number(r) for r in self._results) if n is not None]
        self._choosing = True
        try:
            self.w_show_run.options = [("latest", -1)] + [(f"run {n}", n) for n in reversed(kept)]
            self.w_show_run.value = self._shown_run if self._shown_run in kept else -1
            self.w_compare.options = [("—", -1)] + [(f"run {n}", n) for n in reversed(kept)]
            self.w_compare.value = self._compare_run if self._compare_run in kept else -1
        finally:
            self._choosing = False
        self.w_restore.disabled = shown is None
        self.w_restore.description = "Restore this plan" if shown is None else f"Restore run {shown}'s plan"
        self._refresh_timelines()
        self._refresh_header()
        self._refresh_stages()
        self._refresh_residuals()
        self._refresh_compare()

    def _refresh_residuals(self) -> None:
        """In residuals mode: the shown run's error per action, stage × micro-batch, in place of the timelines."""
        if not hasattr(self, "w_mode"):
            return
        residual_mode = self.w_mode.value == "residuals"
        self.w_residuals.layout.display = "" if residual_mode else "none"
        self.w_timeline_box.layout.display = "none" if residual_mode else ""
        if not residual_mode:
            return
        from pipexplore.predict.residuals import residuals

        result = self._shown_result()
        table = residuals(result.predicted, result.timeline) if result is not None else None
        title = f"run {self._run_number(result)}" if result is not None else ""
        if self.residual_figure is None:
            self.residual_figure = ResidualCanvas()
            self.w_residuals.children = [self.residual_figure]
        self.residual_figure.show(table, title)

    def _refresh_compare(self) -> None:
        """Two runs side by side: their figures and plans in a table, their timelines on one time axis."""
        if not hasattr(self, "w_compare_box"):
            return
        a, b = self._shown_result(), self._result_of(self._compare_run)
        if a is None or b is None or a is b:
            self.w_compare_box.children = []
            return
        rows = {row["run"]: row for row in self._runs}
        first, second = rows.get(self._run_number(a), {}), rows.get(self._run_number(b), {})

        def cell(row: Mapping[str, Any], key: str) -> str:
            value = row.get(key, "")
            if key in ("step_time", "predicted_step_time"):
                return f"{value * 1e3:.2f} ms"
            if key in ("bubble", "prediction_error"):
                return f"{value * 100:+.1f} %" if key == "prediction_error" else f"{value * 100:.1f} %"
            if key == "throughput":
                return f"{value:,.0f} samples/s"
            return html.escape(str(value))

        keys = ["step_time", "predicted_step_time", "prediction_error", "bubble", "throughput", "splits", "chunks",
                "schedule", "checkpoint", "executor", "devices"]
        body = "".join(f"<tr><th>{key.replace('_', ' ')}</th><td>{cell(first, key)}</td>"
                       f"<td>{cell(second, key)}</td></tr>"
                       for key in keys)
        table = W.HTML(f"<table class='pipexplore-compare-table'><tr><th></th><th>run {first.get('run')}</th>"
                       f"<th>run {second.get('run')}</th></tr>{body}</table>")
        names = (f"run {first.get('run')}", f"run {second.get('run')}")
        view = self._compare_view
        if view is None:  # one view for every comparison: its widget is redrawn, not replaced
            view = self._compare_view = TimelineView(samples=batch_size(self.sample), memory=False)
        view.names = names
        view.show(predicted=a.timeline, measured=b.timeline, predicted_title=short_plan_text(a.plan),
                  measured_title=short_plan_text(b.plan))
        self.w_compare_box.children = [W.HTML("<div class='pipexplore-section'>compared</div>"), table, view.figure]

    def _set_status(self, text: str, *, busy: bool = False, error: bool = False) -> None:
        if busy:
            self._running_text = text
        spinner = "<span class='pipexplore-spinner' role='progressbar' aria-label='working'></span>" if busy else ""
        css = "pipexplore-status" + (" pipexplore-error-text" if error else "")
        self.w_status.value = self._notes_html() + f"<div class='{css}'>{spinner}{html.escape(text)}</div>"
        if busy and threading.current_thread() is not self._thread and self.w_run.description != "Cancel":
            self._show_running()
        elif not busy and self._thread is not None and threading.current_thread() is self._thread:
            self._show_idle()  # the run's last word: the button runs again

    def _show_running(self) -> None:
        """During a run: the button cancels it, and a bar shows the time spent against the predicted."""
        self._run_started = time.monotonic()
        self.w_run.description, self.w_run.icon, self.w_run.button_style = "Cancel", "stop", "danger"
        self.w_run.tooltip = "stop the run: its workers stop after their current action; the plan and runs stay"
        self.w_run.disabled = False
        self.w_progress.value = 0.0
        self.w_progress.layout.display = ""
        try:
            loop = asyncio.get_running_loop()  # the kernel's: a tick every 0.25 s while the run lasts
        except RuntimeError:
            return
        expected = max(1e-3, 4 * tl.step_time(self._plan.predicted))  # 1 warm-up + 3 measured steps
        per_stage = _actions_per_stage(self._plan.predicted, steps=3)

        def tick() -> None:
            if self._thread is None or not self._thread.is_alive():
                return
            elapsed = time.monotonic() - self._run_started
            done = self._counter.done() if self._counter is not None else {}
            total = sum(per_stage.values())
            if done and total:  # the measured steps' actions, as the stages do them
                self.w_progress.value = min(0.99, sum(done.values()) / total)
                detail = " · ".join(f"stage {s}: {done.get(s, 0)}/{n}" for s, n in sorted(per_stage.items()))
                detail = f"measured steps, actions done: {detail}"
            else:  # the warm-up step (or a process per stage, which reports at the end)
                self.w_progress.value = min(0.95, elapsed / (expected + 0.5))
                detail = f"1 warm-up + 3 measured steps, predicted {expected:.2f} s"
            with self._plan_lock:
                if not self._running_text:  # the run has said its last word meanwhile: keep it
                    return
                self.w_status.value = self._notes_html() + (
                    "<div class='pipexplore-status'><span class='pipexplore-spinner'></span>"
                    f"{html.escape(self._running_text)} {elapsed:.1f} s ({html.escape(detail)})</div>")
            loop.call_later(0.25, tick)

        loop.call_later(0.25, tick)

    def _show_idle(self) -> None:
        self._running_text = ""
        self.w_run.description, self.w_run.icon, self.w_run.button_style = "Run step", "play", "primary"
        self.w_run.tooltip = "train 1 warm-up + 3 measured steps of this plan"
        self.w_progress.layout.display = "none"

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
        try:
            action()
            self.last_error = self._strip_error = ""
            if self._thread is not None and self._thread.is_alive():
                self._set_status(self._running_text, busy=True)  # a change during a run keeps its status
            else:
                self._set_status("")
        except Exception as exc:  # a bad value: show it, keep the plan
            self._show_error(exc)
        self._refresh_bar()

    def _devices_for(self, stages: int) -> tuple[tuple[str, ...], str]:
        """The devices for ``stages`` stages: extra ones dropped, missing ones repeated from the last."""
        plan = self._plan
        needed = max(1, stages // plan.virtual_stages) if plan.schedule == "interleaved" else stages
        pool = list(plan.devices)
        if len(pool) >= needed:
            dropped = pool[needed:]
            return tuple(pool[:needed]), (f"{stages} stages: {', '.join(dropped)} dropped" if dropped else "")
        added = needed - len(pool)
        return (tuple(pool + [pool[-1]] * added),
                f"{stages} stages: {pool[-1]} repeated for {added} more device{'s' if added > 1 else ''}")

    def _on_bar_splits(self, change: dict[str, Any]) -> None:
        proposed = list(change["new"])
        if proposed == list(self._plan.splits):
            return
        try:
            if len(proposed) != len(self._plan.splits):  # a split added or removed in the strip
                devices, note = self._devices_for(len(proposed) + 1)
                self.update(splits=proposed, devices=devices)
                self._set_field_message("devices", note, error=False)
            else:
                self.splits = proposed
            self._strip_error = ""
        except Exception as exc:  # refused: the strip shows the plan's splits and says why
            self._strip_error = f"{type(exc).__name__}: {exc}"
            self.last_error = self._strip_error
        self._refresh_bar()

    def _set_field_message(self, name: str, text: str, *, error: bool = True) -> None:
        """A message beside the field ``name`` (hidden when empty)."""
        box = self.w_errors[name]
        box.value = html.escape(text) if error else f"<span class='pipexplore-field-note'>{html.escape(text)}</span>"
        box.layout.display = "" if text else "none"

    def _on_control(self, name: str) -> Callable[[dict[str, Any]], None]:
        def handler(change: dict[str, Any]) -> None:
            value = change["new"]
            plan = self._plan
            current = {"chunks": plan.chunks, "checkpoint": plan.checkpoint, "schedule": plan.schedule,
                       "executor": plan.executor, "devices": ",".join(plan.devices), "stages": plan.num_stages,
                       "memory_cap": None}[name]
            if name != "memory_cap" and (value == current
                                         or (name == "devices" and str(value).replace(" ", "") == current)):
                self._set_field_message(name, "")
                return
            try:
                note = ""
                if name == "stages":
                    note = self._set_stage_count(value)
                elif name == "memory_cap":
                    self.memory_cap = value.strip() or None
                else:
                    self.update(**{name: value})
                    if name == "devices" and len(self._plan.devices) > self._plan.num_devices:
                        unused = self._plan.devices[self._plan.num_devices:]
                        note = f"{', '.join(unused)} not used: {self._plan.num_stages} stages"
                self.last_error = ""
                self._set_field_message(name, note, error=False)
            except Exception as exc:  # shown beside the field; what was typed stays there
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._set_field_message(name, str(exc))
        return handler

    def _set_stage_count(self, stages: Any) -> str:
        """Split into ``stages`` balanced stages (by time); the devices follow. Returns what changed in them."""
        count = len(self.layer_table)
        if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= count:
            raise ValueError(f"stages must be a whole number from 1 to {count} (the layers), got {stages!r}")
        devices, note = self._devices_for(stages)
        self.update(splits=self._balanced(stages, "time"), devices=devices)
        self._set_field_message("devices", note, error=False)
        return ""

    def _sync_controls(self) -> None:
        plan = self._plan
        for control, value, name in ((self.w_chunks, plan.chunks, "chunks"),
                                     (self.w_checkpoint, plan.checkpoint, "checkpoint"),
                                     (self.w_schedule, plan.schedule, "schedule"),
                                     (self.w_devices, ",".join(plan.devices), "devices"),
                                     (self.w_executor, plan.executor, "executor"),
                                     (self.w_stage_count, plan.num_stages, "stages")):
            if control.value != value:
                control.value = value
                self._set_field_message(name, "")

    def _on_run_clicked(self, _: Any) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._set_status("cancelling: the workers stop after their current action…", busy=True)
            if hasattr(self, "cancel"):
                self.cancel(timeout=0)
            return
        try:
            self.run_async()
        except Exception as exc:
            self._show_idle()
            self._show_error(exc)

    def _on_show_run(self, change: dict[str, Any]) -> None:
        if self._choosing:
            return
        self._shown_run = None if change["new"] == -1 else int(change["new"])
        self._refresh_runs()

    def _on_compare(self, change: dict[str, Any]) -> None:
        if self._choosing:
            return
        self._compare_run = None if change["new"] == -1 else int(change["new"])
        self._refresh_compare()

    def _on_sort(self, change: dict[str, Any]) -> None:
        self._runs_sort = str(change["new"])
        self._refresh_runs()

    def _on_export(self, _: Any) -> None:
        kind = self.w_export_kind.value
        try:
            if kind == "chrome-trace":
                result = self._shown_result()
                frame = result.timeline if result is not None else self._plan.predicted
                what = f"run {self._run_number(result)}" if result is not None else "the predicted step"
                self._show_code(json.dumps(tl.to_chrome_trace(frame), indent=1),
                                f"Chrome trace of {what}: save as .json, open in ui.perfetto.dev or chrome://tracing")
            elif kind == "html":
                path = self.to_html("pipexplore-report.html")
                self._show_code(str(path), "HTML report written (one file, opens with no kernel):")
                self._set_status(f"wrote {path}")
            else:
                titles = {"gpipe": "GPipe", "pipelining": "torch.distributed.pipelining",
                          "torchrun": "a script for torchrun --standalone --nproc-per-node "
                                      f"{self._plan.num_devices}"}
                self._show_code(self.export(kind), titles[kind])
            self._set_field_message("export", "")
        except Exception as exc:
            self._show_code("", "")
            self._set_field_message("export", f"{type(exc).__name__}: {exc}")

    def _show_code(self, code: str, title: str = "") -> None:
        self.w_code.title = title
        self.w_code.code = code


def _stage_layers(splits: Sequence[int], layers: int) -> list[tuple[int, int]]:
    """Each stage's first and last layer."""
    return [(a, b - 1) for a, b in stage_bounds(splits, layers)]


def _actions_per_stage(predicted: pd.DataFrame, steps: int) -> dict[int, int]:
    """The compute actions each stage does in ``steps`` steps of a plan, from its prediction."""
    compute = predicted[predicted["phase"].isin(tl.COMPUTE_PHASES)]
    return {int(s): int(n) * steps for s, n in compute.groupby("stage").size().items()}


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
