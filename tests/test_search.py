"""The plan that fits: a memory-capped split per schedule (exact: brute force agrees), every
combination predicted and ranked, ``fits`` and ``pareto``, nothing that fits refused with the
closest plan, a row applied, planned plans too."""
import itertools

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from pipexplore.plan import Plan
from pipexplore.predict.dataflow import KINDS
from pipexplore.predict.search import SEARCH_COLUMNS, layer_bytes, search
from pipexplore.predict.simulator import SCHEDULES as SIMULATED
from pipexplore.predict.simulator import prepare_step
from pipexplore.predict.split_search import StageMemory, capped_splits, held_shares, least_over, stage_bytes
from pipexplore.predict.sweep import SWEEP_COLUMNS, plan_balanced_splits
from pipexplore.widgets.state import ExplorerState


def _table(n=8, seed=0, saved=1e6, params=1e5):
    rng = np.random.default_rng(seed)
    table = pd.DataFrame({"name": [f"l{k}" for k in range(n)], "type": "Linear",
                          "forward": rng.uniform(0.5, 1.5, n) * 1e-3, "backward": rng.uniform(1, 3, n) * 1e-3,
                          "param_bytes": rng.uniform(0.5, 1.5, n) * params, "output_bytes": rng.uniform(0.5, 1.5, n) * 1e5,
                          "saved_bytes": rng.uniform(0.5, 1.5, n) * saved, "stash": "", "pop": ""})
    table.attrs["batch"] = 16
    return table


def _shares(plan):
    setup = prepare_step(plan.layer_table, list(plan.splits), **plan.simulate_options())
    graph = setup.graph
    return held_shares(graph.stage, np.asarray(KINDS)[graph.kind], graph.micro, setup.fractions, setup.stop,
                       plan.num_stages)


def _brute(time, memory):
    n, stages = len(time), len(memory.caps)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        if np.all(stage_bytes(memory, cuts) <= memory.caps):
            points = [0, *cuts, n]
            slowest = max(float(np.sum(time[i:j])) for i, j in zip(points, points[1:]))
            best = slowest if best is None else min(best, slowest)
    return best


@pytest.mark.parametrize("schedule,checkpoint", [("1f1b", "never"), ("gpipe", "except_last"),
                                                 ("zero-bubble", "always"), ("1f1b", "except_last")])
def test_the_capped_split_equals_brute_force_over_every_split(schedule, checkpoint):
    """8 layers, 3 stages, random costs and sizes, the schedule's own in-flight shares, caps from
    loose to impossible: the fastest split that fits (or none) is brute force's."""
    rng = np.random.default_rng(1)
    plan = Plan(_table(), splits=(3, 6), devices=("cpu",) * 3, chunks=4, schedule=schedule, checkpoint=checkpoint)
    shares = _shares(plan)
    checked = binding = 0
    for trial in range(60):
        time = rng.uniform(0.1, 1.0, 8)
        static, act, inp = rng.uniform(0, 3, 8), rng.uniform(0, 3, 8), np.r_[0.0, rng.uniform(0, 6, 7)]
        free = StageMemory(static, act, inp, shares, [np.inf] * 3)
        balanced = balanced_cut = capped_splits(time, free)
        cap = float(np.max(stage_bytes(free, balanced))) * rng.uniform(0.5, 1.1)
        memory = StageMemory(static, act, inp, shares, [cap] * 3)
        expected, got = _brute(time, memory), capped_splits(time, memory)
        if expected is None:
            assert got is None
            over = min(float(np.max(stage_bytes(memory, c) - cap)) for c in itertools.combinations(range(1, 8), 2))
            splits, excess = least_over(time, memory)
            assert excess == pytest.approx(over, rel=1e-4) and excess > 0
            continue
        points = [0, *got, 8]
        assert np.all(stage_bytes(memory, got) <= cap)
        assert max(time[i:j].sum() for i, j in zip(points, points[1:])) == pytest.approx(expected, rel=1e-12)
        checked += 1
        binding += got != balanced_cut
    assert checked >= 15 and binding >= 5  # the cap moved the split in some, and they were still exact


