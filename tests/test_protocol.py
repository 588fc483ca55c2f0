"""The protocol between Python and the page (pipexplore/widgets/protocol.py), held from both sides.

Python side: each payload, built by the function that sends it, has exactly its TypedDict's keys
(nested dicts and lists of dicts too), each optional key seen at least once, and leaf values of the
declared kind. Page side: every field a TypedDict declares is read in the ``.js`` files its
docstring names, every field those files read off a payload is declared, and each widget's
``model.get``/``model.set`` names are its state's keys. A field added or renamed on one side only
fails here.
"""
from __future__ import annotations

import pathlib
import re
import threading
import types
import typing
from types import SimpleNamespace

import anywidget
import numpy as np
import pandas as pd
import pytest

from pipexplore.plan import Plan
from pipexplore.predict.simulator import simulate
from pipexplore.widgets import protocol as P

WIDGETS = pathlib.Path(P.__file__).parent

# ---- Python side: a payload against its TypedDict --------------------------------------------------

_LEAVES: dict[typing.Any, tuple[type, ...]] = {
    str: (str,), bytes: (bytes,), bool: (bool, np.bool_),
    int: (int, np.integer), float: (float, int, np.floating, np.integer)}


def _fields(td: typing.Any) -> frozenset[str]:
    return td.__required_keys__ | td.__optional_keys__


def _pick(value: typing.Any, options: tuple[typing.Any, ...]) -> typing.Any:
    """The TypedDict of a union that ``value`` is: the one whose Literal fields it matches."""
    for option in options:
        hints = typing.get_type_hints(option)
        literals = {k: typing.get_args(t) for k, t in hints.items() if typing.get_origin(t) is typing.Literal}
        if isinstance(value, dict) and all(value.get(k) in allowed for k, allowed in literals.items()
                                           if k in option.__required_keys__):
            return option
    raise AssertionError(f"{value!r:.200} is none of {[o.__name__ for o in options]}")


def check(value: typing.Any, tp: typing.Any, seen: dict[str, set[str]], path: str = "payload") -> None:
    """Assert that ``value`` is a ``tp`` (keys exactly, recursively); record the keys each TypedDict had."""
    origin = typing.get_origin(tp)
    if typing.is_typeddict(tp):
        assert isinstance(value, dict), f"{path}: a {tp.__name__} is a dict, got {type(value).__name__}"
        missing, extra = tp.__required_keys__ - set(value), set(value) - _fields(tp)
        assert not missing and not extra, (f"{path} is not a protocol.{tp.__name__}: missing {sorted(missing)}, "
                                           f"not declared {sorted(extra)}")
        seen.setdefault(tp.__name__, set()).update(value)
        hints = typing.get_type_hints(tp)
        for key, item in value.items():
            check(item, hints[key], seen, f"{path}.{key}")
    elif origin is list:
        assert isinstance(value, list), f"{path}: a list, got {type(value).__name__}"
        (item_type,) = typing.get_args(tp)
        for k, item in enumerate(value):
            check(item, item_type, seen, f"{path}[{k}]")
    elif origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            assert type(None) in options, f"{path}: None where {tp} is declared"
            return
        options = tuple(o for o in options if o is not type(None))
        if all(typing.is_typeddict(o) for o in options) and len(options) > 1:
            check(value, _pick(value, options), seen, path)
        else:
            assert len(options) == 1, tp
            check(value, options[0], seen, path)
    elif origin is typing.Literal:
        assert value in typing.get_args(tp), f"{path}: {value!r} is not one of {typing.get_args(tp)}"
    else:
        kinds = _LEAVES[tp]
        assert isinstance(value, kinds) and not (tp in (int, float) and isinstance(value, (bool, np.bool_))), \
            f"{path}: a {tp.__name__}, got {type(value).__name__} {value!r:.80}"


def assert_all_seen(seen: dict[str, set[str]], *types_: typing.Any) -> None:
    """Each field of each type (optional ones too) was in some payload: a rename of one fails above."""
    for td in types_:
        unseen = set(_fields(td)) - seen.get(td.__name__, set())
        assert not unseen, f"protocol.{td.__name__}: fields no payload of this test had: {sorted(unseen)}"


def widget_state(widget: anywidget.AnyWidget) -> dict[str, typing.Any]:
    """A widget's own synced traits (beyond AnyWidget's; not its private ``_esm``, ``_css``, ``_anywidget_id``)."""
    own = set(type(widget).class_trait_names(sync=True)) - set(anywidget.AnyWidget.class_trait_names(sync=True))
    return {name: getattr(widget, name) for name in sorted(own) if not name.startswith("_")}


