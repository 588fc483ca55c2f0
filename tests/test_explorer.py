"""The explorer through its Python model: plan, splits, controls, runs, errors, export, magic."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from models import unet_model
from pipexplore import GPipe, SplitError
from pipexplore.widgets import Explorer, explore
from pipexplore.widgets.timeline_canvas import blocks_of


@pytest.fixture
def explorer():
    return explore(unet_model(), torch.randn(16, 6), chunks=4, devices=["cpu"] * 3, splits=[2, 6])


def test_builds_on_cpu_and_says_so():
    ex = explore(unet_model(), torch.randn(16, 6))
    if not torch.cuda.is_available():
        assert set(ex.plan.devices) == {"cpu"}
        assert any("No GPU found" in note for note in ex.notes)
    assert any("synthetic loss" in note for note in ex.notes)
    assert "synthetic loss" in ex.w_status.value
    assert len(ex.layer_table) == 9 and len(ex.bar.layers) == 9


def test_setting_splits_updates_plan_strip_and_prediction(explorer):
    before = explorer.timeline("predicted")
    explorer.splits = [3, 7]
    assert explorer.plan.balance == [3, 4, 2]
    assert explorer.bar.splits == [3, 7]
    assert len(explorer.bar.stage_totals) == 3
    after = explorer.timeline("predicted")
    assert set(after["stage"]) == {0, 1, 2} and not after.equals(before)
    # the figure's predicted row shows the new plan's numbers
    panel = explorer.figure.scene["panels"][0]
    assert panel["title"].startswith("predicted: step")
    lanes = {panel["lanes"][lane] for lane in blocks_of(panel)["lane"]}  # stage 0 on top
    assert lanes == {"stage 0 · cpu", "stage 1 · cpu", "stage 2 · cpu"}


def test_skip_routes_drawn_and_crossing_counted(explorer):
    assert explorer.bar.skips == [{"name": "skip", "from": 1, "to": 7}, {"name": "skip", "from": 3, "to": 5}]
    assert "1 of 2 skip routes cross stages" in explorer.w_stages.value  # splits [2, 6]: outer crosses
    explorer.splits = [1, 8]
    assert "0 of 2 skip routes cross stages" in explorer.w_stages.value


@pytest.mark.parametrize("splits,message", [
    ([2, 12], r"split point 12 is past the last layer \(8\)"),
    ([6, 2], "split points must be sorted"),
    ([4, 4], "split point 4 is repeated"),
    ([1, 2, 3], r"4 stages need 4 devices but 3 are chosen"),
])
def test_invalid_splits_are_refused_and_the_previous_kept(explorer, splits, message):
    with pytest.raises(SplitError, match=message):
        explorer.splits = splits
    assert explorer.splits == [2, 6] and explorer.bar.splits == [2, 6]


def test_splits_from_the_front_end_are_validated(explorer):
    explorer.bar.splits = [4, 6]  # as a drag would send it
    assert explorer.splits == [4, 6] and explorer.plan.balance == [4, 2, 3]
    explorer.bar.splits = [4, 40]  # a bad proposal: reverted, message under the strip
    assert explorer.splits == [4, 6] and explorer.bar.splits == [4, 6]
    assert "split point 40 is past the last layer" in explorer.bar.error
    explorer.bar.splits = [5, 6]
    assert explorer.bar.error == ""


def test_controls_change_the_plan_and_bad_values_are_refused(explorer):
    explorer.w_chunks.value = 8
    assert explorer.plan.chunks == 8
    assert explorer.timeline("predicted")["microbatch"].max() == 7
    explorer.w_schedule.value = "1f1b"
    assert explorer.plan.schedule == "1f1b"
    explorer.w_checkpoint.value = "never"
    assert explorer.plan.checkpoint == "never"
    explorer.w_devices.value = "cpu,cpu,cuda:7"
    assert explorer.plan.devices == ("cpu", "cpu", "cpu")
    # refused beside its field, with what was typed still in it
    assert explorer.w_devices.value == "cpu,cpu,cuda:7"
    assert "cuda:7" in explorer.w_errors["devices"].value and "does not exist" in explorer.w_errors["devices"].value
    with pytest.raises(ValueError, match="device 'cuda:7' does not exist"):
        explorer.update(devices=["cpu", "cpu", "cuda:7"])


def test_balance_buttons(explorer):
    explorer.w_balance_time.click()
    costs = (explorer.layer_table["forward"] + explorer.layer_table["backward"]).tolist()
    from pipexplore.balance import optimal_splits
    assert explorer.splits == optimal_splits(costs, 3)
    explorer.w_balance_size.click()
    sizes = (explorer.layer_table["output_bytes"] + 2 * explorer.layer_table["param_bytes"]).tolist()
    assert explorer.splits == optimal_splits(sizes, 3)
    explorer.w_view.value = "memory"
    assert explorer.bar.view == "memory" and explorer.bar.stage_totals[0].endswith("act.")


def test_run_adds_a_row_and_a_measured_timeline(explorer):
    with pytest.raises(LookupError, match="no run yet"):
        explorer.timeline("measured")
    row = explorer.run()
    explorer.splits = [3, 7]
    explorer.run()
    runs = explorer.runs
    assert len(runs) == 2 and runs["splits"].tolist() == [[2, 6], [3, 7]]
    assert (runs["step_time"] > 0).all() and (runs["bubble"].between(0, 1)).all()
    assert (runs["throughput"] > 0).all() and runs["prediction_error"].notna().all()
    assert row["executor"] == "threads" and row["devices"] == "cpu,cpu,cpu"
    measured = explorer.timeline("measured")
    assert set(measured["source"]) == {"measured"} and set(measured["stage"]) == {0, 1, 2}
    assert explorer.w_runs.value.count("<tr") == 3  # header + 2 runs
    assert explorer.figure.scene["panels"][1]["title"].startswith("measured: step")


def test_the_users_model_is_not_changed_by_a_run(explorer):
    before = {k: v.clone() for k, v in explorer.model.state_dict().items()}
    explorer.run()
    after = explorer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_failing_run_shows_the_error_and_keeps_plan_and_runs():
    class Boom(nn.Module):
        armed = False

        def forward(self, x):
            if Boom.armed:
                raise ArithmeticError("layer blew up")
            return x

    ex = explore(nn.Sequential(nn.Linear(4, 4), Boom(), nn.Linear(4, 4)), torch.randn(8, 4), devices=["cpu", "cpu"],
                 splits=[1])
    ex.run()
    Boom.armed = True
    before = set(threading.enumerate())
    thread = ex.run_async()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert "ArithmeticError: layer blew up" in ex.w_status.value
    assert len(ex.runs) == 1 and ex.splits == [1]
    assert not ex.w_run.disabled
    assert {t for t in threading.enumerate() if t.name.startswith("pipexplore")} <= before


def test_run_button_runs_in_the_background(explorer):
    explorer.w_run.click()
    explorer.state.runner.thread.join(timeout=60)
    assert len(explorer.runs) == 1
    assert "run 0: step" in explorer.w_status.value


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_every_schedule_runs_through_the_schedule_executor(explorer, schedule):
    explorer.update(schedule=schedule)
    predicted = set(explorer.timeline("predicted")["phase"])
    row = explorer.run()
    assert row["executor"] == "threads" and row["schedule"] == schedule
    assert set(explorer.timeline("measured")["phase"]) == predicted


def test_interleaved_runs_on_half_the_devices(explorer):
    with pytest.raises(ValueError, match=r"stage count \(3\) to be a multiple of virtual_stages \(2\)"):
        explorer.update(schedule="interleaved")
    explorer.update(devices=["cpu", "cpu"], schedule="interleaved", chunks=4, splits=[2, 4, 6])  # 4 stages, 2 devices
    assert explorer.w_schedule.value == "interleaved" and explorer.w_devices.value == "cpu,cpu"
    row = explorer.run()
    assert row["devices"] == "cpu,cpu" and set(explorer.timeline("measured")["stage"]) == {0, 1, 2, 3}


@pytest.mark.parametrize("schedule", ["interleaved", "zbv", "dualpipev"])
def test_a_multi_stage_schedule_puts_two_stages_on_every_device_given(schedule):
    """As torch's multi-stage schedules place them: two devices run four stages, none idle (the
    first plan had put two stages on the first device and left the second unused)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(8)])
    ex = explore(model, torch.randn(8, 16), devices=["cpu", "cpu"], chunks=4, schedule=schedule)
    assert (ex.plan.num_stages, ex.plan.num_devices) == (4, 2)
    assert len(set(ex.plan.splits)) == 3
    if not torch.cuda.is_available():  # none named: this machine's two CPU devices, each holding two stages
        default = explore(model, torch.randn(8, 16), chunks=4, schedule=schedule)
        assert default.plan.devices == ("cpu", "cpu") and default.plan.num_stages == 4
    given = explore(model, torch.randn(8, 16), devices=["cpu", "cpu"], chunks=4, schedule=schedule, splits=[4])
    assert (given.plan.num_stages, given.plan.num_devices) == (2, 1)  # the splits given say otherwise
    few = explore(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)), torch.randn(8, 16),
                  devices=["cpu", "cpu"], chunks=4, schedule=schedule)
    assert few.plan.num_stages == 2  # three layers: as many stages as the schedule takes (an even count)

