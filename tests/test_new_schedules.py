"""Looped BFS, interleaved zero-bubble, ZB-V and DualPipeV everywhere (issue 25, item 2): simulated
with the published bubbles and memory, re-timed by the page, run by threads and by processes.

Uniform layers, each stage's forward ``F``, input-gradient ``I`` and weight-gradient ``W`` per
micro-batch (``B = I + W``, the full backward). Bubbles are a rank's idle time in a step. The
published ones (DeepSeek's DualPipe table, PP = stages): 1F1B ``(PP−1)(F+B)``, ZB1P
``(PP−1)(F+B−2W)``, DualPipeV ``(PP/2−1)(F&B+B−3W)`` with ``F&B`` an overlapped forward and
backward pair. We run DualPipeV's pairs one after the other (as torch does without a custom
overlap function), so what our simulator gives is derived and tested instead: where ``I = F ≥ W``
(``F = I = W`` among them) each rank idles ``(ranks − 1)(F + I − W)``, which is the published
formula with ``F&B`` costing ``B`` alone, below the published formula with ``F&B = F + B`` (no
overlap) by ``(ranks − 1)·F``: run as a dataflow, a pair's forward feeds the next rank as soon as
it is done, without waiting for the pair's backward. The published formula with ``F&B = F + B``
bounds ours from above for any F, I, W (tested on a grid).
"""
from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from models import SleepFIW, plain_model
from pipexplore import timeline as tl
from pipexplore.export import plan_code
from pipexplore.plan import PLAN_SCHEDULES, Plan
from pipexplore.predict.simulator import simulate
from pipexplore.schedules import MULTI_STAGE, stage_ranks
from pipexplore.executors.threads import ScheduleExecutor

from ranks import no_pool_left_behind  # noqa: F401  (every pool of rank processes gone after the module)
from ranks import assert_equals_unsplit, plan_for, torchrun_first_loss

NEW = ("looped-bfs", "interleaved-zero-bubble", "zbv", "dualpipev")


def _predict(schedule, ranks, m, F, I, W, v=None, saved=0.0, **options):
    """A prediction of uniform stages (per micro-batch costs) on one device per rank."""
    v = v or (2 if schedule in MULTI_STAGE else 1)
    S = ranks * v
    table = pd.DataFrame({"forward": [F] * S, "backward": [I + W] * S, "output_bytes": [0.0] * S,
                          "input_grad_ratio": [I / (I + W)] * S, "weight_grad_ratio": [W / (I + W)] * S,
                          "saved_bytes": [saved] * S})
    devices = [f"worker{d}" for d in range(ranks if schedule in MULTI_STAGE else S)]
    return simulate(table, list(range(1, S)), chunks=m, schedule=schedule, checkpoint="never", executor="threads",
                    cpu_stages_overlap=True, per_microbatch=True, virtual_stages=v, devices=devices, **options)


def _ranks(schedule, frame, ranks):
    S = int(frame["stage"].max()) + 1
    layout = stage_ranks(schedule, S, ranks) if schedule in MULTI_STAGE else list(range(S))
    return np.asarray(layout)[frame["stage"].to_numpy()]


def _idle(schedule, ranks, m, F, I, W):
    """Each rank's idle seconds in the step."""
    frame = _predict(schedule, ranks, m, F, I, W)
    compute = frame[frame["phase"] != "copy"]
    busy = (compute["end"] - compute["start"]).groupby(_ranks(schedule, compute, ranks)).sum()
    return tl.step_time(frame) - busy.to_numpy()


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("F,I,W", [(1.0, 1.0, 1.0), (1.0, 1.3, 0.7), (2.0, 1.0, 0.5)])
def test_one_f_one_b_and_zb1p_have_the_published_bubbles(ranks, F, I, W):
    B = I + W
    np.testing.assert_allclose(_idle("1f1b", ranks, 2 * ranks, F, I, W), (ranks - 1) * (F + B))
    # ZB1P (zero-bubble, ZB-H1) where W ≤ min(F, I), the published schedule's assumption
    np.testing.assert_allclose(_idle("zero-bubble", ranks, 2 * ranks, F, I, W), (ranks - 1) * (F + B - 2 * W))


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
@pytest.mark.parametrize("F,W", [(1.0, 1.0), (1.0, 0.5), (2.0, 0.3)])
def test_dualpipev_with_its_pairs_one_after_the_other(ranks, F, W):
    I, B = F, F + W  # I = F ≥ W
    for m in (2 * ranks, 4 * ranks):
        idle = _idle("dualpipev", ranks, m, F, I, W)
        np.testing.assert_allclose(idle, (ranks - 1) * (F + I - W))
        published = lambda pair: (ranks - 1) * (pair + B - 3 * W)  # noqa: E731  (PP/2 − 1 = ranks − 1)
        np.testing.assert_allclose(idle, published(B))  # the published bubble, a pair costing its backward
        np.testing.assert_allclose(idle, published(F + B) - (ranks - 1) * F)  # no overlap: F less per hop