def test_random_shares_and_caps_per_stage_agree_with_brute_force():
    rng = np.random.default_rng(7)
    for trial in range(150):
        n, stages = int(rng.integers(3, 9)), int(rng.integers(2, 4))
        time = rng.uniform(0.0, 1.0, n)
        shares = [rng.uniform(0, stages - s, (int(rng.integers(1, 4)), 2)) for s in range(stages)]
        memory = StageMemory(rng.uniform(0, 3, n), rng.uniform(0, 2, n), np.r_[0.0, rng.uniform(0, 4, n - 1)],
                             shares, rng.uniform(3, 12, stages))
        expected, got = _brute(time, memory), capped_splits(time, memory)
        assert (got is None) == (expected is None), trial
        if got is not None:
            points = [0, *got, n]
            assert np.all(stage_bytes(memory, got) <= memory.caps)
            assert max(time[i:j].sum() for i, j in zip(points, points[1:])) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("schedule", SIMULATED)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_the_shares_hold_what_the_predicted_timeline_holds(schedule, checkpoint):
    """Each stage's peak from its in-flight shares is the simulator's (its ``memory`` column), for
    every schedule the simulator knows (four stages; two a device where a schedule puts several)."""
    table = _table(12, seed=3)
    plan = Plan(table, splits=(2, 5, 9), devices=("cpu",) * 4, chunks=4, schedule=schedule, checkpoint=checkpoint)
    plan = plan.with_options(devices=plan.devices[: plan.num_devices])
    static, act, inp = layer_bytes(table)
    memory = StageMemory(np.zeros(12), act, inp, _shares(plan), [np.inf] * 4)
    predicted = plan.predicted.groupby("stage")["memory"].max().to_numpy()
    assert stage_bytes(memory, plan.splits) == pytest.approx(predicted, rel=1e-9)
    if schedule == "1f1b" and checkpoint == "never":  # a 1F1B stage s of p holds p - s micro-batches
        assert [float(s[:, 1].max()) for s in _shares(plan)] == pytest.approx([1.0, 0.75, 0.5, 0.25])


def _state(n=16, **options):
    table = _table(n, seed=2, saved=4e6, params=1e6)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])
    return ExplorerState(model, torch.zeros(16, 4), layer_table=table, devices=["cpu"] * 4, chunks=4,
                         schedule="1f1b", checkpoint="never", calibrate=False, **options)


def _gpu_plan(n=16):
    """Four devices of their own (named, not used: a prediction needs no device)."""
    return Plan(_table(n, seed=2, saved=4e6, params=1e6), splits=(4, 8, 12),
                devices=tuple(f"cuda:{k}" for k in range(4)), chunks=4, schedule="1f1b", checkpoint="never", batch=16)


def test_a_memory_cap_moves_the_split_and_what_does_not_fit_gives_way():
    plan = _gpu_plan()
    free = search(plan, stages=[4], chunks=[4], schedules=["1f1b"], checkpoint=["never"])
    assert free["fits"].all() and free["splits"].iloc[0] == plan_balanced_splits(plan, 4)
    # a cap the balanced split's first stage (4 micro-batches in flight) exceeds, a smaller first stage does not
    cap = free["peak_bytes"].iloc[0] * 0.85
    capped = search(plan, memory_cap=cap, stages=[4], chunks=[4], schedules=["1f1b"], checkpoint=["never"])
    row = capped.iloc[0]
    assert row["fits"] and row["peak_bytes"] <= cap and row["splits"] != free["splits"].iloc[0]
    assert row["splits"][0] < free["splits"].iloc[0][0]  # the first stage, which holds the most, got smaller
    assert row["predicted_step_time"] >= free["predicted_step_time"].iloc[0]
    assert max(row["peak_bytes_per_stage"]) == row["peak_bytes"] == max(row["peak_bytes_per_device"])
    # the memory per stage is stage_memory's of the predicted peaks
    predicted = plan.with_splits(row["splits"]).predicted.groupby("stage")["memory"].max()
    from pipexplore.predict.memory import stage_memory

    expected = stage_memory(plan.layer_table, row["splits"], peak_activations=predicted.tolist())["peak_bytes"]
    assert row["peak_bytes_per_stage"] == pytest.approx(expected.tolist())


