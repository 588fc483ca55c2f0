"""SplitBar: the anywidget that draws the layer strip and its draggable split points."""
from __future__ import annotations

import pathlib

import anywidget
import traitlets

__all__ = ["SplitBar"]

_HERE = pathlib.Path(__file__).parent

_CSS = """
.pipexplore-splitbar { font-family: system-ui, sans-serif; user-select: none; }
.pipexplore-splitbar .cell { stroke: white; stroke-width: 0.5; }
.pipexplore-splitbar .cell-label { font-size: 10px; fill: white; text-anchor: middle; pointer-events: none; }
.pipexplore-splitbar .stage-total { font-size: 12px; fill: var(--jp-ui-font-color1, #333); text-anchor: middle; }
.pipexplore-splitbar .group { fill: none; stroke: var(--jp-ui-font-color2, #777); stroke-width: 1; }
.pipexplore-splitbar .group-label { font-size: 10px; fill: var(--jp-ui-font-color2, #777); text-anchor: middle;
  pointer-events: none; }
.pipexplore-splitbar .skip { fill: none; stroke: #888; stroke-width: 1.5; }
.pipexplore-splitbar .skip.crossing { stroke: #d62728; stroke-width: 2; stroke-dasharray: 5 3; }
.pipexplore-splitbar .handle { cursor: ew-resize; outline: none; }
.pipexplore-splitbar .handle:focus .grip, .pipexplore-splitbar .handle:hover .grip { fill: rgba(128, 128, 128, 0.4); }
.pipexplore-splitbar .handle .bar { stroke: var(--jp-ui-font-color0, #111); stroke-width: 3; }
.pipexplore-splitbar .handle:focus .bar { stroke: var(--jp-brand-color1, #1976d2); }
.pipexplore-splitbar .handle.removing .bar { stroke: #d62728; stroke-dasharray: 4 3; }
.pipexplore-splitbar .handle .grip { fill: rgba(128, 128, 128, 0.18); }
.pipexplore-splitbar .handle .hit { fill: transparent; pointer-events: all; }
.pipexplore-splitbar.dragging .stage-total { opacity: 0.35; }
.pipexplore-splitbar .handle.node .bar { stroke: var(--jp-brand-color1, #1976d2); stroke-width: 4; }
.pipexplore-splitbar .node-label { font-size: 10px; fill: var(--jp-brand-color1, #1976d2); text-anchor: middle;
  pointer-events: none; }
.pipexplore-splitbar .group.closed { stroke-width: 2.5; }
.pipexplore-splitbar .group-hit { fill: transparent; cursor: pointer; }
.pipexplore-splitbar .cell.block { stroke: var(--jp-ui-font-color1, #333); stroke-width: 1; }
.pipexplore-splitbar .overview { cursor: crosshair; }
.pipexplore-splitbar .overview-stage { opacity: 0.55; }
.pipexplore-splitbar .brush { fill: rgba(128, 128, 128, 0.15); stroke: var(--jp-ui-font-color1, #333);
  stroke-width: 1.5; cursor: grab; }
.pipexplore-splitbar .pipexplore-error { color: #b00020; font-size: 13px; min-height: 1em; }
"""


class SplitBar(anywidget.AnyWidget):
    """The layer strip. ``splits`` is the trait the front end changes for the plan: on release of a
    dragged handle, on an arrow key, and with one more split (double-click a layer boundary) or
    one fewer (Delete on a focused handle, or a handle dragged off the strip).

    ``layers``: one dict per layer (``name``, ``type``, ``time``, ``params``, ``memory``, ``label``);
    ``skips``: ``{'name', 'from', 'to'}`` per route; ``view``: which cost sets the widths;
    ``stage_totals``: one label per stage; ``error``: a message shown under the strip;
    ``hovered``: the stage of the layer under the pointer (-1: none), set by the front end;
    ``nodes``: the node of each stage's device for planned devices (empty: one machine): a split
    where the node changes is drawn as a node boundary.
    """

    # The module's text, not its path: anywidget makes a path a FileContents on the class, whose
    # change signal holds every instance (and, through its handlers, the explorer and its model)
    # for the life of the process, closed or not.
    _esm = (_HERE / "splitbar.js").read_text()
    _css = _CSS

    layers = traitlets.List(traitlets.Dict()).tag(sync=True)
    splits = traitlets.List(traitlets.Int()).tag(sync=True)
    skips = traitlets.List(traitlets.Dict()).tag(sync=True)
    view = traitlets.Unicode("time").tag(sync=True)
    stage_totals = traitlets.List(traitlets.Unicode()).tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)
    nodes = traitlets.List(traitlets.Int()).tag(sync=True)
    #: The stage of the layer under the pointer (-1: none), set by the front end.
    hovered = traitlets.Int(-1).tag(sync=True)
    #: A name shared with the timeline that re-times this strip's moves in the page (a
    #: :class:`~pipexplore.widgets.timeline_canvas.TimelineCanvas` of the same ``group``; empty: none):
    #: the strip tells it every splits it shows, moved here or set by the kernel.
    group = traitlets.Unicode("").tag(sync=True)
