"""The messages and synced trait payloads that cross between Python and the page, as TypedDicts.

Fields are named as the ``.js`` files read them (``tests/test_protocol.py`` holds both sides to
these types). Optional fields are those of a ``total=False`` subclass (``NotRequired`` is Python
3.11's, and ``from __future__ import annotations`` hides it from ``__required_keys__`` there).

==============  =================  =========================================  ======================
widget          trait or message   type                                       read by
==============  =================  =========================================  ======================
SplitBar        its traits         SplitBarState                              splitbar.js
                layers, skips      list[StripLayer], list[StripSkip]          splitbar.js
                view               StripView                                  splitbar.js
TimelineCanvas  its traits         TimelineCanvasState                        timeline_canvas.js
                scene              TimelineScene: BlockPanel, MemoryPanel,    timeline_canvas.js
                                   MemorySeries, MemoryPeak, ScenePhase
                retime             RetimePayload: RetimeModel, RetimePanel,   retime.js
                                   RetimeFsdp
                custom message     DrawnMessage (page to kernel)              panels/timelines.py
ResidualCanvas  grid               ResidualGrid                               residual_canvas.js
ScheduleGrid    its traits         ScheduleGridState                          schedule_grid.js
FrontChart      its traits         FrontChartState                            front.js
==============  =================  =========================================  ======================
"""
from __future__ import annotations

from typing import Literal, TypedDict

__all__ = [
    "NOT_READ_BY_PAGE", "BlockPanel", "DrawnMessage", "FrontChartState", "MemoryPanel", "MemoryPeak",
    "MemorySeries", "MicroBytes", "PageEvent", "PanelRole", "ResidualCanvasState", "ResidualGrid",
    "RetimeCollectives", "RetimeFsdp", "RetimeModel", "RetimePanel", "RetimePayload", "ScenePhase",
    "ScheduleGridState", "SplitBarState", "StripLayer", "StripSkip", "StripView", "TimelineCanvasState",
    "TimelineScene",
]

# ---- the split strip (splitbar.py, panels/stages.py) -------------------------------------------

#: The cost that sets the strip's cell widths (``SplitBar.view``).
StripView = Literal["time", "params", "memory"]


class StripLayer(TypedDict):
    """One cell of the strip: sent by ``panels/stages.layer_cells`` as ``SplitBar.layers``; read by splitbar.js."""

    name: str
    type: str
    time: float
    params: float
    memory: float
    label: str


# (``from`` is a keyword: the functional form)
StripSkip = TypedDict("StripSkip", {"name": str, "from": int, "to": int})
StripSkip.__doc__ = ("One skip route's arc: sent by ``panels/stages.skip_arcs`` as ``SplitBar.skips``; "
                     "read by splitbar.js.")


class SplitBarState(TypedDict):
    """The synced traits of ``SplitBar`` (``splits`` and ``hovered`` set by the page too); read by splitbar.js."""

    layers: list[StripLayer]
    splits: list[int]
    skips: list[StripSkip]
    view: StripView
    stage_totals: list[str]
    error: str
    nodes: list[int]
    hovered: int
    group: str


# ---- the timelines (timeline_canvas.py, timeline_figure.py) -------------------------------------

#: Bytes a micro-batch number takes in a block panel's ``micro`` buffer (uint16 or int32).
MicroBytes = Literal[2, 4]
#: The panel the page re-times after a drag (``timeline_figure.TimelineView`` marks the predicted one).
PanelRole = Literal["predicted"]


class ScenePhase(TypedDict):
    """A phase of a scene: sent by ``timeline_canvas.phase_table`` (``phases``); read by timeline_canvas.js."""

    name: str
    color: str
    letter: str


class _BlockPanel(TypedDict):
    kind: Literal["blocks"]
    title: str
    warning: str
    empty: str
    lanes: list[str]
    lane_stage: list[int]
    offsets: list[int]
    stage_layers: list[list[int]]
    other_name: str
    count: int
    start: bytes
    end: bytes
    phase: bytes
    micro: bytes
    micro_bytes: MicroBytes


class BlockPanel(_BlockPanel, total=False):
    """Blocks: sent by ``timeline_canvas.block_panel`` (timeline_figure adds role, title_parts); read by timeline_canvas.js."""

    lane_node: list[int]
    other: bytes
    extra: list[str]
    role: PanelRole
    title_parts: list[str]


class MemorySeries(TypedDict):
    """One stage's memory step line: sent by ``timeline_canvas.memory_panel``; read by timeline_canvas.js."""

    stage: int
    color: str
    t: bytes
    v: bytes


class MemoryPeak(TypedDict):
    """One stage's peak: sent by ``timeline_canvas.memory_panel`` in ``peaks``; read by timeline_canvas.js."""

    stage: int
    t: float
    v: float
    over: bool


