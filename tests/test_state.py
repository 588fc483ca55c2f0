"""The explorer's behaviour on its state alone: no widget library, changes told to subscribers."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from pipexplore.cancel import Cancelled
from pipexplore.profiling.sequential import profile
from pipexplore.widgets.header import plan_difference
from pipexplore.widgets.state import ExplorerState


class Slow(nn.Module):
    """A layer that takes its time (so a step can be cancelled while it runs)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        time.sleep(self.seconds)
        return self.linear(x)


def _state(**options) -> ExplorerState:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(6)])
    options = {"devices": ["cpu", "cpu"], "chunks": 2, "splits": [3], "calibrate": False, **options}
    return ExplorerState(model, torch.randn(8, 6), **options)


@pytest.fixture
def state():
    return _state()


def _heard(state: ExplorerState) -> list[str]:
    changes: list[str] = []
    state.subscribe(changes.append)
    return changes


def test_the_state_imports_no_widget_library():
    """Importing the state imports no widget library: what its modules import when they load, all
    the way down inside the package, read from the code (as tests/test_layers.py reads it). The
    profile's progress bar imports ipywidgets inside a function, only in a notebook's kernel."""
    import ast
    import pathlib

    package = pathlib.Path(__file__).resolve().parents[1] / "pipexplore"

    def path_of(module: str) -> pathlib.Path:
        base = package.parent.joinpath(*module.split("."))
        return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")

    def loaded_with(module: str) -> list[str]:  # the imports a module runs as it loads (not in functions)
        names = []
        for node in ast.parse(path_of(module).read_text()).body:
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        return names

    seen: set[str] = set()
    outside: set[str] = set()
    todo = ["pipexplore.widgets.state"]
    while todo:
        module = todo.pop()
        if module in seen or not path_of(module).exists():
            continue
        seen.add(module)
        for name in loaded_with(module):
            if name.startswith("pipexplore"):
                todo.append(name)
            else:
                outside.add(name.split(".")[0])
    assert {"pipexplore.widgets.run_log", "pipexplore.widgets.layer_table", "pipexplore.plan"} <= seen
    assert "torch" in outside and not outside & {"ipywidgets", "anywidget", "traitlets"}


def test_a_change_of_plan_is_told_and_a_refused_one_keeps_the_plan(state):
    heard = _heard(state)
    plan = state.update(chunks=4, splits=[2])
    assert heard == ["plan"] and state.plan is plan and list(plan.splits) == [2] and plan.chunks == 4
    with pytest.raises(ValueError, match="split"):
        state.update(splits=[9])
    assert heard == ["plan"] and state.plan is plan
    with pytest.raises(TypeError, match="update\\(\\) cannot change 'colour'"):
        state.update(colour="red")


def test_moving_splits_to_more_stages_repeats_the_last_device_and_says_so(state):
    note = state.set_splits([2, 4])
    assert list(state.plan.splits) == [2, 4] and state.plan.devices == ("cpu", "cpu", "cpu")
    assert note == "3 stages: cpu repeated for 1 more device"
    assert state.set_splits([3]) == "2 stages: cpu dropped" and state.plan.devices == ("cpu", "cpu")
    assert state.set_splits([4]) == "" and list(state.plan.splits) == [4]


def test_the_stage_count_balances_by_time_and_refuses_what_cannot_be(state):
    state.set_stage_count(3)
    assert state.plan.num_stages == 3 and len(state.plan.devices) == 3
    with pytest.raises(ValueError, match="stages must be a whole number from 1 to 6"):
        state.set_stage_count(7)
    assert state.plan.num_stages == 3


def test_an_attempt_that_fails_shows_the_error_and_keeps_the_plan(state):
    plan = state.plan
    heard = _heard(state)
    assert not state.attempt(lambda: state.update(chunks=9))
    assert state.plan is plan and state.status.error and "chunks" in state.status.text
    assert state.last_error == state.status.text and "Traceback" in state.status.traceback
    assert heard == ["status"]
    assert state.attempt(lambda: state.balance("size"))
    assert state.last_error == "" and state.status.text == "" and not state.status.error


