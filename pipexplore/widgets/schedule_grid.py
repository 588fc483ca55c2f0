"""ScheduleGrid: the plan's schedule as a grid of actions, a row per rank (worker), a cell per step.

The cells are what the workers run, in torch's notation (``{stage}{F|B|I|W|R}{micro-batch}``;
not the optimizer steps that end the step), the text of the plan's CSV schedule
(``ex.export("schedule-csv")`` writes torch's own). Hovering a block of a timeline
highlights its action's cell: the canvas's ``hovered`` is linked to the grid's ``hover`` in the
page (``ipywidgets.jsdlink``), so no message goes through the kernel.

Example::

    grid = ScheduleGrid()
    grid.labels, grid.rows = schedule_rows(plan)
"""
from __future__ import annotations

import pathlib
from typing import Any

import anywidget
import traitlets

from pipexplore.schedules import checkpointed, is_multi_stage, worker_orders

__all__ = ["ScheduleGrid", "schedule_rows", "MOST_CELLS"]

_HERE = pathlib.Path(__file__).parent

#: The most cells the grid draws; beyond, each row's first steps and a note (the CSV has them all).
MOST_CELLS = 20_000

_CSS = """
.pipexplore-grid { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 11px;
  color: var(--jp-ui-font-color1, #333); }
.pipexplore-grid-scroll { overflow: auto; max-height: 260px; max-width: 100%; }
.pipexplore-grid table { border-collapse: collapse; }
.pipexplore-grid th { position: sticky; left: 0; background: var(--jp-layout-color1, white); font-weight: normal;
  text-align: left; padding: 1px 8px 1px 0; white-space: nowrap; color: var(--jp-ui-font-color2, #777); }
.pipexplore-grid td { padding: 1px 4px; border: 1px solid var(--jp-border-color2, #e0e0e0); text-align: center;
  min-width: 2.6em; }
.pipexplore-grid td.hot { background: #ffd54f; color: #000; outline: 2px solid #f57f17; }
.pipexplore-grid-note { font-family: system-ui, sans-serif; color: var(--jp-ui-font-color2, #777); padding: 2px 0; }
"""


class ScheduleGrid(anywidget.AnyWidget):
    """``rows``: per rank, its actions in order; ``labels``: each row's name; ``hover``: the action
    whose cells are highlighted (set through a link from a timeline's ``hovered``); ``note``: a
    line under the grid."""

    _esm = (_HERE / "schedule_grid.js").read_text()  # text, not a path: see splitbar.py
    _css = _CSS

    rows = traitlets.List(traitlets.List(traitlets.Unicode())).tag(sync=True)
    labels = traitlets.List(traitlets.Unicode()).tag(sync=True)
    hover = traitlets.Unicode("").tag(sync=True)
    note = traitlets.Unicode("").tag(sync=True)


def schedule_rows(plan: Any) -> tuple[list[str], list[list[str]], str]:
    """What the grid shows for ``plan``: a label per worker, its actions in order (what the simulator
    and the executors run: :func:`pipexplore.schedules.worker_orders`, recompute and optimizer steps
    included as the prediction has them), and a note (how many steps are left out, if any).

    Example::

        labels, rows, note = schedule_rows(Plan(table, splits=[2], chunks=2, schedule="1f1b"))
        # labels ['rank 0: stage 0', 'rank 1: stage 1'], rows[1] ['1F0', '1B0', '1F1', '1B1']
    """
    stages, m = plan.num_stages, plan.chunks
    v = plan.virtual_stages if is_multi_stage(plan.schedule) else 1
    recomputed = checkpointed(plan.checkpoint, m)
    rows, labels = [], []
    for rank, order in enumerate(worker_orders(plan.schedule, stages, m, v)):
        cells = []
        for s, kind, i in order:
            if kind in ("B", "I") and i < recomputed:
                cells.append(f"{s}R{i}")
            cells.append(f"{s}{kind}{i}")
        mine = sorted({s for s, _, _ in order})
        labels.append(f"rank {rank}: stage{'s' if len(mine) > 1 else ''} {', '.join(map(str, mine))}")
        rows.append(cells)
    total = sum(map(len, rows))
    note = ""
    if total > MOST_CELLS:
        keep = max(1, MOST_CELLS // max(1, len(rows)))
        note = (f"the first {keep} steps of each rank shown ({total:,} actions in all): "
                f"ex.export('schedule-csv') writes them all")
        rows = [row[:keep] for row in rows]
    return labels, rows, note
