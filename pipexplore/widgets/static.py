"""Static SVG of the explorer (strip and timelines) for pages without a kernel: reports, reloads, nbviewer."""
from __future__ import annotations

import html
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from pipexplore import timeline as tl
from pipexplore.widgets.timeline_figure import PHASE_COLORS, PHASE_LETTERS, STAGE_COLORS, lanes

__all__ = ["strip_svg", "timeline_svg", "STATIC_BLOCK_LIMIT"]

#: Above this many blocks a static timeline draws each lane's busy time instead (and says so).
STATIC_BLOCK_LIMIT = 4_000
_W = 1000


def _weights(layers: Sequence[Mapping[str, Any]], view: str) -> np.ndarray:
    """Cell widths as in the interactive strip: cost share plus a floor so that cheap layers show."""
    key = {"time": "time", "params": "params", "memory": "memory"}.get(view, "time")
    values = np.array([max(0.0, float(layer.get(key, 0.0) or 0.0)) for layer in layers])
    n = len(values)
    total = values.sum()
    raw = (values / total if total > 0 else np.full(n, 1.0 / n)) + 0.25 / n
    return raw / raw.sum()


def strip_svg(layers: Sequence[Mapping[str, Any]], splits: Sequence[int], skips: Sequence[Mapping[str, Any]] = (),
              view: str = "time", stage_totals: Sequence[str] = ()) -> str:
    """The split strip as one SVG: a cell per layer in its stage's colour, skip arcs (dashed red
    where they cross stages), split lines and each stage's total.

    Example::

        strip_svg(explorer.bar.layers, explorer.splits, explorer.bar.skips)
    """
    bar_y, bar_h = 62, 40
    xs = np.concatenate([[0.0], np.cumsum(_weights(layers, view)) * _W])
    stage_of = np.searchsorted(np.asarray(splits, dtype=int), np.arange(len(layers)), side="right")
    parts = [f"<svg class='pipexplore-strip' viewBox='0 0 {_W} 130' width='100%' role='img' "
             f"aria-label='pipeline split points {html.escape(','.join(map(str, splits)))}' "
             "xmlns='http://www.w3.org/2000/svg' style='font-family: system-ui, sans-serif'>"]
    for i, layer in enumerate(layers):
        color = STAGE_COLORS[int(stage_of[i]) % len(STAGE_COLORS)]
        width = max(0.5, xs[i + 1] - xs[i] - 1)
        name = html.escape(str(layer.get("name", i)))
        parts.append(f"<rect class='cell' data-layer='{i}' data-stage='{stage_of[i]}' x='{xs[i]:.2f}' y='{bar_y}' "
                     f"width='{width:.2f}' height='{bar_h}' fill='{color}'><title>{name} "
                     f"({html.escape(str(layer.get('type', '')))}) · stage {stage_of[i]}\n"
                     f"{html.escape(str(layer.get('label', '')))}</title></rect>")
        if xs[i + 1] - xs[i] > 8 * max(3, len(str(layer.get("name", "")))) * 0.8:
            parts.append(f"<text x='{(xs[i] + xs[i + 1]) / 2:.2f}' y='{bar_y + bar_h / 2 + 4}' font-size='10' "
                         f"fill='white' text-anchor='middle'>{name}</text>")
    for skip in skips:
        a, b = (xs[skip["from"]] + xs[skip["from"] + 1]) / 2, (xs[skip["to"]] + xs[skip["to"] + 1]) / 2
        crosses = stage_of[skip["from"]] != stage_of[skip["to"]]
        height = min(bar_y - 6, 14 + (b - a) / 6)
        style = ("stroke='#d62728' stroke-width='2' stroke-dasharray='5 3'" if crosses
                 else "stroke='#888' stroke-width='1.5'")
        parts.append(f"<path d='M {a:.2f} {bar_y} C {a:.2f} {bar_y - height:.2f}, {b:.2f} {bar_y - height:.2f}, "
                     f"{b:.2f} {bar_y}' fill='none' {style}><title>skip {html.escape(str(skip.get('name', '')))}: "
                     f"layer {skip['from']} → {skip['to']}{' (crosses stages: copied)' if crosses else ''}"
                     "</title></path>")
    points = [0, *splits, len(layers)]
    for s in range(len(points) - 1):
        label = stage_totals[s] if s < len(stage_totals) else f"stage {s}"
        middle = (xs[points[s]] + xs[points[s + 1]]) / 2
        if xs[points[s + 1]] - xs[points[s]] > 7 * len(label):
            parts.append(f"<text x='{middle:.2f}' y='{bar_y + bar_h + 18}' font-size='12' fill='#777' "
                         f"text-anchor='middle'>{html.escape(label)}</text>")
    for k, split in enumerate(splits):
        parts.append(f"<line class='split' data-index='{k}' x1='{xs[split]:.2f}' x2='{xs[split]:.2f}' y1='{bar_y - 8}' "
                     f"y2='{bar_y + bar_h + 8}' stroke='#111' stroke-width='3'><title>stage {k + 1} begins at layer "
                     f"{split}</title></line>")
    parts.append("</svg>")
    return "".join(parts)