def test_stages_that_share_a_device_share_its_cap():
    """On one CPU every stage's memory is the host's: the device's peak is their sum at once."""
    plan = _gpu_plan().with_options(devices=("cpu",) * 4)
    table = search(plan, stages=[4], chunks=[4], schedules=["1f1b"], checkpoint=["never"])
    row = table.iloc[0]
    assert row["devices"] == "cpu,cpu,cpu,cpu" and len(row["peak_bytes_per_device"]) == 1
    assert sum(row["peak_bytes_per_stage"]) >= row["peak_bytes"] > max(row["peak_bytes_per_stage"])


def test_the_table_has_sweeps_columns_fits_and_the_pareto_front():
    plan = _gpu_plan()
    options = dict(stages=[2, 4], chunks=[2, 4, 8], schedules=["gpipe", "1f1b"], checkpoint=["never", "always"])
    cap = float(search(plan, **options)["peak_bytes"].median())
    table = search(plan, memory_cap=cap, **options)
    assert list(table.columns) == SEARCH_COLUMNS and set(SWEEP_COLUMNS) <= set(table.columns)
    assert len(table) == 24 and table["rank"].tolist() == list(range(1, 25))
    assert "step_time" not in table  # one name a figure: the predicted step is predicted_step_time
    assert table["fits"].tolist() == (table["peak_bytes"] <= cap).tolist()
    assert table["fits"].any() and not table["fits"].all()
    fitting = table[table["fits"]]
    assert table["fits"].iloc[: len(fitting)].all() and fitting["predicted_step_time"].is_monotonic_increasing
    step, peak = table["predicted_step_time"].to_numpy(), table["peak_bytes"].to_numpy()
    for k in range(len(table)):
        dominated = any(step[j] <= step[k] and peak[j] <= peak[k] and (step[j] < step[k] or peak[j] < peak[k])
                        for j in range(len(table)))
        assert table["pareto"].iloc[k] == (not dominated)
    assert table["pareto"].any()
    # checkpointing holds less: its fastest plan needs less than the fastest plan without
    never, always = (table[table["checkpoint"] == mode] for mode in ("never", "always"))
    assert always["peak_bytes"].min() < never["peak_bytes"].min()


def test_the_collector_is_paused_while_plans_are_predicted_and_put_back_after(monkeypatch):
    import gc

    from pipexplore.predict import search as searching

    seen = []
    row = searching._row
    monkeypatch.setattr(searching, "_row", lambda *args: seen.append(gc.isenabled()) or row(*args))
    plan = _gpu_plan()
    options = dict(stages=[2, 4], chunks=[4], schedules=["1f1b"], workers=1)
    assert gc.isenabled()
    table = search(plan, **options)
    assert seen == [False, False] and gc.isenabled() and len(table) == 2
    gc.disable()  # a caller that runs without it keeps it off
    try:
        search(plan, **options)
        assert not gc.isenabled()
    finally:
        gc.enable()
    def fails(*args):
        raise RuntimeError("a prediction failed")

    monkeypatch.setattr(searching, "_row", fails)
    with pytest.raises(RuntimeError, match="a prediction failed"):  # and after an error, it is back
        search(plan, **options)
    assert gc.isenabled()


