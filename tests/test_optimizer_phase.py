"""The step a training loop times: from the first forward to the last optimizer update, measured and predicted."""
from __future__ import annotations

import copy
import importlib
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from pipexplore import timeline as tl
from pipexplore.predict.costs import Corrections
from pipexplore.executors.base import StageOptimizers
from pipexplore.executors.threads import ScheduleExecutor
from pipexplore.plan import Plan
from pipexplore.executors.step import run_step
from pipexplore.training import default_optimizer
from pipexplore.predict.simulator import schedule_graph, simulate

from models import plain_model
from ranks import no_pool_left_behind  # noqa: F401  (every pool gone after the module)

simulate_module = importlib.import_module("pipexplore.predict.simulator")
sharing_module = importlib.import_module("pipexplore.predict.sharing")

BACKWARD_SIDE = ("backward", "input_grad", "weight_grad")
OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def hand_table(n: int = 8, optimizer: bool = True, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"name": [str(k) for k in range(n)], "forward": 1e-3 * (0.5 + rng.random(n)),
                          "backward": 2e-3 * (0.5 + rng.random(n)), "output_bytes": 1e5 * rng.random(n),
                          "param_bytes": 1e3})
    if optimizer:
        frame["optimizer"] = 2e-4 * (0.5 + rng.random(n))
    return frame


def optimizer_events_follow_the_backward(timeline: pd.DataFrame, stages: int) -> pd.DataFrame:
    """One optimizer event per stage, after the stage's last backward-side event, and the step ends at the last."""
    steps = timeline[timeline["phase"] == "optimizer"]
    assert sorted(steps["stage"]) == list(range(stages))
    assert (steps["microbatch"] == tl.OPTIMIZER_MICROBATCH).all()
    assert (steps["end"] >= steps["start"]).all()
    for stage, row in steps.set_index("stage").iterrows():
        backward = timeline[(timeline["stage"] == stage) & timeline["phase"].isin(BACKWARD_SIDE)]
        assert len(backward) and row["start"] >= backward["end"].max() - 1e-12, stage
        assert row["device"] == backward["device"].iloc[0]
    assert timeline["end"].max() == steps["end"].max()
    assert tl.step_time(timeline) == pytest.approx(steps["end"].max() - timeline["start"].min(), abs=1e-12)
    return steps


# ---- measured ------------------------------------------------------------------------------------

@pytest.mark.parametrize("executor,schedule", [("threads", "1f1b"), ("autograd", "gpipe"), ("threads", "zero-bubble")])
def test_an_in_process_run_records_each_stages_optimizer_step_in_stage_order(executor, schedule):
    model, x = plain_model(), torch.randn(8, 6)
    plan = Plan(hand_table(), (4,), ("cpu", "cpu"), chunks=4, schedule=schedule, executor=executor,
                checkpoint="never")
    result = run_step(model, x, plan, warmup=0, repeats=1)
    steps = optimizer_events_follow_the_backward(result.timeline, 2).sort_values("stage")
    # one after the other, stage 0 first, once every worker is done
    assert steps["start"].iloc[1] >= steps["end"].iloc[0]
    compute = result.timeline[result.timeline["phase"] != "optimizer"]
    assert steps["start"].min() >= compute["end"].max()
    assert result.metrics["step_time"] == pytest.approx(tl.step_time(result.timeline))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_per_stage_optimizers_train_as_one_optimizer_over_the_model(name):
    torch.manual_seed(0)
    model, x, target = plain_model(), torch.randn(8, 6), torch.randn(8, 6)
    reference = copy.deepcopy(model)
    executor = ScheduleExecutor(copy.deepcopy(model), [3, 5], chunks=4, schedule="1f1b",
                                loss_fn=nn.functional.mse_loss)
    stages = StageOptimizers(OPTIMIZERS[name], executor.stage_parameters(), executor.stage_devices)
    assert [len(p) for p in executor.stage_parameters()] == [len(list(executor.partitions[s].parameters()))
                                                             for s in range(2)]
    one = OPTIMIZERS[name](reference.parameters())
    with tl.record() as rec:
        for _ in range(2):
            stages.zero_grad()
            executor.step(x, target)
            stages.step()
            one.zero_grad()
            nn.functional.mse_loss(reference(x), target).backward()
            one.step()
    trained = [p for partition in executor.partitions for p in partition.parameters()]
    for mine, theirs in zip(trained, reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert (rec.timeline["phase"] == "optimizer").sum() == 2 * 2  # a stage's step per training step


def one_optimizer_losses(model: nn.Module, x: torch.Tensor, target: torch.Tensor, optimizer, steps: int = 3) -> list:
    """The losses of ``steps`` plain steps of a copy of ``model`` with one optimizer over all its
    parameters (each loss before its update)."""
    reference = copy.deepcopy(model)
    one = optimizer(reference.parameters())
    losses = []
    for _ in range(steps):
        one.zero_grad()
        loss = nn.functional.mse_loss(reference(x), target)
        losses.append(loss.item())
        loss.backward()
        one.step()
    return losses


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("executor,schedule", [("threads", "1f1b"), ("autograd", "gpipe")])
def test_measured_losses_after_two_updates_equal_a_plain_model_with_one_optimizer(name, executor, schedule):
    torch.manual_seed(0)
    model, x, target = plain_model(), torch.randn(8, 6), torch.randn(8, 6)
    plan = Plan(hand_table(), (4,), ("cpu", "cpu"), chunks=4, schedule=schedule, executor=executor)
    result = run_step(model, x, plan, target=target, loss_fn=nn.functional.mse_loss, optimizer=OPTIMIZERS[name],
                      warmup=1, repeats=2)
    losses = one_optimizer_losses(model, x, target, OPTIMIZERS[name])
    assert result.loss == pytest.approx(losses[0], rel=1e-5)
    assert result.measured_losses == pytest.approx(losses[1:], rel=1e-5)  # after one and after two updates


def test_a_stage_without_parameters_still_records_its_empty_optimizer_step():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Tanh())
    executor = ScheduleExecutor(model, [1, 2], chunks=2, schedule="1f1b")
    stages = StageOptimizers(default_optimizer, executor.stage_parameters(), executor.stage_devices)
    assert stages.optimizers[1] is None
    with tl.record() as rec:
        stages.zero_grad()
        executor.step(torch.randn(4, 4))
        stages.step()
    optimizer_events_follow_the_backward(rec.timeline, 2)


