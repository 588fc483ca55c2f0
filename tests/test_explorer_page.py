"""The explorer's page through its Python model: header, shared time axis, memory, residuals, runs,
progress and cancel, export and report, editing the plan in the strip."""
from __future__ import annotations

import html.parser
import json
import re
import threading

import numpy as np

import pytest
import torch
from torch import nn

from pipexplore import timeline as tl
from pipexplore.profiling.sequential import profile
from pipexplore.widgets import explore
from pipexplore.widgets.header import format_bytes
from pipexplore.widgets.residual_view import residual_grid
from pipexplore.widgets.timeline_canvas import blocks_of

LAYERS, WIDTH, BATCH = 8, 16, 16


def _model() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)])


@pytest.fixture(scope="module")
def table():
    """One profile for the module: the explorers below take it as ``layer_table`` (no profiling each)."""
    torch.manual_seed(0)
    return profile(_model(), torch.randn(BATCH, WIDTH), microbatch_rows=[4, BATCH])


@pytest.fixture
def explorer(table):
    return explore(_model(), torch.randn(BATCH, WIDTH), chunks=4, devices=["cpu"] * 3, splits=[2, 5],
                   layer_table=table, calibrate=False)


def _text(widget) -> str:
    """What an HTML widget says (entities decoded)."""
    return html.unescape(widget.value)


def _panel(explorer, k: int) -> dict:
    """Panel ``k`` of the explorer's timelines (0 predicted, 1 measured, 2 memory), as the page gets it."""
    return explorer.figure.scene["panels"][k]


def _title(panel: dict) -> str:
    return panel["title"] + (f" ⚠ {panel['warning']}" if panel.get("warning") else "")


def _peaks(plan) -> list[float]:
    return tl.activation_memory(plan.predicted).groupby("stage")["bytes"].max().tolist()


# ---- one dashboard ----------------------------------------------------------------------

def test_header_shows_the_plans_predicted_figures(explorer):
    predicted = explorer.plan.predicted
    step = tl.step_time(predicted)
    header = explorer.w_header.value
    assert f"{step * 1e3:.2f} ms" in header
    assert f"{tl.bubble_fraction(predicted) * 100:.1f} %" in header
    assert "throughput, samples/s" in header and f">{BATCH / step:,.0f}<" in header
    assert " · ".join(format_bytes(v) for v in _peaks(explorer.plan)) in header.replace("<span class=''>", "").replace(
        "</span>", "")
    assert "measured" in header and "no run yet" in header
    explorer.splits = [3, 6]  # the header follows the plan
    assert f"{tl.step_time(explorer.plan.predicted) * 1e3:.2f} ms" in explorer.w_header.value
    assert "splits [3, 6]" in explorer.w_header.value
    row = explorer.run()  # the last measured step and how far its prediction was
    assert ("measured · run 0" in explorer.w_header.value
            and f"{row['step_time'] * 1e3:.2f} ms" in explorer.w_header.value)
    assert (f"predicted {row['predicted_step_time'] * 1e3:.2f} ms then ({row['prediction_error'] * 100:+.0f} %)"
            in explorer.w_header.value)


def test_an_empty_measured_panel_says_no_run_yet_without_axes(explorer):
    measured = _panel(explorer, 1)
    assert measured["title"] == "measured: no run yet" and "no run yet" in measured["empty"]
    assert measured["lanes"] == [] and measured["count"] == 0 and len(blocks_of(measured)) == 0  # no lanes drawn


def test_predicted_and_measured_share_one_time_axis(explorer):
    explorer.run()
    scene = explorer.figure.scene
    assert [p["kind"] for p in scene["panels"]] == ["blocks", "blocks", "memory"]  # one canvas stack, one axis
    longest = max(tl.step_time(explorer.plan.predicted), tl.step_time(explorer.timeline("measured"))) * 1e3
    assert scene["x_range"] == pytest.approx((0.0, longest * 1.02))
    for k in (0, 1):  # both panels' blocks lie on that axis
        assert blocks_of(_panel(explorer, k))["end"].max() <= scene["x_range"][1]
    assert _panel(explorer, 1)["title"].startswith("measured: step") and _panel(explorer, 1)["lanes"]
    shown = set(explorer.plan.predicted["phase"]) | set(explorer.timeline("measured")["phase"])
    legend = [scene["phases"][k]["name"] for k in scene["legend"]]  # one legend for both panels
    assert sorted(legend) == sorted(shown)


