"""Timelines: predicted and measured steps on one shared time axis, activation memory under them."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

from pipexplore import timeline as tl
from pipexplore.widgets import timeline_canvas as canvas
from pipexplore.widgets.protocol import BlockPanel, MemoryPanel, TimelineScene

__all__ = ["PHASE_COLORS", "PHASE_LETTERS", "PHASES", "STAGE_COLORS", "TimelineView", "Scene", "timeline_figure",
           "summary", "lanes", "memory_scale", "held_memory"]

PHASE_COLORS = {
    "forward": "#4e79a7", "backward": "#e15759", "recompute": "#f28e2b", "copy": "#9c9c9c",
    "input_grad": "#ff9d9a", "weight_grad": "#b07aa1", "send": "#76b7b2", "recv": "#59a14f",
    "optimizer": "#edc948", "collective": "#8c8c3c",
}
PHASES = list(PHASE_COLORS)
#: The letter on a block (with its micro-batch), where it fits: F3, B3, I3, W3, R3; U for a stage's
#: optimizer step (the update: it belongs to no micro-batch).
PHASE_LETTERS = {"forward": "F", "backward": "B", "input_grad": "I", "weight_grad": "W", "recompute": "R",
                 "optimizer": "U"}
#: One colour per stage, as in the split strip.
STAGE_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7", "#9c755f"]


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
    return canvas.lane_labels(canvas.lane_of(frame)[0])


def held_memory(frame: pd.DataFrame) -> pd.DataFrame:
    """``stage, time, bytes``: the activation memory of ``frame``'s rows that say it (its ``memory``
    column), time in seconds from the step's start, by stage then time (what the memory panel draws).

    Example::

        held_memory(plan.predicted).groupby("stage")["bytes"].max()    # each stage's predicted peak
    """
    said = frame["memory"].notna()
    memory = tl.activation_memory(frame if said.all() else frame[said])
    memory["time"] -= frame["start"].min()  # from the step's start
    return memory


def memory_scale(peak_bytes: float) -> tuple[float, str]:
    """The divisor and unit that show ``peak_bytes`` in one to four digits.

    Example::

        memory_scale(3 * 2**20)  # (1048576.0, 'MiB')
    """
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if peak_bytes >= 1024.0 ** power:
            return 1024.0 ** power, unit
    return 1.0, "B"


class Scene:
    """What a :class:`TimelineView` draws, without a widget: ``scene`` and ``highlight`` as
    :class:`~pipexplore.widgets.timeline_canvas.TimelineCanvas` has them (what a report embeds)."""

    def __init__(self) -> None:
        self.scene: dict[str, Any] = {}
        self.highlight = -1


class TimelineView:
    """The predicted step (top), the measured one, and the predicted activation memory per stage
    (bottom), on one shared time axis (same range, zoom and pan together).

    Stage 0 is the top lane; blocks carry their phase letter and micro-batch where they fit.
    ``figure`` holds the ``scene`` (what :mod:`~pipexplore.widgets.timeline_canvas` draws; its
    ``scene['splits']`` names the plan drawn): with ``widget=True`` (the explorer's) it is a
    :class:`~pipexplore.widgets.timeline_canvas.TimelineCanvas` (class ``pipexplore-timeline``), a
    redraw is one message of binary arrays; with ``widget=False`` a plain :class:`Scene` (what a
    report embeds). ``names`` titles the two timeline panels; ``memory=False`` leaves the memory
    panel out.

    Example::

        view = TimelineView(plan.predicted, samples=64)
        view.show(measured=run.timeline, measured_title="run 0")
        view.figure          # display it
    """

    def __init__(self, predicted: Optional[pd.DataFrame] = None, measured: Optional[pd.DataFrame] = None,
                 samples: Optional[int] = None, *, widget: bool = True,
                 names: Sequence[str] = ("predicted", "measured"),
                 memory: bool = True, memory_cap: Optional[float] = None,
                 measured_empty: str = "no run yet: press Run step to measure this plan") -> None:
        self.samples = samples
        self.names = tuple(names)
        self.memory = memory
        self.predicted: Optional[pd.DataFrame] = None
        self.measured: Optional[pd.DataFrame] = None
        self.predicted_title = ""
        self.measured_title = ""
        self.measured_warning = ""
        #: What the measured panel says before a run.
        self.measured_empty = measured_empty
        self.memory_cap: Optional[float] = memory_cap
        self.splits: Sequence[int] = ()
        #: Each stage's (first, last) layer, for the hover of a block: the current plan's and the
        #: measured run's (empty: not shown).
        self.stage_layers: Sequence[tuple[int, int]] = ()
        self.measured_stage_layers: Sequence[tuple[int, int]] = ()
        #: What was predicted for the run in the measured panel (its blocks' hover shows it).
        self.measured_prediction: Optional[pd.DataFrame] = None
        self._summaries: dict[int, tuple[pd.DataFrame, str]] = {}
        # the block panels (1, 2: BlockPanel) and the memory panel (3: MemoryPanel), kept until their rows change
        self._panels: dict[int, Any] = {}
        self._retime_key = ""  # the plan shape the page may re-time (see :meth:`retime`)
        self.figure: Any = canvas.TimelineCanvas() if widget else Scene()
        if isinstance(self.figure, canvas.TimelineCanvas):
            self.figure.add_class("pipexplore-timeline")
        self.show(predicted=predicted, measured=measured)

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
            rows |= {2, 3}
        if clear_measured and self.measured is not None:
            self.measured = None
            rows |= {2, 3}
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
            self.stage_layers = [(int(b[0]), int(b[1])) for b in stage_layers]
            rows.add(1)
        if measured_stage_layers is not None and list(measured_stage_layers) != list(self.measured_stage_layers):
            self.measured_stage_layers = [(int(b[0]), int(b[1])) for b in measured_stage_layers]
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
        cached: tuple[Any, Any] = getattr(self, "_peaks_of", (None, None))
        if cached[0] is not memory:
            # Each stage's first row of the most bytes (the memory is sorted by stage, then time):
            # per run of a stage its maximum, then the first row that reaches it.
            stage, held = memory["stage"].to_numpy(), memory["bytes"].to_numpy(dtype=float)
            firsts = np.zeros(0, dtype=np.int64)
            if len(stage):
                bounds = np.flatnonzero(np.r_[True, stage[1:] != stage[:-1]])
                most = np.maximum.reduceat(held, bounds)
                reached = np.flatnonzero(held == np.repeat(most, np.diff(np.r_[bounds, len(stage)])))
                firsts = reached[np.searchsorted(reached, bounds)]
            cached = (memory, memory.iloc[firsts].reset_index(drop=True))
            self._peaks_of = cached
        rows = cached[1].copy()
        cap = self.memory_cap
        rows["over_cap"] = rows["bytes"] > cap if cap is not None else False
        return rows[columns]

    def _memory(self) -> pd.DataFrame:
        return self._held(self.predicted, "_memory_of")

    def _held(self, frame: pd.DataFrame, slot: str) -> pd.DataFrame:
        """The activation memory of ``frame``'s rows that say it, time from its step's start;
        kept in ``slot`` while the frame is the same."""
        cached = getattr(self, slot, (None, None))
        if cached[0] is not frame:
            cached = (frame, held_memory(frame))
            setattr(self, slot, cached)
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

    def retime(self, key: str, model: Optional[dict[str, Any]] = None, lanes: Sequence[tuple[int, str]] = ()) -> None:
        """Let the page re-time a moved split of the predicted plan itself. ``key`` names the
        predicted plan's shape (:func:`pipexplore.predict.retime.retime_key`; scenes drawn from now on
        carry it; ``''``: none); ``model``: :func:`pipexplore.predict.retime.retime_model` of that plan
        with the same ``key``, ``lanes`` the (stage, device) of each of its lanes
        (:func:`~pipexplore.widgets.timeline_canvas.lane_of`; may come later: the page re-times only
        with a model whose key is its scene's)."""
        self._retime_key = key
        if model is not None and isinstance(self.figure, canvas.TimelineCanvas):
            # (a protocol.RetimePayload: retime_model's fields, the key, and the panel)
            self.figure.retime = {**model, "panel": canvas.retime_panel(lanes, PHASES, model)}

    def highlight(self, stage: Optional[int]) -> None:
        """Shade ``stage``'s lane in both timelines (what hovering a layer of the strip does);
        ``None`` clears it. One small message; the scene is untouched."""
        self.figure.highlight = -1 if stage is None else int(stage)

    def _draw(self, rows: set[int]) -> None:
        """One scene message: block panels rebuilt for the rows that changed, titles and memory always."""
        measured_text, measured_warning = self._measured_parts()
        if 1 in rows or 1 not in self._panels:
            self._panels[1] = canvas.block_panel(self.predicted, PHASES, stage_layers=self.stage_layers)
        if 2 in rows or 2 not in self._panels:
            self._panels[2] = canvas.block_panel(
                self.measured, PHASES, empty=self.measured_empty,
                stage_layers=self.measured_stage_layers, other=self.measured_prediction,
                other_name="predicted for this run")
        panels: list[BlockPanel | MemoryPanel] = [
            self._panels[1] | {"title": self._predicted_text(), "role": "predicted",
                               "title_parts": [f"{self.names[0]}: ", self._predicted_suffix()]},
            self._panels[2] | {"title": measured_text, "warning": measured_warning}]
        if self.memory:
            if 3 in rows or 3 not in self._panels:
                self._panels[3] = self._memory_panel()
            text, warning = self._memory_parts()
            panels.append(self._panels[3] | {"title": text, "warning": warning})
        # The phases drawn, from the panels' phase codes (one byte a block; not the frames' strings).
        shown = set()
        for row in (1, 2):
            shown.update(np.flatnonzero(np.bincount(np.frombuffer(self._panels[row]["phase"], np.uint8))).tolist())
        scene: TimelineScene = {
            "panels": panels, "phases": canvas.phase_table(PHASE_COLORS, PHASE_LETTERS),
            "legend": [k for k in range(len(PHASES)) if k in shown],
            "x_range": self.x_range, "splits": ",".join(str(s) for s in self.splits),
            "measured_ms": tl.step_time(self.measured) * 1e3 if self.measured is not None else 0.0,
            "retime_key": self._retime_key}
        self.figure.scene = scene

    def _memory_scale(self, peaks: pd.DataFrame) -> tuple[float, str]:
        """The divisor and unit of the memory panel: its largest peak's (predicted or measured),
        or the cap's if larger."""
        measured = self.measured_memory()
        return memory_scale(max(float(peaks["bytes"].max()) if len(peaks) else 0.0, float(self.memory_cap or 0.0),
                                float(measured["bytes"].max()) if measured is not None and len(measured) else 0.0))

    def measured_memory(self) -> Optional[pd.DataFrame]:
        """``stage, time, bytes``: the activation memory each stage held over the measured step (time
        from its start), where the run measured it (the schedule executor counts what autograd
        saves), else ``None``.

        Example::

            view.measured_memory().groupby("stage")["bytes"].max()    # each stage's measured peak
        """
        measured = self.measured
        if measured is None or measured.empty or "memory" not in measured or measured["memory"].isna().all():
            return None
        return self._held(measured, "_measured_memory_of")

    def _memory_panel(self) -> MemoryPanel:
        peaks = self.peaks()
        memory = self._memory() if len(peaks) else pd.DataFrame({"stage": [], "time": [], "bytes": []})
        scale, unit = self._memory_scale(peaks)
        return canvas.memory_panel(memory, peaks, STAGE_COLORS, scale=scale, unit=unit, cap=self.memory_cap,
                                   measured=self.measured_memory())

    def _predicted_text(self) -> str:
        return f"{self.names[0]}: " + self._summary(self.predicted) + self._predicted_suffix()

    def _predicted_suffix(self) -> str:
        return f" — {self.predicted_title}" if self.predicted_title else ""

    def _measured_parts(self) -> tuple[str, str]:
        """The measured panel's title and its warning ('' when none)."""
        text = f"{self.names[1]}: " + self._summary(self.measured)
        if self.measured is not None and self.measured_title:
            text += f" — {self.measured_title}"
        return text, self.measured_warning if self.measured is not None else ""

    def _memory_parts(self) -> tuple[str, str]:
        """The memory panel's title and its warning (the stages over the cap; '' when none)."""
        peaks = self.peaks()
        if peaks.empty:
            return "activation memory: not predicted for this timeline", ""
        scale, unit = self._memory_scale(peaks)
        top = peaks.loc[peaks["bytes"].idxmax()]
        text = (f"predicted activation memory per stage — peak {top['bytes'] / scale:.2f} {unit} "
                f"(stage {int(top['stage'])})")
        measured = self.measured_memory()
        if measured is not None and len(measured):
            most = measured.loc[measured["bytes"].idxmax()]
            text += f"; measured (dashed) {most['bytes'] / scale:.2f} {unit} (stage {int(most['stage'])})"
        if self.memory_cap is None:
            return text, ""
        over = [str(int(s)) for s in peaks.loc[peaks["over_cap"].astype(bool), "stage"]]
        cap = f"{self.memory_cap / scale:.2f} {unit}"
        if over:
            return text, f"stage{'s' if len(over) > 1 else ''} {', '.join(over)} over the cap of {cap}"
        return text + f" · all stages under the cap of {cap}", ""


def warm_up() -> None:
    """Pay the first-use costs of an explorer ahead of it: the widget modules, the simulator,
    autograd's first backward and torch's first optimizer (the profile times the optimizer's step;
    an optimizer's construction imports ``torch._dynamo``, ~1 s on 2 cores), by laying out a tiny
    timeline and running one step of it. ``%load_ext pipexplore`` runs this in a background thread
    while the user writes the next cell; what a run needs besides comes after (:func:`warm_up_runs`)."""
    import torch

    from pipexplore.predict.simulator import simulate
    from pipexplore.training import Training

    table = pd.DataFrame({"name": ["0", "1"], "forward": [1e-3, 1e-3], "backward": [2e-3, 2e-3],
                          "output_bytes": 0.0, "param_bytes": 0.0})
    predicted = simulate(table, [1], chunks=2)
    canvas.block_panel(predicted, PHASES)
    tl.activation_memory(predicted)
    # A first backward imports torch's symbolic shapes (and sympy: ~0.5 s); the profile's first is one.
    out = torch.nn.Linear(1, 1)(torch.ones(1, 1))
    torch.autograd.backward([out], [torch.ones_like(out)])  # (with its gradient given, as the profile's)
    Training.of().optimizer([torch.zeros(1, requires_grad=True)])  # the optimizer the profile times where none is given


def warm_up_runs() -> None:
    """Pay what a first run needs ahead of it: the pipelining helpers of zero-bubble schedules
    (with torch's export and DTensor, ~1 s on 2 cores; the optimizers came with :func:`warm_up`).
    An explorer starts this in the background once the page has drawn it; a run waits for it
    (:func:`pipexplore.background.wait`)."""
    import torch.distributed.pipelining._backward  # noqa: F401


def timeline_figure(predicted: pd.DataFrame, measured: Optional[pd.DataFrame] = None,
                    samples: Optional[int] = None) -> Any:
    """A figure of the predicted step above the measured one and the activation memory, one time axis.

    Example::

        timeline_figure(plan.predicted, run.timeline, samples=64)
    """
    return TimelineView(predicted, measured, samples).figure
