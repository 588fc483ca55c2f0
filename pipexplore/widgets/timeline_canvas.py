"""TimelineCanvas: the anywidget that draws timelines and activation memory on canvas, one time axis.

A scene is plain data: per block panel its lane labels, each lane's bounds, and as binary buffers
(single-precision times in ms, uint8 phases, 2- or 4-byte micro-batches) one block per action,
sorted by lane then start; per memory panel one step line per stage, the peaks and the cap. Setting
:attr:`TimelineCanvas.scene` is one widget message; the front end (``timeline_canvas.js``) draws
it with a level of detail (narrow blocks merged per lane and phase), zooms and pans every panel
together, and tells what a block is on hover. :func:`block_panel` and :func:`memory_panel` build
the panels; :func:`blocks_of` reads a block panel back as a DataFrame.
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping, Optional, Sequence, cast

import anywidget
import numpy as np
import pandas as pd
import traitlets

from pipexplore.devices import is_planned, node_of
from pipexplore.timeline.metrics import lexsort
from pipexplore.widgets.protocol import BlockPanel, MemoryPanel, MemoryPeak, MemorySeries, RetimePanel, ScenePhase

__all__ = ["TimelineCanvas", "CANVAS_CSS", "block_panel", "memory_panel", "blocks_of", "phase_table", "lane_of",
           "lane_labels", "retime_panel"]

_HERE = pathlib.Path(__file__).parent

#: The look of the canvas widgets (timelines, residuals): titles, tooltips, buttons, theme colours.
CANVAS_CSS = """
.pipexplore-tl { position: relative; font-family: system-ui, sans-serif; font-size: 12px;
  color: var(--jp-ui-font-color1, #555); user-select: none; }
.pipexplore-tl-bar { display: flex; align-items: center; gap: 8px; flex-wrap: wrap; min-height: 22px; }
.pipexplore-tl-legend { display: flex; gap: 10px; flex-wrap: wrap; flex: 1; font-size: 11px; }
.pipexplore-tl-key i, .pipexplore-tl-tip i { display: inline-block; width: 10px; height: 10px; margin-right: 4px;
  vertical-align: -1px; border-radius: 2px; }
.pipexplore-tl-button { font-size: 11px; padding: 1px 8px; cursor: pointer; color: inherit;
  background: var(--jp-layout-color2, #eee); border: 1px solid var(--jp-border-color1, #ccc); border-radius: 3px; }
.pipexplore-tl-stack { position: relative; cursor: crosshair; }
.pipexplore-tl-panel { margin: 0; }
.pipexplore-tl-stale { opacity: 0.45; }
.pipexplore-tl-title { padding: 8px 0 3px 0; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.pipexplore-tl-warning { color: #d62728; }
.pipexplore-tl-canvas { display: block; width: 100%; }
.pipexplore-tl-band { position: absolute; top: 0; bottom: 0; display: none; pointer-events: none;
  background: rgba(66, 133, 244, 0.15); border-left: 1px solid #4285f4; border-right: 1px solid #4285f4; }
.pipexplore-tl-tip { position: absolute; display: none; pointer-events: none; z-index: 10; padding: 5px 8px;
  font-size: 12px; line-height: 1.4; white-space: nowrap; border-radius: 4px;
  background: var(--jp-layout-color0, white); color: var(--jp-ui-font-color0, #222);
  border: 1px solid var(--jp-border-color1, #bbb); box-shadow: 0 1px 4px rgba(0, 0, 0, 0.2); }
.pipexplore-tl-faint { color: var(--jp-ui-font-color2, #888); }
.pipexplore-rg-wrap { position: relative; }
"""


class TimelineCanvas(anywidget.AnyWidget):
    """Timelines drawn on canvas. ``scene``: what is drawn (see :func:`block_panel`,
    :func:`memory_panel`; keys ``panels``, ``phases``, ``legend``, ``x_range`` in ms and ``splits``,
    which the element shows as ``data-splits`` once drawn); ``highlight``: the stage whose lanes
    are shaded (-1: none). With ``retime`` and ``group``, a split moved in the strip of the same
    group is re-timed and drawn by the page at once (the predicted panel, ``role: 'predicted'``),
    and the kernel's scene of the new plan replaces it when it comes.

    Example::

        from pipexplore.widgets.timeline_figure import PHASE_COLORS, PHASE_LETTERS, PHASES

        canvas = TimelineCanvas(scene={"panels": [block_panel(plan.predicted, PHASES, title="predicted")],
                                       "phases": phase_table(PHASE_COLORS, PHASE_LETTERS), "legend": [0, 1],
                                       "x_range": [0, 12.5], "splits": "2,5"})
    """

    # (the page's re-timing of a drag, then the drawing)
    _esm = (_HERE / "retime.js").read_text() + "\n" + (_HERE / "timeline_canvas.js").read_text()
    _css = CANVAS_CSS

    scene = traitlets.Dict().tag(sync=True)
    highlight = traitlets.Int(-1).tag(sync=True)
    #: What the page needs to re-time the predicted plan for a moved split itself
    #: (:func:`pipexplore.predict.retime.retime_model` with ``panel``: :func:`retime_panel`), used while its
    #: ``key`` is the scene's ``retime_key``; empty: the page waits for the kernel's scene.
    retime = traitlets.Dict().tag(sync=True)
    #: The split strip whose moves this canvas re-times (the same ``group`` on a
    #: :class:`~pipexplore.widgets.splitbar.SplitBar`; empty: none).
    group = traitlets.Unicode("").tag(sync=True)
    #: The action of the block under the pointer in torch's notation (``"3F1"``; empty: none), set
    #: by the front end in the page only (not sent to the kernel): a
    #: :class:`~pipexplore.widgets.schedule_grid.ScheduleGrid` linked to it there highlights its cell.
    hovered = traitlets.Unicode("").tag(sync=True)


def phase_table(colors: Mapping[str, str], letters: Mapping[str, str]) -> list[ScenePhase]:
    """The phases a scene knows, in code order: name, colour and the letter on a block."""
    return [{"name": name, "color": color, "letter": letters.get(name, "")} for name, color in colors.items()]


def lane_of(frame: pd.DataFrame) -> tuple[list[tuple[int, str]], np.ndarray]:
    """The lanes of a timeline, (stage, device) pairs by stage and then first appearance, and each
    row's lane (what ``frame[['stage', 'device']].drop_duplicates().sort_values('stage')`` orders,
    with array operations)."""
    device_codes, devices = pd.factorize(frame["device"])
    width = max(1, len(devices))
    # (hashed, not sorted: the pairs come numbered in order of first appearance)
    codes, pairs_seen = pd.factorize(frame["stage"].to_numpy().astype(np.int64) * width + device_codes)
    stage_seen = pairs_seen // width
    order = np.argsort(stage_seen, kind="stable")  # by stage, then first appearance
    rank = np.empty(len(pairs_seen), dtype=np.int32)
    rank[order] = np.arange(len(pairs_seen), dtype=np.int32)
    pairs = [(int(stage_seen[k]), str(devices[pairs_seen[k] % width])) for k in order]
    return pairs, rank[codes]


def lane_labels(pairs: Sequence[tuple[int, str]]) -> list[str]:
    """The label of each lane of :func:`lane_of`: ``'stage 0 · cpu'``."""
    return [f"stage {s} · {d}" for s, d in pairs]


def block_panel(frame: Optional[pd.DataFrame], phases: Sequence[str], *, title: str = "", warning: str = "",
                empty: str = "", stage_layers: Sequence[tuple[int, int]] = (),
                other: Optional[pd.DataFrame] = None, other_name: str = "") -> BlockPanel:
    """A panel of blocks: one lane per (stage, device), stage 0 first, times in ms from the step's start.

    Lanes of planned devices (a prediction whose ``attrs['gpus_per_node']`` says how many a node
    holds) carry their node (``lane_node``): the page draws a line where a node ends.
    ``phases``: the phase names in code order (a block of another phase gets the code after them);
    ``stage_layers``: each stage's first and last layer (the hover names them); ``other``: another
    timeline of the same plan, whose span of the same (stage, micro-batch, phase) each block's
    hover shows as ``other_name`` (on a measured block: what its run predicted).

    Example::

        block_panel(plan.predicted, list(PHASE_COLORS), title="predicted: step 12.3 ms")
    """
    panel: dict[str, Any] = {"kind": "blocks", "title": title, "warning": warning, "empty": empty, "lanes": [],
                             "lane_stage": [], "offsets": [0], "stage_layers": [list(b) for b in stage_layers],
                             "other_name": other_name, "count": 0}
    if frame is None or frame.empty:
        return cast(BlockPanel, panel | {key: b"" for key in ("start", "end", "phase", "micro")} | {"micro_bytes": 2})
    pairs, lane = lane_of(frame)
    origin = float(frame["start"].min())
    start = (frame["start"].to_numpy(dtype=float) - origin) * 1e3
    end = (frame["end"].to_numpy(dtype=float) - origin) * 1e3
    codes = pd.Index(list(phases)).get_indexer(frame["phase"])
    codes[codes < 0] = len(phases)
    order = lexsort((start, lane))  # by lane, then start
    lane = lane[order]
    micro = frame["microbatch"].to_numpy()[order]
    # The lanes travel as their bounds (``offsets``), micro-batch numbers in 2 bytes where they fit:
    # 11 bytes a block (0.7 MB at 1,000 × 64 × 256).
    wide = len(micro) and (micro.max() >= 2**16 or micro.min() < 0)
    per_node = frame.attrs.get("gpus_per_node")
    # planned devices (a rank's collectives lane too): which node each lane is on
    if per_node and all(is_planned(d.split(" · ")[0]) for _, d in pairs):
        panel["lane_node"] = [node_of(d.split(" · ")[0], per_node) for _, d in pairs]
    panel.update(
        lanes=lane_labels(pairs), lane_stage=[int(s) for s, _ in pairs],
        offsets=np.searchsorted(lane, np.arange(len(pairs) + 1)).tolist(), count=len(frame),
        start=start[order].astype(np.float32).tobytes(), end=end[order].astype(np.float32).tobytes(),
        phase=codes[order].astype(np.uint8).tobytes(), micro_bytes=4 if wide else 2,
        micro=micro.astype(np.int32 if wide else np.uint16).tobytes())
    if other is not None and not other.empty:
        keys = ["stage", "microbatch", "phase"]
        spans = other.assign(span=(other["end"] - other["start"]) * 1e3).drop_duplicates(keys)[keys + ["span"]]
        beside = frame[keys].merge(spans, on=keys, how="left")["span"].to_numpy(dtype=float)
        panel["other"] = np.nan_to_num(beside[order], nan=-1.0).astype(np.float32).tobytes()  # JSON has no NaN
    if {"batch_size", "tasks", "wait"} <= set(frame.columns):  # each block a batch an expert backend formed
        panel["extra"] = [f"batch of {r} rows from {t} tasks, waited {w * 1e3:.2f} ms" for r, t, w in
                          zip(frame["batch_size"].to_numpy()[order], frame["tasks"].to_numpy()[order],
                              frame["wait"].to_numpy()[order])]
    return cast(BlockPanel, panel)  # (built up in steps: the protocol test holds its keys)


def retime_panel(lanes: Sequence[tuple[int, str]], phases: Sequence[str], model: Mapping[str, Any]) -> RetimePanel:
    """How the page lays out a re-timed step (:mod:`pipexplore.predict.retime`) as :func:`block_panel` lays
    out the plan's (``lanes``: its (stage, device) pairs, :func:`lane_of`'s): each stage's first lane
    (its compute) and its collectives lane (a mesh's, -1 where it has none), how many lanes, the
    phase code of each of the graph's kinds, of a copy and of a collective, the micro-batch bytes,
    and each stage's bubble key."""
    from pipexplore.predict.mesh_costs import COLLECTIVE_LANE

    stage_lane, collective_lane = [0] * int(model["stages"]), [-1] * int(model["stages"])
    for lane, (stage, device) in reversed(list(enumerate(lanes))):  # (the first lane of a stage wins)
        if str(device).endswith(COLLECTIVE_LANE):
            collective_lane[stage] = lane
        else:
            stage_lane[stage] = lane
    index = {name: k for k, name in enumerate(phases)}
    return {"stage_lane": stage_lane, "collective_lane": collective_lane, "lanes": len(lanes),
            "codes": [index.get(name, len(phases)) for name in model["kind_names"]],
            "collective_code": index.get("collective", len(phases)),
            # (4 bytes, signed, where micro-batch numbers pass 2 bytes or an optimizer step's -1 is among them)
            "micro_bytes": 4 if int(model["micro_batches"]) > 2**16 or model.get("optimizer") else 2,
            "bubble_key": model["bubble_key"]}


def _memory_series(memory: pd.DataFrame, colors: Sequence[str], scale: float) -> list[MemorySeries]:
    stages = memory["stage"].to_numpy()
    times = (memory["time"].to_numpy(dtype=float) * 1e3).astype(np.float32)
    values = (memory["bytes"].to_numpy(dtype=float) / scale).astype(np.float32)
    present = np.unique(stages)
    bounds = np.searchsorted(stages, present, side="left").tolist() + [len(stages)]
    return [{"stage": int(s), "color": colors[int(s) % len(colors)], "t": times[a:b].tobytes(),
             "v": values[a:b].tobytes()} for s, a, b in zip(present, bounds[:-1], bounds[1:])]


def memory_panel(memory: pd.DataFrame, peaks: pd.DataFrame, colors: Sequence[str], *, scale: float, unit: str,
                 cap: Optional[float] = None, title: str = "", warning: str = "",
                 measured: Optional[pd.DataFrame] = None) -> MemoryPanel:
    """A panel of step lines, one per stage: ``memory`` has ``stage``, ``time`` (s) and ``bytes``
    after each change, sorted by stage; ``peaks`` one row per stage (``stage``, ``time``, ``bytes``,
    ``over_cap``). Values travel divided by ``scale`` and are labelled ``unit``. ``measured``: the
    same columns from a run (time from its step's start), drawn dashed beside the prediction."""
    series = _memory_series(memory, colors, scale)
    marks: list[MemoryPeak] = [{"stage": int(s), "t": float(t) * 1e3, "v": float(v) / scale, "over": bool(o)}
                               for s, t, v, o in zip(peaks["stage"], peaks["time"], peaks["bytes"], peaks["over_cap"])]
    measured_series = _memory_series(measured, colors, scale) if measured is not None and len(measured) else []
    most_measured = float(measured["bytes"].max()) / scale if measured is not None and measured_series else 0.0
    top = max([m["v"] for m in marks] + [cap / scale if cap is not None else 0.0, most_measured])
    return {"kind": "memory", "title": title, "warning": warning, "unit": unit, "series": series, "peaks": marks,
            "measured_series": measured_series, "cap": cap / scale if cap is not None else None, "y_max": top}


def blocks_of(panel: Mapping[str, Any]) -> pd.DataFrame:
    """A block panel's blocks as a DataFrame (``start``, ``end`` in ms, ``lane``, ``stage``, ``phase``
    code, ``microbatch``, and ``other`` where the panel has it), in the panel's order.

    Example::

        blocks_of(explorer.figure.scene["panels"][0]).query("phase == 0")   # the forward blocks
    """
    micro = np.frombuffer(panel["micro"], np.int32 if panel.get("micro_bytes") == 4 else np.uint16)
    out = pd.DataFrame({
        "start": np.frombuffer(panel["start"], np.float32), "end": np.frombuffer(panel["end"], np.float32),
        "lane": np.repeat(np.arange(len(panel["lanes"]), dtype=np.int32), np.diff(panel["offsets"])),
        "phase": np.frombuffer(panel["phase"], np.uint8), "microbatch": micro.astype(np.int32)})
    out["stage"] = np.asarray(panel["lane_stage"], dtype=int)[out["lane"]] if len(out) else np.zeros(0, int)
    if "other" in panel:
        out["other"] = np.frombuffer(panel["other"], np.float32)
    return out
