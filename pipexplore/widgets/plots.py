"""Timeline figures: predicted and measured steps, one lane per stage, bars per micro-batch."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from pipexplore import timeline as tl

__all__ = ["PHASE_COLORS", "timeline_figure", "update_timeline_figure", "summary"]

PHASE_COLORS = {
    "forward": "#4e79a7", "backward": "#e15759", "recompute": "#f28e2b", "copy": "#9c9c9c",
    "input_grad": "#e15759", "weight_grad": "#b07aa1", "send": "#76b7b2", "recv": "#59a14f",
}
PHASES = list(PHASE_COLORS)


def summary(frame: Optional[pd.DataFrame], samples: Optional[int] = None) -> str:
    """One line: step time, bubble fraction (and throughput when ``samples`` is given)."""
    if frame is None or frame.empty:
        return "no run yet"
    text = f"step {tl.step_time(frame) * 1e3:.1f} ms · bubble {tl.bubble_fraction(frame) * 100:.1f} %"
    if samples:
        text += f" · {tl.throughput(frame, samples):,.0f} samples/s"
    return text


def _traces(frame: Optional[pd.DataFrame]) -> dict[str, dict]:
    """x (duration ms), base (start ms), y (lane) and hover text per phase, as numpy arrays."""
    empty = dict(x=np.empty(0), base=np.empty(0), y=np.empty(0, dtype=object), hovertext=np.empty(0, dtype=object))
    if frame is None or frame.empty:
        return {phase: empty for phase in PHASES}
    phase_of = frame["phase"].to_numpy()
    stage, device = frame["stage"].to_numpy(), frame["device"].to_numpy()
    microbatch = frame["microbatch"].to_numpy()
    start, end = frame["start"].to_numpy() * 1e3, frame["end"].to_numpy() * 1e3
    # Expert-backend runs: each bar is a batch the pools formed; say how big and how long it waited.
    extra = np.array([f"<br>batch of {r} rows from {t} tasks, waited {w * 1e3:.2f} ms"
                      for r, t, w in zip(frame["batch_size"], frame["tasks"], frame["wait"])], dtype=object) \
        if {"batch_size", "tasks", "wait"} <= set(frame.columns) else np.full(len(frame), "", dtype=object)
    out = {}
    for phase in PHASES:
        mask = phase_of == phase
        if not mask.any():
            out[phase] = empty
            continue
        s, d, i, a, b, e = stage[mask], device[mask], microbatch[mask], start[mask], end[mask], extra[mask]
        out[phase] = dict(
            x=b - a, base=a, y=np.array([f"stage {x} · {y}" for x, y in zip(s, d)], dtype=object),
            hovertext=np.array([f"{phase} · micro-batch {mb} · stage {st}<br>{t0:.2f} → {t1:.2f} ms ({t1 - t0:.2f} ms){ex}"
                                for mb, st, t0, t1, ex in zip(i, s, a, b, e)], dtype=object),
        )
    return out


def timeline_figure(predicted: pd.DataFrame, measured: Optional[pd.DataFrame] = None,
                    samples: Optional[int] = None) -> go.FigureWidget:
    """A two-row figure: the predicted step above, the measured one below (same lanes, ms)."""
    figure = make_subplots(rows=2, cols=1, shared_xaxes=False, vertical_spacing=0.16,
                           subplot_titles=("predicted", "measured"))
    for row, frame in ((1, predicted), (2, measured)):
        for phase, data in _traces(frame).items():
            figure.add_trace(go.Bar(orientation="h", name=phase, legendgroup=phase, showlegend=row == 1,
                                    marker_color=PHASE_COLORS[phase], hoverinfo="text", **data), row=row, col=1)
    figure.update_layout(barmode="overlay", height=420, margin=dict(l=10, r=10, t=40, b=30),
                         legend=dict(orientation="h", y=1.12))
    figure.update_xaxes(title_text="ms")
    widget = go.FigureWidget(figure)
    update_timeline_figure(widget, predicted, measured, samples)
    return widget


def update_timeline_figure(figure: go.FigureWidget, predicted: Optional[pd.DataFrame] = None,
                           measured: Optional[pd.DataFrame] = None, samples: Optional[int] = None,
                           *, rows: tuple[int, ...] = (1, 2)) -> None:
    """Replace the bars of the given rows (1: predicted, 2: measured) in one batch update."""
    n = len(PHASES)
    with figure.batch_update():
        for row in rows:
            frame = predicted if row == 1 else measured
            for k, data in enumerate(_traces(frame).values()):
                trace = figure.data[(row - 1) * n + k]
                trace.x, trace.base, trace.y, trace.hovertext = data["x"], data["base"], data["y"], data["hovertext"]
            title = ("predicted: " if row == 1 else "measured: ") + summary(frame, samples)
            figure.layout.annotations[row - 1].text = title