def _table(n: int = 6) -> pd.DataFrame:
    return pd.DataFrame({"name": [f"blocks.{k // 2}.l{k}" for k in range(n)], "type": "Linear",
                         "forward": np.full(n, 1e-3), "backward": np.full(n, 2e-3), "output_bytes": np.full(n, 4096.0),
                         "param_bytes": np.full(n, 1e3), "stash": ["s"] + [""] * (n - 1),
                         "pop": [""] * (n - 2) + ["s", ""]})


def test_the_strip_sends_layers_and_skips_as_declared():
    from pipexplore.widgets.panels.stages import layer_cells, skip_arcs, stage_nodes, stage_totals
    from pipexplore.widgets.splitbar import SplitBar

    plan = Plan(_table(), splits=(2, 4), chunks=2)
    seen: dict[str, set[str]] = {}
    layers, skips = layer_cells(plan.layer_table), skip_arcs(plan)
    assert layers and skips  # (a route: layer 0 to layer 4)
    check(layers, list[P.StripLayer], seen)
    check(skips, list[P.StripSkip], seen)
    bar = SplitBar(layers=layers, splits=list(plan.splits), skips=skips, view="params", group="g",
                   stage_totals=stage_totals(plan, "params"), nodes=stage_nodes(plan))
    check(widget_state(bar), P.SplitBarState, seen)
    assert_all_seen(seen, P.StripLayer, P.StripSkip, P.SplitBarState)


def _planned_and_measured() -> tuple[pd.DataFrame, pd.DataFrame]:
    """A prediction on planned devices (lanes carry their node) and a 'measured' step of expert
    batches (blocks carry a line each), with activation memory in both."""
    table = _table(3)
    predicted = simulate(table, [1, 2], chunks=2, devices=["H100:0", "H100:1", "H100:2"], gpus_per_node=2,
                         executor="threads", checkpoint="never")
    measured = predicted.assign(start=predicted["start"] * 1.1, end=predicted["end"] * 1.1, batch_size=4, tasks=2,
                                wait=1e-4)
    return predicted, measured


def test_the_timeline_scene_and_its_panels_are_as_declared():
    from pipexplore.widgets.timeline_figure import PHASES, TimelineView
    from pipexplore.widgets.timeline_canvas import block_panel

    predicted, measured = _planned_and_measured()
    assert "lane_node" in block_panel(predicted, PHASES)
    seen: dict[str, set[str]] = {}
    view = TimelineView(predicted, samples=4, memory_cap=1e3)
    check(view.figure.scene, P.TimelineScene, seen)  # nothing measured yet: an empty panel
    view.show(measured=measured, measured_prediction=predicted, splits=[1, 2], stage_layers=[(0, 0), (1, 1), (2, 2)],
              measured_stage_layers=[(0, 0), (1, 1), (2, 2)], measured_title="run 0", memory_cap=None)
    check(view.figure.scene, P.TimelineScene, seen)
    assert "other" in view.figure.scene["panels"][1] and "extra" in view.figure.scene["panels"][1]
    assert view.figure.scene["panels"][2]["measured_series"]
    check(block_panel(None, PHASES, empty="no run yet"), P.BlockPanel, seen)
    assert_all_seen(seen, P.TimelineScene, P.BlockPanel, P.MemoryPanel, P.MemorySeries, P.MemoryPeak, P.ScenePhase)


def test_the_retime_model_and_the_canvas_state_are_as_declared():
    from pipexplore.predict.retime import retime_key, retime_model
    from pipexplore.widgets.timeline_figure import TimelineView
    from pipexplore.widgets.timeline_canvas import lane_of

    plan = Plan(_table(), splits=(2, 4), chunks=3, devices=("cpu", "cpu", "cpu"))
    options = plan.simulate_options()
    key = retime_key(plan.layer_table, plan.splits, options)
    model = retime_model(plan.layer_table, list(plan.splits), samples=6, **options)
    seen: dict[str, set[str]] = {}
    check(model, P.RetimeModel, seen)
    check(retime_model(plan.layer_table, list(plan.splits), collectives=True, **{**options, "batch": 6})["collectives"],
          P.RetimeCollectives, seen)  # (a mesh rank's: the same layers' collectives)
    view = TimelineView(plan.predicted)
    view.retime(key, {**model, "key": key}, lane_of(plan.predicted)[0])
    check(view.figure.retime, P.RetimePayload, seen)
    view.figure.group = "g"
    check(widget_state(view.figure), P.TimelineCanvasState, seen)
    assert_all_seen(seen, P.RetimeModel, P.RetimePayload, P.RetimePanel, P.RetimeCollectives, P.TimelineCanvasState)


