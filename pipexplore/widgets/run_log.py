"""The explorer's runs: run a step (blocking or in the background), cancel it, keep its row and
timeline, and the tables, timelines and comparisons read from them.

:class:`RunLog` is the runs half of :class:`pipexplore.widgets.state.ExplorerState`, which holds
the plan, the lock and the subscribers it uses.
"""
from __future__ import annotations

import math
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import pandas as pd

from pipexplore import timeline as tl
from pipexplore import validate
from pipexplore.cancel import CancelToken, Cancelled, cancel_scope, check_cancelled
from pipexplore.executors.base import RunResult
from pipexplore.executors.step import run_step
from pipexplore.plan import EXECUTORS, Plan
from pipexplore.widgets.header import parse_bytes, plan_text, splits_text

if TYPE_CHECKING:  # pragma: no cover
    from pipexplore.widgets.state import ExplorerState

__all__ = ["RunLog", "RUN_COLUMNS", "run_summary"]

RUN_COLUMNS = ["run", "executor", "splits", "chunks", "checkpoint", "schedule", "devices", "step_time",
               "startup_seconds", "bubble", "throughput", "peak_memory", "predicted_step_time", "prediction_error",
               "loss", "measured_losses", "finite", "nodes", "ranks", "hosts"]


def run_summary(row: dict[str, Any]) -> str:
    """The status line after a run; a run whose loss or gradients are not finite says so."""
    text = (f"run {row['run']}: step {row['step_time'] * 1e3:.1f} ms, bubble {row['bubble'] * 100:.1f} %, "
            f"loss {row['loss']:.4f}")
    if not row.get("finite", True):
        text += (" ⚠ the loss or a gradient is not finite (NaN or inf): this run does not calibrate predictions; "
                 "check the model, the learning rate and the data")
    return text


def refuse_planned(plan: Plan) -> None:
    """Refuse to run a plan for planned devices, saying why and what to do instead.

    Raises:
        RuntimeError: the plan's devices are catalogue devices, not devices of this machine.
    """
    if plan.planned:
        devices = plan.devices[: plan.num_devices]
        raise RuntimeError(f"this plan is for planned devices ({devices[0]} … {devices[-1]}, {len(set(devices))} "
                           f"on {plan.nodes} node{'s' if plan.nodes > 1 else ''}), which are not on this machine: "
                           "export it (ex.export('torchrun')) and run it there under torchrun")


