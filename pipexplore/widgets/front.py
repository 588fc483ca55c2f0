"""The search's front, drawn: each plan's predicted step against its peak memory (SVG), the plans
no other beats in both joined, the cap a dashed line; a click on a point applies its plan, as does
the panel's picker and Apply.

Example::

    table = explorer.search(memory_cap="70 GiB", stages=[4, 8], chunks=[8, 16])
    front_panel(explorer, table)        # the drawing (click a point), a plan picker and Apply
"""
from __future__ import annotations

import html
import math
import pathlib
from typing import Any, Optional

import anywidget
import pandas as pd
import traitlets

from pipexplore.widgets.timeline_figure import STAGE_COLORS

__all__ = ["front_svg", "front_panel", "FrontChart"]


class FrontChart(anywidget.AnyWidget):
    """The front's SVG (``svg``: :func:`front_svg`) in the page; ``picked``: the rank of the plan
    whose point was clicked (or Enter on it; -1: none), set by the front end."""

    _esm = (pathlib.Path(__file__).parent / "front.js").read_text()  # text, not a path: see splitbar.py
    _css = (".pipexplore-front-chart circle.plan:hover, .pipexplore-front-chart circle.plan:focus, "
            ".pipexplore-front-chart circle.picked { stroke: #000; stroke-width: 2; outline: none; }")

    svg = traitlets.Unicode("").tag(sync=True)
    picked = traitlets.Int(-1).tag(sync=True)


_W, _H, _LEFT, _BOTTOM, _TOP, _RIGHT = 640, 360, 70, 44, 16, 16


def _label(row: pd.Series) -> str:
    virtual = f", {row['virtual_stages']} a device" if row.get("virtual_stages", 1) > 1 else ""
    return (f"#{row['rank']}: {row['stages']} stages{virtual}, {row['chunks']} chunks, {row['schedule']}, "
            f"checkpoint {row['checkpoint']}")


