"""The explorer's run log: a summary row for every run, the latest runs' results with their timelines,
and which run the page shows and compares.

:class:`RunLog` is a part the explorer's state has (``state.log``): it knows nothing of plans being
changed or runs being made, and holds no lock of its own (the state changes it under its lock).

Example::

    log = RunLog(keep_timelines=20)
    log.add({"run": log.next_number, **result.row()}, result)
    log.frame()                     # one row per run
    log.measured_timeline()         # the latest run's timeline
"""
from __future__ import annotations

from collections import deque
from typing import Any, Optional

import pandas as pd

from pipexplore.executors.base import RunResult
from pipexplore.plan import Plan
from pipexplore.predict.residuals import residuals
from pipexplore.widgets.header import steal_note

__all__ = ["RunLog", "RUN_COLUMNS", "run_summary", "refuse_planned"]

RUN_COLUMNS = ["run", "executor", "splits", "chunks", "checkpoint", "schedule", "devices", "mesh", "step_time",
               "startup_seconds", "bubble", "throughput", "peak_bytes", "predicted_step_time", "prediction_error",
               "prediction_basis", "benchmark_error", "host_steal", "loss", "measured_losses", "finite", "nodes",
               "ranks", "hosts"]


def run_summary(row: dict[str, Any]) -> str:
    """The status line after a run; a run whose loss or gradients are not finite says so."""
    text = (f"run {row['run']}: step {row['step_time'] * 1e3:.1f} ms, bubble {row['bubble'] * 100:.1f} %, "
            f"loss {row['loss']:.4f}")
    stolen = steal_note(row.get("host_steal"))
    if stolen:
        text += f" · {stolen}"
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
    """The runs of one explorer (see the module docstring)."""

    def __init__(self, keep_timelines: int = 20) -> None:
        #: How many runs keep their full timelines (the latest ones).
        self.keep_timelines = keep_timelines
        self._rows: list[dict[str, Any]] = []
        self._results: deque[RunResult] = deque(maxlen=keep_timelines)
        #: The number the next run gets.
        self.next_number = 0
        #: The run the page shows (None: the latest) and the one it compares with (None: none).
        self.shown_run: Optional[int] = None
        self.compare_run: Optional[int] = None

    def add(self, row: dict[str, Any], result: RunResult) -> None:
        """Keep a run: its summary ``row`` (numbered ``row["run"]``) and its ``result``."""
        self.next_number = int(row["run"]) + 1
        self._rows.append(row)
        self._results.append(result)

    def frame(self) -> pd.DataFrame:
        """One row per run (:data:`RUN_COLUMNS`)."""
        return pd.DataFrame(self._rows, columns=RUN_COLUMNS)

    def rows(self) -> list[dict[str, Any]]:
        """The runs' rows (a copy), oldest first."""
        return list(self._rows)

    def clear(self) -> None:
        """Forget every run (rows and timelines); the numbering goes on."""
        self._rows.clear()
        self._results.clear()

    def row_of(self, run: Any) -> dict[str, Any]:
        """Run ``run``'s summary row.

        Raises:
            LookupError: no such run (the latest runs named).
        """
        for row in self._rows:
            if row["run"] == run:
                return row
        known = ", ".join(str(row["run"]) for row in self._rows[-10:]) or "none yet"
        raise LookupError(f"run {run!r} is not in explorer.runs (latest runs: {known}): pass a number from the "
                          "'run' column")

    def measured_timeline(self, run: Optional[int] = None) -> pd.DataFrame:
        """The latest run's timeline, or run ``run``'s while it is among the last ``keep_timelines``.

        Raises:
            LookupError: no run yet, or that run's timeline is no longer kept.
        """
        results = list(self._results)
        if run is None:
            if results:
                return results[-1].timeline
            if not self._rows:
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

    def result_of(self, run: Optional[int]) -> Optional[RunResult]:
        """Run ``run``'s kept result, or None."""
        for result in reversed(self._results):
            if self.run_number(result) == run:
                return result
        return None

    def latest(self, index: int = -1) -> RunResult:
        """A kept result by position (``-1``: the latest).

        Raises:
            LookupError: no run yet.
        """
        if not self._results:
            raise LookupError("no run yet: call explorer.run() or press 'Run step'")
        return self._results[index]

    def kept_runs(self) -> list[int]:
        """The numbers of the runs whose timelines are kept, oldest first."""
        return [n for n in (self.run_number(r) for r in self._results) if n is not None]

    def shown_result(self) -> Optional[RunResult]:
        """The result the page shows: the chosen run's, else the latest (None before any run)."""
        if not self._results:
            return None
        if self.shown_run is None:
            return self._results[-1]
        return self.result_of(self.shown_run) or self._results[-1]

    def show(self, run: Optional[int] = None, compare: Optional[int] = -1) -> None:
        """Show run ``run`` (None: the latest) and compare it with run ``compare`` (None: with none;
        -1: keep the comparison)."""
        self.shown_run = run
        if compare != -1:
            self.compare_run = compare

    def residuals(self, index: int = -1) -> pd.DataFrame:
        """Each action of a kept run (by position; default: the latest) against its prediction (see
        :func:`pipexplore.predict.residuals.residuals`).

        Raises:
            LookupError: no run yet.
        """
        result = self.latest(index)
        return residuals(result.predicted, result.timeline)