def test_nothing_that_fits_is_refused_with_the_closest_plan_and_how_far_over():
    plan = _gpu_plan()
    options = dict(stages=[2, 4], chunks=[4], schedules=["gpipe", "1f1b"], checkpoint=["always"])
    least = search(plan, **options)["peak_bytes"].min()
    with pytest.raises(ValueError, match=r"no plan fits memory_cap .*: the closest is 4 stages \(splits \[.*\]\), "
                                         r"4 chunks, .*, checkpoint always, .* at its peak, [0-9,]+ bytes \(.* [KMG]iB\) over"):
        search(plan, memory_cap=least * 0.5, **options)
    with pytest.raises(ValueError, match="memory_cap must be a number of bytes"):
        _state().search(memory_cap="lots")


def test_apply_makes_a_row_the_current_plan():
    from pipexplore import explore

    table = _table(16, seed=2, saved=4e6, params=1e6)
    ex = explore(nn.Sequential(*[nn.Linear(4, 4) for _ in range(16)]), torch.zeros(16, 4), layer_table=table,
                 devices=["cpu"] * 2, chunks=4, calibrate=False)
    result = ex.search(memory_cap=60e6, stages=[4], chunks=[4, 8], schedules=["1f1b", "interleaved"],
                       checkpoint=["never", "except_last"])
    assert set(result["schedule"]) == {"1f1b", "interleaved"}
    for _, row in result.head(3).iterrows():
        plan = ex.apply(row)
        assert plan is ex.plan and list(plan.splits) == row["splits"] and plan.chunks == row["chunks"]
        assert (plan.schedule, plan.checkpoint) == (row["schedule"], row["checkpoint"])
        assert plan.num_devices * row["virtual_stages"] == plan.num_stages
        assert ",".join(plan.devices[: plan.num_devices]) == row["devices"]
        assert float(tl_step(plan)) == pytest.approx(row["predicted_step_time"])



def test_apply_takes_a_mapping_of_some_plan_columns_and_keeps_the_rest():
    state = _state()
    before = state.plan
    plan = state.apply({"splits": [2, 4, 8]})
    assert list(plan.splits) == [2, 4, 8] and state.plan is plan
    assert (plan.chunks, plan.schedule, plan.checkpoint, plan.devices) == (before.chunks, before.schedule,
                                                                             before.checkpoint, before.devices)
    plan = state.apply({"chunks": 8, "schedule": "gpipe"})
    assert (list(plan.splits), plan.chunks, plan.schedule) == ([2, 4, 8], 8, "gpipe")
    refusal = (r"apply takes a row of sweep\(\) or search\(\), or a mapping of some of splits, chunks, schedule, "
               r"checkpoint, devices, virtual_stages; got \['split'\]")
    with pytest.raises(ValueError, match=refusal):
        state.apply({"split": [3]})
    with pytest.raises(ValueError, match="split point 17 is past the last layer"):
        state.apply({"splits": [17]})
    assert state.plan is plan  # what was refused changed nothing


def test_unknown_kinds_name_every_known_one():
    state = _state()
    with pytest.raises(ValueError, match=r"unknown export kind 'deepspeed': 'gpipe', 'pipelining', 'torchrun', "
                                         r"'schedule-csv', 'megatron', 'torchtitan', 'chrome-trace' or 'html'"):
        state.export("deepspeed")
    with pytest.raises(ValueError, match="unknown executor 'mpi': choose one of threads, autograd, processes, torchrun"):
        state.runner.run(executor="mpi")
    assert state.runs.empty

def tl_step(plan):
    from pipexplore.timeline import step_time

    return step_time(plan.predicted)