@pytest.mark.slow
def test_a_processes_run_records_each_ranks_optimizer_step_and_trains_as_one_optimizer():
    from pipexplore.executors.distributed import shutdown_pool

    torch.manual_seed(0)
    model, x, target = plain_model(), torch.randn(8, 6), torch.randn(8, 6)
    plan = Plan(hand_table(), (4,), ("cpu", "cpu"), chunks=4, schedule="1f1b", executor="processes")
    try:
        result = run_step(model, x, plan, target=target, loss_fn=nn.functional.mse_loss,
                          optimizer=OPTIMIZERS["sgd-momentum"], warmup=1, repeats=2)
    finally:
        shutdown_pool(keep_server=True)
    timeline = result.timeline
    optimizer_events_follow_the_backward(timeline, 2)
    assert (timeline[timeline["phase"] != "optimizer"].groupby("phase").size() == 4 * 2).all()
    losses = one_optimizer_losses(model, x, target, OPTIMIZERS["sgd-momentum"])
    assert result.loss == pytest.approx(losses[0], rel=1e-5)
    assert result.measured_losses == pytest.approx(losses[1:], rel=1e-5)


# ---- predicted -----------------------------------------------------------------------------------

GPUS = ["cuda:0", "cuda:1"]


@pytest.mark.parametrize("executor,schedule", [("autograd", "gpipe"), ("threads", "1f1b"), ("threads", "zero-bubble"),
                                               ("processes", "1f1b"), ("processes", "gpipe")])
def test_the_prediction_ends_with_each_stages_optimizer_step_costed_from_the_table(executor, schedule):
    table = hand_table()
    predicted = simulate(table, [3], chunks=4, schedule=schedule, executor=executor, devices=GPUS, checkpoint="never",
                         batch=8)
    steps = optimizer_events_follow_the_backward(predicted, 2).set_index("stage")
    for stage, (a, b) in enumerate([(0, 3), (3, 8)]):
        assert steps.loc[stage, "end"] - steps.loc[stage, "start"] == pytest.approx(table["optimizer"][a:b].sum())
    if executor == "processes":  # each rank steps its own once its schedule is done
        assert set(steps["lane"]) == {0, 1}
    else:  # the caller's thread steps them one after another, in stage order
        assert steps["lane"].nunique() == 1 and steps.loc[1, "start"] >= steps.loc[0, "end"]
    assert (predicted.loc[predicted["phase"] == "optimizer", "memory"] >= 0).all()


@pytest.mark.parametrize("executor,schedule,devices", [
    ("autograd", "gpipe", ["cpu", "cpu"]), ("threads", "1f1b", GPUS), ("processes", "1f1b", ["cpu", "cpu"]),
    ("threads", "interleaved", GPUS)])