def front_svg(table: pd.DataFrame, memory_cap: Optional[float] = None) -> str:
    """``table`` (from ``search``) as one SVG: a point per plan at (peak memory, predicted step),
    coloured by schedule where it fits, hollow grey where it does not; the Pareto front joined;
    ``memory_cap`` (default: ``table.attrs['memory_cap']``) a dashed line. Each point says its
    plan on hover and carries its rank (``data-rank``)."""
    cap = memory_cap if memory_cap is not None else table.attrs.get("memory_cap")
    if table.empty:
        return "<svg class='pipexplore-front' xmlns='http://www.w3.org/2000/svg'></svg>"
    gib = 2.0 ** 30
    memory = table["peak_bytes"].to_numpy(dtype=float) / gib
    step = table["predicted_step_time"].to_numpy(dtype=float) * 1e3
    x_max = max(float(memory.max()), (cap or 0.0) / gib) * 1.05 or 1.0
    y_max = float(step.max()) * 1.05 or 1.0

    def x(value: float) -> float:
        return _LEFT + value / x_max * (_W - _LEFT - _RIGHT)

    def y(value: float) -> float:
        return _H - _BOTTOM - value / y_max * (_H - _BOTTOM - _TOP)

    schedules = list(dict.fromkeys(table["schedule"]))
    parts = [f"<svg class='pipexplore-front' viewBox='0 0 {_W} {_H}' width='100%' role='img' "
             "aria-label='predicted step against peak memory' xmlns='http://www.w3.org/2000/svg' "
             "style='font-family: system-ui, sans-serif'>",
             f"<line x1='{_LEFT}' y1='{_H - _BOTTOM}' x2='{_W - _RIGHT}' y2='{_H - _BOTTOM}' stroke='#888'/>",
             f"<line x1='{_LEFT}' y1='{_TOP}' x2='{_LEFT}' y2='{_H - _BOTTOM}' stroke='#888'/>"]
    for k in range(5):
        gx, gy = x_max * k / 4, y_max * k / 4
        parts.append(f"<text x='{x(gx):.1f}' y='{_H - _BOTTOM + 16}' font-size='11' fill='#777' "
                     f"text-anchor='middle'>{gx:.3g}</text>")
        parts.append(f"<text x='{_LEFT - 6}' y='{y(gy) + 4:.1f}' font-size='11' fill='#777' "
                     f"text-anchor='end'>{gy:.3g}</text>")
    parts.append(f"<text x='{(_LEFT + _W) / 2:.0f}' y='{_H - 8}' font-size='12' fill='#555' text-anchor='middle'>"
                 "peak memory a device (GiB)</text>")
    parts.append(f"<text x='14' y='{(_TOP + _H - _BOTTOM) / 2:.0f}' font-size='12' fill='#555' text-anchor='middle' "
                 f"transform='rotate(-90 14 {(_TOP + _H - _BOTTOM) / 2:.0f})'>predicted step (ms)</text>")
    if cap is not None and math.isfinite(cap):
        parts.append(f"<line class='cap' x1='{x(cap / gib):.1f}' x2='{x(cap / gib):.1f}' y1='{_TOP}' "
                     f"y2='{_H - _BOTTOM}' stroke='#d62728' stroke-dasharray='6 4'><title>memory cap "
                     f"{cap / gib:.2f} GiB</title></line>")
    front = table[table["pareto"]].sort_values("peak_bytes")
    if len(front) > 1:
        points = " ".join(f"{x(m / gib):.1f},{y(s * 1e3):.1f}"
                          for m, s in zip(front["peak_bytes"], front["predicted_step_time"]))
        parts.append(f"<polyline class='front' points='{points}' fill='none' stroke='#444' stroke-width='1.5'/>")
    for k, row in table.iterrows():
        color = STAGE_COLORS[schedules.index(row["schedule"]) % len(STAGE_COLORS)]
        fill = f"fill='{color}'" if row["fits"] else "fill='none' stroke='#999'"
        radius = 5 if row["pareto"] else 3.5
        parts.append(f"<circle class='plan{' pareto' if row['pareto'] else ''}' data-rank='{row['rank']}' "
                     f"cx='{x(memory[k]):.1f}' cy='{y(step[k]):.1f}' r='{radius}' {fill}><title>"
                     f"{html.escape(_label(row))}: {step[k]:.1f} ms, {memory[k]:.2f} GiB"
                     f"{'' if row['fits'] else ' (does not fit)'}</title></circle>")
    for k, schedule in enumerate(schedules):
        color = STAGE_COLORS[k % len(STAGE_COLORS)]
        parts.append(f"<circle cx='{_W - _RIGHT - 120}' cy='{_TOP + 8 + 15 * k}' r='4' fill='{color}'/>"
                     f"<text x='{_W - _RIGHT - 110}' y='{_TOP + 12 + 15 * k}' font-size='11' fill='#555'>"
                     f"{html.escape(schedule)}</text>")
    parts.append("</svg>")
    return "".join(parts)


def front_panel(explorer: Any, table: pd.DataFrame) -> Any:
    """The front (:func:`front_svg`, a :class:`FrontChart`: a click on a point applies its plan) with
    a picker of the table's plans (those on the front first) and an Apply button that makes the
    picked one the explorer's plan (``explorer.apply``)."""
    import ipywidgets as widgets

    order = pd.concat([table[table["pareto"]], table[~table["pareto"]]])
    picker = widgets.Dropdown(options=[(_label(row), int(row["rank"])) for _, row in order.iterrows()],
                              description="plan", layout=widgets.Layout(width="70%"))
    button = widgets.Button(description="Apply", button_style="primary")
    said = widgets.HTML()

    def apply(_: Any = None) -> None:
        row = table[table["rank"] == picker.value].iloc[0]
        try:
            explorer.apply(row)
            said.value = f"applied {html.escape(_label(row))}"
        except Exception as exc:  # shown beside the button; the plan stays
            said.value = f"<span style='color:#d62728'>{html.escape(f'{type(exc).__name__}: {exc}')}</span>"

    def clicked(change: Any) -> None:  # a point clicked in the page: its plan picked and applied
        if change["new"] in {value for _, value in picker.options}:
            picker.value = change["new"]
            apply()
            chart.picked = -1  # (so that a second click on it, after the plan moved, applies it again)

    chart = FrontChart(svg=front_svg(table))
    chart.observe(clicked, names="picked")
    button.on_click(apply)
    panel = widgets.VBox([chart, widgets.HBox([picker, button]), said])
    panel.apply = apply  # what the button does (for code and tests)
    panel.picker, panel.chart = picker, chart
    return panel