def test_the_search_works_on_a_planned_plan():
    import transformers  # the test extra (declared: a missing one fails)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(0, 256, (8, 16))
    state = ExplorerState(model, ids, devices=["H100"] * 4, gpus_per_node=2, chunks=4, schedule="1f1b",
                          optimizer=torch.optim.AdamW)
    table = state.search(stages=[2, 4], chunks=[4, 8], schedules=["gpipe", "1f1b"], checkpoint=["never", "always"])
    assert len(table) == 16 and table["fits"].all()  # 80 GB an H100: a tiny model fits anywhere
    assert all(d.startswith("H100:") for d in ",".join(table["devices"]).split(","))
    assert table.loc[table["stages"] == 4, "devices"].iloc[0] == "H100:0,H100:1,H100:2,H100:3"
    # the memory per stage is the explorer's own count for the same plan
    row = table.iloc[0]
    state.apply(row)
    assert state.plan.planned and list(state.plan.splits) == row["splits"]
    assert state.stage_table()["peak_bytes"].tolist() == pytest.approx(row["peak_bytes_per_stage"])
    cap = float(table["peak_bytes"].median())
    capped = state.search(memory_cap=cap, stages=[2, 4], chunks=[4, 8], schedules=["gpipe", "1f1b"],
                          checkpoint=["never", "always"])
    assert capped["fits"].any() and (capped.loc[capped["fits"], "peak_bytes"] <= cap).all()


def test_the_front_is_drawn_and_its_panel_applies_a_plan():
    from pipexplore.widgets.front import front_panel, front_svg

    state = _state()
    plan = _gpu_plan()
    options = dict(stages=[2, 4], chunks=[2, 4, 8], schedules=["gpipe", "1f1b"], checkpoint=["never", "always"])
    cap = float(search(plan, **options)["peak_bytes"].median())
    table = search(plan, memory_cap=cap, **options)
    svg = front_svg(table)
    assert svg.count("class='plan") == len(table) and svg.count("class='plan pareto'") == int(table["pareto"].sum())
    assert "class='cap'" in svg and ("class='front'" in svg) == (table["pareto"].sum() > 1)
    assert svg.count("does not fit") == int((~table["fits"]).sum())
    class Explorer:  # what the panel asks of an explorer: apply(row)
        def apply(self, row):
            return state.apply(row)

    panel = front_panel(Explorer(), state.search(stages=[2, 4], chunks=[4], schedules=["gpipe", "1f1b"]))
    rank = panel.picker.options[-1][1]
    panel.apply()
    assert panel.picker.value == panel.picker.options[0][1] and state.plan.num_stages in (2, 4)
    panel.picker.value = rank
    panel.apply()
    assert "applied #" in panel.children[2].value
    # a point clicked in the page (the chart's picked rank): its plan is picked and applied
    row = panel.picker.options[1]
    state.update(chunks=2)
    panel.chart.picked = row[1]
    assert panel.picker.value == row[1] and f"applied {row[0]}" == panel.children[2].value
    assert state.plan.chunks == 4 and panel.chart.svg.count("class='plan") == len(panel.picker.options)
    assert panel.chart.picked == -1  # ready for the next click: the same point, after the plan moved, again
    state.update(chunks=2)
    panel.chart.picked = row[1]
    assert state.plan.chunks == 4


def test_a_csv_schedule_is_searched_at_the_shape_its_file_runs(tmp_path):
    from pipexplore.schedules.csv_files import write_csv
    from pipexplore.schedules import rank_orders

    path = str(write_csv(rank_orders("1f1b", 2, 4), tmp_path / "ours.csv"))
    plan = Plan(_table(), splits=(4,), devices=("cpu", "cpu"), chunks=4, schedule=path, batch=16)
    table = search(plan, stages=[2, 3], chunks=[2, 4], schedules=[path, "1f1b"], checkpoint=["never"], workers=1)
    mine = table[table["schedule"] == path]
    assert mine[["stages", "chunks"]].values.tolist() == [[2, 4]]  # the file's stages and micro-batches only
    same = table[(table["schedule"] == "1f1b") & (table["stages"] == 2) & (table["chunks"] == 4)]
    assert mine["predicted_step_time"].iloc[0] == same["predicted_step_time"].iloc[0]  # the file holds 1F1B's orders
    left = [line for line in table.attrs["left_out"] if path in line]
    assert len(left) == 3 and all("does not fit the plan" in line for line in left)
    assert any("expected 3 stages (the plan's stages), got 2 stages in the file" in line for line in left)
