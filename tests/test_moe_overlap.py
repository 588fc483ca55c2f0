"""A mixture of experts' all-to-alls hidden behind another micro-batch's compute where the schedule pairs a
forward and a backward (Megatron-Core's 1F1B overlap, DualPipeV's overlapped pairs): off by default, the
pairs as Megatron and torch form them, each pair's exposed time by hand, drawn hidden and exposed."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
import transformers

from pipexplore.plan import Plan
from pipexplore.predict.moe_overlap import overlap_pairs
from pipexplore.predict.simulator import schedule_graph, simulate
from pipexplore.widgets.options import ExploreOptions


def _table(layers: int = 2) -> pd.DataFrame:
    """One layer a stage, a micro-batch of one row: forward 5 s of which 2 s all-to-all (3 s
    compute), backward 9 s of which 5 s all-to-all (4 s compute)."""
    table = pd.DataFrame({"name": [f"layer{i}" for i in range(layers)], "forward_a": 0.0, "forward_b": 5.0,
                          "backward_a": 0.0, "backward_b": 9.0, "ep_forward_a": 0.0, "ep_forward_b": 2.0,
                          "ep_backward_a": 0.0, "ep_backward_b": 5.0})
    table["forward"], table["backward"] = table["forward_b"] * 4, table["backward_b"] * 4
    table.attrs["batch"] = 4
    return table


def _spans(frame: pd.DataFrame) -> dict[tuple[int, str, int], float]:
    return {(int(s), str(p), int(m)): float(e - b)
            for s, p, m, b, e in zip(frame["stage"], frame["phase"], frame["microbatch"], frame["start"], frame["end"])
            if p in ("forward", "backward")}


def test_megatrons_1f1b_overlap_pairs_each_backward_with_the_forward_after_it_exposing_what_exceeds():
    """1F1B over 2 stages, 4 micro-batches. Stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3: B0 with F2, B1
    with F3 (Megatron's extra warm-up forward: the pair's actions independent); stage 1 F0 B0 F1 B1
    F2 B2 F3 B3: B0 with F1, B1 with F2, B2 with F3. In a pair the forward runs its 3 s of compute
    and max(0, 2 − 4) of its all-to-all, the backward its 4 s and max(0, 5 − 3) = 2 s: 2 s exposed
    of the pair's 7. Unpaired actions keep 5 s and 9 s."""
    devices = ["H100:0", "H100:1"]
    plain = simulate(_table(), [1], chunks=4, schedule="1f1b", devices=devices, checkpoint="never")
    hidden = simulate(_table(), [1], chunks=4, schedule="1f1b", devices=devices, checkpoint="never",
                      moe_overlap=True)
    assert set(_spans(plain).values()) == {5.0, 9.0} and "moe_overlap" not in plain.attrs
    paired = {(0, 0, 2), (0, 1, 3), (1, 0, 1), (1, 1, 2), (1, 2, 3)}  # (stage, backward's, forward's micro-batch)
    expected = {}
    for s in (0, 1):
        for i in range(4):
            expected[(s, "forward", i)] = 3.0 if any(p[0] == s and p[2] == i for p in paired) else 5.0
            expected[(s, "backward", i)] = 6.0 if any(p[0] == s and p[1] == i for p in paired) else 9.0
    assert _spans(hidden) == pytest.approx(expected)
    records = {r[:3]: r[3:] for r in hidden.attrs["moe_overlap"]}
    for s, b, f in paired:
        assert records[(s, "backward", b)] == (5.0, 2.0, (s, "forward", f))
        assert records[(s, "forward", f)] == (2.0, 0.0, (s, "backward", b))
    assert len(records) == 2 * len(paired)
    assert hidden["end"].max() < plain["end"].max()