def test_the_autograd_executor_runs_the_gpipe_module(explorer):
    row = explorer.run(executor="autograd")
    assert row["executor"] == "autograd" and explorer.plan.executor == "autograd"
    with pytest.raises(ValueError, match="the autograd executor .* runs only the gpipe schedule"):
        explorer.update(schedule="1f1b")
    assert explorer.plan.schedule == "gpipe"
    explorer.w_executor.value = "threads"
    explorer.update(schedule="1f1b")
    assert explorer.run()["executor"] == "threads"
    assert explorer.runs["executor"].tolist() == ["autograd", "threads"]


def test_exported_gpipe_code_runs_as_is(explorer):
    explorer.splits = [3, 7]
    code = explorer.export("gpipe")
    namespace = {"model": unet_model()}
    exec(code, namespace)
    pipe = namespace["pipe"]
    assert isinstance(pipe, GPipe)
    assert [len(p) for p in pipe.partitions] == explorer.plan.balance == [3, 4, 2]
    assert pipe.chunks == 4 and pipe.checkpoint == "except_last"
    assert pipe(torch.randn(8, 6)).shape == (8, 6)


@pytest.mark.slow
def test_exported_pipelining_split_traces_to_the_same_stages(explorer):
    explorer.splits = [3, 7]
    code = explorer.export("pipelining")
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(9)])
    namespace = {"model": model, "sample": torch.randn(16, 6)}
    exec(code, namespace)
    pipe = namespace["pipe"]
    assert pipe.num_stages == 3
    per_stage = [sum(p.numel() for p in pipe.split_gm.get_submodule(f"submod_pp_{k}").parameters()) for k in range(3)]
    assert per_stage == [3 * 42, 4 * 42, 2 * 42]
    switched = [m for m in pipe.split_gm.modules() if hasattr(m, "_run_with_interpreter")]
    assert switched and not any(m._run_with_interpreter for m in switched)  # their generated code runs