def test_the_published_dualpipev_bubble_without_overlap_bounds_ours():
    for ranks in (2, 4, 8):
        for F, I, W in [(1, 1, 1), (2, 1, 1), (3, 1, 1), (0.5, 1, 1), (1, 2, 1), (1, 3, 1), (1, 0.5, 1), (1, 1, 2),
                        (1, 1, 0.2), (1, 1.3, 0.7)]:
            B = I + W
            assert _idle("dualpipev", ranks, 2 * ranks, F, I, W).max() <= (ranks - 1) * (F + 2 * B - 3 * W) + 1e-9


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_zbv_is_nearly_bubble_free_at_many_micro_batches(ranks):
    # F = I = W, the condition of ZB-V's zero bubble: each rank idles (ranks − 1)·F however many
    # micro-batches, the warm-up of the first forward; so the bubble's share goes to 0 as m grows.
    for m in (2 * ranks, 64):
        np.testing.assert_allclose(_idle("zbv", ranks, m, 1.0, 1.0, 1.0), ranks - 1)
    frame = _predict("zbv", ranks, 256, 1.0, 1.0, 1.0)
    assert tl.bubble_fraction(frame, by=tl.bubble_by("zbv")) == pytest.approx((ranks - 1) / (6 * 256 + ranks - 1))
    assert tl.bubble_fraction(frame, by="device") < 0.005
    # half of ZB1P's on the same ranks and layers (ZB-H1's stage: both of a V rank's stages)
    zb1p = _idle("zero-bubble", ranks, 64, 2.0, 2.0, 2.0)
    np.testing.assert_allclose(_idle("zbv", ranks, 64, 1.0, 1.0, 1.0), zb1p / 2)


def _peak_per_rank(schedule, ranks, m, v=None):
    """Each rank's most micro-batches' activations held at once, in stage micro-batches."""
    frame = _predict(schedule, ranks, m, 1.0, 1.0, 1.0, v=v, saved=1.0)
    frame = frame.assign(rank=_ranks(schedule, frame, ranks)).sort_values(["end", "start"], kind="stable")
    peaks = []
    for rank in range(ranks):
        held: dict[int, float] = {}
        peak = 0.0
        for stage, memory in frame.loc[frame["rank"] == rank, ["stage", "memory"]].itertuples(index=False):
            held[stage] = memory
            peak = max(peak, sum(held.values()))
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_activation_memory_per_rank_as_each_schedule_holds_it(ranks):
    p, m, v = ranks, 4 * ranks, 2
    assert _peak_per_rank("1f1b", p, m) == [p - r for r in range(p)]  # PP on the first rank
    assert _peak_per_rank("zero-bubble", p, m) == [p - r for r in range(p)]  # ZB1P: PP too
    assert _peak_per_rank("interleaved", p, m) == [(v - 1) * p + 2 * (p - 1 - r) + 1 for r in range(p)]
    assert _peak_per_rank("interleaved-zero-bubble", p, m) == [(v - 1) * p + (p - 1 - r) + 1 for r in range(p)]
    assert _peak_per_rank("looped-bfs", p, m) == [v * m] * p  # every micro-batch, breadth first
    assert _peak_per_rank("zbv", p, m) == [2 * p] * p  # 1F1B's first rank's: p micro-batches of both stages
    assert _peak_per_rank("dualpipev", p, m) == [2 * p + 1] * p  # PP + 1 (PP = 2p stages), as published


