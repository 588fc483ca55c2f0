"""One name, one meaning: a figure of a plan reads the same, under the same name and in the same unit
(seconds, bytes), through the sweep, the search, the stage table, the page's figures and the runs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipexplore.predict.search import SEARCH_COLUMNS
from pipexplore.predict.sweep import SWEEP_COLUMNS
from pipexplore.widgets import what_if
from pipexplore.widgets.run_log import RUN_COLUMNS
from pipexplore.widgets.state import ExplorerState


def _state() -> ExplorerState:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(6)])
    return ExplorerState(model, torch.randn(16, 32), devices=["cpu", "cpu"], chunks=4, calibrate=False,
                         profile_repeats=1, schedule="1f1b")


def test_a_plans_figures_are_the_same_through_every_table():
    state = _state()
    choice = dict(stages=[2], chunks=[4], schedules=["1f1b"], checkpoint=[state.plan.checkpoint])
    swept = what_if.sweep(state, **choice).iloc[0]
    what_if.apply(state, swept)  # the sweep's balanced split becomes the plan
    searched = what_if.search(state, **choice).iloc[0]
    figures, stages = state.figures(), state.stage_table()
    assert list(searched["splits"]) == list(swept["splits"]) == list(state.plan.splits)

    # the predicted step, in seconds
    step = figures["predicted_step_time"]
    assert swept["predicted_step_time"] == pytest.approx(step, rel=1e-12)
    assert searched["predicted_step_time"] == pytest.approx(step, rel=1e-12)
    # activation bytes a stage holds at its peak, as the schedule holds them
    held = figures["activation_bytes_per_stage"]
    assert swept["activation_bytes_per_stage"] == pytest.approx(held, rel=1e-12)
    assert searched["activation_bytes_per_stage"] == pytest.approx(held, rel=1e-12)
    assert stages["activation_bytes"].tolist() == pytest.approx(held, rel=1e-12)
    assert swept["activation_bytes"] == searched["activation_bytes"] == pytest.approx(max(held))
    # training bytes a stage holds at its peak (parameters, gradients, optimizer state, activations)
    assert searched["peak_bytes_per_stage"] == pytest.approx(stages["peak_bytes"].tolist(), rel=1e-12)
    assert (stages["peak_bytes"] > stages["activation_bytes"]).all()

    # a run: its predicted step is the plan's, under the same name; what it measured beside it
    row = state.runner.run()
    assert row["predicted_step_time"] == pytest.approx(step, rel=1e-12)
    assert 0 < row["step_time"] < 60  # seconds, as the prediction


def test_no_table_names_a_figure_twice_or_by_the_old_ambiguous_name():
    """``peak_memory`` meant activations in the sweep and training memory in the search: gone from
    every table; the search has no second name for its predicted step."""
    for columns in (SWEEP_COLUMNS, SEARCH_COLUMNS, RUN_COLUMNS):
        assert len(set(columns)) == len(columns)
        assert not any(name.startswith("peak_memory") for name in columns)
    assert "step_time" not in SEARCH_COLUMNS and "step_time" not in SWEEP_COLUMNS
    table = _state().stage_table()
    assert not any(" " in name or "+" in name for name in table.columns)  # names, not captions
    assert {"activation_bytes", "peak_bytes", "measured_peak_bytes", "compute_seconds"} <= set(table.columns)