def test_explorer_refuses_bad_models():
    with pytest.raises(ValueError, match="Linear has no child modules to split between"):
        Explorer(nn.Linear(2, 2), torch.randn(2, 2))  # not a Sequential: traced, but it has no blocks
    with pytest.raises(TypeError, match="the explorer needs an nn.Module, got function"):
        Explorer(lambda x: x, torch.randn(2, 2))
    broken = unet_model()
    del broken[5]
    with pytest.raises(TypeError, match="one or more pairs of stash and pop do not match"):
        explore(broken, torch.randn(4, 6))


def test_magic_parses_arguments_and_reports_unknown_names():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "pipexplore")
    shell.run_line_magic("load_ext", "pipexplore")  # loading twice is harmless
    shell.user_ns.update(model=unet_model(), sample=torch.randn(8, 6))
    ex = shell.run_line_magic("pipexplore", "model sample --chunks 2 --devices cpu,cpu --splits 4 --schedule 1f1b")
    assert isinstance(ex, Explorer)
    assert ex.plan.chunks == 2 and ex.splits == [4] and ex.plan.schedule == "1f1b"
    with pytest.raises(NameError, match="%pipexplore: model 'nosuch' is not defined in the notebook"):
        shell.run_line_magic("pipexplore", "nosuch sample")
    assert "Show an explorer for a model" in shell.find_line_magic("pipexplore").__doc__
    shell.run_line_magic("unload_ext", "pipexplore")
    assert shell.find_line_magic("pipexplore") is None
    shell.run_line_magic("load_ext", "pipexplore")
    assert shell.find_line_magic("pipexplore") is not None