def _reference(model, x, target):
    ref = copy.deepcopy(model)
    loss = nn.functional.mse_loss(ref(x), target)
    loss.backward()
    return loss.item(), [p.grad for p in ref.parameters()]


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("schedule", NEW)
def test_threads_run_each_new_schedule_with_the_gradients_of_a_plain_step(schedule, checkpoint):
    torch.manual_seed(0)
    model = plain_model()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    loss, grads = _reference(model, x, target)
    executor = ScheduleExecutor(copy.deepcopy(model), [2, 2, 2, 2], devices=["cpu", "cpu"], chunks=4,
                                schedule=schedule, checkpoint=checkpoint, loss_fn=nn.functional.mse_loss)
    assert len(executor.worker_devices) == 2  # two ranks, two stages each
    result = executor.step(x, target)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    for got, expected in zip(executor.parameters(), grads, strict=True):
        torch.testing.assert_close(got.grad, expected)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_each_worker_runs_the_predicted_order_with_i_and_w(schedule):
    seconds, p, m = 0.002, 2, 4
    model = nn.Sequential(*[SleepFIW(seconds, seconds, seconds) for _ in range(2 * p)])
    executor = ScheduleExecutor(model, [1] * 2 * p, devices=["cpu"] * p, chunks=m, schedule=schedule)
    assert executor.stage_devices == [torch.device("cpu")] * 4 and executor.virtual_stages == 2
    with tl.record() as rec:
        executor.step(torch.ones(m, 1))
    measured = rec.timeline.assign(rank=lambda t: [stage_ranks(schedule, 2 * p, p)[s] for s in t["stage"]])
    assert {"input_grad", "weight_grad"} <= set(measured["phase"])
    predicted = _predict(schedule, p, m, seconds, seconds, seconds)
    predicted = predicted[predicted["phase"] != "copy"].assign(rank=lambda t: _ranks(schedule, t, p))
    for rank, ran in measured.sort_values("start").groupby("rank"):
        planned = predicted[predicted["rank"] == rank].sort_values("start")
        assert list(zip(ran["stage"], ran["phase"], ran["microbatch"], strict=True)) == list(
            zip(planned["stage"], planned["phase"], planned["microbatch"], strict=True)), rank


def _table(n=8):
    return pd.DataFrame({"name": [str(k) for k in range(n)], "forward": 1e-3, "backward": 2e-3,
                         "output_bytes": 1e3, "param_bytes": 1e3})


def test_plans_lay_the_stages_out_and_export_them():
    assert set(NEW) <= set(PLAN_SCHEDULES)  # the explorer's schedule dropdown lists them
    plan = Plan(_table(), splits=(2, 4, 6), devices=("cpu:a", "cpu:b"), chunks=4, schedule="zbv")
    assert plan.num_devices == 2 and plan.stage_devices == ["cpu:a", "cpu:b", "cpu:b", "cpu:a"]
    assert set(plan.predicted["device"]) == {"cpu:a", "cpu:b"}
    assert {"input_grad", "weight_grad"} <= set(plan.predicted["phase"])
    code = plan_code(plan, "pipelining")
    assert "ScheduleZBVZeroBubble" in code and "for s in (rank, 2 * world_size - 1 - rank)" in code
    looped = plan.with_options(schedule="looped-bfs")
    assert looped.stage_devices == ["cpu:a", "cpu:b", "cpu:a", "cpu:b"] and "ScheduleLoopedBFS" in plan_code(
        looped, "pipelining")
    from pipexplore.export.torchrun import torchrun_script

    script = torchrun_script(_table(), [2, 4, 6], hooks="hooks", chunks=4, schedule="dualpipev")
    assert "SCHEDULE_CLASS = ScheduleDualPipeV" in script and "V_SHAPED = True" in script
    assert "--nproc-per-node 2" in script
    compile(script, "train_pipeline.py", "exec")


@pytest.mark.parametrize("options,reason", [
    (dict(schedule="dualpipev", chunks=3), r"ScheduleDualPipeV\) needs at least as many micro-batches as stages"),
    (dict(schedule="zbv", virtual_stages=4, devices=["cpu"]), r"needs exactly two stages per rank"),
    (dict(schedule="zbv", splits=[2, 4]), r"zbv needs the stage count \(3\) to be a multiple of virtual_stages"),
    (dict(schedule="interleaved-zero-bubble", chunks=5), r"multiple of its rounds"),
])
def test_the_prediction_refuses_what_torch_refuses(options, reason):
    options = {"splits": [2, 4, 6], "chunks": 4, "devices": ["cpu", "cpu"], **options}
    with pytest.raises(ValueError, match=reason):
        simulate(_table(), options.pop("splits"), per_microbatch=True, executor="threads", **options)