class RunLog:
    """Runs of the current plan, and what is read from them (a part of ``ExplorerState``)."""

    # ---- running ----------------------------------------------------------------------------
    def run(self: ExplorerState, executor: Optional[str] = None, *, timeout: Optional[float] = None,
            nodes: int = 1) -> pd.Series:
        """Run a real training step of the current plan (blocking) and add it to :attr:`runs`.

        ``executor``: ``'threads'`` (the schedule executor, in this process), ``'autograd'`` (the
        ``GPipe`` module) or ``'processes'`` (one process per stage); it becomes the plan's.
        ``'torchrun'``: the exported script under ``nodes`` torchrun node agents here (see
        :meth:`run_torchrun`; the plan's executor stays).
        ``timeout`` (seconds, ``'processes'`` and ``'torchrun'``) bounds the step in the worker processes.

        Raises:
            RuntimeError: the plan is for planned devices (catalogue names), which are not here.
            Exception: what the step raised (a bad device, out of memory, a layer, a crashed
                worker); the plan and earlier runs are kept.
            pipexplore.cancel.Cancelled: the run was cancelled; nothing of it is recorded.
        """
        if executor is not None:
            validate.executor(executor, (*EXECUTORS, "torchrun"))
        refuse_planned(self._plan)
        if executor == "torchrun":
            return self.run_torchrun(nodes=nodes, timeout=timeout)
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
                check_cancelled()  # a Cancel that came as the step ended: nothing of it is recorded
                self._next_run = number + 1
                self._runs.append(row)
                self._results.append(result)
                if row["finite"] and self.calibrate and plan.schedule != "async-backends" and self._plan == plan:
                    # Later predictions include the executor's own cost per action, as this run measured it.
                    self._plan = plan.calibrated(result.timeline)
                    self._emit("plan")
                self._emit("runs")
                self.say(run_summary(row), error=not row["finite"])
        return pd.Series(row)

    def run_async(self: ExplorerState, executor: Optional[str] = None, **options: Any) -> threading.Thread:
        """Start :meth:`run` in a background thread (what the button does); returns the thread.
        ``executor`` and ``options`` (``nodes``, ``timeout``) go to :meth:`run`.

        Raises:
            RuntimeError: a run is already in progress, or the plan is for planned devices.
        """
        refuse_planned(self._plan)
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a run is already in progress")
        self._cancel_token = token = CancelToken()
        self._thread = threading.Thread(target=self._run_in_background, args=(token, executor, options),
                                        name="pipexplore-run", daemon=True)
        self.running = True
        self.say("running a training step…", busy=True)
        self._thread.start()
        return self._thread

    def cancel(self: ExplorerState, timeout: float = 60.0) -> bool:
        """Stop the background run: its workers stop after their current action and are joined;
        nothing of it is recorded, the plan and earlier runs are kept. Returns whether a run was
        in progress (and has ended within ``timeout`` seconds)."""
        thread, token = self._thread, self._cancel_token
        if thread is None or token is None or not thread.is_alive():
            return False
        token.cancel()
        thread.join(timeout)
        return not thread.is_alive()

    def _run_in_background(self: ExplorerState, token: CancelToken, executor: Optional[str] = None,
                           options: Optional[dict[str, Any]] = None) -> None:
        try:
            with cancel_scope(token), tl.counting_actions() as counter:
                self.counter = counter
                self.run(executor, **(options or {}))
        except Cancelled:
            self.say("run cancelled: the plan and earlier runs are kept")
        except BaseException as exc:  # shown; the plan and the runs stay
            self.show_error(exc)
        finally:
            with self._plan_lock:
                self.counter = None
                self.running = False
                self._emit("status")

    def run_torchrun(self: ExplorerState, nodes: int = 2, *, timeout: Optional[float] = None) -> pd.Series:
        """Export the current plan, run it under ``nodes`` torchrun node agents on this machine
        (c10d rendezvous on loopback, gloo), wait with progress on the status line (Cancel stops
        every agent and rank), and load the run as :meth:`load_run` does. Returns its row.

        Raises:
            pipexplore.runs.launch.TorchrunError: a rank failed (its rank, host and exit code), or a timeout.
            pipexplore.cancel.Cancelled: cancelled; nothing is recorded.
        """
        from pipexplore.runs.roundtrip import torchrun_result

        refuse_planned(self._plan)
        with self._lock:
            with self._plan_lock:
                plan, number = self._plan, self._next_run
            self.say(f"torchrun: exporting the plan for {nodes} node agents…", busy=True)
            result = torchrun_result(self.model, self.sample, plan, nodes=nodes, target=self.target,
                                     loss_fn=self.loss_fn, optimizer=self.optimizer, run=number, timeout=timeout,
                                     progress=lambda text: self.say(text, busy=True))
            return self._keep_loaded(result, number)

    def load_run(self: ExplorerState, directory: Any) -> pd.Series:
        """Add a run recorded elsewhere (the exported script's ``--record DIR``) as a row of
        :attr:`runs` (executor ``torchrun``, its nodes, ranks and hosts), its timeline on rank 0's
        clock, predicted again for the plan it ran (rebuilt on this layer table from the one it
        recorded) and teaching the cost model as a local run does. Refused whole (nothing kept)
        when a rank's file is missing, truncated or of another run or plan, or the run is of
        another model (:class:`pipexplore.runs.load.RunDirectoryError`)."""
        from pipexplore.microbatch import batch_size
        from pipexplore.runs.roundtrip import load_result

        with self._lock:
            with self._plan_lock:
                plan, number = self._plan, self._next_run
            _, result = load_result(directory, self.layer_table, plan, samples=batch_size(self.sample), run=number)
            return self._keep_loaded(result, number)

    def _keep_loaded(self: ExplorerState, result: RunResult, number: int) -> pd.Series:
        """Keep a run made under torchrun (loaded or launched) as any run; learn from it."""
        row = {"run": number, **{k: v for k, v in result.row().items() if k != "rank_table"}}
        loss = row.get("loss", math.nan)
        row["finite"] = bool(row.get("finite", True)) and isinstance(loss, float) and math.isfinite(loss)
        with self._plan_lock:
            check_cancelled()
            self._next_run = number + 1
            self._runs.append(row)
            self._results.append(result)
            untaught = result.metrics.get("untaught")
            if row["finite"] and self.calibrate and not untaught:  # what it teaches carries to this explorer's plan
                learnt = result.plan.calibrated(result.timeline).corrections
                self._plan = replace(self._plan, corrections=learnt)
                self._emit("plan")
            self._emit("runs")
            self.say(f"{run_summary(row)} · torchrun, {row.get('nodes', '?')} nodes, {row.get('ranks', '?')} ranks "
                     f"({row.get('hosts', '?')}), prediction error {row['prediction_error'] * 100:+.1f} %"
                     + (f" · it teaches the predictions nothing: {untaught}" if untaught and self.calibrate else ""))
        return pd.Series(row)

    # ---- the runs ---------------------------------------------------------------------------
    @property
    def runs(self: ExplorerState) -> pd.DataFrame:
        """One row per run: the plan, what was measured, the prediction's error, and whether the
        loss and gradients were ``finite``."""
        return pd.DataFrame(self._runs, columns=RUN_COLUMNS)

    def run_rows(self: ExplorerState) -> list[dict[str, Any]]:
        """The runs' rows (a copy), oldest first."""
        return list(self._runs)

    def clear_runs(self: ExplorerState) -> None:
        """Forget every run (rows and timelines); the plan and what calibration taught it stay."""
        with self._plan_lock:
            self._runs.clear()
            self._results.clear()
            self._emit("runs")

    def timeline(self: ExplorerState, kind: str = "predicted", run: Optional[int] = None) -> pd.DataFrame:
        """``'predicted'``: the current plan's; ``'measured'``: the latest run's, or run ``run``'s
        while it is among the last ``keep_timelines`` runs.

        Raises:
            ValueError: another ``kind``.
            LookupError: no run yet, or that run's timeline is no longer kept.
        """
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

    @staticmethod
    def run_number(result: Optional[RunResult]) -> Optional[int]:
        """The number of the run ``result`` measured (None for none)."""
        if result is None or result.timeline.empty:
            return None
        return int(result.timeline["run"].iloc[0])

    def result_of(self: ExplorerState, run: Optional[int]) -> Optional[RunResult]:
        """Run ``run``'s kept result, or None."""
        for result in reversed(self._results):
            if self.run_number(result) == run:
                return result
        return None

    def kept_runs(self: ExplorerState) -> list[int]:
        """The numbers of the runs whose timelines are kept, oldest first."""
        return [n for n in (self.run_number(r) for r in self._results) if n is not None]

    def shown_result(self: ExplorerState) -> Optional[RunResult]:
        """The result the page shows: the chosen run's, else the latest (None before any run)."""
        if not self._results:
            return None
        if self.shown_run is None:
            return self._results[-1]
        return self.result_of(self.shown_run) or self._results[-1]

    def show(self: ExplorerState, run: Optional[int] = None, compare: Optional[int] = -1) -> None:
        """Show run ``run`` (None: the latest) and compare it with run ``compare`` (None: with none;
        -1: keep the comparison)."""
        with self._plan_lock:
            self.shown_run = run
            if compare != -1:
                self.compare_run = compare
            self._emit("shown")

    def plan_difference(self: ExplorerState, other: Plan) -> str:
        """'' when ``other`` is the current plan, else what differs (for the measured panel's title)."""
        plan = self._plan
        changes = [f"{name} {theirs} → {ours}" for name, theirs, ours in (
            ("splits", splits_text(other.splits), splits_text(plan.splits)), ("chunks", other.chunks, plan.chunks),
            ("schedule", other.schedule, plan.schedule), ("checkpoint", other.checkpoint, plan.checkpoint),
            ("executor", other.executor, plan.executor),
            ("devices", ",".join(other.devices[: other.num_devices]), ",".join(plan.devices[: plan.num_devices])))
            if theirs != ours]
        return ("not the current plan: " + ", ".join(changes)) if changes else ""

    def restore(self: ExplorerState, run: Optional[int]) -> Plan:
        """Make the plan of run ``run`` (its number in :attr:`runs`) the current plan again; what
        calibration learnt since is kept.

        Raises:
            LookupError: no such run.
        """
        rows = [row for row in self._runs if row["run"] == run]
        if not rows:
            known = ", ".join(str(row["run"]) for row in self._runs[-10:]) or "none yet"
            raise LookupError(f"run {run!r} is not in explorer.runs (latest runs: {known}): pass a number from the "
                              "'run' column")
        row = rows[0]
        result = self.result_of(run)
        if result is not None:
            old = result.plan
            options = dict(splits=old.splits, devices=old.devices, chunks=old.chunks, checkpoint=old.checkpoint,
                           schedule=old.schedule, executor=old.executor, virtual_stages=old.virtual_stages)
        else:
            executor = row["executor"] if row["executor"] in EXECUTORS else self._plan.executor
            options = dict(splits=tuple(row["splits"]), devices=tuple(str(row["devices"]).split(",")),
                           chunks=int(row["chunks"]), checkpoint=str(row["checkpoint"]), schedule=str(row["schedule"]),
                           executor=executor)
        plan = self.change_plan(lambda plan: plan.with_options(**options))
        self.say(f"restored the plan of run {run}: {plan_text(plan)}")
        return plan

    def residuals(self: ExplorerState, run: int = -1) -> pd.DataFrame:
        """Each action of a run (default: the latest) against its prediction (see
        :func:`pipexplore.predict.residuals.residuals`).

        Raises:
            LookupError: no run yet.
        """
        from pipexplore.predict.residuals import residuals

        if not self._results:
            raise LookupError("no run yet: call explorer.run() or press 'Run step'")
        result = self._results[run]
        return residuals(result.predicted, result.timeline)

    # ---- what if ------------------------------------------------------------------------------
    def _what_if(self: ExplorerState, schedules: Sequence[str]) -> tuple[Plan, Optional[Callable[[int], Any]]]:
        """The plan a sweep or search starts from (its table with the input/weight-gradient split
        measured where a schedule asked for splits the backward), and the devices for ``n`` stages
        where they are planned: more GPUs of the kind, never two stages on one (None: the sweep's own)."""
        from pipexplore.schedules import splits_backward

        if any(map(splits_backward, schedules)) and self._with_backward_split() is not self._plan.layer_table:
            self.change_plan(lambda plan: replace(plan, layer_table=self.layer_table))
        plan = self._plan
        if not plan.planned:
            return plan, None
        from pipexplore.devices import planned_devices

        kind = plan.devices[0].split(":")[0]
        return plan, lambda n: planned_devices([kind] * n, plan.gpus_per_node)

    def sweep(self: ExplorerState, *, stages: Sequence[int] = (), chunks: Sequence[int] = (),
              schedules: Sequence[str] = (), checkpoint: Sequence[str] = (), measure: int = 0) -> pd.DataFrame:
        """Predict every combination (each with its balanced split), ranked by predicted step time;
        with ``measure=k`` the top ``k`` rows are also run (see :func:`pipexplore.predict.sweep.sweep`)."""
        from pipexplore.predict.sweep import sweep

        plan, more_gpus = self._what_if(schedules)
        table = sweep(plan, stages=stages, chunks=chunks, schedules=schedules, checkpoint=checkpoint,
                      devices_for=more_gpus)
        if measure > 0 and not table.empty:
            previous = self._plan
            measured = []
            try:
                for _, row in table.head(measure).iterrows():
                    self.apply(row)
                    measured.append(float(self.run()["step_time"]))
            finally:
                self.change_plan(lambda plan: previous.with_options(corrections=plan.corrections))
            table["measured_step_time"] = measured + [math.nan] * (len(table) - len(measured))
            order = pd.Series(measured).rank(method="first").astype(int).tolist()
            table["measured_rank"] = order + [pd.NA] * (len(table) - len(measured))
        return table

    def search(self: ExplorerState, *, memory_cap: Any = None, stages: Sequence[int] = (),
               chunks: Sequence[int] = (), schedules: Sequence[str] = (), checkpoint: Sequence[str] = (),
               virtual_stages: Sequence[int] = (), workers: Optional[int] = None) -> pd.DataFrame:
        """Every combination with the fastest split whose every device holds the plan within
        ``memory_cap`` (bytes or text such as ``'80 GiB'``: parameters, gradients, the optimizer's
        state and the activations the schedule holds; None: each device's memory), predicted;
        the plans that fit first, by predicted step (see :func:`pipexplore.predict.search.search`).
        Apply a row with :meth:`apply`. Not the explorer's ``memory_cap``, which caps the
        activations the memory panel draws.

        Raises:
            ValueError: a bad ``memory_cap``; nothing fits (the closest plan named, and by how
                many bytes it is over).
        """
        from pipexplore.predict.search import search

        cap = parse_bytes(memory_cap, "memory_cap")
        plan, more_gpus = self._what_if(schedules)
        return search(plan, memory_cap=cap, stages=stages, chunks=chunks, schedules=schedules, checkpoint=checkpoint,
                      virtual_stages=virtual_stages, devices_for=more_gpus, optimizer=self.optimizer,
                      mixed_precision=self.mixed_precision, workers=workers)

    def apply(self: ExplorerState, row: Any) -> Plan:
        """Make a row of :meth:`sweep` or :meth:`search` the current plan; or a mapping of some of
        their plan columns (``splits``, ``chunks``, ``schedule``, ``checkpoint``, ``devices``,
        ``virtual_stages``), the others kept from the current plan: ``apply({"splits": [2, 4]})``.

        Raises:
            ValueError: a mapping with none of those columns, or a plan they make that is refused.
        """
        now = self._plan
        current = {"splits": now.splits, "chunks": now.chunks, "schedule": now.schedule, "checkpoint": now.checkpoint,
                   "devices": now.devices, "virtual_stages": now.virtual_stages}
        given = [key for key in current if key in row]
        if not given:
            raise ValueError(f"apply takes a row of sweep() or search(), or a mapping of some of "
                             f"{', '.join(current)}; got {list(row.keys())}")
        values = {key: row[key] if key in given else current[key] for key in current}
        devices = values["devices"]
        devices = str(devices).split(",") if isinstance(devices, str) else list(devices)
        virtual = int(values["virtual_stages"] or 1)
        more = {"virtual_stages": virtual} if virtual > 1 else {}
        plan = now.with_options(splits=tuple(int(s) for s in values["splits"]), chunks=int(values["chunks"]),
                                schedule=str(values["schedule"]), checkpoint=str(values["checkpoint"]),
                                devices=tuple(devices), **more)
        if plan.executor == "autograd" and plan.schedule != "gpipe":
            plan = plan.with_options(executor="threads")
        return self.change_plan(lambda _: plan)
