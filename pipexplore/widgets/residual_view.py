"""Residuals as a picture: each action's prediction error in a stage × micro-batch strip."""
from __future__ import annotations

import pathlib
from typing import Any, Optional

import anywidget
import numpy as np
import pandas as pd
import traitlets

from pipexplore.widgets.plots import PHASES, PLOTLY_CONFIG, TEXT_COLOR
from pipexplore.widgets.timeline_canvas import CANVAS_CSS

__all__ = ["residual_grid", "ResidualCanvas", "residual_figure", "update_residual_figure"]

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


def _title(grid: pd.DataFrame, title: str) -> str:
    if grid.empty:
        return "residuals: no run yet"
    median = float(np.nanmedian(np.abs(grid.to_numpy(dtype=float) * 100)))
    return (f"residuals{' — ' + title if title else ''}: predicted ÷ measured − 1 per action "
            f"(median |error| {median:.0f} %)")


class ResidualCanvas(anywidget.AnyWidget):
    """The residuals of a run drawn on canvas (the explorer's residual mode): ``grid`` holds the
    ``title``, the ``rows`` (``'stage 0 · forward'``), the ``columns`` (micro-batches) and the
    error of each cell in percent as float32 bytes, row after row (NaN: no such action).

    Example::

        view = ResidualCanvas()
        view.show(explorer.residuals(), "run 3")
    """

    _esm = pathlib.Path(__file__).parent / "residual_canvas.js"
    _css = CANVAS_CSS + ".pipexplore-rg-wrap { position: relative; }"

    grid = traitlets.Dict().tag(sync=True)

    def show(self, table: Optional[pd.DataFrame], title: str = "") -> None:
        """Draw ``table`` (per-action residuals, :func:`pipexplore.residuals.residuals`; ``None``: no run yet)."""
        grid = residual_grid(table) if table is not None else pd.DataFrame()
        percent = grid.to_numpy(dtype=np.float32) * 100 if not grid.empty else np.zeros((0, 0), np.float32)
        self.grid = {"title": _title(grid, title), "rows": [f"stage {s} · {phase}" for s, phase in grid.index],
                     "columns": [str(c) for c in grid.columns], "values": percent.tobytes()}

    def cells(self) -> np.ndarray:
        """The errors drawn, in percent, one row per entry of ``grid['rows']``."""
        return np.frombuffer(self.grid.get("values", b""), np.float32).reshape(len(self.grid.get("rows", [])), -1)


def residual_figure(table: Optional[pd.DataFrame] = None, title: str = "", *, widget: bool = True) -> Any:
    """A stage × micro-batch strip of prediction errors per action (red: predicted too long, blue:
    too short), as a ``go.FigureWidget`` (a plain ``go.Figure`` with ``widget=False``).

    Example::

        residual_figure(explorer.residuals(), title="run 3")
    """
    import plotly.graph_objects as go  # on first use: the explorer's page draws no plotly until then

    heat = go.Heatmap(colorscale="RdBu_r", zmid=0, texttemplate="%{text}", colorbar=dict(title="error %", thickness=12),
                      hovertemplate="%{y} · micro-batch %{x}<br>error %{z:+.1f} %<extra></extra>")
    figure = (go.FigureWidget if widget else go.Figure)(go.Figure(heat))
    figure.update_layout(paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)", autosize=True,
                         font=dict(family="system-ui, sans-serif", size=12, color=TEXT_COLOR),
                         margin=dict(l=10, r=10, t=40, b=40))
    figure.update_yaxes(autorange="reversed", type="category", automargin=True, color=TEXT_COLOR)
    figure.update_xaxes(title_text="micro-batch", type="category", color=TEXT_COLOR)
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
        figure.layout.title.text = _title(grid, title)
        figure.layout.height = max(200, 22 * len(grid) + 110)