def timeline_svg(frame: Optional[pd.DataFrame], title: str, *, x_max_ms: Optional[float] = None,
                 splits: Optional[Sequence[int]] = None) -> str:
    """One timeline as SVG: a lane per stage (stage 0 on top), a block per action in its phase's
    colour, labelled with its phase letter and micro-batch where it fits, on ``x_max_ms`` of time
    (pass the same to two timelines to share their axis). ``splits`` goes to ``data-splits``.

    Example::

        timeline_svg(plan.predicted, "predicted", splits=plan.splits)
    """
    split_attr = f" data-splits='{','.join(map(str, splits))}'" if splits is not None else ""
    head = f"<div class='pipexplore-static-title'>{html.escape(title)}</div>"
    if frame is None or frame.empty:
        return (f"<div class='pipexplore-static-timeline'{split_attr}>{head}"
                "<div class='pipexplore-note'>no run yet</div></div>")
    lane_names = lanes(frame)
    lane_of = {name: k for k, name in enumerate(lane_names)}
    origin = float(frame["start"].min())
    x_max = x_max_ms if x_max_ms else tl.step_time(frame) * 1e3 * 1.02
    left, width = 110, _W - 120
    lane_h = int(max(6, min(18, 480 / len(lane_names))))  # 64 lanes stay within a screen
    height = len(lane_names) * lane_h + 30
    scale = width / max(x_max, 1e-9)
    parts = [f"<div class='pipexplore-static-timeline'{split_attr}>{head}<svg viewBox='0 0 {_W} {height}' "
             "width='100%' xmlns='http://www.w3.org/2000/svg' style='font-family: system-ui, sans-serif'>"]
    for name, k in lane_of.items():
        parts.append(f"<text x='{left - 6}' y='{k * lane_h + lane_h - 4}' font-size='{min(11, lane_h - 1)}' "
                     f"fill='#777' text-anchor='end'>{html.escape(name)}</text>")
    if len(frame) > STATIC_BLOCK_LIMIT:  # level of detail: each lane's busy time, merged below a pixel
        parts.append(_busy_paths(frame, lane_of, origin, left, scale, lane_h))
    else:
        parts.extend(_block_paths(frame, lane_of, origin, left, scale, lane_h))
    axis_y = len(lane_names) * lane_h + 4
    parts.append(f"<line x1='{left}' x2='{left + width}' y1='{axis_y}' y2='{axis_y}' stroke='#999'/>")
    for tick in np.linspace(0, x_max, 6):
        x = left + tick * scale
        parts.append(f"<text x='{x:.1f}' y='{axis_y + 14}' font-size='10' fill='#777' text-anchor='middle'>"
                     f"{tick:.1f} ms</text>")
    parts.append("</svg>")
    if len(frame) > STATIC_BLOCK_LIMIT:
        parts.append(f"<div class='pipexplore-note'>{len(frame):,} blocks, drawn as each lane's busy time</div>")
    parts.append("</div>")
    return "".join(parts)


def _block_paths(frame: pd.DataFrame, lane_of: Mapping[str, int], origin: float, left: float, scale: float,
                 lane_h: int) -> list[str]:
    """One path per phase (a block per action), and the labels that fit."""
    parts, labels = [], []
    for phase, group in frame.groupby("phase", sort=False):
        color = PHASE_COLORS.get(str(phase), "#999")
        letter = PHASE_LETTERS.get(str(phase), "")
        path = []
        for row in group.itertuples(index=False):
            y = lane_of[f"stage {row.stage} · {row.device}"] * lane_h + 2
            x0 = left + (row.start - origin) * 1e3 * scale
            w = max(0.3, (row.end - row.start) * 1e3 * scale)
            path.append(f"M{x0:.1f} {y}h{w:.1f}v{lane_h - 4}h{-w:.1f}z")
            text = f"{letter}{row.microbatch}" if row.microbatch >= 0 else letter  # an optimizer step: no micro-batch
            if letter and w > 7 * len(text):
                labels.append(f"<text x='{x0 + w / 2:.1f}' y='{y + lane_h - 8}' font-size='9' fill='white' "
                              f"text-anchor='middle'>{text}</text>")
        parts.append(f"<path class='phase-{html.escape(str(phase))}' d='{''.join(path)}' fill='{color}'>"
                     f"<title>{html.escape(str(phase))}</title></path>")
    return parts + labels


def _busy_paths(frame: pd.DataFrame, lane_of: Mapping[str, int], origin: float, left: float, scale: float,
                lane_h: int) -> str:
    """Each lane's busy time as one path: intervals closer than a pixel merged."""
    path = []
    pixel = 1.0 / scale / 1e3  # seconds per pixel
    for (stage, device), lane in frame.groupby(["stage", "device"], sort=False):
        starts, ends = lane["start"].to_numpy(dtype=float), lane["end"].to_numpy(dtype=float)
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], np.maximum.accumulate(ends[order])
        new = np.concatenate([[True], starts[1:] > ends[:-1] + pixel])
        first = np.flatnonzero(new)
        last = np.concatenate([first[1:] - 1, [len(starts) - 1]])
        y = lane_of[f"stage {stage} · {device}"] * lane_h + 2
        for a, b in zip(starts[first], ends[last]):
            x0 = left + (a - origin) * 1e3 * scale
            path.append(f"M{x0:.1f} {y}h{max(0.3, (b - a) * 1e3 * scale):.1f}v{lane_h - 4}H{x0:.1f}z")
    return f"<path class='busy' d='{''.join(path)}' fill='#4e79a7'><title>busy</title></path>"