def test_the_residual_grid_is_as_declared():
    from pipexplore.predict.residuals import residuals
    from pipexplore.widgets.residual_view import ResidualCanvas, residual_state

    predicted, measured = _planned_and_measured()
    seen: dict[str, set[str]] = {}
    check(residual_state(None), P.ResidualGrid, seen)
    canvas = ResidualCanvas()
    canvas.show(residuals(predicted, measured), "run 0")
    assert canvas.grid["rows"]
    check(widget_state(canvas), P.ResidualCanvasState, seen)
    assert_all_seen(seen, P.ResidualGrid, P.ResidualCanvasState)


def test_the_schedule_grid_and_the_front_chart_are_as_declared():
    from pipexplore.widgets.front import FrontChart, front_svg
    from pipexplore.widgets.schedule_grid import ScheduleGrid, schedule_rows

    seen: dict[str, set[str]] = {}
    grid = ScheduleGrid()
    grid.labels, grid.rows, grid.note = schedule_rows(Plan(_table(), splits=(3,), chunks=2, schedule="1f1b"))
    check(widget_state(grid), P.ScheduleGridState, seen)
    check(widget_state(FrontChart(svg=front_svg(pd.DataFrame()))), P.FrontChartState, seen)
    assert_all_seen(seen, P.ScheduleGridState, P.FrontChartState)


def test_the_kernel_takes_the_pages_drawn_message_and_nothing_else(monkeypatch):
    from pipexplore import background
    from pipexplore.widgets.panels.timelines import TimelinesPanel

    started: list[str] = []
    monkeypatch.setattr(background, "start", lambda function, name: started.append(name))
    panel = SimpleNamespace(state=SimpleNamespace(lock=threading.Lock()), drawn=False, retimed=0)
    panel.send_retime = lambda: setattr(panel, "retimed", panel.retimed + 1)
    for content in ({"event": "drawn", "more": 1}, {"event": "moved"}, {}, "drawn"):
        TimelinesPanel.on_figure_message(panel, None, content, [])
    assert not panel.drawn and not started
    message: P.DrawnMessage = {"event": "drawn"}
    check(message, P.DrawnMessage, {})
    TimelinesPanel.on_figure_message(panel, None, message, [])
    assert panel.drawn and panel.retimed == 1 and started == ["pipexplore-warm-up-runs"]


# ---- page side: the .js files against the TypedDicts -----------------------------------------------

def _js(name: str) -> str:
    """A widget's .js file without its comments (``//`` after a colon or a quote is a URL or a string)."""
    text = (WIDGETS / name).read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
    return re.sub(r"(^|[^:\"'\\])//.*$", r"\1", text, flags=re.MULTILINE)


TYPES = {name: getattr(P, name) for name in P.__all__ if typing.is_typeddict(getattr(P, name))}
STATES = {name: td for name, td in TYPES.items() if name.endswith("State")}
#: What the page sends (its fields are written there, not read: see test_the_pages_messages_are_declared).
PAGE_SENT = {"DrawnMessage"}


def _readers(td: typing.Any) -> list[str]:
    return sorted(set(re.findall(r"\b(\w+\.js)\b", td.__doc__ or "")))


def _reads(field: str, text: str) -> bool:
    """Whether the page reads ``field``: ``x.field``, ``"field"`` (a key by name), or ``{ field } =``."""
    f = re.escape(field)
    return bool(re.search(rf"\.{f}\b|[\"']{f}[\"']|\{{[^{{}}=;]*\b{f}\b[^{{}}=;]*\}}\s*=", text))


def test_every_type_names_the_js_files_that_read_it_and_every_js_file_is_typed():
    for name, td in TYPES.items():
        assert _readers(td), f"protocol.{name}'s docstring names no .js file that reads it"
        for reader in _readers(td):
            assert (WIDGETS / reader).is_file(), f"protocol.{name}: no {reader} in {WIDGETS}"
    typed = {reader for td in TYPES.values() for reader in _readers(td)}
    assert typed == {path.name for path in WIDGETS.glob("*.js")}


