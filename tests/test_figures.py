"""ex.to_plotly: the explorer's timelines, memory and residuals as plotly figures of the data the page draws."""
from __future__ import annotations

import re
import sys

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from torch import nn

import pipexplore
from pipexplore import timeline as tl
from pipexplore.widgets import figures
from pipexplore.widgets.timeline_figure import PHASE_COLORS, STAGE_COLORS
from pipexplore.widgets.residual_view import residual_grid
from pipexplore.widgets.timeline_canvas import blocks_of

UNITS = {"B": 1.0, "KiB": 1024.0, "MiB": 1024.0 ** 2, "GiB": 1024.0 ** 3}
LANES = ("stage 0 · cpu", "stage 1 · cpu")


def _explorer():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return pipexplore.explore(model, torch.randn(16, 8), chunks=4, devices=["cpu", "cpu"])


@pytest.fixture(scope="module")
def ran():
    """An explorer after one real step (the figures only read it)."""
    ex = _explorer()
    ex.run()
    yield ex
    ex.close()


@pytest.fixture
def fresh():
    ex = _explorer()
    yield ex
    ex.close()


def _bars(fig: go.Figure, yaxis: str) -> pd.DataFrame:
    """Every bar drawn on one row of subplots: its lane, phase, micro-batch, span (ms) and colour."""
    rows = []
    for trace in fig.data:
        if trace.type != "bar" or trace.yaxis != yaxis:
            continue
        assert trace.orientation == "h"
        for lane, base, width, data in zip(trace.y, trace.base, trace.x, trace.customdata):
            rows.append({"lane": lane, "phase": trace.name, "microbatch": int(data[1]), "start": float(base),
                         "end": float(base) + float(width), "color": trace.marker.color})
    return pd.DataFrame(rows, columns=["lane", "phase", "microbatch", "start", "end", "color"])


def _expected(frame: pd.DataFrame) -> pd.DataFrame:
    """A timeline's rows as the canvas places them: lane label, times in ms from the step's start."""
    origin = frame["start"].min()
    return pd.DataFrame({"lane": [f"stage {s} · {d}" for s, d in zip(frame["stage"], frame["device"])],
                         "phase": frame["phase"].astype(str).to_numpy(), "microbatch": frame["microbatch"].to_numpy(),
                         "start": (frame["start"].to_numpy() - origin) * 1e3,
                         "end": (frame["end"].to_numpy() - origin) * 1e3})