@pytest.mark.parametrize("ranks, chunks", [(2, 4), (2, 6), (4, 10)])
def test_dualpipev_pairs_are_torchs_overlapped_actions(ranks, chunks):
    """The forward and full backward each rank runs as one ``OVERLAP_F_B`` in torch's
    ``ScheduleDualPipeV`` (its own order, computed by torch) are the pairs predicted."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B, ScheduleDualPipeV

    graph = schedule_graph("dualpipev", 2 * ranks, chunks, executor="processes", checkpointed=0)
    ours = sorted((int(graph.stage[f]), int(graph.micro[f]), int(graph.stage[b]), int(graph.micro[b]))
                  for f, b in overlap_pairs(graph, "dualpipev"))
    fake = SimpleNamespace(pp_group_size=ranks, _n_microbatches=chunks, _num_stages=2 * ranks)
    theirs = sorted((a.sub_actions[0].stage_index, a.sub_actions[0].microbatch_index,
                     a.sub_actions[1].stage_index, a.sub_actions[1].microbatch_index)
                    for rank in range(ranks) for a in ScheduleDualPipeV._calculate_single_rank_operations(fake, rank)
                    if a is not None and a.computation_type == OVERLAP_F_B)
    assert ours == theirs and ours


def test_schedules_without_pairs_hide_nothing():
    devices = ["H100:0", "H100:1"]
    for schedule in ("gpipe", "zero-bubble"):
        plain = simulate(_table(), [1], chunks=4, schedule=schedule, devices=devices, checkpoint="never",
                         executor="threads")
        hidden = simulate(_table(), [1], chunks=4, schedule=schedule, devices=devices, checkpoint="never",
                          executor="threads", moe_overlap=True)
        assert np.array_equal(plain["end"].to_numpy(), hidden["end"].to_numpy()) and "moe_overlap" not in hidden.attrs


@pytest.fixture(scope="module")
def moe_table():
    """A small Qwen3-MoE's layer table, counted on meta for H100s (8 rows of 256 tokens)."""
    from pipexplore.models.profile import profile_model

    config = transformers.Qwen3MoeConfig(hidden_size=512, moe_intermediate_size=256, intermediate_size=1024,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=64, num_experts=8, num_experts_per_tok=2, vocab_size=1000)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    devices = [f"H100:{i}" for i in range(16)]
    return profile_model(model, torch.zeros(8, 256, dtype=torch.long, device="meta"), devices=devices,
                         gpus_per_node=8, chunks=4), devices


def test_a_planned_plan_hides_each_pairs_exchange_by_the_rule_and_draws_it_hidden_and_exposed(moe_table):
    """pp 2 × dp 8 × ep 8 (the ep group across two nodes): the option off by default (every
    all-to-all exposed, as before); on, each paired action's exposed all-to-all is what exceeds its
    partner's compute (from the rank table's columns, stage by stage), the collectives lane draws
    each paired action's all-to-all as its exposed part and its hidden part (together its whole),
    and the step is shorter."""
    table, devices = moe_table
    splits = (3,)
    base = Plan(table, splits=splits, devices=tuple(devices), chunks=4, schedule="1f1b", checkpoint="never",
                executor="processes", gpus_per_node=8, mesh={"pp": 2, "dp": 8, "ep": 8}, data_parallel="zero1")
    assert base.moe_overlap is False and "moe_overlap" not in base.simulate_options()
    shown = base.predicted[base.predicted["collective"] == "ep all_to_all"]
    assert len(shown) and shown["exposed"].all()
    plan = base.with_options(moe_overlap=True)
    assert plan.rank_table is base.rank_table  # (the option changes no cost of a layer)
    rank = plan.rank_table
    points = [0, *splits, len(rank)]
    rows = 2.0  # a micro-batch's rows (8 rows, 4 micro-batches)

    def per_stage(column: str) -> np.ndarray:
        values = rank[column].to_numpy(dtype=float)
        return np.add.reduceat(values, points[:-1])

    exchange = {p: per_stage(f"ep_{p}_a") + per_stage(f"ep_{p}_b") * rows for p in ("forward", "backward")}
    whole = {p: per_stage(f"{p}_a") + per_stage(f"{p}_b") * rows for p in ("forward", "backward")}
    compute = {p: whole[p] - exchange[p] for p in whole}
    predicted = plan.predicted
    spans = _spans(predicted[predicted["phase"] != "collective"])
    records = predicted.attrs["moe_overlap"]
    assert len(records) == 2 * (3 + 2)  # stage 0: B0-F2, B1-F3; stage 1: B0-F1, B1-F2, B2-F3
    for stage, phase, micro, seconds, exposed, partner in records:
        other = "backward" if phase == "forward" else "forward"
        assert seconds == pytest.approx(exchange[phase][stage])
        assert exposed == pytest.approx(max(0.0, exchange[phase][stage] - compute[other][partner[0]]))
        assert spans[(stage, phase, micro)] == pytest.approx(compute[phase][stage] + exposed)
        lane = predicted[(predicted["collective"] == "ep all_to_all")]
        mine = lane[(lane["stage"] == stage) & (lane["microbatch"] == micro)]
        drawn = mine["end"] - mine["start"]
        assert drawn[mine["exposed"]].sum() + drawn[~mine["exposed"]].sum() >= seconds * (1 - 1e-9)
    assert any(exposed < seconds for *_, seconds, exposed, _ in records)
    lane = predicted[predicted["collective"] == "ep all_to_all"]
    assert (~lane["exposed"]).any() and lane["exposed"].any()
    assert predicted["end"].max() < base.predicted["end"].max()


def test_the_option_is_checked_where_it_enters():
    assert ExploreOptions.of(moe_overlap=True).moe_overlap is True
    with pytest.raises((TypeError, ValueError), match="moe_overlap"):
        ExploreOptions.of(moe_overlap="yes")
    with pytest.raises((TypeError, ValueError), match="moe_overlap"):
        Plan(_table(), splits=(1,), devices=("H100:0", "H100:1"), chunks=4, moe_overlap=1)
