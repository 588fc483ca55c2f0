"""Residuals as a picture: each action's prediction error in a stage × micro-batch grid, on canvas."""
from __future__ import annotations

import pathlib
from typing import Optional

import anywidget
import numpy as np
import pandas as pd
import traitlets

from pipexplore.widgets.timeline_figure import PHASES
from pipexplore.widgets.protocol import ResidualGrid
from pipexplore.widgets.timeline_canvas import CANVAS_CSS

__all__ = ["residual_grid", "residual_state", "ResidualCanvas"]


def residual_grid(table: pd.DataFrame) -> pd.DataFrame:
    """Residuals (from :func:`pipexplore.predict.residuals.residuals`) as a grid: one row per stage and
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


def residual_state(table: Optional[pd.DataFrame], title: str = "") -> ResidualGrid:
    """What :class:`ResidualCanvas` draws for ``table`` (per-action residuals; ``None``: no run
    yet): ``title``, ``rows``, ``columns`` and the errors in percent as float32 bytes."""
    grid = residual_grid(table) if table is not None else pd.DataFrame()
    percent = grid.to_numpy(dtype=np.float32) * 100 if not grid.empty else np.zeros((0, 0), np.float32)
    return {"title": _title(grid, title), "rows": [f"stage {s} · {phase}" for s, phase in grid.index],
            "columns": [str(c) for c in grid.columns], "values": percent.tobytes()}


class ResidualCanvas(anywidget.AnyWidget):
    """The residuals of a run drawn on canvas (the explorer's residual mode): ``grid`` holds the
    ``title``, the ``rows`` (``'stage 0 · forward'``), the ``columns`` (micro-batches) and the
    error of each cell in percent as float32 bytes, row after row (NaN: no such action).

    Example::

        view = ResidualCanvas()
        view.show(explorer.residuals(), "run 3")
    """

    _esm = (pathlib.Path(__file__).parent / "residual_canvas.js").read_text()  # text: see splitbar.py
    _css = CANVAS_CSS

    grid = traitlets.Dict().tag(sync=True)

    def show(self, table: Optional[pd.DataFrame], title: str = "") -> None:
        """Draw ``table`` (per-action residuals, :func:`pipexplore.predict.residuals.residuals`; ``None``: no run yet)."""
        self.grid = dict(residual_state(table, title))

    def cells(self) -> np.ndarray:
        """The errors drawn, in percent, one row per entry of ``grid['rows']``."""
        return np.frombuffer(self.grid.get("values", b""), np.float32).reshape(len(self.grid.get("rows", [])), -1)
