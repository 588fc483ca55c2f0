"""Plotly figures of what the explorer draws: the timelines, the activation memory, the residuals.

Pure functions from data (timelines, a residual table) to a ``plotly.graph_objects.Figure``, for a
notebook or dashboard of one's own (what :meth:`~pipexplore.widgets.explorer.Explorer.to_plotly`
returns). Each draws what the page's canvas draws, in its units (ms from the step's start) and its
colours. plotly is an optional extra (``pip install 'pipexplore[plotly]'``), imported only when a
figure is asked for.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

from pipexplore.widgets.timeline_figure import (
    PHASE_COLORS,
    PHASE_LETTERS,
    PHASES,
    STAGE_COLORS,
    held_memory,
    memory_scale,
    summary,
)
from pipexplore.widgets.residual_view import residual_grid, residual_state
from pipexplore.widgets.timeline_canvas import lane_labels, lane_of

__all__ = ["timelines_figure", "memory_figure", "residuals_figure", "require_plotly", "MISSING_PLOTLY"]

#: What a figure asked for without plotly says.
MISSING_PLOTLY = "to_plotly needs plotly: pip install 'pipexplore[plotly]' (or pip install plotly)"
#: The colour of a phase the canvas's table does not know (``timeline_canvas.js`` draws it so too).
OTHER_PHASE = "#999"
#: The colour of the memory cap and of a peak over it, as the canvas draws them.
OVER_CAP = "#d62728"


def require_plotly() -> Any:
    """``plotly.graph_objects``; an ``ImportError`` naming the extra where plotly is not installed."""
    try:
        import plotly.graph_objects as go
        import plotly.subplots  # noqa: F401
    except ImportError as exc:
        raise ImportError(MISSING_PLOTLY) from exc
    return go


def _phase_order(phases: np.ndarray) -> list[str]:
    """The phases of a timeline in the canvas's legend order, unknown ones after them."""
    present = set(pd.unique(phases).tolist())
    return [p for p in PHASES if p in present] + sorted(str(p) for p in present - set(PHASES))


def timelines_figure(predicted: pd.DataFrame, measured: Optional[pd.DataFrame] = None, *,
                     samples: Optional[int] = None, names: Sequence[str] = ("predicted", "measured")) -> Any:
    """The predicted step (top) and the measured one (``None``: left out) as rows of subplots on
    one shared time axis: one horizontal bar per row of each timeline, from its ``start`` to its
    ``end`` in ms from that step's start (as the canvas draws them), a lane per (stage, device)
    with stage 0 on top, coloured by phase with the canvas's colours. ``names`` titles the rows
    (with :func:`~pipexplore.widgets.timeline_figure.summary`, ``samples`` giving the throughput).

    Example::

        timelines_figure(explorer.timeline("predicted"), explorer.timeline("measured")).show()
    """
    go = require_plotly()
    from plotly.subplots import make_subplots

    panels = [(names[0], predicted)] + ([(names[1], measured)] if measured is not None else [])
    lanes = [lane_of(frame) if frame is not None and not frame.empty else ([], np.zeros(0, int))
             for _, frame in panels]
    heights = [max(1, len(pairs)) for pairs, _ in lanes]
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.12 / len(panels),
                        row_heights=[h / sum(heights) for h in heights],
                        subplot_titles=[f"{name}: {summary(frame, samples)}" for name, frame in panels])
    shown: set[str] = set()  # one legend entry per phase, for both rows
    for row, ((_, frame), (pairs, lane)) in enumerate(zip(panels, lanes), start=1):
        labels = lane_labels(pairs)
        if pairs:
            origin = float(frame["start"].min())
            start = (frame["start"].to_numpy(dtype=float) - origin) * 1e3
            end = (frame["end"].to_numpy(dtype=float) - origin) * 1e3
            phase = frame["phase"].to_numpy().astype(str)
            micro = frame["microbatch"].to_numpy()
            lane_label = np.asarray(labels, dtype=object)[lane]
            for name in _phase_order(phase):
                rows = np.flatnonzero(phase == name)
                letter = PHASE_LETTERS.get(name, "")
                block = [f"{letter}{m}" if letter and m >= 0 else (letter or name) for m in micro[rows]]
                fig.add_trace(go.Bar(
                    orientation="h", base=start[rows], x=end[rows] - start[rows], y=lane_label[rows],
                    name=name, legendgroup=name, showlegend=name not in shown,
                    marker_color=PHASE_COLORS.get(name, OTHER_PHASE), marker_line_width=0,
                    customdata=pd.DataFrame({"block": block, "micro": micro[rows], "end": end[rows]}).to_numpy(),
                    hovertemplate=(f"<b>%{{customdata[0]}}</b> {name}, micro-batch %{{customdata[1]}}<br>%{{y}}<br>"
                                   "%{base:.3f}–%{customdata[2]:.3f} ms (%{x:.3f} ms)<extra></extra>")),
                    row=row, col=1)
                shown.add(name)
        # stage 0 on top: the lanes in the canvas's order, read downwards
        fig.update_yaxes(type="category", categoryorder="array", categoryarray=labels, autorange="reversed",
                         row=row, col=1)
    fig.update_xaxes(title_text="ms from the step's start", row=len(panels), col=1)
    fig.update_layout(barmode="overlay", bargap=0.2, height=140 + 34 * sum(heights) + 60 * len(panels),
                      legend_title_text="phase", margin=dict(l=10, r=10, t=60, b=40))
    return fig