def test_without_the_column_the_prediction_is_as_before(executor, schedule, devices):
    table = hand_table()
    splits = [2, 4, 6] if schedule == "interleaved" else [3]
    options = dict(chunks=4, schedule=schedule, executor=executor, devices=devices, batch=8)
    without = simulate(table.drop(columns="optimizer"), splits, **options)
    assert "optimizer" not in set(without["phase"])
    graph = schedule_graph(schedule, len(splits) + 1, 4, executor=executor, checkpointed=3,
                           resources=("host",) * 2 if executor == "autograd" else None)
    assert len(without) - (without["phase"] == "copy").sum() == len(graph)  # the graph without optimizer steps
    # With the column, the same actions at the same times (the optimizer steps come after them all) …
    with_steps = simulate(table, splits, **options)
    rest = with_steps[with_steps["phase"] != "optimizer"].reset_index(drop=True)
    keys = ["stage", "phase", "microbatch", "start"]
    a, b = rest.sort_values(keys).reset_index(drop=True), without.sort_values(keys).reset_index(drop=True)
    assert (a[["stage", "phase", "microbatch", "device"]].to_numpy() == b[["stage", "phase", "microbatch",
                                                                           "device"]].to_numpy()).all()
    np.testing.assert_allclose(a[["start", "end", "memory"]], b[["start", "end", "memory"]], rtol=1e-12, atol=1e-15)
    # … and a step that ends later by the optimizer steps
    assert tl.step_time(with_steps) > tl.step_time(without)
    # a column of zeros: optimizer steps that take no time
    zero = simulate(table.assign(optimizer=0.0), splits, **options)
    assert tl.step_time(zero) == pytest.approx(tl.step_time(without))


def test_corrections_scale_the_optimizer_step_and_a_run_teaches_them():
    table = hand_table()
    options = dict(chunks=4, schedule="1f1b", executor="threads", devices=GPUS, batch=8)
    predicted = simulate(table, [3], **options)
    # a run whose stage 1 updated three times as slowly as predicted
    measured = predicted.copy()
    slow = (measured["phase"] == "optimizer") & (measured["stage"] == 1)
    span = measured.loc[slow, "end"] - measured.loc[slow, "start"]
    measured.loc[slow, "end"] = measured.loc[slow, "start"] + 3 * span
    learnt = Corrections().learn(table, [3], "threads", predicted, measured)
    factor = learnt.scale("threads", "optimizer")
    np.testing.assert_allclose(factor, [1.0] * 3 + [3.0] * 5)
    again = simulate(table, [3], corrections=learnt, **options)
    steps = again[again["phase"] == "optimizer"].set_index("stage")
    assert steps.loc[1, "end"] - steps.loc[1, "start"] == pytest.approx(3 * table["optimizer"][3:].sum())
    assert steps.loc[0, "end"] - steps.loc[0, "start"] == pytest.approx(table["optimizer"][:3].sum())


def test_the_optimizer_step_is_work_of_its_stage_in_the_metrics():
    table = hand_table()
    options = dict(chunks=4, schedule="1f1b", executor="processes", devices=GPUS, batch=8, checkpoint="never")
    with_steps, without = simulate(table, [3], **options), simulate(table.drop(columns="optimizer"), [3], **options)
    busy = {s: tl.busy_time(with_steps, s) - tl.busy_time(without, s) for s in (0, 1)}
    assert busy[0] == pytest.approx(table["optimizer"][:3].sum()) and busy[1] == pytest.approx(
        table["optimizer"][3:].sum())
    trace = tl.to_chrome_trace(with_steps)
    names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "optimizer"}
    assert names == {"optimizer"}


@pytest.mark.parametrize("schedule,executor,devices", [
    ("gpipe", "autograd", ["cpu"] * 4), ("1f1b", "threads", ["cpu"] * 4), ("zero-bubble", "processes", ["cpu"] * 4),
    ("interleaved", "threads", ["cpu", "cpu"]), ("1f1b", "threads", ["cpu", "cuda:0", "cuda:0", "cuda:1"])])