def test_a_run_is_a_row_and_a_timeline_and_is_told(state):
    heard = _heard(state)
    row = state.runner.run()
    assert heard == ["runs", "status"] and row["run"] == 0 and row["finite"]
    assert state.status.text.startswith("run 0: step") and not state.status.busy
    assert state.runs["run"].tolist() == [0] and state.log.kept_runs() == [0]
    assert state.log.shown_result() is state.log.result_of(0)
    # the loss at the plan's weights (the unsplit model's), the measured steps' losses beside it
    with torch.no_grad():
        unsplit = float(state.model(state.sample).pow(2).mean())
    assert state.runs.loc[0, "loss"] == pytest.approx(unsplit, rel=1e-5)
    measured = state.runs.loc[0, "measured_losses"]
    assert len(measured) == 3 and all(loss < unsplit for loss in measured)
    assert set(state.log.measured_timeline()["run"]) == {0}
    assert plan_difference(state.plan, state.log.result_of(0).plan) == ""
    state.update(chunks=4)
    assert plan_difference(state.plan, state.log.result_of(0).plan) == "not the current plan: chunks 2 → 4"
    state.restore(0)
    assert state.plan.chunks == 2 and state.status.text.startswith("restored the plan of run 0")
    with pytest.raises(LookupError, match="run 5 is not in explorer.runs"):
        state.restore(5)
    state.clear_runs()
    assert state.runs.empty and state.log.shown_result() is None


def test_showing_and_comparing_runs_and_the_memory_cap_are_told(state):
    state.runner.run()
    state.runner.run()
    heard = _heard(state)
    state.show(0, compare=1)
    assert (state.log.shown_run, state.log.compare_run) == (0, 1) and state.log.run_number(state.log.shown_result()) == 0
    state.memory_cap = "1 KiB"
    assert state.memory_cap == 1024.0
    assert heard == ["shown", "shown"]
    with pytest.raises(ValueError, match="memory_cap"):
        state.memory_cap = "lots"
    assert state.memory_cap == 1024.0


def test_the_stage_table_peaks_are_the_prediction(state):
    table = state.stage_table()
    assert table["stage"].tolist() == [0, 1] and table["layers"].tolist() == ["0–2", "3–5"]
    assert table["activation_bytes"].tolist() == state.figures()["activation_bytes_per_stage"]


def test_a_background_run_is_running_until_its_last_word_and_cancel_records_nothing():
    torch.manual_seed(0)
    # costs of fast layers (timing the slow ones would take seconds): the run itself is slow
    table = profile(nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]), torch.randn(8, 6), repeats=1)
    state = ExplorerState(nn.Sequential(Slow(0.05), Slow(0.05), Slow(0.05), Slow(0.05)), torch.randn(8, 6),
                          devices=["cpu", "cpu"], chunks=2, splits=[2], calibrate=False, layer_table=table)
    running: list[bool] = []
    state.subscribe(lambda change: change == "status" and running.append(state.runner.running))
    thread = state.runner.run_async()
    assert state.runner.running and state.status.busy and state.runner.thread is thread
    with pytest.raises(RuntimeError, match="already in progress"):
        state.runner.run_async()
    time.sleep(0.2)
    started = time.monotonic()
    assert state.runner.cancel(timeout=10)
    assert time.monotonic() - started < 5
    assert not state.runner.running and state.runs.empty and state.status.text.startswith("run cancelled")
    assert running[0] is True and running[-1] is False
    assert not [t for t in threading.enumerate() if t.name.startswith("pipexplore-run")]
    assert not state.runner.cancel()  # nothing to cancel now


def test_run_and_cancel_raise_cancelled_in_a_cancel_scope():
    from pipexplore.cancel import CancelToken, cancel_scope

    state = _state()
    token = CancelToken()
    token.cancel()
    with cancel_scope(token), pytest.raises(Cancelled):
        state.runner.run()
    assert state.runs.empty


def test_a_cancel_that_comes_as_the_step_ends_records_nothing(monkeypatch):
    from pipexplore.cancel import CancelToken, cancel_scope
    from pipexplore.widgets import runner as run_log

    state = _state()
    token = CancelToken()
    real = run_log.run_step

    def step_then_cancel(*args, **kwargs):  # the step has finished when the Cancel comes
        result = real(*args, **kwargs)
        token.cancel()
        return result

    monkeypatch.setattr(run_log, "run_step", step_then_cancel)
    with cancel_scope(token), pytest.raises(Cancelled):
        state.runner.run()
    assert state.runs.empty and state.log.kept_runs() == []