def _same_rows(bars: pd.DataFrame, frame: pd.DataFrame) -> None:
    keys = ["lane", "phase", "microbatch", "start"]
    got = bars.sort_values(keys).reset_index(drop=True)
    want = _expected(frame).sort_values(keys).reset_index(drop=True)
    assert len(got) == len(frame)  # one bar per row of the timeline
    assert got[["lane", "phase"]].equals(want[["lane", "phase"]])
    assert (got["microbatch"].to_numpy() == want["microbatch"].to_numpy()).all()
    np.testing.assert_allclose(got["start"], want["start"], rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(got["end"], want["end"], rtol=1e-12, atol=1e-9)


def test_timelines_have_a_bar_per_action_on_the_canvas_axis_in_stage_order(ran):
    fig = ran.to_plotly("timelines")
    predicted, measured = ran.timeline("predicted"), ran.timeline("measured")
    _same_rows(_bars(fig, "y"), predicted)
    _same_rows(_bars(fig, "y2"), measured)
    assert len([t for t in fig.data if t.type == "bar"]) == len(set(predicted["phase"])) + len(set(measured["phase"]))
    # the canvas's own blocks (float32 ms): the same spans, predicted and measured
    for k, yaxis in enumerate(("y", "y2")):
        canvas = blocks_of(ran.figure.scene["panels"][k]).sort_values(["stage", "start"])
        bars = _bars(fig, yaxis).assign(stage=lambda b: b["lane"].str.slice(6, 7).astype(int))
        bars = bars.sort_values(["stage", "start"])
        np.testing.assert_allclose(bars["start"], canvas["start"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(bars["end"], canvas["end"], rtol=1e-5, atol=1e-5)
    # the canvas's colour of each phase; stage 0 on top in both rows; one time axis
    for bars in (_bars(fig, "y"), _bars(fig, "y2")):
        assert (bars["color"] == bars["phase"].map(PHASE_COLORS)).all()
    for axis in (fig.layout.yaxis, fig.layout.yaxis2):
        assert tuple(axis.categoryarray) == LANES and axis.autorange == "reversed"
    assert fig.layout.xaxis.matches == "x2"
    assert [a.text.split(":")[0] for a in fig.layout.annotations] == ["predicted", "measured, run 0"]
    # one legend entry per phase
    assert sorted(t.name for t in fig.data if t.showlegend is not False) == sorted(set(predicted["phase"])
                                                                                 | set(measured["phase"]))


def test_before_a_run_the_timelines_hold_the_prediction_only_and_residuals_say_so(fresh):
    fig = fresh.to_plotly()
    assert {t.yaxis for t in fig.data} == {"y"} and len(fig.layout.annotations) == 1
    _same_rows(_bars(fig, "y"), fresh.timeline("predicted"))
    with pytest.raises(ValueError, match=r"'residuals'\) compares a run with its prediction: no run yet"):
        fresh.to_plotly("residuals")
    memory = fresh.to_plotly("memory")
    assert memory.data and not any("measured" in t.name for t in memory.data)


def _memory_traces(fig: go.Figure, kind: str) -> dict[int, go.Scatter]:
    return {int(re.match(r"stage (\d+) ", t.name).group(1)): t for t in fig.data
            if t.mode == "lines" and t.name.endswith(kind)}


def _check_series(traces: dict[int, go.Scatter], memory: pd.DataFrame, scale: float, dash: str) -> None:
    assert sorted(traces) == sorted(set(memory["stage"]))
    for stage, trace in traces.items():
        held = memory[memory["stage"] == stage]
        assert trace.line.shape == "hv" and trace.line.dash == dash
        assert trace.line.color == STAGE_COLORS[stage]
        assert trace.x[0] == 0 and trace.y[0] == 0  # from (0, 0), as the canvas draws it
        np.testing.assert_allclose(trace.x[1:], held["time"].to_numpy() * 1e3)
        np.testing.assert_allclose(np.asarray(trace.y[1:]) * scale, held["bytes"].to_numpy())


def test_memory_series_are_the_explorers_memory(ran):
    fig = ran.to_plotly("memory")
    scale = UNITS[fig.layout.yaxis.title.text]
    predicted = ran.timeline("predicted")
    memory = tl.activation_memory(predicted)
    memory["time"] -= predicted["start"].min()
    _check_series(_memory_traces(fig, "predicted"), memory, scale, "solid")
    measured = ran.timelines.measured_memory()  # what the page draws dashed
    assert measured is not None and len(measured)
    _check_series(_memory_traces(fig, "measured"), measured, scale, "dash")
    # the peaks the page marks
    peaks = next(t for t in fig.data if t.name == "peak")
    page = ran.timelines.peaks()
    np.testing.assert_allclose(peaks.x, page["time"].to_numpy() * 1e3)
    np.testing.assert_allclose(np.asarray(peaks.y) * scale, page["bytes"].to_numpy())
    assert scale == UNITS["KiB"] and "peak" in fig.layout.title.text and "measured (dashed)" in fig.layout.title.text


def test_memory_cap_is_drawn_and_peaks_over_it_flagged(fresh):
    peaks = fresh.timelines.peaks()
    fresh.memory_cap = float(peaks["bytes"].min()) + 1  # the lower stage under it, the other over
    fig = fresh.to_plotly("memory")
    scale = UNITS[fig.layout.yaxis.title.text]
    (line,) = fig.layout.shapes
    assert line.y0 == line.y1 == pytest.approx(fresh.memory_cap / scale)
    marks = next(t for t in fig.data if t.name == "peak")
    over = (peaks["bytes"] > fresh.memory_cap).to_list()
    assert sorted(over) == [False, True]
    assert list(marks.marker.symbol) == ["x" if o else "diamond" for o in over]


def test_residuals_are_the_residual_tables_values(ran):
    fig = ran.to_plotly("residuals")
    (heatmap,) = fig.data
    table = ran.residuals()
    grid = residual_grid(table)
    np.testing.assert_allclose(np.asarray(heatmap.z, dtype=float), grid.to_numpy(dtype=float) * 100,
                               equal_nan=True)
    assert list(heatmap.y) == [f"stage {s} · {p}" for s, p in grid.index]
    assert list(heatmap.x) == [str(m) for m in grid.columns]
    late = (table["measured_seconds"] - table["predicted_seconds"]) * 1e3
    for _, row in table.iterrows():  # each action's measured − predicted in its cell's hover
        same = (table["stage"] == row["stage"]) & (table["phase"] == row["phase"]) & (
            table["microbatch"] == row["microbatch"])
        cell = heatmap.customdata[list(heatmap.y).index(f"stage {row['stage']} · {row['phase']}")][
            list(heatmap.x).index(str(row["microbatch"]))]
        assert cell == pytest.approx(late[same].mean())
    assert heatmap.zmid == 0 and fig.layout.title.text.startswith("residuals — run 0")


def test_a_wrong_kind_names_the_three(ran):
    with pytest.raises(ValueError, match=r"'timelines', 'memory' or 'residuals', not 'memroy'"):
        ran.to_plotly("memroy")


def test_without_plotly_the_error_names_the_extra(ran, monkeypatch):
    monkeypatch.setitem(sys.modules, "plotly", None)
    extra = re.escape("pip install 'pipexplore[plotly]'")
    for what in ("timelines", "memory", "residuals"):
        with pytest.raises(ImportError, match=extra):
            ran.to_plotly(what)
    with pytest.raises(ImportError, match=extra):
        figures.timelines_figure(ran.timeline("predicted"))
    with pytest.raises(ImportError, match=extra):
        figures.memory_figure(ran.timeline("predicted"))
    with pytest.raises(ImportError, match=extra):
        figures.residuals_figure(ran.residuals())