def test_the_compiled_loops_time_optimizer_steps_as_the_python_ones_do_bit_for_bit(monkeypatch, schedule, executor,
                                                                                  devices):
    assert simulate_module._sharing is not None
    table = hand_table(12).assign(share_forward=0.6, share_backward=0.6)
    real = sharing_module.processor_sharing
    calls = []
    monkeypatch.setattr(simulate_module, "processor_sharing", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(simulate_module, "_longest_path", lambda *a, **k: None)
    simulate(table, [3, 6, 9], chunks=4, schedule=schedule, executor=executor, devices=devices, batch=8)
    graph, costs, gap, resource = calls[0]
    assert (graph.kind == 5).sum() == 4  # an optimizer step per stage
    c, py = real(graph, costs, gap, resource, compiled=True), real(graph, costs, gap, resource, compiled=False)
    for x, y in zip(c, py, strict=True):
        assert np.array_equal(x, y)
    seconds, first_wait, second_wait = costs.seconds, costs.first_wait, costs.second_wait
    compiled = graph.times(seconds, first_wait, second_wait, 0.01)
    passes = graph.times(seconds, first_wait, second_wait, 0.01, compiled=False)
    for x, y in zip(compiled, passes, strict=True):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("case", ["1f1b threads, crowded host", "gpipe autograd", "processes on GPUs"])
def test_the_page_retimes_a_drag_with_optimizer_steps_as_simulate_does(case, tmp_path):
    import base64

    from test_retime import run_page, table as retime_table

    from pipexplore.predict.retime import retime_model
    from pipexplore.widgets.timeline_figure import PHASES
    from pipexplore.widgets.timeline_canvas import block_panel, lane_of, retime_panel

    options = {"1f1b threads, crowded host": dict(chunks=6, schedule="1f1b", devices=["cpu"] * 3, executor="threads"),
               "gpipe autograd": dict(chunks=4, schedule="gpipe", devices=["cpu"] * 3),
               "processes on GPUs": dict(chunks=4, schedule="1f1b", devices=["cuda:0", "cuda:1", "cuda:2"],
                                         executor="processes", corrections=Corrections(
                                             scales={("processes", "optimizer"): np.linspace(0.5, 2.0, 12)}))}[case]
    frame = retime_table(12, seed=3)
    frame["optimizer"] = 3e-4 * (0.5 + np.random.default_rng(3).random(12))
    model = retime_model(frame, [4, 8], samples=30, **options)
    assert model["optimizer"]
    panel = retime_panel(lane_of(simulate(frame, [4, 8], **options))[0], PHASES, model)
    afters = [[3, 9], [1, 2]]
    for splits, page in zip(afters, run_page(model, panel, afters, tmp_path), strict=True):
        assert "error" not in page, page
        predicted = simulate(frame, splits, **options)
        kernel = block_panel(predicted, PHASES)
        assert page["offsets"] == kernel["offsets"]
        for key, dtype in (("phase", np.uint8), ("micro", np.int32)):
            assert np.array_equal(np.frombuffer(base64.b64decode(page[key]), dtype),
                                  np.frombuffer(kernel[key], dtype)), (splits, key)
        for key in ("start", "end"):
            np.testing.assert_allclose(np.frombuffer(base64.b64decode(page[key]), np.float32),
                                       np.frombuffer(kernel[key], np.float32), rtol=1e-6, atol=1e-6)
        assert page["step"] == pytest.approx(tl.step_time(predicted) * 1e3, rel=1e-9)
        assert page["bubble"] == pytest.approx(tl.bubble_fraction(predicted), abs=1e-9)


# ---- profiled ------------------------------------------------------------------------------------

def test_profile_times_each_layers_optimizer_step_without_changing_the_model():
    from pipexplore import profile

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 32), nn.Linear(32, 4))
    before = [p.detach().clone() for p in model.parameters()]
    table = profile(model, torch.randn(8, 16), repeats=1, max_repeats=1, calibrate=False,
                    optimizer=OPTIMIZERS["adam"])
    seconds = table["optimizer"].to_numpy()
    assert all(math.isfinite(s) for s in seconds)
    assert seconds[0] > 0 and seconds[2] > 0 and seconds[3] > 0 and seconds[1] == 0.0  # ReLU has no parameters
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q) and p.grad is None
    default = profile(model, torch.randn(8, 16), repeats=1, max_repeats=1, calibrate=False)  # SGD, as runs make it
    assert (default["optimizer"].to_numpy()[[0, 2, 3]] > 0).all()
    predicted = simulate(table, [2], chunks=2)
    assert (predicted["phase"] == "optimizer").sum() == 2


def test_traced_candidates_time_each_candidates_optimizer_step():
    from pipexplore.models.trace import candidates_in_rows

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)

        def forward(self, x):
            return self.c(self.b(self.a(x)) + x)

    table = candidates_in_rows(Model(), torch.randn(8, 8), chunks=2, repeats=1)
    seconds = table.set_index("name")["optimizer"]
    assert seconds["a"] > 0 and seconds["c"] > 0 and seconds["b"] == 0.0
    assert np.isfinite(seconds).all()
