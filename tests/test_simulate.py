"""The schedule simulator: analytic bubbles, dependencies, lanes, split moves, memory, errors."""
from __future__ import annotations

import pandas as pd
import pytest

from pipexplore.predict.simulator import simulate, stage_costs, stage_orders
from pipexplore.timeline import activation_memory, bubble_fraction, step_time


def uniform(n: int, forward: float = 1.0, backward: float = 2.0) -> pd.DataFrame:
    return pd.DataFrame({"forward": [forward] * n, "backward": [backward] * n,
                         "output_bytes": [1000.0] * n, "param_bytes": [10.0] * n})


CASES = [(2, 4), (3, 6), (4, 4), (4, 8), (4, 16)]


@pytest.mark.parametrize("p,m", CASES)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_analytic(schedule, p, m):
    t = simulate(uniform(p), list(range(1, p)), chunks=m, schedule=schedule, checkpoint="never", executor="threads",
                 cpu_stages_overlap=True)
    assert bubble_fraction(t) == pytest.approx((p - 1) / (m + p - 1))
    assert step_time(t) == pytest.approx((m + p - 1) * 3 / m)  # (F + B) per micro-batch = 3/m


@pytest.mark.parametrize("p,m", CASES)
def test_zero_bubble_h1_bubble_is_analytic(p, m):
    # F = 1, I = W = 1 (per micro-batch, ×1/m): ZB-H1 idles (p-1)(F + I - W) per stage.
    t = simulate(uniform(p), list(range(1, p)), chunks=m, schedule="zero-bubble", checkpoint="never",
                 cpu_stages_overlap=True)
    assert bubble_fraction(t) == pytest.approx((p - 1) / (3 * m + p - 1))
    assert set(t["phase"]) == {"forward", "input_grad", "weight_grad"}


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 6)])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble_is_analytic(p, m, v):
    devices = [f"cuda:{d}" for d in range(p)]
    t = simulate(uniform(p * v), list(range(1, p * v)), chunks=m, schedule="interleaved", virtual_stages=v,
                 checkpoint="never", devices=devices, copy_cost=0.0)
    assert bubble_fraction(t, by="device") == pytest.approx((p - 1) / (v * m + p - 1))
    assert set(t["device"]) == set(devices)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "interleaved"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_dependencies_and_lanes_hold(schedule, checkpoint):
    p, m = 4, 8
    table = uniform(p, forward=0.3, backward=0.7)
    table.loc[2, "forward"] = 1.1  # an uneven stage
    devices = ["cuda:0", "cuda:1"] if schedule == "interleaved" else [f"cuda:{s}" for s in range(p)]
    t = simulate(table, [1, 2, 3], chunks=m, schedule=schedule, checkpoint=checkpoint, devices=devices,
                 copy_cost=1e-6)
    grad = "input_grad" if schedule == "zero-bubble" else "backward"
    ev = t.set_index(["stage", "phase", "microbatch"]).sort_index()
    for s in range(p):
        for i in range(m):
            f = ev.loc[(s, "forward", i)]
            g = ev.loc[(s, grad, i)]
            if s > 0:
                assert f["start"] >= ev.loc[(s - 1, "forward", i), "end"] + 1e-6 * 1000 / m - 1e-12
            assert g["start"] >= f["end"] - 1e-12
            if s < p - 1:
                assert g["start"] >= ev.loc[(s + 1, grad, i), "end"] - 1e-12
            if checkpoint == "always":
                assert g["start"] >= ev.loc[(s, "recompute", i), "end"] - 1e-12
    compute = t[t["phase"] != "copy"]
    for _, lane in compute.groupby("device"):  # one GPU runs one thing at a time
        lane = lane.sort_values("start")
        assert (lane["start"].to_numpy()[1:] >= lane["end"].to_numpy()[:-1] - 1e-12).all()
    assert (t[t.phase == "copy"]["end"] > t[t.phase == "copy"]["start"]).all()


def test_recompute_only_for_checkpointed_micro_batches():
    t = simulate(uniform(3), [1, 2], chunks=4, checkpoint="except_last", cpu_stages_overlap=True)
    assert sorted(t[t.phase == "recompute"]["microbatch"].unique()) == [0, 1, 2]
    assert len(t[t.phase == "recompute"]) == 9
    assert (t[t.phase == "recompute"]["end"] - t[t.phase == "recompute"]["start"]).round(9).eq(0.25).all()


def test_autograd_gpipe_runs_cpu_backward_serially():
    t = simulate(uniform(3), [1, 2], chunks=4, checkpoint="never", cpu_stages_overlap=True)  # GPipe module
    b = t[t.phase == "backward"].sort_values("start")
    assert (b["start"].to_numpy()[1:] >= b["end"].to_numpy()[:-1] - 1e-12).all()
    # Micro-batch-major, last first, as one backward() call runs it.
    assert list(zip(b["microbatch"], b["stage"]))[:4] == [(3, 2), (3, 1), (3, 0), (2, 2)]
    threads = simulate(uniform(3), [1, 2], chunks=4, checkpoint="never", executor="threads", cpu_stages_overlap=True)
    assert step_time(threads) < step_time(t)
    # Compute-bound CPU stages share the cores: no overlap at all, the step is the sum of the work.
    shared = simulate(uniform(3), [1, 2], chunks=4, checkpoint="never")
    assert step_time(shared) == pytest.approx(3 * (1 + 2))
    assert bubble_fraction(shared, by="device") == pytest.approx(0.0)