def test_stage_zero_is_the_top_lane_and_blocks_carry_phase_and_microbatch(explorer):
    panel = _panel(explorer, 0)
    assert panel["lanes"] == ["stage 0 · cpu", "stage 1 · cpu", "stage 2 · cpu"]  # lane 0 drawn at the top
    phases = explorer.figure.scene["phases"]
    assert [p["letter"] for p in phases[:2]] == ["F", "B"]  # a block's label: its phase letter and micro-batch
    blocks = blocks_of(panel)
    forward = blocks[blocks["phase"] == [p["name"] for p in phases].index("forward")]
    predicted = explorer.plan.predicted
    expected = predicted[predicted["phase"] == "forward"].sort_values(["stage", "start"])
    assert forward["microbatch"].tolist() == expected["microbatch"].tolist()
    assert forward["stage"].tolist() == forward["lane"].tolist() == expected["stage"].tolist()
    assert forward["start"].tolist() == pytest.approx((expected["start"] * 1e3).tolist(), abs=1e-4)
    assert forward["end"].tolist() == pytest.approx((expected["end"] * 1e3).tolist(), abs=1e-4)
    # Sorted by lane, then start: each lane's blocks are one slice (what the page searches on hover).
    assert panel["offsets"] == [0] + blocks.groupby("lane").size().cumsum().tolist()
    assert blocks.groupby("lane")["start"].apply(lambda s: s.is_monotonic_increasing).all()


def test_zero_bubble_input_gradients_are_coloured_apart_from_backward(explorer):
    explorer.update(schedule="zero-bubble")
    phases = {p["name"]: (k, p) for k, p in enumerate(explorer.figure.scene["phases"])}
    blocks = blocks_of(_panel(explorer, 0))
    predicted = explorer.plan.predicted
    input_grad = blocks[blocks["phase"] == phases["input_grad"][0]]
    assert len(input_grad) == (predicted["phase"] == "input_grad").sum() > 0
    assert set(input_grad["microbatch"]) == set(range(4)) and phases["input_grad"][1]["letter"] == "I"
    assert phases["weight_grad"][1]["letter"] == "W"
    assert phases["input_grad"][1]["color"] != phases["backward"][1]["color"]


def test_a_measured_panel_of_another_plan_says_so(explorer):
    explorer.run()
    assert "not the current plan" not in _title(_panel(explorer, 1))
    explorer.update(chunks=8)
    title = _title(_panel(explorer, 1))
    assert "run 0" in title and "not the current plan: chunks 4 → 8" in title


def test_hovering_a_layer_shades_its_stage_and_a_block_names_its_layers(explorer):
    explorer.run()
    explorer.bar.hovered = 1  # what the strip sets when the pointer is over a layer of stage 1
    assert explorer.figure.highlight == 1  # the page shades stage 1's lanes in both timelines
    explorer.bar.hovered = -1
    assert explorer.figure.highlight == -1
    # splits [2, 5] of 8 layers: a block of stage 1 says layers 2–4; a measured block also says
    # what its own run predicted for the same action.
    assert _panel(explorer, 0)["stage_layers"] == [[0, 1], [2, 4], [5, 7]]
    measured = _panel(explorer, 1)
    assert measured["stage_layers"] == [[0, 1], [2, 4], [5, 7]] and measured["other_name"] == "predicted for this run"
    result = explorer.state.log.shown_result()
    spans = {(r.stage, r.microbatch, r.phase): (r.end - r.start) * 1e3 for r in result.predicted.itertuples()}
    names = [p["name"] for p in explorer.figure.scene["phases"]]
    blocks = blocks_of(measured)
    assert len(blocks) == len(result.timeline)
    for row in blocks.itertuples():
        assert row.other == pytest.approx(spans[(row.stage, row.microbatch, names[row.phase])], rel=1e-5)
    # What travels to the browser is JSON plus binary buffers: no NaN in the JSON.
    from pipexplore.widgets.timeline_canvas import TimelineCanvas

    state = TimelineCanvas(scene=explorer.figure.scene).get_state()
    json.dumps({k: v for k, v in state.items() if k != "scene"}, allow_nan=False)
    json.dumps(explorer.figure.scene, allow_nan=False, default=lambda b: None)  # raises on NaN