def test_load_ext_pays_the_first_explorers_imports_in_one_background_thread():
    import sys

    from IPython.core.interactiveshell import InteractiveShell

    from pipexplore import magics

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "pipexplore")
    thread = magics.warm_up_thread
    assert thread is not None and thread.daemon and thread.name == "pipexplore-warm-up"
    shell.run_line_magic("unload_ext", "pipexplore")
    shell.run_line_magic("load_ext", "pipexplore")
    assert magics.warm_up_thread is thread  # once per process
    thread.join(120)
    assert not thread.is_alive() and "pipexplore.widgets.timeline_canvas" in sys.modules


def test_async_backends_schedule_runs_stages_as_expert_backends():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    ex = explore(model, torch.randn(32, 8), devices=["cpu", "cpu"], splits=[2], chunks=4, schedule="async-backends")
    row = ex.run()
    assert row["executor"] == "backends" and row["schedule"] == "async-backends"
    batches = ex.timeline("measured")
    assert set(batches["phase"]) == {"forward", "backward"} and set(batches["stage"]) == {0, 1}
    assert batches["tasks"].sum() == 4 * 2 * 2  # 4 micro-batches × 2 stages × forward and backward
    assert (batches["batch_size"] >= 8).all() and (batches["wait"] >= 0).all()
    measured = ex.figure.scene["panels"][1]
    hover = measured["extra"]  # each block's hover says what batch it was
    assert len(hover) == measured["count"] == len(batches) and all("rows from" in h and "waited" in h for h in hover)
    # Beside it, a GPipe run of the same split.
    ex.update(schedule="gpipe")
    ex.run()
    assert ex.runs["executor"].tolist() == ["backends", "threads"]
    assert ex.runs["schedule"].tolist() == ["async-backends", "gpipe"]


def test_async_backends_refuse_skips_that_cross_stages(explorer):
    explorer.update(schedule="async-backends")
    with pytest.raises(ValueError, match=r"skip routes 'skip' \(1→7\) cross stages, "
                                         r"which expert backends cannot carry"):
        explorer.run()
    assert explorer.runs.empty


def test_stage_table_shows_predicted_peak_activations_per_stage(explorer):
    table = explorer.stage_table()
    assert table["stage"].tolist() == [0, 1, 2] and table["layers"].tolist() == ["0–1", "2–5", "6–8"]
    from pipexplore.timeline import activation_memory
    expected = activation_memory(explorer.plan.predicted).groupby("stage")["bytes"].max().tolist()
    assert table["activation_bytes"].tolist() == expected and all(v > 0 for v in expected)
    assert "peak act. (predicted)" in explorer.w_stages.value
    explorer.update(checkpoint="never")
    never = explorer.stage_table()["activation_bytes"]
    explorer.update(checkpoint="always")
    always = explorer.stage_table()["activation_bytes"]
    assert (always < never).all()  # checkpointing keeps inputs, not activations
    explorer.run()
    measured = explorer.stage_table()["measured_peak_bytes"]
    if not torch.cuda.is_available():
        assert measured.isna().all()  # the CPU reports no peak: shown as "–"


def test_runs_calibrate_later_predictions():
    from torch import nn as _nn

    model = _nn.Sequential(*[_nn.Linear(8, 8) for _ in range(6)])  # tiny: executor overhead dominates
    ex = explore(model, torch.randn(16, 8), devices=["cpu", "cpu"], splits=[3], chunks=4)
    assert ex.plan.corrections.runs == 0
    ex.run()
    assert ex.plan.corrections.runs == 1
    assert set(ex.plan.corrections.scales) >= {("threads", "forward"), ("threads", "backward")}
    uncalibrated = explore(model, torch.randn(16, 8), devices=["cpu", "cpu"], splits=[3], chunks=4, calibrate=False)
    uncalibrated.run()
    assert uncalibrated.plan.corrections.runs == 0