@pytest.mark.parametrize("name", sorted(set(TYPES) - PAGE_SENT))
def test_the_page_reads_every_field_the_kernel_sends(name):
    td = TYPES[name]
    text = "\n".join(_js(reader) for reader in _readers(td))
    unread = P.NOT_READ_BY_PAGE.get(name, frozenset())
    assert unread <= _fields(td), f"NOT_READ_BY_PAGE[{name!r}] names fields protocol.{name} does not have"
    missing = sorted(f for f in _fields(td) - unread if not _reads(f, text))
    assert not missing, f"protocol.{name}: {', '.join(_readers(td))} never read {missing}"


#: Per .js file, the names that hold a payload there and what each may be. The page's own
#: additions to a panel it decoded (its elements and height) are allowed beside the fields.
HOLDERS = {
    "splitbar.js": {"layer": (P.StripLayer,), "skip": (P.StripSkip,)},
    "timeline_canvas.js": {"p": (P.BlockPanel, P.MemoryPanel, {"canvas", "node", "height"}),
                           "panel": (P.BlockPanel, P.MemoryPanel), "s": (P.MemorySeries,), "peak": (P.MemoryPeak,),
                           "ph": (P.ScenePhase,), "scene": (P.TimelineScene,), "kernel": (P.TimelineScene,),
                           "raw": (P.TimelineScene, P.RetimePayload), "m": (P.RetimePayload,)},
    "retime.js": {"m": (P.RetimePayload,), "raw": (P.RetimePayload,), "panel": (P.RetimePanel,)},
    "residual_canvas.js": {"grid": (P.ResidualGrid,)},
}
#: Members of JS arrays and typed arrays (a local of the same name as a payload's holder).
_JS_MEMBERS = {"length", "map", "reduce", "forEach", "filter", "slice", "subarray", "push", "join", "toFixed"}


#: Fields the page reads by a name in a string (``raw[k]``): where in each file, and off what.
KEYED = {
    "retime.js": [(r"\b(?:f64|i32)\(\s*[\"'](\w+)[\"']\s*\)", P.RetimeModel)],  # decodeRetime's buffers
    "splitbar.js": [(r"const key = \{([^}]*)\}", P.StripLayer)],  # weights(): the cost a view sets the widths by
}


@pytest.mark.parametrize("reader", sorted(HOLDERS))
def test_the_page_reads_no_field_the_kernel_does_not_send(reader):
    text = _js(reader)
    for pattern, kind in KEYED.get(reader, []):
        found = re.findall(pattern, text)
        assert found, f"{reader}: {pattern} finds nothing (the table above is stale)"
        keyed = set(re.findall(r"[\"'](\w+)[\"']", " ".join(found))) | {f for f in found if re.fullmatch(r"\w+", f)}
        unknown = sorted(keyed - _fields(kind))
        assert not unknown, f"{reader} reads {unknown}, not in protocol.{kind.__name__}"
    for holder, kinds in HOLDERS[reader].items():
        declared: set[str] = set()
        for kind in kinds:
            declared |= set(kind) if isinstance(kind, set) else set(_fields(kind))
        read = set(re.findall(rf"(?<![\w.$]){holder}\??\.(\w+)", text)) - _JS_MEMBERS
        assert read, f"{reader}: no field read off `{holder}` (the table above is stale)"
        assert read <= declared, (f"{reader} reads {sorted(read - declared)} off `{holder}`, which "
                                  f"{[k.__name__ for k in kinds if not isinstance(k, set)]} do not declare")


@pytest.mark.parametrize("name", sorted(STATES))
def test_each_widgets_js_gets_and_sets_exactly_its_state(name):
    td = STATES[name]
    text = "\n".join(_js(reader) for reader in _readers(td))
    used = set(re.findall(r"model\.(?:get|set)\(\s*[\"'](\w+)[\"']", text)) | set(re.findall(r"change:(\w+)", text))
    assert used == set(_fields(td)), (f"protocol.{name} declares {sorted(_fields(td))}; "
                                      f"{', '.join(_readers(td))} use {sorted(used)}")


def test_the_pages_messages_are_declared():
    sent = re.findall(r"model\.send\(\s*\{([^}]*)\}", _js("timeline_canvas.js"))
    assert len(sent) == 1
    keys = {part.split(":")[0].strip() for part in sent[0].split(",") if part.strip()}  # (shorthand ones too)
    assert keys == set(_fields(P.DrawnMessage))
    events = re.findall(r"event\s*:\s*[\"'](\w+)[\"']", sent[0])
    assert events and set(events) <= set(typing.get_args(P.PageEvent))
