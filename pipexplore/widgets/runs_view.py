"""The runs table of the explorer: pandas Styler, units in the headers, empty columns hidden, the error coloured."""
from __future__ import annotations

import math
from typing import Any, Optional

import pandas as pd
from pandas.io.formats.style import Styler

from pipexplore.widgets.header import format_bytes, steal_note

__all__ = ["RUNS_VIEW_COLUMNS", "SORT_KEYS", "runs_styler", "runs_html", "error_color"]

#: Column of ``explorer.runs`` → header shown (with its unit), in the order shown.
RUNS_VIEW_COLUMNS = {
    "run": "run", "executor": "executor", "schedule": "schedule", "splits": "splits", "chunks": "chunks",
    "checkpoint": "checkpoint", "devices": "devices", "step_time": "step ms", "predicted_step_time": "predicted ms",
    "prediction_error": "error %", "prediction_basis": "predicted from", "benchmark_error": "benchmarks' error %",
    "host_steal": "other guests' CPU %",
    "bubble": "bubble %", "throughput": "samples/s", "startup_seconds": "startup s",
    "peak_bytes": "peak memory", "loss": "loss", "finite": "finite",
}
#: What the runs table can be sorted by (a column of ``explorer.runs``).
SORT_KEYS = ("run", "step_time", "prediction_error", "bubble", "throughput", "peak_bytes")


def error_color(error: Any) -> str:
    """CSS for a prediction error (a fraction): green within 10 %, amber within 25 %, red beyond.

    Example::

        error_color(0.4)   # 'color: #d62728; background-color: rgba(214, 39, 40, 0.12); font-weight: 600'
    """
    if not isinstance(error, (int, float)) or isinstance(error, bool) or math.isnan(error):
        return ""
    size = abs(error)
    if size <= 0.10:
        return "color: #2ca02c; background-color: rgba(44, 160, 44, 0.12)"
    if size <= 0.25:
        return "color: #c77c02; background-color: rgba(237, 161, 0, 0.14)"
    return "color: #d62728; background-color: rgba(214, 39, 40, 0.12); font-weight: 600"


def _empty(column: pd.Series) -> bool:
    values = column.dropna()
    return values.empty or bool((values.astype(str) == "").all())


def runs_styler(runs: pd.DataFrame, *, sort_by: str = "run", descending: bool = False,
                shown_run: Optional[int] = None, limit: Optional[int] = None, uuid: str = "pipexplore-runs") -> Styler:
    """``runs`` (``explorer.runs``) as a Styler: units in the headers, empty columns hidden,
    ``error %`` coloured by size, the run shown above bold. ``limit`` keeps the latest rows;
    ``uuid`` keeps the cell styles of two tables on one page apart.

    Example::

        runs_styler(explorer.runs, sort_by="step_time").to_html()
    """
    if sort_by not in SORT_KEYS:
        raise ValueError(f"sort_by must be one of {', '.join(SORT_KEYS)}, got {sort_by!r}")
    frame = runs.tail(limit) if limit else runs
    frame = frame.sort_values(sort_by, ascending=not descending, kind="stable", na_position="last")
    columns = [c for c in RUNS_VIEW_COLUMNS if c in frame and not _empty(frame[c])
               and not (c == "finite" and frame[c].astype(bool).all())  # "finite" only when one is not
               and not (c == "host_steal" and not any(map(steal_note, frame[c])))]  # and the steal where noted
    frame = frame[columns].reset_index(drop=True)
    if "splits" in frame:
        frame["splits"] = [",".join(map(str, s)) if isinstance(s, (list, tuple)) else str(s) for s in frame["splits"]]
    if "finite" in frame:
        frame["finite"] = ["yes" if f is True or f == 1 else "⚠ no" for f in frame["finite"]]
    formats = {
        "step_time": lambda v: f"{v * 1e3:.2f}", "predicted_step_time": lambda v: f"{v * 1e3:.2f}",
        "prediction_error": lambda v: f"{v * 100:+.1f}", "benchmark_error": lambda v: f"±{v * 100:.0f}", "bubble": lambda v: f"{v * 100:.1f}",
        "throughput": lambda v: f"{v:,.0f}", "startup_seconds": lambda v: f"{v:.2f}",
        "peak_bytes": format_bytes, "loss": lambda v: f"{v:.5g}",
        "host_steal": lambda v: f"{v * 100:.0f}",
    }
    styler = frame.style.format({k: f for k, f in formats.items() if k in frame}, na_rep="–")
    styler = styler.relabel_index([RUNS_VIEW_COLUMNS[c] for c in columns], axis="columns")
    styler = styler.hide(axis="index").set_uuid(uuid)
    if "prediction_error" in frame:
        styler = styler.map(error_color, subset=["prediction_error"])
    if shown_run is not None:
        classes = pd.DataFrame("", index=frame.index, columns=frame.columns)
        classes.loc[frame["run"] == shown_run, :] = "pipexplore-shown"
        styler = styler.set_td_classes(classes)
    return styler


def runs_html(runs: pd.DataFrame, *, earlier: int = 0, **options: Any) -> str:
    """The runs view's HTML (class ``pipexplore-runs``): 'no runs yet', or the Styler's table.

    Example::

        runs_html(explorer.runs, sort_by="step_time", shown_run=2)
    """
    if runs.empty:
        return "<div class='pipexplore-runs'>no runs yet: press Run step</div>"
    note = (f"<div class='pipexplore-note'>the latest {len(runs)} runs; {earlier} earlier ones are in "
            "explorer.runs</div>" if earlier else "")
    return "<div class='pipexplore-runs'>" + note + runs_styler(runs, **options).to_html() + "</div>"