def test_the_page_retimes_the_v_schedules_as_simulate_predicts(tmp_path):
    from pipexplore.predict.retime import retime_model
    from pipexplore.widgets.timeline_figure import PHASES
    from pipexplore.widgets.timeline_canvas import block_panel, lane_of, retime_panel
    from test_retime import run_page, table

    import base64

    for schedule in ("zbv", "dualpipev"):
        frame = table(12, seed=3)
        frame["input_grad_ratio"], frame["weight_grad_ratio"] = 0.6, 0.7
        options = dict(chunks=6, schedule=schedule, devices=["cuda:0", "cuda:1", "cuda:2"], executor="threads")
        before, after = [2, 4, 6, 8, 10], [1, 3, 6, 9, 11]
        model = retime_model(frame, before, samples=30, bubble_by="device", **options)
        panel = retime_panel(lane_of(simulate(frame, before, **options))[0], PHASES, model)
        page = run_page(model, panel, [after], tmp_path)[0]
        assert "error" not in page, page
        predicted = simulate(frame, after, **options)
        kernel = block_panel(predicted, PHASES)
        assert page["offsets"] == kernel["offsets"]
        for key in ("start", "end"):
            np.testing.assert_allclose(np.frombuffer(base64.b64decode(page[key]), np.float32),
                                       np.frombuffer(kernel[key], np.float32), rtol=1e-6, atol=1e-6)
        assert page["step"] == pytest.approx(tl.step_time(predicted) * 1e3, rel=1e-9)
        assert page["bubble"] == pytest.approx(tl.bubble_fraction(predicted, by="device"), abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_processes_run_the_v_schedules_with_the_gradients_of_one_process(schedule):
    from pipexplore.executors.distributed import run_processes

    torch.manual_seed(0)
    model = plain_model()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    plan = plan_for(model, x, [2, 4, 6], ["cpu"] * 2, schedule)
    result = run_processes(model, x, plan, target=target, loss_fn=nn.functional.mse_loss, return_grads=True, warmup=0)
    loss, _ = _reference(model, x, target)
    reference = copy.deepcopy(model)
    nn.functional.mse_loss(reference(x), target).backward()
    assert result.loss == pytest.approx(loss, rel=1e-5)
    named = dict(reference.named_parameters())
    assert len(result.metrics["grads"]) == len(named)
    for key, grad in result.metrics["grads"].items():
        torch.testing.assert_close(grad, named[key.split(".", 1)[1]].grad)
    measured = result.timeline
    assert set(measured["stage"]) == {0, 1, 2, 3} and {"input_grad", "weight_grad"} <= set(measured["phase"])
    assert set(measured.loc[measured["stage"].isin([0, 3]), "device"]) == {"cpu"}


@pytest.mark.slow
def test_a_traced_model_runs_zbv_in_processes_and_dualpipev_in_its_exported_script(tmp_path):
    import pathlib

    from pipexplore.executors.distributed import run_processes
    from pipexplore.export.torchrun import torchrun_script
    from ranks import traced_tiny_transformer
    from tiny_transformer import loss_fn

    model, tokens, target, table, splits = traced_tiny_transformer()
    plan = Plan(table, splits, ("cpu",) * 2, chunks=4, schedule="zbv", executor="processes")
    result = run_processes(model, tokens, plan, target=target, loss_fn=loss_fn, return_grads=True, warmup=0)
    unsplit = assert_equals_unsplit(result, model, tokens, target, loss_fn)

    path = tmp_path / "train_pipeline.py"
    # with every micro-batch's forward run again in backward, for the input gradient and the weight
    # gradient apart (the V's split backward): the same loss
    path.write_text(torchrun_script(table, splits, hooks="tiny_transformer", chunks=4, schedule="dualpipev",
                                    device="cpu", checkpoint="always"))
    assert torchrun_first_loss(path, str(pathlib.Path(__file__).parent)) == pytest.approx(unsplit, rel=1e-5)


def test_a_stages_warm_up_sends_nothing_to_its_own_rank():
    """A V's middle stages share a rank: torch's link warm-up (2.13 for traced stages, 2.11 for
    every stage) would send to that rank itself, which gloo cannot; those sends are left out, the
    others kept, and a torch without the warm-up is left alone."""
    from types import SimpleNamespace

    from pipexplore.executors.distributed import _no_self_warmup

    stage = SimpleNamespace(_get_init_p2p_neighbors_ops=lambda: [SimpleNamespace(peer=p) for p in (0, 1, 1, 2)])
    _no_self_warmup(stage, 1)
    assert [op.peer for op in stage._get_init_p2p_neighbors_ops()] == [0, 2]
    older = SimpleNamespace()
    _no_self_warmup(older, 1)
    assert vars(older) == {}