def memory_figure(predicted: pd.DataFrame, measured: Optional[pd.DataFrame] = None, *,
                  cap: Optional[float] = None) -> Any:
    """The activation memory each stage holds across the step, as the page's memory panel draws
    it: a step line per stage from 0 (ms from the step's start, values in the unit of the largest
    peak), each stage's predicted peak marked (a red cross where it is over ``cap``), the cap as a
    dashed red line, and dashed beside the prediction what ``measured`` held where its run
    measured it (a ``memory`` column with values).

    Example::

        memory_figure(plan.predicted, run.timeline, cap=2 * 2**30).show()
    """
    go = require_plotly()
    memory = held_memory(predicted) if "memory" in predicted and predicted["memory"].notna().any() else None
    held = (held_memory(measured) if measured is not None and "memory" in measured
            and measured["memory"].notna().any() else None)
    peaks = memory.loc[memory.groupby("stage", sort=True)["bytes"].idxmax()] if memory is not None else None
    top = max([float(frame["bytes"].max()) for frame in (memory, held) if frame is not None and len(frame)]
              + [float(cap or 0.0)])
    scale, unit = memory_scale(top)
    fig = go.Figure()
    for frame, kind in ((memory, "predicted"), (held, "measured")):
        for stage, group in (frame.groupby("stage", sort=True) if frame is not None else ()):
            color = STAGE_COLORS[int(stage) % len(STAGE_COLORS)]
            # from (0, 0), the value holding from each change to the next: the canvas's step line
            fig.add_trace(go.Scatter(
                x=np.r_[0.0, group["time"].to_numpy(dtype=float) * 1e3],
                y=np.r_[0.0, group["bytes"].to_numpy(dtype=float) / scale],
                mode="lines", line_shape="hv", name=f"stage {int(stage)} {kind}", legendgroup=f"stage {int(stage)}",
                line=dict(color=color, width=1.5, dash="dash" if kind == "measured" else "solid"),
                hovertemplate=f"stage {int(stage)} {kind}: %{{y:.2f}} {unit} at %{{x:.3f}} ms<extra></extra>"))
    title = "activation memory: not predicted for this timeline"
    if peaks is not None and len(peaks):
        over = peaks["bytes"].to_numpy(dtype=float) > cap if cap is not None else np.zeros(len(peaks), bool)
        fig.add_trace(go.Scatter(
            x=peaks["time"].to_numpy(dtype=float) * 1e3, y=peaks["bytes"].to_numpy(dtype=float) / scale,
            mode="markers", name="peak", marker=dict(
                symbol=np.where(over, "x", "diamond"), size=np.where(over, 11, 9),
                color=[OVER_CAP if o else STAGE_COLORS[int(s) % len(STAGE_COLORS)]
                       for s, o in zip(peaks["stage"], over)]),
            customdata=peaks["stage"].to_numpy(),
            hovertemplate=f"stage %{{customdata}} peak: %{{y:.2f}} {unit} at %{{x:.3f}} ms<extra></extra>"))
        most = peaks.loc[peaks["bytes"].idxmax()]
        title = (f"predicted activation memory per stage — peak {most['bytes'] / scale:.2f} {unit} "
                 f"(stage {int(most['stage'])})")
    if held is not None and len(held):
        most = held.loc[held["bytes"].idxmax()]
        title += f"; measured (dashed) {most['bytes'] / scale:.2f} {unit} (stage {int(most['stage'])})"
    if cap is not None:
        fig.add_hline(y=cap / scale, line_dash="dash", line_color=OVER_CAP,
                      annotation_text=f"cap {cap / scale:.2f} {unit}", annotation_position="top left")
    fig.update_layout(title_text=title, xaxis_title="ms from the step's start", yaxis_title=unit,
                      yaxis_rangemode="tozero", height=360, margin=dict(l=10, r=10, t=60, b=40))
    return fig


def residuals_figure(table: pd.DataFrame, *, title: str = "") -> Any:
    """A run's residuals (:func:`pipexplore.predict.residuals.residuals`) as the page's residual
    mode draws them: a cell per action, a row per stage and phase (stage 0 on top), a column per
    micro-batch, coloured by the error (predicted ÷ measured − 1, in percent) on a blue–white–red
    scale about 0; a cell's hover adds the measured minus the predicted span in ms. ``title``
    names the run.

    Example::

        residuals_figure(explorer.residuals(), title="run 3").show()
    """
    go = require_plotly()
    grid = residual_grid(table)
    fig = go.Figure()
    if not grid.empty:
        late = table.assign(late=(table["measured_seconds"] - table["predicted_seconds"]) * 1e3).pivot_table(
            index=["stage", "phase"], columns="microbatch", values="late", aggfunc="mean")
        late = late.reindex(index=grid.index, columns=grid.columns)
        fig.add_trace(go.Heatmap(
            z=grid.to_numpy(dtype=float) * 100, x=[str(c) for c in grid.columns],
            y=[f"stage {s} · {phase}" for s, phase in grid.index], customdata=late.to_numpy(dtype=float),
            colorscale="RdBu_r", zmid=0, colorbar=dict(title="error %"), xgap=1, ygap=1,
            hovertemplate=("%{y}, micro-batch %{x}<br>predicted ÷ measured − 1: %{z:.1f} %<br>"
                           "measured − predicted: %{customdata:.3f} ms<extra></extra>")))
    fig.update_xaxes(type="category", title_text="micro-batch")
    fig.update_yaxes(type="category", autorange="reversed")
    fig.update_layout(title_text=residual_state(table, title)["title"], height=140 + 26 * max(1, len(grid)),
                      margin=dict(l=10, r=10, t=60, b=40))
    return fig
