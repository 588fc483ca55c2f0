"""Timeline figures: predicted and measured steps on one shared time axis, activation memory under them."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

from pipexplore import timeline as tl
from pipexplore.widgets import timeline_canvas as canvas

__all__ = ["PHASE_COLORS", "PHASE_LETTERS", "PHASES", "STAGE_COLORS", "PLOTLY_CONFIG", "BAR_LIMIT", "TEXT_COLOR",
           "TimelineView", "timeline_figure", "update_timeline_figure", "summary", "lanes", "memory_scale"]

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
#: Text colour of the figures (JupyterLab's dark theme overrides it with CSS).
TEXT_COLOR = "#555"
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


def _lane_pairs(frame: pd.DataFrame) -> pd.MultiIndex:
    pairs = frame[["stage", "device"]].drop_duplicates().sort_values("stage", kind="stable")
    return pd.MultiIndex.from_frame(pairs)


def lanes(frame: Optional[pd.DataFrame]) -> list[str]:
    """The lane labels of a timeline (``'stage 0 · cpu'``), stage 0 first.

    Example::

        lanes(plan.predicted)    # ['stage 0 · cpu', 'stage 1 · cpu']
    """
    if frame is None or frame.empty:
        return []
    return [f"stage {s} · {d}" for s, d in _lane_pairs(frame)]


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
    """Per phase, as arrays: start and end (ms from the step's start), lane (0 = stage 0), stage,
    micro-batch, and for expert-backend runs a hover line about the batch each block was."""
    out: dict[str, dict[str, np.ndarray]] = {}
    if frame is None or frame.empty:
        return out
    origin = float(frame["start"].min())
    lane = _lane_pairs(frame).get_indexer(pd.MultiIndex.from_frame(frame[["stage", "device"]]))
    phase_of = frame["phase"].to_numpy()
    columns = {"start": (frame["start"].to_numpy(dtype=float) - origin) * 1e3,
               "end": (frame["end"].to_numpy(dtype=float) - origin) * 1e3, "lane": lane,
               "stage": frame["stage"].to_numpy(), "microbatch": frame["microbatch"].to_numpy()}
    if {"batch_size", "tasks", "wait"} <= set(frame.columns):  # each bar a batch the pools formed
        columns["extra"] = np.array([f"<br>batch of {r} rows from {t} tasks, waited {w * 1e3:.2f} ms"
                                     for r, t, w in zip(frame["batch_size"], frame["tasks"], frame["wait"])],
                                    dtype=object)
    for phase in PHASES:
        mask = phase_of == phase
        if mask.any():
            out[phase] = {name: values[mask] for name, values in columns.items()}
    return out


def _hover(phase: str, layers: bool = False, other: str = "") -> str:
    """Phase, micro-batch, stage (and its layers), span; ``other``: the name of the span of the same
    action shown beside it (on a measured block: what its run predicted)."""
    text = f"{phase} · micro-batch %{{customdata[0]}} · stage %{{customdata[1]}}"
    if layers:
        text += " · layers %{customdata[5]}–%{customdata[6]}"
    text += "<br>%{customdata[2]:.2f} → %{customdata[3]:.2f} ms (%{customdata[4]:.2f} ms)"
    if other:
        text += f"<br>{other}: %{{customdata[7]:.2f}} ms"
    return text + "<extra></extra>"


def _bar_props(phase: str, data: Optional[dict[str, np.ndarray]],
               stage_layers: Optional[Sequence[tuple[int, int]]] = None,
               other: Optional[dict[str, np.ndarray]] = None, other_name: str = "") -> dict[str, Any]:
    """What a phase's bars change from one plan to the next (a restyle of one trace).
    ``stage_layers``: each stage's first and last layer; ``other``: the other panel's blocks of
    this phase, whose span of the same (stage, micro-batch) the hover shows."""
    if not data:
        return dict(x=np.empty(0), base=np.empty(0), y=np.empty(0), text=np.empty(0, dtype=object),
                    customdata=np.empty((0, 8)), hovertext=np.empty(0, dtype=object), hovertemplate=_hover(phase))
    start, end = data["start"], data["end"]
    letter = PHASE_LETTERS.get(phase, "")
    text = (letter + pd.Series(data["microbatch"]).astype(str)).to_numpy(dtype=object) if letter else \
        np.full(len(start), "", dtype=object)
    stage = data["stage"].astype(int)
    first = last = np.full(len(start), np.nan)
    known = stage_layers is not None and len(stage_layers) > 0 and stage.max() < len(stage_layers)
    if known:
        bounds = np.asarray(stage_layers, dtype=float)
        first, last = bounds[stage, 0], bounds[stage, 1]
    beside = np.full(len(start), np.nan)
    if other:
        keys = zip(other["stage"].astype(int), other["microbatch"].astype(int))
        spans = dict(zip(keys, other["end"] - other["start"]))
        beside = np.array([spans.get((s, int(i)), np.nan) for s, i in zip(stage, data["microbatch"])], dtype=float)
    # No NaN in what travels to the browser (the widget's messages are JSON): -1 where unknown.
    custom = np.nan_to_num(np.column_stack([data["microbatch"], data["stage"], start, end, end - start, first, last,
                                            beside]).astype(float), nan=-1.0)
    hovertext = np.array([f"{phase} · micro-batch {mb} · stage {st}<br>{a:.2f} → {b:.2f} ms ({b - a:.2f} ms){ex}"
                          for mb, st, a, b, ex in zip(data["microbatch"], data["stage"], start, end, data["extra"])],
                         dtype=object) if "extra" in data else np.empty(0, dtype=object)
    template = _hover(phase, layers=known, other=other_name if other and not np.isnan(beside).all() else "")
    return dict(x=end - start, base=start, y=data["lane"], text=text, customdata=custom, hovertext=hovertext,
                hovertemplate="%{hovertext}<extra></extra>" if len(hovertext) else template)


def _line_props(phase: str, data: Optional[dict[str, np.ndarray]], width: float) -> dict[str, Any]:
    """Blocks as line segments (start → end on the lane) with gaps between: one WebGL trace a phase.
    Plain numeric arrays only (they travel as binary buffers): the micro-batch rides as customdata.
    Single precision (what WebGL draws with anyway): half the bytes of a redraw, and times keep
    ~7 digits (1 µs at a 10 s step)."""
    hover = f"{phase} · micro-batch %{{customdata}} · stage %{{y}}<br>%{{x:.2f}} ms<extra></extra>"
    if not data:
        return {"x": np.empty(0), "y": np.empty(0), "customdata": np.empty(0), "hovertemplate": hover,
                "line.width": width}
    n = len(data["start"])
    x, y, custom = (np.full(3 * n, np.nan, dtype=np.float32) for _ in range(3))
    x[0::3], x[1::3] = data["start"], data["end"]
    y[0::3] = y[1::3] = data["lane"]
    custom[0::3] = custom[1::3] = data["microbatch"]
    return {"x": x, "y": y, "customdata": custom, "hovertemplate": hover, "line.width": width}


def _axes(row: int) -> dict[str, str]:
    return {"xaxis": f"x{row if row > 1 else ''}", "yaxis": f"y{row if row > 1 else ''}"}


def _bar_trace(phase: str, props: dict[str, Any], row: int) -> Any:
    import plotly.graph_objects as go

    return go.Bar(orientation="h", name=phase, legendgroup=phase, showlegend=row == 1, marker_color=PHASE_COLORS[phase],
                  marker_line_width=0, textposition="inside", insidetextanchor="middle", textangle=0,
                  textfont=dict(color="white"), constraintext="inside", cliponaxis=True, **_axes(row), **props)


def _line_trace(phase: str, props: dict[str, Any], row: int) -> Any:
    import plotly.graph_objects as go

    props = dict(props)
    width = props.pop("line.width")
    return go.Scattergl(mode="lines", name=phase, legendgroup=phase, showlegend=row == 1, connectgaps=False,
                        line=dict(color=PHASE_COLORS[phase], width=width), **_axes(row), **props)


class TimelineView:
    """The predicted step (top), the measured one, and the predicted activation memory per stage
    (bottom), on one shared time axis (same range, zoom and pan together).

    Stage 0 is the top lane; blocks carry their phase letter and micro-batch where they fit. With
    ``widget=True`` (the explorer's) ``figure`` is a :class:`~pipexplore.widgets.timeline_canvas.TimelineCanvas`
    (class ``pipexplore-timeline``; its ``scene['splits']`` names the plan drawn): a redraw is one
    message of binary arrays, drawn on canvas with a level of detail. With ``widget=False`` it is a
    plotly figure (what a static report embeds), where panels of more than :data:`BAR_LIMIT` blocks
    are WebGL lines. ``names`` titles the two timeline panels; ``memory=False`` leaves the memory
    panel out.

    Example::

        view = TimelineView(plan.predicted, samples=64)
        view.show(measured=run.timeline, measured_title="run 0")
        view.figure          # display it
    """

    def __init__(self, predicted: Optional[pd.DataFrame] = None, measured: Optional[pd.DataFrame] = None,
                 samples: Optional[int] = None, *, widget: bool = True,
                 names: Sequence[str] = ("predicted", "measured"),
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
        #: Each stage's (first, last) layer, for the hover of a block: the current plan's and the
        #: measured run's (empty: not shown).
        self.stage_layers: Sequence[tuple[int, int]] = ()
        self.measured_stage_layers: Sequence[tuple[int, int]] = ()
        #: What was predicted for the run in the measured panel (its blocks' hover shows it).
        self.measured_prediction: Optional[pd.DataFrame] = None
        self._kinds: tuple[Any, ...] = ()
        self._summaries: dict[int, tuple[pd.DataFrame, str]] = {}
        self._memory_unit = "B"
        self._panels: dict[int, dict[str, Any]] = {}  # the canvas's block panels, kept until their rows change
        self.widget = widget
        self.figure: Any = canvas.TimelineCanvas() if widget else self._plotly_figure()
        self.figure._pipexplore_view = self  # update_timeline_figure finds the view of a figure
        if widget:
            self.figure.add_class("pipexplore-timeline")
        self.show(predicted=predicted, measured=measured)

    def _plotly_figure(self) -> Any:
        from plotly.subplots import make_subplots

        memory = self.memory
        figure = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.05,
                               subplot_titles=(self.names[0], self.names[1], "activation memory"))
        figure.add_annotation(text="", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                              font=dict(size=13, color="#888"))  # "no run yet" in the empty measured panel
        figure.update_layout(
            barmode="overlay", bargap=0.25, autosize=True, paper_bgcolor="rgba(0,0,0,0)",
            plot_bgcolor="rgba(0,0,0,0)", font=dict(family="system-ui, sans-serif", size=12, color=TEXT_COLOR),
            margin=dict(l=10, r=10, t=_TOP_PX, b=_BOTTOM_PX), uniformtext=dict(minsize=8, mode="hide"),
            legend=dict(orientation="h", x=0, y=1, yanchor="top", yref="container", font=dict(size=11),
                        bgcolor="rgba(0,0,0,0)"),
            hoverlabel=dict(font_size=12), dragmode="zoom", meta={"splits": ""})
        for annotation in figure.layout.annotations[:3]:
            annotation.update(x=0, xanchor="left", font=dict(size=12, color=TEXT_COLOR))
        figure.update_xaxes(showgrid=True, gridcolor=_GRID, zeroline=False, color=TEXT_COLOR)
        figure.update_yaxes(gridcolor=_GRID, zeroline=False, color=TEXT_COLOR, automargin=True)
        for axis in ("yaxis", "yaxis2"):
            figure.layout[axis].update(tickmode="array", showgrid=False, fixedrange=True)
        figure.update_xaxes(title_text="ms from the step's start", row=3 if memory else 2, col=1)
        return figure

    # ---- what is drawn ---------------------------------------------------------------
    def show(self, *, predicted: Optional[pd.DataFrame] = None, measured: Optional[pd.DataFrame] = None,
             clear_measured: bool = False, predicted_title: Optional[str] = None,
             measured_title: Optional[str] = None, measured_warning: Optional[str] = None,
             memory_cap: Any = (), splits: Optional[Sequence[int]] = None,
             predicted_summary: Optional[str] = None,
             stage_layers: Optional[Sequence[tuple[int, int]]] = None,
             measured_stage_layers: Optional[Sequence[tuple[int, int]]] = None,
             measured_prediction: Optional[pd.DataFrame] = None) -> None:
        """Redraw what changed (``None`` keeps a panel's timeline; ``clear_measured`` empties it).
        ``predicted_summary`` replaces the predicted panel's figures (when the caller has them).

        Example::

            view.show(predicted=plan.predicted, splits=plan.splits, predicted_title="splits [4, 8]")
        """
        rows = set()
        if predicted is not None and predicted is not self.predicted:
            self.predicted = predicted
            rows |= {1, 3}
        if predicted_summary is not None and self.predicted is not None:
            self._summaries[id(self.predicted)] = (self.predicted, predicted_summary)
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
        if stage_layers is not None and list(stage_layers) != list(self.stage_layers):
            self.stage_layers = [tuple(b) for b in stage_layers]
            rows.add(1)
        if measured_stage_layers is not None and list(measured_stage_layers) != list(self.measured_stage_layers):
            self.measured_stage_layers = [tuple(b) for b in measured_stage_layers]
            rows.add(2)
        if measured_prediction is not None and measured_prediction is not self.measured_prediction:
            self.measured_prediction = measured_prediction
            rows.add(2)
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
        memory = self._memory()
        cached = getattr(self, "_peaks_of", (None, None))
        if cached[0] is not memory:
            # Each stage's first row of the most bytes (the memory is sorted by stage, then time).
            stage, held = memory["stage"].to_numpy(), memory["bytes"].to_numpy(dtype=float)
            order = np.lexsort((-held, stage))
            firsts = order[np.concatenate([[0], np.flatnonzero(np.diff(stage[order])) + 1])] if len(order) else order
            cached = (memory, memory.iloc[firsts].reset_index(drop=True))
            self._peaks_of = cached
        rows = cached[1].copy()
        cap = self.memory_cap
        rows["over_cap"] = rows["bytes"] > cap if cap is not None else False
        return rows[columns]

    def _memory(self) -> pd.DataFrame:
        predicted = self.predicted
        cached = getattr(self, "_memory_of", (None, None))
        if cached[0] is not predicted:
            memory = tl.activation_memory(predicted)
            memory["time"] -= predicted["start"].min()  # from the step's start
            cached = (predicted, memory)
            self._memory_of = cached
        return cached[1]

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

    def _row_props(self, row: int, kind: str, lane_count: int) -> list[dict[str, Any]]:
        data = _blocks(self.predicted if row == 1 else self.measured)
        if kind == "gl":
            width = 0.7 * _lane_px(lane_count)
            return [_line_props(phase, data.get(phase), width) for phase in PHASES]
        if row == 1:
            return [_bar_props(phase, data.get(phase), self.stage_layers) for phase in PHASES]
        # A measured block's hover shows what was predicted for the same action of its own run.
        other = _blocks(self.measured_prediction) if self.measured_prediction is not None else {}
        return [_bar_props(phase, data.get(phase), self.measured_stage_layers, other.get(phase),
                           "predicted for this run") for phase in PHASES]

    def highlight(self, stage: Optional[int]) -> None:
        """Shade ``stage``'s lane in both timelines (what hovering a layer of the strip does);
        ``None`` clears it. One layout message; the traces are untouched."""
        if self.widget:
            self.figure.highlight = -1 if stage is None else int(stage)
            return
        shapes = []
        if stage is not None:
            color = STAGE_COLORS[int(stage) % len(STAGE_COLORS)]
            for row, frame in ((1, self.predicted), (2, self.measured)):
                if frame is None or frame.empty:
                    continue
                pairs = _lane_pairs(frame)
                lanes_of_stage = [k for k, (s, _) in enumerate(pairs) if int(s) == int(stage)]
                for lane in lanes_of_stage:
                    suffix = "" if row == 1 else "2"
                    shapes.append(dict(type="rect", xref=f"x{suffix} domain", yref=f"y{suffix}", x0=0, x1=1,
                                       y0=lane - 0.5, y1=lane + 0.5, fillcolor=color, opacity=0.18,
                                       line=dict(width=0), layer="below"))
        self.figure.layout.shapes = shapes

    def _draw(self, rows: set[int]) -> None:
        if self.widget:
            self._draw_canvas(rows)
        else:
            self._draw_plotly(rows)

    def _draw_canvas(self, rows: set[int]) -> None:
        """One scene message: block panels rebuilt for the rows that changed, titles and memory always."""
        phases = list(PHASE_COLORS)
        measured_text, measured_warning = self._measured_parts()
        if 1 in rows or 1 not in self._panels:
            self._panels[1] = canvas.block_panel(self.predicted, phases, stage_layers=self.stage_layers)
        if 2 in rows or 2 not in self._panels:
            self._panels[2] = canvas.block_panel(
                self.measured, phases, empty="no run yet: press Run step to measure this plan",
                stage_layers=self.measured_stage_layers, other=self.measured_prediction,
                other_name="predicted for this run")
        panels = [self._panels[1] | {"title": self._predicted_text()},
                  self._panels[2] | {"title": measured_text, "warning": measured_warning}]
        if self.memory:
            if 3 in rows or 3 not in self._panels:
                self._panels[3] = self._memory_panel()
            text, warning = self._memory_parts()
            panels.append(self._panels[3] | {"title": text, "warning": warning})
        shown = {phase for frame in (self.predicted, self.measured) if frame is not None
                 for phase in frame["phase"].unique()}
        self.figure.scene = {
            "panels": panels, "phases": canvas.phase_table(PHASE_COLORS, PHASE_LETTERS),
            "legend": [k for k, phase in enumerate(phases) if phase in shown],
            "x_range": self.x_range, "splits": ",".join(str(s) for s in self.splits)}

    def _memory_panel(self) -> dict[str, Any]:
        peaks = self.peaks()
        has_memory = self.predicted is not None and "memory" in self.predicted and not self.predicted.empty
        memory = self._memory() if has_memory else pd.DataFrame({"stage": [], "time": [], "bytes": []})
        scale, unit = memory_scale(max([float(peaks["bytes"].max()) if len(peaks) else 0.0,
                                        float(self.memory_cap or 0.0)]))
        self._memory_unit = unit
        return canvas.memory_panel(memory, peaks, STAGE_COLORS, scale=scale, unit=unit, cap=self.memory_cap)

    def _draw_plotly(self, rows: set[int]) -> None:
        from plotly.basedatatypes import Undefined

        lane_sets = [lanes(self.predicted), lanes(self.measured)]
        counts = [len(f) if f is not None else 0 for f in (self.predicted, self.measured)]
        has_memory = self.memory and self.predicted is not None and "memory" in self.predicted \
            and not self.predicted.empty
        stages = sorted(self.predicted["stage"].unique()) if has_memory else []
        memory_gl = bool(stages) and len(self._memory()) > BAR_LIMIT
        kinds = tuple("gl" if count > BAR_LIMIT else "bar" for count in counts) + (len(stages), memory_gl)
        rebuild = kinds != self._kinds
        updates: list[tuple[int, dict[str, Any]]] = []
        n = len(PHASES)
        for row in (1, 2):
            if rebuild or row in rows:
                props = self._row_props(row, kinds[row - 1], len(lane_sets[row - 1]))
                updates += [((row - 1) * n + k, p) for k, p in enumerate(props)]
        if rebuild or rows:
            updates += [(2 * n + k, p) for k, p in enumerate(self._memory_props(stages))]
        layout = self._layout(lane_sets)
        figure = self.figure
        if rebuild:
            self._kinds_memory_gl = memory_gl
            traces = [(_line_trace if kinds[(i // n)] == "gl" else _bar_trace)(PHASES[i % n], p, i // n + 1)
                      if i < 2 * n else self._memory_trace(i - 2 * n, p, stages) for i, p in updates]
            with figure.batch_update():
                figure.data = []
                figure.add_traces(traces)
            self._kinds = kinds
            figure.plotly_relayout(layout)
            return
        keys = sorted({key for _, props in updates for key in props})
        restyle = {key: [props.get(key, Undefined) for _, props in updates] for key in keys}
        figure.plotly_update(restyle_data=restyle, relayout_data=layout, trace_indexes=[i for i, _ in updates])

    def _memory_props(self, stages: Sequence[int]) -> list[dict[str, Any]]:
        """The cap line, the peak marks, then one step line per stage (what a redraw changes)."""
        peaks = self.peaks() if self.memory else pd.DataFrame(columns=["stage", "time", "bytes", "over_cap"])
        scale, unit = memory_scale(max([float(peaks["bytes"].max()) if len(peaks) else 0.0,
                                        float(self.memory_cap or 0.0)]))
        self._memory_unit = unit
        cap = self.memory_cap if self.memory else None
        end = self.x_range[1]
        over = peaks["over_cap"].to_numpy(dtype=bool) if len(peaks) else np.zeros(0, dtype=bool)
        props: list[dict[str, Any]] = [
            {"x": np.array([0.0, end]) if cap is not None else np.empty(0),
             "y": np.array([cap / scale] * 2) if cap is not None else np.empty(0), "showlegend": cap is not None,
             "hovertemplate": "memory cap %{y:.2f} " + unit + "<extra></extra>"},
            {"x": peaks["time"].to_numpy(dtype=float) * 1e3, "y": peaks["bytes"].to_numpy(dtype=float) / scale,
             "text": np.array([f"stage {s} peak" + (" — over the cap" if o else "")
                               for s, o in zip(peaks["stage"], over)], dtype=object),
             "marker.symbol": np.where(over, "x", "diamond").astype(object), "marker.size": np.where(over, 11, 8),
             "marker.color": np.array([("#d62728" if o else STAGE_COLORS[int(s) % len(STAGE_COLORS)])
                                       for s, o in zip(peaks["stage"], over)], dtype=object),
             "hovertemplate": "%{text}: %{y:.2f} " + unit + " at %{x:.2f} ms<extra></extra>"},
        ]
        if not stages:
            return props
        memory = self._memory()
        order = memory["stage"].to_numpy()
        times, values = memory["time"].to_numpy() * 1e3, memory["bytes"].to_numpy() / scale
        if len(memory) > BAR_LIMIT:  # drawn with WebGL: single precision, as the blocks
            times, values = times.astype(np.float32), values.astype(np.float32)
        bounds = np.searchsorted(order, np.asarray(stages), side="left").tolist() + [len(order)]
        for k, stage in enumerate(stages):
            a, b = bounds[k], bounds[k + 1]
            props.append({"x": np.concatenate([np.zeros(1, times.dtype), times[a:b]]),
                          "y": np.concatenate([np.zeros(1, values.dtype), values[a:b]]),
                          "hovertemplate": f"stage {stage}: " + "%{y:.2f} " + unit + " at %{x:.2f} ms<extra></extra>"})
        return props

    def _memory_trace(self, k: int, props: dict[str, Any], stages: Sequence[int]) -> Any:
        import plotly.graph_objects as go

        common = dict(xaxis="x3", yaxis="y3", x=props["x"], y=props["y"], hovertemplate=props["hovertemplate"])
        if k == 0:
            return go.Scatter(mode="lines", name="memory cap", showlegend=props["showlegend"],
                              line=dict(color="#d62728", dash="dash", width=1.5), **common)
        if k == 1:
            return go.Scatter(mode="markers", name="peak", showlegend=False, text=props["text"],
                              marker=dict(symbol=props["marker.symbol"], size=props["marker.size"],
                                          color=props["marker.color"]), **common)
        stage = stages[k - 2]
        line = dict(color=STAGE_COLORS[int(stage) % len(STAGE_COLORS)], width=1.5)
        if self._kinds_memory_gl:
            return go.Scattergl(mode="lines", name=f"stage {stage}", showlegend=False, line=line, **common)
        return go.Scatter(mode="lines", name=f"stage {stage}", showlegend=False, line=dict(shape="hv", **line),
                          **common)

    def _layout(self, lane_sets: Sequence[list[str]]) -> dict[str, Any]:
        """The layout for these lanes: heights follow the lanes; panels stack with room for their titles."""
        heights = [_panel_px(len(lane_sets[0])), _panel_px(len(lane_sets[1])), _MEMORY_PX if self.memory else 0.0]
        total = sum(heights) + (3 if self.memory else 2) * _TITLE_PX
        top = 1.0
        domains = []
        for h in heights:
            top -= _TITLE_PX / total if h else 0.0
            domains.append([max(0.0, top - h / total), max(0.0, top)])
            top -= h / total
        layout: dict[str, Any] = {"height": total + _TOP_PX + _BOTTOM_PX,
                                  "meta": {"splits": ",".join(str(s) for s in self.splits)}}
        for k, (axis, lane_list) in enumerate(zip(("yaxis", "yaxis2"), lane_sets)):
            layout.update({f"{axis}.domain": domains[k], f"{axis}.tickvals": list(range(len(lane_list))),
                           f"{axis}.ticktext": list(lane_list), f"{axis}.range": [len(lane_list) - 0.5, -0.5],
                           f"{axis}.visible": bool(lane_list)})
        measured_empty = not lane_sets[1]
        x_range = self.x_range
        layout.update({
            "yaxis3.domain": domains[2] if self.memory else [0, 0],
            "yaxis3.title.text": f"activations ({self._memory_unit})", "yaxis3.rangemode": "tozero",
            "yaxis3.fixedrange": True, "yaxis3.visible": self.memory, "yaxis3.ticklabelstandoff": 6,
            "xaxis3.visible": self.memory, "xaxis3.ticklabelstandoff": 4,  # the two zeros at the corner apart
            "xaxis2.showgrid": not measured_empty, "xaxis2.showticklabels": not self.memory,
            "xaxis.range": x_range, "xaxis2.range": x_range, "xaxis3.range": x_range,
            "annotations[0].y": domains[0][1], "annotations[0].yanchor": "bottom",
            "annotations[0].text": self._predicted_text(),
            "annotations[1].y": domains[1][1], "annotations[1].yanchor": "bottom",
            "annotations[1].text": self._measured_text(),
            "annotations[2].y": domains[2][1], "annotations[2].yanchor": "bottom",
            "annotations[2].text": self._memory_text(), "annotations[2].visible": self.memory,
            "annotations[3].y": sum(domains[1]) / 2, "annotations[3].visible": measured_empty,
            "annotations[3].text": "no run yet: press Run step to measure this plan" if measured_empty else "",
        })
        return layout

    def _predicted_text(self) -> str:
        text = f"{self.names[0]}: " + self._summary(self.predicted)
        return text + (f" — {self.predicted_title}" if self.predicted_title else "")

    def _measured_parts(self) -> tuple[str, str]:
        """The measured panel's title and its warning ('' when none)."""
        text = f"{self.names[1]}: " + self._summary(self.measured)
        if self.measured is not None and self.measured_title:
            text += f" — {self.measured_title}"
        return text, self.measured_warning if self.measured is not None else ""

    def _measured_text(self) -> str:
        text, warning = self._measured_parts()
        return text + (f" <span style='color:#d62728'>⚠ {warning}</span>" if warning else "")

    def _memory_parts(self) -> tuple[str, str]:
        """The memory panel's title and its warning (the stages over the cap; '' when none)."""
        peaks = self.peaks()
        if peaks.empty:
            return "activation memory: not predicted for this timeline", ""
        scale, unit = memory_scale(float(max(peaks["bytes"].max(), self.memory_cap or 0.0)))
        top = peaks.loc[peaks["bytes"].idxmax()]
        text = (f"predicted activation memory per stage — peak {top['bytes'] / scale:.2f} {unit} "
                f"(stage {int(top['stage'])})")
        if self.memory_cap is None:
            return text, ""
        over = [str(int(s)) for s in peaks.loc[peaks["over_cap"].astype(bool), "stage"]]
        cap = f"{self.memory_cap / scale:.2f} {unit}"
        if over:
            return text, f"stage{'s' if len(over) > 1 else ''} {', '.join(over)} over the cap of {cap}"
        return text + f" · all stages under the cap of {cap}", ""

    def _memory_text(self) -> str:
        text, warning = self._memory_parts()
        return text + (f" · <span style='color:#d62728'>⚠ {warning}</span>" if warning else "")


def warm_up() -> None:
    """Pay the first-use costs of an explorer ahead of it: torch's pipelining helpers that the
    profile uses, the widget modules, the simulator, and torch's optimizers (~1 s on first use;
    a run needs them), by laying out a tiny timeline and making one optimizer. ``%load_ext
    pipexplore`` runs this in a background thread, while the user writes the next cell."""
    import torch
    # What profiling a layer's input- and weight-gradient passes needs (~2 s: it imports torch._dynamo).
    import torch.distributed.pipelining._backward  # noqa: F401

    from pipexplore.simulate import simulate

    table = pd.DataFrame({"name": ["0", "1"], "forward": [1e-3, 1e-3], "backward": [2e-3, 2e-3],
                          "output_bytes": 0.0, "param_bytes": 0.0})
    predicted = simulate(table, [1], chunks=2)
    canvas.block_panel(predicted, PHASES)
    tl.activation_memory(predicted)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


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