def test_moving_one_split_changes_only_its_two_stages():
    table = pd.DataFrame({"forward": [1.0, 2, 3, 4, 5, 6, 7, 8], "backward": [2.0] * 8, "output_bytes": [8.0] * 8})
    before = stage_costs(table, [2, 4, 6])
    after = stage_costs(table, [2, 5, 6])
    changed = (before[["forward", "backward", "layers"]] != after[["forward", "backward", "layers"]]).any(axis=1)
    assert changed.tolist() == [False, True, True, False]
    separate = dict(devices=[f"cuda:{d}" for d in range(4)], copy_cost=0.0)  # no device shared
    t1 = simulate(table, [2, 4, 6], chunks=4, **separate)
    t2 = simulate(table, [2, 5, 6], chunks=4, **separate)
    d1 = t1.assign(d=t1.end - t1.start).groupby(["stage", "phase"])["d"].sum()
    d2 = t2.assign(d=t2.end - t2.start).groupby(["stage", "phase"])["d"].sum()
    assert (d1 - d2).abs().groupby("stage").sum().gt(1e-9).tolist() == [False, True, True, False]


def test_1f1b_holds_less_activation_memory_than_gpipe():
    table = uniform(4)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        t = simulate(table, [1, 2, 3], chunks=8, schedule=schedule, checkpoint="never", executor="threads",
                     cpu_stages_overlap=True)
        memory = activation_memory(t)
        peaks[schedule] = memory.groupby("stage")["bytes"].max()
        assert memory.groupby("stage")["bytes"].last().abs().max() < 1e-6  # all freed at the end
    assert peaks["gpipe"][0] == pytest.approx(8 * 1000 / 8)  # all 8 micro-batches in flight
    assert peaks["1f1b"][0] == pytest.approx(4 * 1000 / 8)   # p = 4 in flight
    assert peaks["1f1b"][3] == pytest.approx(1 * 1000 / 8)


def test_checkpointing_lowers_predicted_memory():
    table = uniform(8)  # stages of 4 layers: activations 4,000 bytes, input 1,000, for the mini-batch
    never = activation_memory(simulate(table, [4], chunks=4, checkpoint="never"))
    always = activation_memory(simulate(table, [4], chunks=4, checkpoint="always"))
    assert never.groupby("stage")["bytes"].max().tolist() == [4000, 4000]
    # Inputs of all micro-batches held (4 × 250) plus one recomputed micro-batch (1,000).
    assert always[always.stage == 1]["bytes"].max() == 2000


def test_stage_orders_1f1b_warmup():
    orders = stage_orders("1f1b", 3, 4)
    assert orders[0][:4] == [("F", 0), ("F", 1), ("F", 2), ("B", 0)]
    assert orders[2][:3] == [("F", 0), ("B", 0), ("F", 1)]


@pytest.mark.parametrize("kwargs,message", [
    (dict(schedule="2f2b"), "unknown schedule '2f2b'"),
    (dict(schedule="interleaved", virtual_stages=3), r"stage count \(4\) to be a multiple of virtual_stages \(3\)"),
    (dict(schedule="interleaved", chunks=3), r"chunks \(3\) to be a multiple of the device count \(2\)"),
    (dict(chunks=0), "chunks must be at least 1"),
    (dict(checkpoint="maybe"), "checkpoint is not one of"),
    (dict(devices=["cpu"]), "4 stages need 4 devices, got 1"),
    (dict(schedule="1f1b", executor="autograd"), "the autograd executor .* runs only the gpipe schedule"),
])
def test_errors(kwargs, message):
    args = dict(chunks=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        simulate(uniform(4), [1, 2, 3], **args)


def test_action_overhead_lengthens_every_compute_action():
    p, m, overhead = 3, 4, 0.1
    t = simulate(uniform(p), [1, 2], chunks=m, checkpoint="never", executor="threads", cpu_stages_overlap=True,
                 action_overhead=overhead)
    compute = t[t.phase != "copy"]
    assert ((compute.end - compute.start) - overhead).round(9).isin([1 / m, 2 / m]).all()
    assert step_time(t) == pytest.approx((m + p - 1) * (3 / m + 2 * overhead))
    with pytest.raises(ValueError, match="action_overhead must be non-negative"):
        simulate(uniform(p), [1, 2], chunks=m, action_overhead=-1.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_each_stages_first_backward_of_a_step_allocates_its_gradients(schedule):
    """``fresh_grads`` (seconds a layer's gradients take to allocate, once a step) lengthen each
    stage's micro-batch 0 backward by its layers' sum — its W where the backward is split, the
    first stage's I (which does its weights too) — and nothing else."""
    p, m = 3, 4
    plain = uniform(p * 2)
    fresh = plain.assign(fresh_grads=[0.01, 0.02, 0.0, 0.04, 0.05, 0.06])
    options = dict(chunks=m, checkpoint="never", executor="threads", cpu_stages_overlap=True)
    before, after = (simulate(t, [2, 4], schedule=schedule, **options) for t in (plain, fresh))
    key = ["stage", "phase", "microbatch"]
    spans = [(t.set_index(key)["end"] - t.set_index(key)["start"]).sort_index() for t in (before, after)]
    added = (spans[1] - spans[0]).round(9)
    charged = {(0, "input_grad" if schedule == "zero-bubble" else "backward", 0): 0.03,
               (1, "weight_grad" if schedule == "zero-bubble" else "backward", 0): 0.04,
               (2, "weight_grad" if schedule == "zero-bubble" else "backward", 0): 0.11}
    assert added[added != 0].to_dict() == pytest.approx(charged)
    assert step_time(after) > step_time(before)