class MemoryPanel(TypedDict):
    """A panel of memory step lines: sent by ``timeline_canvas.memory_panel``; read by timeline_canvas.js."""

    kind: Literal["memory"]
    title: str
    warning: str
    unit: str
    series: list[MemorySeries]
    peaks: list[MemoryPeak]
    measured_series: list[MemorySeries]
    cap: float | None
    y_max: float


class TimelineScene(TypedDict):
    """What the canvas draws: sent by ``timeline_figure.TimelineView`` as ``TimelineCanvas.scene``; read by timeline_canvas.js."""

    panels: list[BlockPanel | MemoryPanel]
    phases: list[ScenePhase]
    legend: list[int]
    x_range: list[float]
    splits: str
    measured_ms: float
    retime_key: str


class RetimePanel(TypedDict):
    """How the page lays out a re-timed step: sent by ``timeline_canvas.retime_panel``; read by retime.js."""

    stage_lane: list[int]
    lanes: int
    codes: list[int]
    micro_bytes: MicroBytes
    bubble_key: list[int]
    collective_lane: list[int]
    collective_code: int


class RetimeCollectives(TypedDict):
    """A mesh rank's collectives per layer (``retime_model``'s ``collectives``); read by retime.js."""

    names: list[str]
    seconds: bytes
    rows: bytes


class RetimeFsdp(TypedDict):
    """FSDP's gathers and reduce-scatters as torch's lowering places them (``retime_model``'s ``fsdp``); read by retime.js."""

    unshard: bytes
    reduce_grad: bytes
    regather: bytes
    ops: bytes
    ops_at: bytes
    updates: bytes
    again: bytes


class RetimeModel(TypedDict):
    """A plan shape's split-independent costs and graph (``retime_model``); read by retime.js, timeline_canvas.js."""

    layers: int
    stages: int
    actions: int
    micro_batches: int
    sizes: int
    size_of_micro: bytes
    seconds: bytes
    raw: bytes
    weighted: bytes
    has_share: list[bool]
    extra: list[float]
    gap: float
    handoff: float
    stop: int
    zero_bubble: bool
    share_cap: bytes
    copy_rates: bytes
    out_bytes: bytes
    fractions: bytes
    fresh: bytes
    weight_grad: int
    resource: bytes
    free: int
    first: bytes
    second: bytes
    stage: bytes
    kind: bytes
    micro: bytes
    optimizer: bool
    queue_len: bytes
    lanes_at: bytes
    lanes: bytes
    fsdp: RetimeFsdp | None
    collectives: RetimeCollectives | None
    forward: int
    backward: int
    input_grad: int
    kind_names: list[str]
    stage_device: list[str]
    samples: int | None
    bubble_key: list[int]


class RetimePayload(RetimeModel):
    """``TimelineCanvas.retime`` (``{}``: none): sent by ``TimelineView``; read by retime.js, timeline_canvas.js."""

    key: str
    panel: RetimePanel


#: What the page tells the kernel with a custom message (``model.send``).
PageEvent = Literal["drawn"]


class DrawnMessage(TypedDict):
    """Sent by timeline_canvas.js once a scene is drawn; handled by ``panels/timelines.on_figure_message``."""

    event: PageEvent


class TimelineCanvasState(TypedDict):
    """The synced traits of ``TimelineCanvas`` (``hovered``: set in the page only); read by timeline_canvas.js."""

    scene: TimelineScene
    highlight: int
    retime: RetimePayload
    group: str
    hovered: str


# ---- residuals, schedule grid, search front ----------------------------------------------------

class ResidualGrid(TypedDict):
    """Each action's error: sent by ``residual_view.residual_state`` (``grid``); read by residual_canvas.js."""

    title: str
    rows: list[str]
    columns: list[str]
    values: bytes


class ResidualCanvasState(TypedDict):
    """The synced traits of ``ResidualCanvas``; read by residual_canvas.js."""

    grid: ResidualGrid


class ScheduleGridState(TypedDict):
    """The synced traits of ``ScheduleGrid`` (rows: ``schedule_rows``; hover: a page link); read by schedule_grid.js."""

    rows: list[list[str]]
    labels: list[str]
    hover: str
    note: str


class FrontChartState(TypedDict):
    """The synced traits of ``FrontChart`` (``svg``: ``front_svg``; ``picked``: set by the page); read by front.js."""

    svg: str
    picked: int


#: Fields the kernel sends that no ``.js`` file reads, by type: ``timeline_canvas.retime_panel``
#: reads the first four to build ``panel`` (whose own ``bubble_key`` and ``micro_bytes`` the page
#: reads); nothing reads ``stage_device``.
NOT_READ_BY_PAGE: dict[str, frozenset[str]] = {
    "RetimeModel": frozenset({"micro_batches", "optimizer", "kind_names", "bubble_key", "stage_device"}),
    "RetimePayload": frozenset({"micro_batches", "optimizer", "kind_names", "bubble_key", "stage_device"}),
}
