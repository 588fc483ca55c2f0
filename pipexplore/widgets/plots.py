"""Timeline figures: predicted and measured steps on one shared time axis, activation memory under them."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from pipexplore import timeline as tl

__all__ = ["PHASE_COLORS", "PHASE_LETTERS", "STAGE_COLORS", "PLOTLY_CONFIG", "BAR_LIMIT", "TimelineView",
           "timeline_figure", "update_timeline_figure", "summary", "lanes", "memory_scale", "residual_figure",
           "update_residual_figure", "residual_grid"]

PHASE_COLORS = {
    "forward": "#4e79a7", "backward": "#e15759", "recompute": "#f28e2b", "copy": "#9c9c9c",
    "input_grad": "#ff9d9a", "weight_grad": "#b07aa1", "send": "#76b7b2", "recv": "#59a14f",
}
PHASES = list(PHASE_COLORS)
#: The letter on a block (with its micro-batch), where it fits: F3, B3, I3, W3, R3.
PHASE_LETTERS = {"forward": "F", "backward": "B", "input_grad": "I", "weight_grad": "W", "recompute": "R"}
#: One colour per stage, as in the split strip.
STAGE_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f"]
#: Plotly's toolbar without its logo, Chart Studio link and selection tools.
PLOTLY_CONFIG = {"displaylogo": False, "showSendToCloud": False,
                 "modeBarButtonsToRemove": ["sendDataToCloud", "editInChartStudio", "lasso2d", "select2d",
                                            "autoScale2d", "toggleSpikelines"],
                 "toImageButtonOptions": {"filename": "pipexplore-timeline"}}
#: Above this many blocks a panel is drawn as WebGL lines (one per block) instead of SVG bars.
BAR_LIMIT = 3000
#: Trace layout of the figure: phases of row 1, phases of row 2, the memory cap, the peaks, one line per stage.
CAP_TRACE, PEAK_TRACE, FIRST_STAGE_TRACE = 2 * len(PHASES), 2 * len(PHASES) + 1, 2 * len(PHASES) + 2
_TEXT = "#555"
_GRID = "rgba(128, 128, 128, 0.25)"
_TITLE_PX, _MEMORY_PX, _EMPTY_PX, _TOP_PX, _BOTTOM_PX = 34, 150, 56, 44, 40


def summary(frame: Optional[pd.DataFrame], samples: Optional[int] = None) -> str:
    """One line: step time, bubble fraction (and throughput when ``samples`` is given).

    Example::

        summary(plan.predicted, samples=64)   # 'step 12.3 ms · bubble 21.0 % · 5,203 samples/s'
    """
    if frame is None or frame.empty:
        return "no run yet"
    text = f"step {tl.step_time(frame) * 1e3:.1f} ms · bubble {tl.bubble_fraction(frame) * 100:.1f} %"
    if samples:
        text += f" · {tl.throughput(frame, samples):,.0f} samples/s"
    return text


def lanes(frame: Optional[pd.DataFrame]) -> list[str]:
    """The lane labels of a timeline (``'stage 0 · cpu'``), stage 0 first.

    Example::

        lanes(plan.predicted)    # ['stage 0 · cpu', 'stage 1 · cpu']
    """
    if frame is None or frame.empty:
        return []
    pairs = frame[["stage", "device"]].drop_duplicates().sort_values("stage", kind="stable")
    return [f"stage {s} · {d}" for s, d in pairs.itertuples(index=False, name=None)]


def memory_scale(peak_bytes: float) -> tuple[float, str]:
    """The divisor and unit that show ``peak_bytes`` in one to four digits.

    Example::

        memory_scale(3 * 2**20)  # (1048576.0, 'MiB')
    """
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if peak_bytes >= 1024.0 ** power:
            return 1024.0 ** power, unit
    return 1.0, "B"


def _lane_px(count: int) -> float:
    return max(10.0, min(28.0, 360.0 / max(1, count)))


def _panel_px(count: int) -> float:
    return max(110.0, count * _lane_px(count)) if count else _EMPTY_PX


def _blocks(frame: Optional[pd.DataFrame]) -> dict[str, dict[str, np.ndarray]]:
    """Per phase: start and end (ms from the step's start), lane label, block label and hover text."""
    out: dict[str, dict[str, np.ndarray]] = {}
    if frame is None or frame.empty:
        return out
    origin = float(frame["start"].min())
    phase_of = frame["phase"].to_numpy()
    stage, device = frame["stage"].to_numpy(), frame["device"].to_numpy()
    microbatch = frame["microbatch"].to_numpy()
    start, end = (frame["start"].to_numpy() - origin) * 1e3, (frame["end"].to_numpy() - origin) * 1e3
    # Expert-backend runs: each bar is a batch the pools formed; say how big and how long it waited.
    extra = np.array([f"<br>batch of {r} rows from {t} tasks, waited {w * 1e3:.2f} ms"
                      for r, t, w in zip(frame["batch_size"], frame["tasks"], frame["wait"])], dtype=object) \
        if {"batch_size", "tasks", "wait"} <= set(frame.columns) else np.full(len(frame), "", dtype=object)
    for phase in PHASES:
        mask = phase_of == phase
        if not mask.any():
            continue
        s, d, i, a, b, e = stage[mask], device[mask], microbatch[mask], start[mask], end[mask], extra[mask]
        letter = PHASE_LETTERS.get(phase, "")
        out[phase] = dict(
            start=a, end=b, lane=np.array([f"stage {x} · {y}" for x, y in zip(s, d)], dtype=object),
            label=np.array([f"{letter}{mb}" if letter else "" for mb in i], dtype=object),
            hover=np.array([f"{phase} · micro-batch {mb} · stage {st}<br>{t0:.2f} → {t1:.2f} ms ({t1 - t0:.2f} ms){ex}"
                            for mb, st, t0, t1, ex in zip(i, s, a, b, e)], dtype=object),
        )
    return out


def _bar_trace(phase: str, data: Optional[dict[str, np.ndarray]], axis: int, legend: bool) -> go.Bar:
    data = data or {}
    return go.Bar(
        orientation="h", name=phase, legendgroup=phase, showlegend=legend, marker_color=PHASE_COLORS[phase],
        marker_line_width=0, x=data.get("end", np.empty(0)) - data.get("start", np.empty(0)) if data else np.empty(0),
        base=data.get("start", np.empty(0)), y=data.get("lane", np.empty(0, dtype=object)),
        text=data.get("label", np.empty(0, dtype=object)), textposition="inside", insidetextanchor="middle",
        textangle=0, textfont=dict(color="white"), constraintext="inside", cliponaxis=True,
        hoverinfo="text", hovertext=data.get("hover", np.empty(0, dtype=object)),
        xaxis=f"x{axis if axis > 1 else ''}", yaxis=f"y{axis if axis > 1 else ''}")


def _segments(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Blocks as line segments (start → end on the lane), separated by gaps: one WebGL trace a phase."""
    n = len(data["start"])
    x = np.empty(3 * n, dtype=object)
    y = np.empty(3 * n, dtype=object)
    hover = np.empty(3 * n, dtype=object)
    x[0::3], x[1::3], x[2::3] = data["start"], data["end"], None
    y[0::3], y[1::3], y[2::3] = data["lane"], data["lane"], None
    hover[0::3], hover[1::3], hover[2::3] = data["hover"], data["hover"], None
    return dict(x=x, y=y, hovertext=hover)


def _line_trace(phase: str, data: Optional[dict[str, np.ndarray]], axis: int, legend: bool, width: float) -> go.Scattergl:
    segments = _segments(data) if data else dict(x=np.empty(0), y=np.empty(0, dtype=object),
                                                 hovertext=np.empty(0, dtype=object))
    return go.Scattergl(mode="lines", name=phase, legendgroup=phase, showlegend=legend, connectgaps=False,
                        line=dict(color=PHASE_COLORS[phase], width=width), hoverinfo="text",
                        xaxis=f"x{axis if axis > 1 else ''}", yaxis=f"y{axis if axis > 1 else ''}", **segments)


class TimelineView:
    """One plotly figure: the predicted step (top), the measured one, and the predicted activation
    memory per stage (bottom), on one shared time axis (same range, zoom and pan together).

    Stage 0 is the top lane; blocks carry their phase letter and micro-batch where they fit; panels
    with more than :data:`BAR_LIMIT` blocks are drawn with WebGL. ``figure`` is a
    ``go.FigureWidget`` (class ``pipexplore-timeline``; ``layout.meta['splits']`` names the plan
    drawn). ``names`` titles the two timeline panels; ``memory=False`` leaves the memory panel out.

    Example::

        view = TimelineView(plan.predicted, samples=64)
        view.show(measured=run.timeline, measured_title="run 0")
        view.figure          # display it
    """

    def __init__(self, predicted: Optional[pd.DataFrame] = None, measured: Optional[pd.DataFrame] = None,
                 samples: Optional[int] = None, *, widget: bool = True, names: Sequence[str] = ("predicted", "measured"),
                 memory: bool = True, memory_cap: Optional[float] = None) -> None:
        self.samples = samples
        self.names = tuple(names)
        self.memory = memory
        self.predicted: Optional[pd.DataFrame] = None
        self.measured: Optional[pd.DataFrame] = None
        self.predicted_title = ""
        self.measured_title = ""
        self.measured_warning = ""
        self.memory_cap: Optional[float] = memory_cap
        self.splits: Sequence[int] = ()
        self._kinds: tuple[Any, ...] = ()
        self._summaries: dict[int, tuple[pd.DataFrame, str]] = {}
        self._memory_unit = "B"
        figure = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.05,
                               subplot_titles=(self.names[0], self.names[1], "activation memory"))
        figure.add_annotation(text="", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                              font=dict(size=13, color="#888"))  # "no run yet" in the empty measured panel
        figure.update_layout(
            barmode="overlay", bargap=0.25, autosize=True, paper_bgcolor="rgba(0,0,0,0)",
            plot_bgcolor="rgba(0,0,0,0)", font=dict(family="system-ui, sans-serif", size=12, color=_TEXT),
            margin=dict(l=10, r=10, t=_TOP_PX, b=_BOTTOM_PX), uniformtext=dict(minsize=8, mode="hide"),
            legend=dict(orientation="h", x=0, y=1, yanchor="top", yref="container", font=dict(size=11),
                        bgcolor="rgba(0,0,0,0)"),
            hoverlabel=dict(font_size=12), dragmode="zoom", meta={"splits": ""})
        for annotation in figure.layout.annotations[:3]:
            annotation.update(x=0, xanchor="left", font=dict(size=12, color=_TEXT))
        figure.update_xaxes(showgrid=True, gridcolor=_GRID, zeroline=False, color=_TEXT)
        figure.update_yaxes(gridcolor=_GRID, zeroline=False, color=_TEXT, automargin=True)
        figure.update_xaxes(title_text="ms from the step's start", row=3 if memory else 2, col=1)
        self.figure: Any = go.FigureWidget(figure) if widget else figure
        self.figure._pipexplore_view = self  # update_timeline_figure finds the view of a figure
        if widget:
            self.figure._config = dict(PLOTLY_CONFIG)
            self.figure.add_class("pipexplore-timeline")
        self.show(predicted=predicted, measured=measured)

    # ---- what is drawn ---------------------------------------------------------------
    def show(self, *, predicted: Optional[pd.DataFrame] = None, measured: Optional[pd.DataFrame] = None,
             clear_measured: bool = False, predicted_title: Optional[str] = None,
             measured_title: Optional[str] = None, measured_warning: Optional[str] = None,
             memory_cap: Any = (), splits: Optional[Sequence[int]] = None) -> None:
        """Redraw what changed (``None`` keeps a panel's timeline; ``clear_measured`` empties it).

        Example::

            view.show(predicted=plan.predicted, splits=plan.splits, predicted_title="splits [4, 8]")
        """
        rows = set()
        if predicted is not None and predicted is not self.predicted:
            self.predicted = predicted
            rows |= {1, 3}
        if measured is not None and measured is not self.measured:
            self.measured = measured
            rows.add(2)
        if clear_measured and self.measured is not None:
            self.measured = None
            rows.add(2)
        if memory_cap != () and memory_cap != self.memory_cap:
            self.memory_cap = memory_cap
            rows.add(3)
        if predicted_title is not None:
            self.predicted_title = predicted_title
        if measured_title is not None:
            self.measured_title = measured_title
        if measured_warning is not None:
            self.measured_warning = measured_warning
        if splits is not None:
            self.splits = list(splits)
        self._draw(rows)

    @property
    def x_range(self) -> list[float]:
        """The shared time axis, ms: from 0 to the longer of the two steps."""
        ends = [tl.step_time(f) * 1e3 for f in (self.predicted, self.measured) if f is not None and not f.empty]
        return [0.0, max(ends, default=1.0) * 1.02]

    def peaks(self) -> pd.DataFrame:
        """Per stage: its predicted peak activation ``bytes``, when (``time``, seconds) and whether it is ``over_cap``.

        Example::

            view.peaks()["over_cap"].any()
        """
        columns = ["stage", "time", "bytes", "over_cap"]
        if self.predicted is None or self.predicted.empty or "memory" not in self.predicted:
            return pd.DataFrame(columns=columns)
        memory = tl.activation_memory(self.predicted.assign(end=self.predicted["end"] - self.predicted["start"].min()))
        rows = memory.loc[memory.groupby("stage")["bytes"].idxmax()].reset_index(drop=True)
        cap = self.memory_cap
        rows["over_cap"] = rows["bytes"] > cap if cap is not None else False
        return rows[columns]

    def _summary(self, frame: Optional[pd.DataFrame]) -> str:
        if frame is None:
            return summary(None)
        cached = self._summaries.get(id(frame))
        if cached is None or cached[0] is not frame:
            cached = (frame, summary(frame, self.samples))
            self._summaries = {k: v for k, v in self._summaries.items() if v[0] is self.predicted
                               or v[0] is self.measured}
            self._summaries[id(frame)] = cached
        return cached[1]

    def _row_traces(self, row: int, kind: str, row_lanes: list[str]) -> list[Any]:
        data = _blocks(self.predicted if row == 1 else self.measured)
        width = 0.7 * _lane_px(len(row_lanes))
        if kind == "gl":
            return [_line_trace(phase, data.get(phase), row, row == 1, width) for phase in PHASES]
        return [_bar_trace(phase, data.get(phase), row, row == 1) for phase in PHASES]

    def _draw(self, rows: set[int]) -> None:
        figure = self.figure
        lane_sets = [lanes(self.predicted), lanes(self.measured)]
        counts = [len(f) if f is not None else 0 for f in (self.predicted, self.measured)]
        has_memory = self.memory and self.predicted is not None and "memory" in self.predicted \
            and not self.predicted.empty
        stages = sorted(self.predicted["stage"].unique()) if has_memory else []
        kinds = tuple("gl" if count > BAR_LIMIT else "bar" for count in counts) + (len(stages),)
        n = len(PHASES)
        with figure.batch_update():
            if kinds != self._kinds:
                traces = self._row_traces(1, kinds[0], lane_sets[0]) + self._row_traces(2, kinds[1], lane_sets[1])
                traces += self._memory_traces(stages)
                figure.data = []
                figure.add_traces(traces)
                self._kinds = kinds
            else:
                for row in (1, 2):
                    if row in rows:
                        for old, new in zip(figure.data[(row - 1) * n: row * n],
                                            self._row_traces(row, kinds[row - 1], lane_sets[row - 1])):
                            _copy_data(old, new)
                if rows & {1, 2, 3}:
                    for old, new in zip(figure.data[2 * n:], self._memory_traces(stages)):
                        _copy_data(old, new)
            self._arrange(lane_sets)
            figure.layout.meta = {"splits": ",".join(str(s) for s in self.splits)}

    def _memory_traces(self, stages: Sequence[int]) -> list[Any]:
        peaks = self.peaks() if self.memory else pd.DataFrame(columns=["stage", "time", "bytes", "over_cap"])
        scale, unit = memory_scale(max([float(peaks["bytes"].max()) if len(peaks) else 0.0,
                                        float(self.memory_cap or 0.0)]))
        self._memory_unit = unit
        end = self.x_range[1]
        cap = self.memory_cap if self.memory else None
        cap_trace = go.Scatter(x=[0, end] if cap is not None else [], y=[cap / scale] * 2 if cap is not None else [],
                               mode="lines", name="memory cap", showlegend=cap is not None,
                               line=dict(color="#d62728", dash="dash", width=1.5), xaxis="x3", yaxis="y3",
                               hovertemplate="memory cap %{y:.2f} " + unit + "<extra></extra>")
        over = peaks["over_cap"].to_numpy(dtype=bool) if len(peaks) else np.zeros(0, dtype=bool)
        peak_trace = go.Scatter(
            x=peaks["time"].to_numpy(dtype=float) * 1e3, y=peaks["bytes"].to_numpy(dtype=float) / scale,
            mode="markers", name="peak", showlegend=False, xaxis="x3", yaxis="y3",
            text=[f"stage {s} peak" + (" — over the cap" if o else "") for s, o in zip(peaks["stage"], over)],
            marker=dict(symbol=np.where(over, "x", "diamond"), size=np.where(over, 11, 8),
                        color=[("#d62728" if o else STAGE_COLORS[int(s) % len(STAGE_COLORS)])
                               for s, o in zip(peaks["stage"], over)]),
            hovertemplate="%{text}: %{y:.2f} " + unit + " at %{x:.2f} ms<extra></extra>")
        traces: list[Any] = [cap_trace, peak_trace]
        if not stages:
            return traces
        predicted = self.predicted
        memory = tl.activation_memory(predicted.assign(end=predicted["end"] - predicted["start"].min()))
        kind = go.Scattergl if len(memory) > BAR_LIMIT else go.Scatter
        for stage in stages:
            rows = memory[memory["stage"] == stage]
            traces.append(kind(
                x=np.concatenate([[0.0], rows["time"].to_numpy() * 1e3]),
                y=np.concatenate([[0.0], rows["bytes"].to_numpy() / scale]), mode="lines",
                line=dict(color=STAGE_COLORS[int(stage) % len(STAGE_COLORS)], width=1.5,
                          **({} if kind is go.Scattergl else {"shape": "hv"})),
                name=f"stage {stage}", showlegend=False, xaxis="x3", yaxis="y3",
                hovertemplate=f"stage {stage}: " + "%{y:.2f} " + unit + " at %{x:.2f} ms<extra></extra>"))
        return traces

    def _arrange(self, lane_sets: Sequence[list[str]]) -> None:
        """Heights follow the lanes; the panels stack with room for their titles."""
        layout = self.figure.layout
        heights = [_panel_px(len(lane_sets[0])), _panel_px(len(lane_sets[1])), _MEMORY_PX if self.memory else 0.0]
        total = sum(heights) + (3 if self.memory else 2) * _TITLE_PX
        layout.height = total + _TOP_PX + _BOTTOM_PX
        top = 1.0
        domains = []
        for h in heights:
            top -= _TITLE_PX / total if h else 0.0
            domains.append([max(0.0, top - h / total), max(0.0, top)])
            top -= h / total
        for k, (axis, lane_list) in enumerate(zip(("yaxis", "yaxis2"), lane_sets)):
            layout[axis].update(domain=domains[k], type="category", categoryorder="array", categoryarray=lane_list,
                                autorange="reversed", visible=bool(lane_list), fixedrange=True)
        layout.yaxis3.update(domain=domains[2] if self.memory else [0, 0], title_text=f"activations ({self._memory_unit})",
                             rangemode="tozero", fixedrange=True, visible=self.memory, ticklabelstandoff=6)
        layout.xaxis3.update(visible=self.memory, ticklabelstandoff=4)  # the two zeros at the corner apart
        measured_empty = not lane_sets[1]
        layout.xaxis2.update(showgrid=not measured_empty, showticklabels=not self.memory)
        for axis in ("xaxis", "xaxis2", "xaxis3"):
            layout[axis].update(range=self.x_range)
        titles = layout.annotations
        titles[0].update(y=domains[0][1], yanchor="bottom", text=self._predicted_text())
        titles[1].update(y=domains[1][1], yanchor="bottom", text=self._measured_text())
        titles[2].update(y=domains[2][1], yanchor="bottom", text=self._memory_text(), visible=self.memory)
        titles[3].update(y=sum(domains[1]) / 2, text="no run yet: press Run step to measure this plan" if measured_empty
                         else "", visible=measured_empty)

    def _predicted_text(self) -> str:
        text = f"{self.names[0]}: " + self._summary(self.predicted)
        return text + (f" — {self.predicted_title}" if self.predicted_title else "")

    def _measured_text(self) -> str:
        text = f"{self.names[1]}: " + self._summary(self.measured)
        if self.measured is not None and self.measured_title:
            text += f" — {self.measured_title}"
        if self.measured is not None and self.measured_warning:
            text += f" <span style='color:#d62728'>⚠ {self.measured_warning}</span>"
        return text

    def _memory_text(self) -> str:
        peaks = self.peaks()
        if peaks.empty:
            return "activation memory: not predicted for this timeline"
        scale, unit = memory_scale(float(max(peaks["bytes"].max(), self.memory_cap or 0.0)))
        top = peaks.loc[peaks["bytes"].idxmax()]
        text = f"predicted activation memory per stage — peak {top['bytes'] / scale:.2f} {unit} (stage {int(top['stage'])})"
        if self.memory_cap is not None:
            over = [str(int(s)) for s in peaks.loc[peaks["over_cap"].astype(bool), "stage"]]
            text += (f" · <span style='color:#d62728'>⚠ stage{'s' if len(over) > 1 else ''} {', '.join(over)} over the "
                     f"cap of {self.memory_cap / scale:.2f} {unit}</span>" if over
                     else f" · all stages under the cap of {self.memory_cap / scale:.2f} {unit}")
        return text


def _copy_data(old: Any, new: Any) -> None:
    """Move the data of trace ``new`` into trace ``old`` of the same type (one restyle each)."""
    keys = ("x", "y", "base", "text", "hovertext", "marker", "line")
    old.update({k: new[k] for k in keys if k in new._valid_props and new[k] is not None})


def timeline_figure(predicted: pd.DataFrame, measured: Optional[pd.DataFrame] = None,
                    samples: Optional[int] = None) -> Any:
    """A figure of the predicted step above the measured one and the activation memory, one time axis.

    Example::

        timeline_figure(plan.predicted, run.timeline, samples=64)
    """
    return TimelineView(predicted, measured, samples).figure


def update_timeline_figure(figure: Any, predicted: Optional[pd.DataFrame] = None,
                           measured: Optional[pd.DataFrame] = None, samples: Optional[int] = None,
                           *, rows: tuple[int, ...] = (1, 2)) -> None:
    """Redraw a figure of :func:`timeline_figure` with new timelines (``rows``: 1 predicted, 2 measured).

    Example::

        update_timeline_figure(figure, predicted=plan.predicted, rows=(1,))
    """
    view = getattr(figure, "_pipexplore_view", None)
    if view is None:
        raise ValueError("update_timeline_figure takes a figure made by timeline_figure (or TimelineView.figure)")
    view.samples = samples if samples is not None else view.samples
    view.show(predicted=predicted if 1 in rows else None, measured=measured if 2 in rows else None,
              clear_measured=2 in rows and measured is None)


# ---- residuals ---------------------------------------------------------------------------

def residual_grid(table: pd.DataFrame) -> pd.DataFrame:
    """Residuals (from :func:`pipexplore.residuals.residuals`) as a grid: one row per stage and
    phase, one column per micro-batch, the error (predicted ÷ measured − 1) in each cell.

    Example::

        residual_grid(explorer.residuals())
    """
    if table.empty:
        return pd.DataFrame()
    grid = table.pivot_table(index=["stage", "phase"], columns="microbatch", values="error", aggfunc="mean")
    order = {phase: k for k, phase in enumerate(PHASES)}
    return grid.sort_index(key=lambda index: index.map(order) if index.name == "phase" else index)


def residual_figure(table: Optional[pd.DataFrame] = None, title: str = "", *, widget: bool = True) -> Any:
    """A stage × micro-batch strip of prediction errors per action (red: predicted too long, blue:
    too short), as a ``go.FigureWidget`` (a plain ``go.Figure`` with ``widget=False``).

    Example::

        residual_figure(explorer.residuals(), title="run 3")
    """
    figure = (go.FigureWidget if widget else go.Figure)(go.Figure(go.Heatmap(colorscale="RdBu_r", zmid=0, texttemplate="%{text}",
                                                  colorbar=dict(title="error %", thickness=12),
                                                  hovertemplate="%{y} · micro-batch %{x}<br>error %{z:+.1f} %"
                                                                "<extra></extra>")))
    figure.update_layout(paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)", autosize=True,
                         font=dict(family="system-ui, sans-serif", size=12, color=_TEXT),
                         margin=dict(l=10, r=10, t=40, b=40))
    figure.update_yaxes(autorange="reversed", type="category", automargin=True, color=_TEXT)
    figure.update_xaxes(title_text="micro-batch", type="category", color=_TEXT)
    if widget:
        figure._config = dict(PLOTLY_CONFIG)
        figure.add_class("pipexplore-residuals")
    update_residual_figure(figure, table, title)
    return figure


def update_residual_figure(figure: Any, table: Optional[pd.DataFrame], title: str = "") -> None:
    """Show ``table`` (per-action residuals) in a figure of :func:`residual_figure`.

    Example::

        update_residual_figure(figure, explorer.residuals(run=2), "run 2")
    """
    grid = residual_grid(table) if table is not None else pd.DataFrame()
    with figure.batch_update():
        heat = figure.data[0]
        if grid.empty:
            heat.z, heat.x, heat.y, heat.text = [], [], [], []
            figure.layout.title.text = "residuals: no run yet"
            figure.layout.height = 160
            return
        percent = grid.to_numpy(dtype=float) * 100
        heat.z = percent
        heat.x = [str(c) for c in grid.columns]
        heat.y = [f"stage {s} · {phase}" for s, phase in grid.index]
        heat.text = [["" if np.isnan(v) or grid.shape[1] > 32 else f"{v:+.0f}" for v in row] for row in percent]
        median = float(np.nanmedian(np.abs(percent)))
        figure.layout.title.text = (f"residuals{' — ' + title if title else ''}: predicted ÷ measured − 1 per action "
                                    f"(median |error| {median:.0f} %)")
        figure.layout.height = max(200, 22 * len(grid) + 110)