def _mlp(width: int = 16, depth: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])


def test_the_backward_split_is_measured_when_a_zero_bubble_plan_first_needs_it():
    # Only zero-bubble runs the backward as input- and weight-gradient passes; measuring them needs
    # torch's pipelining helpers (~1.5 s to import), so a gpipe explorer leaves them for later.
    torch.manual_seed(0)
    ex = explore(_mlp(), torch.randn(16, 16), chunks=4, devices=["cpu", "cpu"], schedule="gpipe")
    table = ex.layer_table
    assert table.attrs["backward_split"] is False
    assert table[["input_grad_ratio", "weight_grad_ratio"]].isna().all().all()
    ex.update(schedule="zero-bubble")
    measured = ex.plan.layer_table
    assert measured is ex.layer_table and measured.attrs["backward_split"] is True
    assert (measured["input_grad_ratio"] > 0).all() and (measured["weight_grad_ratio"] >= 0).all()
    for column in ("forward", "backward", "forward_a", "backward_b"):  # nothing else changes
        assert measured[column].tolist() == table[column].tolist()
    phases = set(ex.timeline("predicted")["phase"])
    assert {"input_grad", "weight_grad"} <= phases
    ex.update(schedule="1f1b")
    assert ex.plan.layer_table is measured  # measured once


@pytest.mark.parametrize("how", ["explore", "sweep"])
def test_a_zero_bubble_explorer_or_sweep_measures_the_split_before_predicting_it(how):
    torch.manual_seed(0)
    ex = explore(_mlp(), torch.randn(16, 16), chunks=4, devices=["cpu", "cpu"],
                 schedule="zero-bubble" if how == "explore" else "1f1b")
    if how == "sweep":
        assert ex.layer_table.attrs["backward_split"] is False
        ex.sweep(schedules=["1f1b", "zero-bubble"])
    assert ex.plan.layer_table.attrs["backward_split"] is True
    assert ex.plan.layer_table["input_grad_ratio"].notna().all()


def test_once_the_page_has_drawn_it_an_explorer_imports_what_a_run_needs_and_a_run_waits_for_it(monkeypatch):
    from pipexplore import background

    started, waited = threading.Event(), threading.Event()

    def imports() -> None:  # a stand-in for torch's optimizer and pipelining imports: done once waited for
        started.set()
        waited.wait(30)

    real_wait = background.wait
    monkeypatch.setattr(background, "wait", lambda *a, **k: waited.set() or real_wait(*a, **k))
    monkeypatch.setattr("pipexplore.widgets.timeline_figure.warm_up_runs", imports)
    monkeypatch.setattr(background, "_started", {})  # as in a new process
    ex = explore(_mlp(), torch.randn(8, 16), chunks=2, devices=["cpu", "cpu"])
    assert not started.is_set()  # nothing competes with putting the explorer on the screen
    waited.clear()  # (the profile waited already, for nothing)
    ex.figure._handle_custom_msg({"event": "drawn"}, [])  # what the page sends once it has drawn
    assert started.wait(5) and background.running()
    ex.run()
    assert not background.running()  # the run waited for it


def test_close_frees_the_model_and_every_widget_of_the_page():
    # ipywidgets keeps each widget until it is closed, and the page's handlers hold the state: an
    # explorer a notebook no longer uses kept its model (and runs) for the kernel's life.
    import gc
    import weakref

    import ipywidgets.widgets.widget as registry

    gc.collect()
    before = set(registry._instances)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    explorer = explore(model, torch.randn(8, 4), devices=["cpu", "cpu"], chunks=2, splits=[2])
    explorer.run()
    alive = weakref.ref(model)
    assert len(set(registry._instances) - before) > 20
    explorer.close()
    assert set(registry._instances) - before == set()
    assert len(explorer.runs) == 1 and explorer.splits == [2]  # still readable
    del explorer, model
    gc.collect()
    assert alive() is None