def test_the_timeline_says_which_split_it_shows(explorer):
    assert "pipexplore-timeline" in explorer.figure._dom_classes
    assert explorer.figure.scene["splits"] == "2,5"  # the page's data-splits, once drawn
    explorer.splits = [4, 6]
    assert explorer.figure.scene["splits"] == "4,6"


def test_the_page_a_run_the_residuals_and_the_report_need_no_charting_library(tmp_path):
    """The timelines and residuals are our own canvas widgets (plotly.js shipped as a 5 MB widget
    module): in a process where importing plotly fails, an explorer, its warm-up, a run, the
    residual mode and the HTML report all work."""
    import subprocess
    import sys

    report = tmp_path / "report.html"
    code = ("import sys\nsys.modules['plotly'] = None  # importing it raises ImportError\n"
            "import torch\nfrom torch import nn\nfrom pipexplore.widgets import explore\n"
            "from pipexplore.widgets.timeline_figure import warm_up\nwarm_up()\n"
            "ex = explore(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), torch.randn(8, 4), chunks=2, calibrate=False)\n"
            f"ex._repr_mimebundle_()\nex.run()\nex.w_mode.value = 'residuals'\nex.to_html({str(report)!r})\n"
            "print('ROWS', len(ex.residual_figure.grid['rows']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert re.search(r"ROWS [1-9]", out.stdout), out.stdout  # residuals drawn
    assert "data-pipexplore-widget='residuals'" in report.read_text()


# ---- memory over time -------------------------------------------------------------------

def test_memory_panel_draws_each_stages_activations_and_marks_its_peak(explorer):
    view = explorer.timelines
    peaks = view.peaks()
    assert peaks["bytes"].tolist() == _peaks(explorer.plan)
    memory = tl.activation_memory(explorer.plan.predicted)
    scale = 1024.0 if max(_peaks(explorer.plan)) >= 1024 else 1.0
    panel = _panel(explorer, 2)
    assert panel["kind"] == "memory" and panel["unit"] == ("KiB" if scale == 1024.0 else "B")
    assert [line["stage"] for line in panel["series"]] == [0, 1, 2]
    for stage, line in enumerate(panel["series"]):
        rows = memory[memory["stage"] == stage]
        assert np.frombuffer(line["v"], np.float32).tolist() == pytest.approx((rows["bytes"] / scale).tolist())
        assert np.frombuffer(line["t"], np.float32).tolist() == pytest.approx((rows["time"] * 1e3).tolist(),
                                                                              abs=1e-4)
    assert [m["v"] for m in panel["peaks"]] == pytest.approx([v / scale for v in _peaks(explorer.plan)])
    assert not any(m["over"] for m in panel["peaks"]) and panel["cap"] is None


def test_a_memory_cap_flags_the_stages_over_it(table, explorer):
    peaks = _peaks(explorer.plan)
    cap = (sorted(peaks)[0] + sorted(peaks)[-1]) / 2
    explorer.update(memory_cap=cap)
    over = [stage for stage, peak in enumerate(peaks) if peak > cap]
    assert 0 < len(over) < 3
    assert explorer.timelines.peaks()["over_cap"].tolist() == [p > cap for p in peaks]
    panel = _panel(explorer, 2)
    assert f"{', '.join(map(str, over))} over the cap" in panel["warning"]
    assert "over the cap" in explorer.w_header.value and "⚠" in explorer.w_stages.value
    scale = 1024.0 if max(peaks) >= 1024 else 1.0
    assert panel["cap"] == pytest.approx(explorer.memory_cap / scale)  # the cap's line
    assert [m["over"] for m in panel["peaks"]] == [p > cap for p in peaks]  # marks of the stages over it
    explorer.w_memory_cap.value = "1 GiB"
    assert explorer.memory_cap == 2 ** 30 and "all stages under the cap" in _panel(explorer, 2)["title"]
    explorer.w_memory_cap.value = "lots"
    assert ("memory_cap must be a number of bytes > 0 or a size such as '2 GiB'"
            in _text(explorer.w_errors["memory_cap"]))
    assert explorer.w_memory_cap.value == "lots" and explorer.memory_cap == 2 ** 30
    with pytest.raises(ValueError, match=r"memory_cap must be a number of bytes > 0 .*got -5"):
        explore(_model(), torch.randn(BATCH, WIDTH), layer_table=table, calibrate=False, memory_cap=-5)


# ---- residuals --------------------------------------------------------------------------

def test_residual_mode_shows_each_actions_error_by_stage_and_microbatch(explorer):
    explorer.w_mode.value = "residuals"
    view = explorer.residual_figure  # our canvas widget: the page loads no plotly for it
    assert view.grid["title"] == "residuals: no run yet" and view.grid["rows"] == []
    explorer.run()
    grid = residual_grid(explorer.residuals())
    assert explorer.residual_figure is view  # redrawn, not replaced
    assert view.cells() == pytest.approx(grid.to_numpy() * 100, nan_ok=True, rel=1e-6)
    assert view.grid["rows"] == [f"stage {s} · {phase}" for s, phase in grid.index]
    assert view.grid["columns"] == [str(c) for c in grid.columns]
    assert view.grid["title"].startswith("residuals — run 0: predicted ÷ measured − 1 per action")
    assert explorer.w_timeline_box.layout.display == "none" and explorer.w_residuals.layout.display == ""
    explorer.w_mode.value = "timelines"
    assert explorer.w_timeline_box.layout.display == "" and explorer.w_residuals.layout.display == "none"


# ---- runs ---------------------------------------------------------------------------------

def test_runs_table_has_units_hides_empty_columns_and_colours_the_error(explorer):
    assert "no runs yet" in explorer.w_runs.value
    explorer.run()
    explorer.splits = [3, 6]
    explorer.run()
    page = explorer.w_runs.value
    assert "pipexplore-runs" in page and page.count("<tr") == 3
    for header in ("step ms", "predicted ms", "error %", "bubble %", "samples/s", "loss"):
        assert f">{header}</th>" in page
    assert ">startup s</th>" not in page and ">peak memory</th>" not in page  # empty on CPU threads
    error = explorer.runs["prediction_error"].iloc[0]
    assert f">{error * 100:+.1f}</td>" in page
    assert "background-color: rgba(" in page  # the error cell is coloured
    explorer.w_sort.value = "step_time"
    order = explorer.runs.sort_values("step_time")["run"].tolist()
    cells = [page_row.split("</td>")[0].rsplit(">", 1)[1] for page_row in explorer.w_runs.value.split("<tr>")[2:]]
    assert [int(c) for c in cells] == order


def test_a_past_run_shows_again_and_its_plan_can_be_restored(explorer):
    explorer.run()
    explorer.update(chunks=8, splits=[4, 6])
    explorer.run()
    explorer.w_show_run.value = 0
    assert "run 0 · splits [2, 5] · 4 chunks · gpipe" in _panel(explorer, 1)["title"]
    assert _panel(explorer, 1)["count"] == len(explorer.timeline("measured", run=0))
    assert explorer.w_restore.description == "Restore run 0's plan"
    explorer.w_restore.click()
    assert explorer.splits == [2, 5] and explorer.plan.chunks == 4
    assert "not the current plan" not in _title(_panel(explorer, 1))
    with pytest.raises(LookupError, match=r"run 7 is not in explorer.runs \(latest runs: 0, 1\)"):
        explorer.restore(7)


def test_two_runs_side_by_side(explorer):
    explorer.run()
    explorer.update(schedule="1f1b")
    explorer.run()
    explorer.w_compare.value = 0
    table_html, figure = explorer.w_compare_box.children[1], explorer.w_compare_box.children[2]
    assert "<th>run 1</th>" in table_html.value and "<th>run 0</th>" in table_html.value
    assert "1f1b" in table_html.value and "gpipe" in table_html.value
    first, second = figure.scene["panels"]  # one time axis, no memory panel
    assert first["title"].startswith("run 1: step") and second["title"].startswith("run 0: step")
    longest = max(tl.step_time(explorer.timeline("measured", run=n)) for n in (0, 1)) * 1e3
    assert figure.scene["x_range"] == pytest.approx((0.0, longest * 1.02))
    explorer.w_compare.value = -1
    assert explorer.w_compare_box.children == ()
    explorer.w_show_run.value = 0  # the other way round: the same widget, redrawn
    explorer.w_compare.value = 1
    again = explorer.w_compare_box.children[2]
    assert again is figure and again.scene["panels"][0]["title"].startswith("run 0: step")
    assert again.scene["panels"][1]["title"].startswith("run 1: step")


# ---- editing the plan in the strip ----------------------------------------------------------

def test_a_split_added_and_removed_in_the_strip_changes_the_stages_and_devices(explorer):
    explorer.bar.splits = [2, 4, 5]  # a double-click on the boundary before layer 4
    assert explorer.splits == [2, 4, 5] and explorer.plan.num_stages == 4
    assert explorer.plan.devices == ("cpu",) * 4 and explorer.w_devices.value == "cpu,cpu,cpu,cpu"
    assert "cpu repeated for 1 more device" in _text(explorer.w_errors["devices"])
    assert explorer.w_stage_count.value == 4 and len(explorer.bar.stage_totals) == 4
    explorer.bar.splits = [2]  # two handles deleted
    assert explorer.splits == [2] and explorer.plan.devices == ("cpu", "cpu")
    assert "cpu, cpu dropped" in _text(explorer.w_errors["devices"])
    explorer.bar.splits = [2, 2]
    assert explorer.splits == [2] and "split point 2 is repeated" in explorer.bar.error


def test_the_stages_field_rebalances_and_refuses_too_many(explorer):
    explorer.w_stage_count.value = 4
    assert explorer.plan.num_stages == 4 and len(explorer.plan.devices) == 4
    explorer.w_stage_count.value = 20
    assert explorer.w_stage_count.value == 20 and explorer.plan.num_stages == 4
    assert "stages must be a whole number from 1 to 8 (the layers), got 20" in _text(explorer.w_errors["stages"])


def test_a_bad_chunks_value_stays_in_its_field_with_the_reason_beside_it(explorer):
    explorer.w_chunks.value = 100
    assert explorer.w_chunks.value == 100 and explorer.plan.chunks == 4
    assert "chunks=100 is more than the batch" in _text(explorer.w_errors["chunks"])
    assert explorer.w_errors["chunks"].layout.display == ""
    explorer.w_chunks.value = 8
    assert explorer.plan.chunks == 8 and explorer.w_errors["chunks"].layout.display == "none"


# ---- progress and cancel ---------------------------------------------------------------------

_GATE = {"armed": False, "started": threading.Event(), "release": threading.Event()}


class _Gate(nn.Module):
    """Identity that, once armed, says it started and waits to be released (a run held open)."""

    def forward(self, x):
        if _GATE["armed"]:
            _GATE["started"].set()
            _GATE["release"].wait(30)
        return x


def test_during_a_run_the_button_cancels_it():
    model = nn.Sequential(nn.Linear(4, 4), _Gate(), nn.Linear(4, 4))
    ex = explore(model, torch.randn(8, 4), devices=["cpu", "cpu"], splits=[1], chunks=2, calibrate=False)
    _GATE.update(armed=True, started=threading.Event(), release=threading.Event())
    try:
        ex.w_run.click()
        assert _GATE["started"].wait(30)
        assert ex.w_run.description == "Cancel" and ex.w_run.button_style == "danger"
        assert "pipexplore-spinner" in ex.w_status.value and "⏳" not in ex.w_status.value
        assert ex.w_progress.layout.display == ""
        ex.w_run.click()  # Cancel
        _GATE["release"].set()
        ex.state.runner.thread.join(30)
    finally:
        _GATE["armed"] = False
        _GATE["release"].set()
    assert not ex.state.runner.thread.is_alive()
    assert "run cancelled" in ex.w_status.value and ex.runs.empty
    assert ex.w_run.description == "Run step" and ex.w_progress.layout.display == "none"


def test_profiling_shows_layers_done_in_a_notebook(monkeypatch):
    import IPython.display

    from pipexplore.widgets import progress as progress_module

    shown = []
    monkeypatch.setattr(progress_module, "in_kernel", lambda: True)
    monkeypatch.setattr(IPython.display, "display", lambda widget: shown.append(widget))
    with progress_module.profile_progress() as progress:
        bar, label = shown[0].children
        progress(3, 8)
        assert (bar.value, bar.max) == (3, 8) and "profiling layers 3 of 8" in label.value
    assert shown[0].comm is None  # closed: the bar is gone once profiling ends
    explore(_model(), torch.randn(BATCH, WIDTH), chunks=4, devices=["cpu", "cpu"], calibrate=False)
    bar, label = shown[1].children
    assert bar.value == bar.max > LAYERS and f"{bar.max} of {bar.max}" in label.value  # every layer at each size


# ---- export and report -----------------------------------------------------------------------

class _Page(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.classes: list[str] = []
        self.attributes: list[dict[str, str]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        self.attributes.append(attributes)
        self.classes.extend((attributes.get("class") or "").split())
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)


def test_export_offers_every_kind_with_its_code(explorer):
    assert [value for _, value in explorer.w_export_kind.options] == [
        "gpipe", "pipelining", "torchrun", "schedule-csv", "megatron", "torchtitan", "chrome-trace", "html"]
    explorer.w_export_kind.value = "gpipe"
    explorer.w_export.click()
    assert explorer.w_code.code == explorer.export("gpipe") and "balance=[2, 3, 3]" in explorer.w_code.code
    explorer.w_export_kind.value = "torchrun"
    explorer.w_export.click()
    assert explorer.w_code.code == explorer.export("torchrun")
    explorer.w_export_kind.value = "schedule-csv"
    explorer.w_export.click()
    assert explorer.w_code.code == explorer.export("schedule-csv")
    assert explorer.w_code.code.splitlines()[0].startswith("0F0,")  # rank 0 first, torch's notation
    explorer.w_export_kind.value = "megatron"  # an nn.Sequential is no model Megatron-LM builds: said beside it
    explorer.w_export.click()
    assert "is not one this export writes" in explorer.view.fields["export"].value and not explorer.w_code.code
    explorer.w_export_kind.value = "chrome-trace"
    explorer.w_export.click()
    trace = json.loads(explorer.w_code.code)
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == len(explorer.plan.predicted)
    assert "predicted step" in explorer.w_code.title


def test_to_html_writes_one_self_contained_page(explorer, tmp_path):
    explorer.run()
    path = explorer.to_html(tmp_path / "report.html")
    text = path.read_text()
    page = _Page()
    page.feed(text)
    assert "pipexplore-timeline" in page.classes and "pipexplore-runs" in page.classes
    assert any(a.get("data-splits") == "2,5" for a in page.attributes)
    # The notebook's own canvas widgets, embedded, each element with its state beside it; no CDN, no plotly.
    assert any("__pipexploreWidgets" in script and "function render" in script for script in page.scripts)
    assert not any(a.get("src") for a in page.attributes) and "plotly" not in text.lower()
    states = {a["id"]: a for a in page.attributes if a.get("data-pipexplore-widget")}
    assert set(states) == {"pipexplore-timeline-figure", "pipexplore-residuals-figure"}
    scene = next(json.loads(script) for script in page.scripts if script.lstrip().startswith('{"scene"'))["scene"]
    assert scene["splits"] == "2,5" and [p["kind"] for p in scene["panels"]] == ["blocks", "blocks", "memory"]
    assert scene["panels"][0]["count"] == len(explorer.plan.predicted)
    assert len(text) < 400_000  # the widgets' JavaScript, not a charting library
    assert explorer.export("gpipe").split("\n")[3].strip() in text.replace("&#x27;", "'")
    assert "pipexplore-strip" in page.classes and "cell" in page.classes  # the strip as SVG


def test_the_notebook_keeps_a_static_view(explorer):
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    page = _Page()
    page.feed(bundle["text/html"])
    assert "pipexplore-timeline" in page.classes and "cell" in page.classes
    assert any(a.get("data-splits") == "2,5" for a in page.attributes)
    assert not page.scripts
    layers = [a for a in page.attributes if a.get("class") == "cell"]
    assert [int(a["data-stage"]) for a in layers] == [0, 0, 1, 1, 1, 2, 2, 2]


def test_large_timelines_travel_as_single_precision_blocks_at_the_right_times():
    import pandas as pd

    from pipexplore.predict.simulator import simulate
    from pipexplore.widgets.timeline_figure import TimelineView

    table = pd.DataFrame({"forward": [1e-3] * 8, "backward": [2e-3] * 8, "output_bytes": 0.0})
    predicted = simulate(table, list(range(1, 8)), chunks=256, schedule="1f1b", executor="threads",
                         devices=[f"cuda:{s}" for s in range(8)], copy_cost=0.0, batch=256)
    view = TimelineView(predicted, samples=256, widget=False)
    panel = view.figure.scene["panels"][0]
    assert len(panel["start"]) == 4 * len(predicted)  # 4 bytes a time: half the bytes of a redraw
    blocks = blocks_of(panel)
    origin = predicted["start"].min()
    np.testing.assert_allclose(np.sort(blocks["start"].to_numpy()), np.sort((predicted["start"] - origin) * 1e3),
                               rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(np.sort(blocks["end"].to_numpy()), np.sort((predicted["end"] - origin) * 1e3),
                               rtol=1e-6, atol=1e-4)


def test_the_memory_panel_draws_what_the_run_measured_beside_the_prediction():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)])
    ex = explore(model, torch.randn(32, 64), devices=["cpu", "cpu"], chunks=4, splits=[3], schedule="1f1b",
                 checkpoint="never", calibrate=False)
    memory = [p for p in ex.figure.scene["panels"] if p["kind"] == "memory"][0]
    assert memory["measured_series"] == [] and "measured" not in memory["title"]  # no run yet
    ex.run()
    memory = [p for p in ex.figure.scene["panels"] if p["kind"] == "memory"][0]
    measured = ex.timeline("measured")
    held = tl.activation_memory(measured[measured["memory"].notna()])
    scale = {"B": 1.0, "KiB": 1024.0, "MiB": 1024.0 ** 2, "GiB": 1024.0 ** 3}[memory["unit"]]
    assert [s["stage"] for s in memory["measured_series"]] == [0, 1]
    for series in memory["measured_series"]:
        stage = held[held["stage"] == series["stage"]]
        np.testing.assert_allclose(np.frombuffer(series["v"], np.float32), stage["bytes"] / scale, rtol=1e-6)
        np.testing.assert_allclose(np.frombuffer(series["t"], np.float32),
                                   (stage["time"] - measured["start"].min()) * 1e3, rtol=1e-5, atol=1e-3)
    top = held["bytes"].max() / scale
    assert f"measured (dashed) {top:.2f} {memory['unit']}" in memory["title"], memory["title"]
    assert memory["y_max"] >= top
