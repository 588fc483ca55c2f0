"""The cost model: costs in the micro-batch size, shared hosts, learning from runs, trustworthy profiles."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from pipexplore import profile, simulate
from pipexplore.costs import Corrections, dispatch_gap, handoff_gaps, lanes_of, layer_seconds, microbatch_rows
from pipexplore.examples import RowCostLayer, SleepLayer
from pipexplore.timeline import step_time
from pipexplore.widgets.explorer import explore

#: How late a sleep can wake on a busy machine (it never wakes early): what sleep-timed costs may
#: carry beyond the slept time.
SLEEP_LATENESS = 1.5e-3


def test_microbatch_rows_follow_torch_chunk():
    for batch in (1, 5, 6, 16, 17):
        for chunks in (1, 2, 4, 8):
            expected = [len(c) for c in torch.arange(batch).chunk(chunks)]
            assert microbatch_rows(batch, chunks) == expected


def test_fixed_cost_layers_predict_the_same_time_at_every_micro_batch_size():
    model = nn.Sequential(*[SleepLayer(0.004, 0.002, 0.002) for _ in range(2)])
    table = profile(model, torch.randn(64, 4), microbatch_rows=[8, 64], repeats=3)
    small, large = layer_seconds(table, 8, "forward"), layer_seconds(table, 64, "forward")
    # The same 4 ms at both sizes, within a sleep's lateness.
    assert (np.abs(small - large) < SLEEP_LATENESS).all(), (small, large)
    assert (np.minimum(small, large) >= 0.95 * 0.004).all(), (small, large)
    assert (table["forward_a"] > 0.003).all()  # the cost is per call, not per row
    # The old way (whole batch ÷ chunks) would predict an eighth of it.
    assert (small > 0.5 * 0.004).all()


def test_a_line_in_the_rows_holds_at_an_unprofiled_size():
    per_call, per_row = np.array([0.002, 0.001]), np.array([0.0002, 0.0001])
    model = nn.Sequential(*[RowCostLayer(a, b) for a, b in zip(per_call, per_row)])
    table = profile(model, torch.randn(64, 4), microbatch_rows=[8, 32], repeats=5, calibrate=False)
    # A sleep's lateness is about the same at both sizes: it lands in the line's intercept and
    # leaves the slope.
    for phase, times in (("forward", 1), ("backward", 2)):
        a, b = table[f"{phase}_a"].to_numpy(), table[f"{phase}_b"].to_numpy()
        assert np.allclose(b, times * per_row, rtol=0.25), (phase, b)
        assert (a >= 0.95 * times * per_call).all() and (a <= times * per_call + SLEEP_LATENESS).all(), (phase, a)
        # Never profiled at these sizes; at 2 rows a cost proportional to the rows, from the nearest
        # profiled size, would be 0.45 and 0.9 ms for the second layer's 1.2 and 2.4 ms.
        for rows in (2, 64):
            line = times * (per_call + per_row * rows)
            seconds = layer_seconds(table, rows, phase)
            assert np.allclose(seconds, a + b * rows) and (seconds >= 0.95 * line).all(), (phase, rows)


def test_profile_warms_up_so_identical_layers_cost_alike_and_balance_evenly():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)])
    table = profile(model, torch.randn(64, 256), microbatch_rows=[16, 64], repeats=5)
    total = table["forward"] + table["backward"]
    assert (total / total.median()).between(0.8, 1.2).all(), total.tolist()
    assert "spread" in table and (table["spread"] >= 0).all()
    ex = explore(model, torch.randn(64, 256), layer_table=table, devices=["cpu", "cpu"], chunks=4)
    assert ex.balance("time") == [4]


def test_a_models_repeated_blocks_are_timed_together_and_their_ratios_measured_once(monkeypatch):
    """Layers that do the same work (type, settings, shapes, input) pool their timings and share
    one measurement of their ratios (slowdown beside a twin, I/W split); any difference in what
    they compute makes another kind."""
    import importlib

    profiling = importlib.import_module("pipexplore.profile")
    measured = []
    real = profiling._contended_slowdown
    monkeypatch.setattr(profiling, "_contended_slowdown", lambda layer, *a: measured.append(layer) or real(layer, *a))
    model = nn.Sequential(SleepLayer(0.001, 0.001, 0.001), SleepLayer(0.001, 0.001, 0.001),
                          SleepLayer(0.002, 0.001, 0.001),  # another sleep: other work
                          nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 16, bias=False))
    table = profile(model, torch.randn(4, 8), microbatch_rows=[2, 4])
    assert [model[k] for k in (0, 2, 3, 5, 6)] == measured  # the first of each kind, once
    for column in ("forward", "backward", "input_grad_ratio", "weight_grad_ratio", "spread"):
        values = table[column].tolist()
        assert values[1] == values[0] and values[4] == values[3], column
    assert len(set(table["forward"].iloc[3:])) == 3  # Linear 8→8 (twice), 8→16, 16→16: three kinds
    assert table["forward"].iloc[2] == pytest.approx(2 * table["forward"].iloc[0], rel=0.25)  # their own sleeps
    each = profile(model, torch.randn(4, 8), microbatch_rows=[2, 4], same_work_once=False)
    assert each["forward"].iloc[1] != each["forward"].iloc[0]  # every layer timed on its own


def _counting_calls(monkeypatch) -> dict:
    import importlib

    profiling = importlib.import_module("pipexplore.profile")
    calls: dict[str, int] = {}
    real_call = profiling._LayerRun.call

    def counted(run, timed):
        calls[run.name] = calls.get(run.name, 0) + timed
        return real_call(run, timed)

    monkeypatch.setattr(profiling._LayerRun, "call", counted)
    return calls


def test_profile_rounds_stop_for_layers_whose_times_agree(monkeypatch):
    import importlib

    profiling = importlib.import_module("pipexplore.profile")
    calls = _counting_calls(monkeypatch)
    # Layer "1" never agrees with itself; the others do at once.
    monkeypatch.setattr(profiling._Kind, "spread", property(lambda kind: 1.0 if kind.runs[0].name == "1" else 0.0))
    profile(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5), nn.Linear(5, 4)), torch.randn(4, 4), repeats=3,
            max_repeats=9, calibrate=False)
    assert calls == {"0": 3, "1": 9, "2": 3}


def test_pooled_timings_of_repeated_blocks_settle_in_fewer_rounds(monkeypatch):
    import importlib

    profiling = importlib.import_module("pipexplore.profile")
    # One call's times spread by 10 %: too much for one layer (5 %), enough for 16 pooled (10 % / 4).
    monkeypatch.setattr(profiling, "_spread", lambda times: 0.10 if len(times) >= 3 else 0.0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(16)])
    calls = _counting_calls(monkeypatch)
    profile(model, torch.randn(4, 4), repeats=3, max_repeats=9, calibrate=False)
    assert set(calls.values()) == {3}
    calls.clear()
    profile(model, torch.randn(4, 4), repeats=3, max_repeats=9, calibrate=False, same_work_once=False)
    assert set(calls.values()) == {9}


def test_sleeping_stages_overlap_and_compute_bound_stages_contend():
    sleepy = profile(nn.Sequential(*[SleepLayer(0.003, 0.001, 0.001) for _ in range(4)]), torch.randn(16, 4),
                     microbatch_rows=[4, 16])
    assert (sleepy["share_forward"] < 0.25).all()  # the host stays free
    options = dict(chunks=4, schedule="gpipe", checkpoint="never", executor="threads", devices=["cpu", "cpu"])
    one_stage = step_time(simulate(sleepy, [], **{**options, "devices": ["cpu"]}))
    two_stages = step_time(simulate(sleepy, [2], **options))
    assert two_stages < 0.75 * one_stage  # overlapped: (m + p - 1) / (m · p) of the serial step
    # Layers that keep every core busy: the same split is predicted no faster than one stage.
    table = sleepy.copy()
    table["share_forward"] = table["share_backward"] = 1.0
    contended = step_time(simulate(table, [2], **options))
    assert contended == pytest.approx(step_time(simulate(table, [], **{**options, "devices": ["cpu"]})), rel=0.01)


def _sleepy_model() -> nn.Sequential:
    # Unbalanced on purpose: the last layers cost three times the first ones.
    costs = [0.001, 0.001, 0.001, 0.001, 0.003, 0.003]
    return nn.Sequential(*[SleepLayer(c, c / 2, c / 2) for c in costs])


def test_two_splits_on_cpu_predict_different_steps_in_the_order_measured():
    model = _sleepy_model()
    ex = explore(model, torch.randn(16, 4), devices=["cpu", "cpu"], chunks=4, splits=[2], calibrate=False)
    first = ex.run()
    ex.splits = [4]
    second = ex.run()
    assert first["predicted_step_time"] != pytest.approx(second["predicted_step_time"], rel=0.05)
    assert (first["predicted_step_time"] < second["predicted_step_time"]) == (first["step_time"] < second["step_time"])


@pytest.mark.parametrize("schedule,splits,executor", [("1f1b", [4], "threads"), ("gpipe", [4], "autograd"),
                                                      ("interleaved", [1, 3, 4], "threads")])
def test_after_one_run_the_same_plan_is_predicted_within_5_percent(schedule, splits, executor):
    # Interleaved: each worker runs two stages; autograd: one engine thread runs every backward.
    ex = explore(_sleepy_model(), torch.randn(16, 4), devices=["cpu", "cpu"], chunks=4, splits=splits,
                 schedule=schedule, executor=executor)
    first = ex.run()
    again = ex.plan.predicted
    assert step_time(again) == pytest.approx(first["step_time"], rel=0.05)
    assert ex.plan.corrections.runs == 1


def test_a_correction_learnt_on_one_split_improves_another_split():
    model = _sleepy_model()
    sample = torch.randn(16, 4)
    table = profile(model, sample, microbatch_rows=[4, 16])
    stale = table.copy()  # a profile that is 40 % too low everywhere (e.g. taken on a faster machine)
    for column in ("forward", "backward", "forward_a", "forward_b", "backward_a", "backward_b"):
        stale[column] = stale[column] * 0.6
    stale.attrs.update(table.attrs)
    uncorrected = explore(model, sample, layer_table=stale, devices=["cpu", "cpu"], chunks=4, splits=[2],
                          calibrate=False)
    corrected = explore(model, sample, layer_table=stale, devices=["cpu", "cpu"], chunks=4, splits=[2])
    corrected.run()  # learns on split [2]
    for ex in (uncorrected, corrected):
        ex.splits = [3]
    baseline = uncorrected.run()
    improved = corrected.run()
    assert abs(improved["prediction_error"]) < abs(baseline["prediction_error"])
    assert abs(improved["prediction_error"]) < 0.15


def test_corrections_rescale_each_stage_and_phase_and_measure_the_dispatch_gap():
    table = pd.DataFrame({"forward": [1.0] * 4, "backward": [2.0] * 4, "output_bytes": [0.0] * 4})
    predicted = simulate(table, [2], chunks=2, schedule="gpipe", checkpoint="never", executor="threads",
                         cpu_stages_overlap=True)
    measured = predicted.copy()
    slow = (measured["stage"] == 1) & (measured["phase"] == "forward")
    measured.loc[slow, "end"] = (measured.loc[slow, "start"]
                                 + 2 * (measured.loc[slow, "end"] - measured.loc[slow, "start"]))
    learnt = Corrections().learn(table, [2], "threads", predicted, measured)
    assert learnt.scale("threads", "forward").tolist() == pytest.approx([1, 1, 2, 2])
    assert learnt.scale("threads", "backward").tolist() == pytest.approx([1, 1, 1, 1])
    # A worker that idles 0.1 s before each action whose inputs are there: the executor's own cost.
    lagging = predicted.copy()
    lagging.loc[lagging["stage"] == 0, ["start", "end"]] += 0.0
    shifted = lagging.sort_values("start").copy()
    assert dispatch_gap(shifted) == pytest.approx(0.0, abs=1e-9)


def test_sweep_ranks_every_combination_and_a_row_applies():
    ex = explore(_sleepy_model(), torch.randn(16, 4), devices=["cpu", "cpu"], chunks=4, calibrate=False)
    table = ex.sweep(stages=[1, 2, 3], chunks=[2, 4], schedules=["gpipe", "1f1b", "zero-bubble"],
                     checkpoint=["never", "always"])
    assert len(table) == 3 * 2 * 3 * 2
    assert table["predicted_step_time"].is_monotonic_increasing
    assert table["rank"].tolist() == list(range(1, len(table) + 1))
    assert all(len(peaks) == n for peaks, n in zip(table["peak_memory_per_stage"], table["stages"]))
    # Fixed-cost layers: fewer, larger micro-batches and more stages win.
    best = table.iloc[0]
    assert best["stages"] == 3 and best["chunks"] == 2
    plan = ex.apply(best)
    assert list(plan.splits) == list(best["splits"]) and plan.chunks == 2 and plan.schedule == best["schedule"]
    assert step_time(plan.predicted) == pytest.approx(best["predicted_step_time"])


def test_sweep_measures_the_top_rows_and_keeps_the_plan():
    ex = explore(_sleepy_model(), torch.randn(16, 4), devices=["cpu", "cpu"], chunks=4, splits=[3])
    before = ex.plan
    table = ex.sweep(stages=[2, 3], chunks=[2, 4], measure=2)
    assert table["measured_step_time"].head(2).notna().all() and table["measured_step_time"].iloc[2:].isna().all()
    assert len(ex.runs) == 2
    assert ex.plan == before


def test_residuals_pair_every_measured_action_with_its_prediction():
    ex = explore(_sleepy_model(), torch.randn(16, 4), devices=["cpu", "cpu"], chunks=4, splits=[3],
                 schedule="1f1b", checkpoint="never")
    with pytest.raises(LookupError, match="no run yet"):
        ex.residuals()
    ex.run()
    table = ex.residuals()
    assert len(table) == 2 * 4 * 2  # stages × micro-batches × (forward, backward)
    assert set(table["phase"]) == {"forward", "backward"}
    assert (table["measured_seconds"] > 0).all()
    assert table["error"].abs().median() < 0.5  # sleeps of known length: the spans agree


@pytest.mark.parametrize("schedule,checkpoint", [("gpipe", "never"), ("1f1b", "never"), ("1f1b", "except_last"),
                                                 ("gpipe", "always")])
def test_predicted_activation_memory_matches_what_autograd_saves_in_the_run(schedule, checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)])
    ex = explore(model, torch.randn(32, 64), devices=["cpu", "cpu"], chunks=4, splits=[3], schedule=schedule,
                 checkpoint=checkpoint, calibrate=False)
    ex.run()
    predicted = ex.timeline("predicted").groupby("stage")["memory"].max()
    measured = ex.timeline("measured").groupby("stage")["memory"].max()
    # The measured side also holds the loss's saved tensors on the last stage (not profiled): within 20 %.
    assert np.allclose(measured.to_numpy(), predicted.to_numpy(), rtol=0.2), (predicted.tolist(), measured.tolist())
    assert (ex.timeline("measured").groupby("stage")["memory"].last() == 0).all()  # all freed by the step's end


def test_hand_offs_are_read_per_worker_as_the_prediction_runs_them():
    # A step whose workers each spend 0.1 s before every action, and hand tensors over at no cost.
    table = pd.DataFrame({"forward": [1.0] * 4, "backward": [2.0] * 4, "output_bytes": [0.0] * 4})
    truth = Corrections(gaps={"autograd": 0.1})
    step = simulate(table, [2], chunks=4, schedule="gpipe", checkpoint="never", executor="autograd",
                    devices=["cpu", "cpu"], cpu_stages_overlap=True, corrections=truth)
    # autograd's engine thread runs the backward of both stages: one worker, read as one.
    assert step.loc[step["phase"] == "backward", "lane"].nunique() == 1
    dispatch, transfer = handoff_gaps(step, lanes_of(step))
    assert dispatch == pytest.approx(0.1) and transfer == pytest.approx(0.0, abs=1e-9)
    # Read stage by stage, the engine's own pause would pass for a hand-over between stages.
    _, per_stage_transfer = handoff_gaps(step.drop(columns="lane"))
    assert per_stage_transfer == pytest.approx(0.05)


def test_zero_bubble_first_stage_runs_its_whole_backward_in_i_and_teaches_the_other_schedules():
    model = _sleepy_model()
    ex = explore(model, torch.randn(16, 4), devices=["cpu", "cpu"], chunks=4, splits=[3], schedule="zero-bubble")
    predicted = ex.plan.predicted
    spans = predicted.assign(seconds=predicted["end"] - predicted["start"]).groupby(["stage", "phase"])["seconds"]
    whole = simulate(ex.layer_table, [3], chunks=4, schedule="1f1b", checkpoint=ex.plan.checkpoint,
                     devices=["cpu", "cpu"], executor="threads", corrections=ex.plan.corrections)
    whole_spans = whole.assign(seconds=whole["end"] - whole["start"]).groupby(["stage", "phase"])["seconds"]
    # The user's data needs no gradient: stage 0's I is its whole backward, its W (almost) nothing.
    assert spans.median()[(0, "input_grad")] == pytest.approx(whole_spans.median()[(0, "backward")], rel=0.05)
    assert spans.median()[(0, "weight_grad")] < 0.1 * spans.median()[(1, "weight_grad")]
    ex.run()  # learns I and W (stage 0: B)
    ex.update(schedule="1f1b")
    switched = ex.run()
    assert abs(switched["prediction_error"]) < 0.10


def test_profile_waits_for_the_extensions_background_imports_before_timing():
    # %load_ext pipexplore and a built explorer import in background threads; a layer timed beside
    # them would hold their share of the interpreter, so the profile starts timing once they are done.
    import threading
    import time

    from pipexplore import background

    finished = threading.Event()

    def imports() -> None:
        time.sleep(1.5)  # longer than this profile takes
        finished.set()

    background.start(imports, f"test-imports-{id(finished)}")
    seen = []
    profile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(8, 4),
            progress=lambda done, total: seen.append(finished.is_set()))
    assert seen and all(seen)
    assert background.start(imports, f"test-imports-{id(finished)}") is not None  # once per name
    assert not background.running()


class _HoldsTheInterpreter(nn.Module):
    """A forward of pure Python (~70 ms of work, many times the interpreter's switch interval):
    two threads running it take turns inside each call (the GIL)."""

    def forward(self, x):
        total = 0
        for k in range(1_500_000):
            total += k
        return x * 1.0


def test_the_twin_test_sees_layers_that_take_turns_and_layers_that_leave_the_host_free():
    import importlib

    profiling = importlib.import_module("pipexplore.profile")
    x = torch.randn(4, 4, requires_grad=True)
    turns, _ = profiling._contended_slowdown(_HoldsTheInterpreter(), x, {}, torch.device("cpu"), 3, 0.15)
    free, _ = profiling._contended_slowdown(SleepLayer(0.002, 0.001, 0.001), x, {}, torch.device("cpu"), 3, 0.004)
    # ~2 (1.4–2.2 seen on 2 cores, also under load): one runs while the other waits; ~1: both sleep at once
    assert turns > 1.3 and free < 1.2, (turns, free)


class _CheaperWithoutAutograd(nn.Module):
    """Sleeps 4 ms in a forward with autograd, 2 ms without (a checkpointed micro-batch's)."""

    def forward(self, x):
        import time

        time.sleep(0.004 if torch.is_grad_enabled() else 0.002)
        return x * 1.0


def test_a_checkpointed_forward_is_profiled_and_predicted_at_its_own_cost():
    table = profile(nn.Sequential(_CheaperWithoutAutograd(), _CheaperWithoutAutograd()), torch.randn(8, 4),
                    microbatch_rows=[2, 8], calibrate=False)
    assert table["checkpointed_ratio"].tolist() == pytest.approx([0.5, 0.5], rel=0.3)
    table["checkpointed_ratio"] = 0.5  # what the forward without autograd costs, exactly
    options = dict(chunks=4, schedule="gpipe", executor="threads", devices=["cuda:0", "cuda:1"])
    for checkpoint, stop in (("always", 4), ("except_last", 3), ("never", 0)):
        frame = simulate(table, [1], checkpoint=checkpoint, **options)
        forwards = frame[frame["phase"] == "forward"].sort_values(["stage", "microbatch"])
        spans = (forwards["end"] - forwards["start"]).to_numpy().reshape(2, 4)
        full = layer_seconds(table, 2, "forward")  # each stage holds one layer; micro-batches of 2 rows
        expected = np.array([[full[s] * (0.5 if i < stop else 1.0) for i in range(4)] for s in range(2)])
        np.testing.assert_allclose(spans, expected, rtol=1e-9)
        recomputes = frame[frame["phase"] == "recompute"]
        np.testing.assert_allclose(recomputes["end"] - recomputes["start"], full[recomputes["stage"]], rtol=1e-9)


def test_each_phase_holds_the_executors_own_cost_as_probed_for_it():
    from pipexplore.executors.probe import probe
    from pipexplore.plan import Plan

    table = pd.DataFrame({"name": ["a", "b"], "forward": [2e-3, 2e-3], "backward": [4e-3, 4e-3],
                          "output_bytes": 0.0, "param_bytes": 8.0})
    plan = Plan(table, splits=(1,), devices=("cpu", "cpu"), chunks=4, checkpoint="except_last", schedule="gpipe",
                executor="threads", batch=4)
    overhead, gap, _ = probe(plan)
    assert {"forward", "backward", "recompute", "all"} <= set(overhead) and gap >= 0
    assert all(seconds > 0 for seconds in overhead.values()), overhead

    learnt = Corrections().with_executor_costs("threads", {"forward": 1e-3, "backward": 3e-3, "all": 2e-3}, 0.0)
    options = dict(chunks=4, executor="threads", devices=["cuda:0", "cuda:1"], checkpoint="never", batch=4)
    frame = simulate(table, [1], schedule="gpipe", corrections=learnt, **options)
    spans = frame.assign(span=frame["end"] - frame["start"]).groupby("phase")["span"]
    assert spans.min()["forward"] == pytest.approx(2e-3 / 4 + 1e-3) and spans.max()["forward"] == pytest.approx(
        2e-3 / 4 + 1e-3)
    assert spans.min()["backward"] == pytest.approx(4e-3 / 4 + 3e-3)
    # Zero-bubble: I and W, which the probe did not run here, cost the median of what it did; the
    # first stage's W does nothing (its I ran the whole backward) and costs nothing.
    frame = simulate(table.assign(input_grad_ratio=0.5, weight_grad_ratio=0.5), [1], schedule="zero-bubble",
                     corrections=learnt, **options)
    w = frame[frame["phase"] == "weight_grad"]
    assert ((w["end"] - w["start"])[w["stage"] == 0] == 0).all()
    assert (w["end"] - w["start"])[w["stage"] == 1].to_numpy() == pytest.approx(4e-3 / 4 * 0.5 + 2e-3)
