"""FSDP under a pipeline: the predicted step gathers and reduce-scatters each stage where torch's own
lowering (``_add_unshard_reshard``, ``_add_reduce_grad``) puts its ``UNSHARD`` and ``REDUCE_GRAD``."""
from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest
import torch
from torch.distributed.pipelining.schedules import (_Action, _add_reduce_grad, _add_unshard_reshard,
                                                    _ComputationType)

from models import meta_llama
from pipexplore.models.profile import profile_model
from pipexplore.plan import Plan
from pipexplore.predict.costs import stage_sums
from pipexplore.predict.fsdp_actions import lowered
from pipexplore.schedules import rank_orders

logging.getLogger("transformers").setLevel(logging.ERROR)

DEVICES = tuple(f"H100:{i}" for i in range(4))
SAMPLE = torch.zeros(8, 256, dtype=torch.long, device="meta")


@pytest.fixture(scope="module")
def table():
    return profile_model(meta_llama(8, heads=8), SAMPLE, devices=DEVICES, gpus_per_node=8, chunks=4,
                         optimizer=torch.optim.AdamW)


def fsdp(table, splits, schedule="1f1b", **options):
    return Plan(table, splits=splits, devices=DEVICES, chunks=4, schedule=schedule, executor="processes", batch=8,
                gpus_per_node=8, mesh={"pp": 2, "dp": 2}, data_parallel="fsdp", **options)


def test_the_lowering_is_torchs_own():
    orders = rank_orders("interleaved", 2, 4, stages_per_rank=4)
    for order in orders:
        letters = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD}
        theirs = _add_reduce_grad(_add_unshard_reshard([_Action(s, letters[k], i) for s, k, i in order]), 4)
        assert [str(a) for a in theirs] == [f"{s}{k}{'' if i < 0 else i}" for s, k, i in lowered(order, 4)]
    assert Counter(k for _, k, _ in lowered(orders[0], 4))["UNSHARD"] > 4  # four stages a rank: some gathered again
    mine = lowered(orders[0], 4)  # kept for the next mesh of the same queue, as a copy of its own each time
    mine.clear()
    assert lowered(orders[0], 4) and lowered(orders[0], 4) == lowered(list(orders[0]), 4)


def test_one_stage_a_rank_gathers_at_the_start_and_reduce_scatters_after_its_last_backward(table):
    plan = fsdp(table, (5,))
    predicted = plan.predicted
    rank = plan.rank_table
    points = [0, 5, len(rank)]
    unshard = stage_sums(rank["unshard_seconds"].to_numpy(), points)
    scatter = stage_sums(rank["reduce_grad_seconds"].to_numpy(), points)
    assert (unshard > 0).all() and (scatter > 0).all()
    rows = predicted[predicted["phase"] == "collective"]
    gathers = rows[rows["collective"] == "fsdp all_gather (UNSHARD)"].set_index("stage")
    assert sorted(gathers.index) == [0, 1]  # once a step each
    assert gathers["start"].to_numpy() == pytest.approx([0.0, 0.0])
    assert (gathers["end"] - gathers["start"]).to_numpy() == pytest.approx(unshard)
    compute = predicted[predicted["phase"] != "collective"]
    first = compute[(compute["phase"] == "forward") & (compute["microbatch"] == 0)].set_index("stage")
    assert first.loc[0, "start"] == pytest.approx(unshard[0])  # nothing to hide the first stage's gather behind
    assert bool(gathers.loc[0, "exposed"])
    # the second stage gathers while it waits for its input: hidden where the first stage's forward is longer
    arrival = first.loc[0, "end"]
    assert first.loc[1, "start"] >= max(arrival, unshard[1]) - 1e-12
    assert bool(gathers.loc[1, "exposed"]) == (unshard[1] > arrival)
    scatters = rows[rows["collective"] == "fsdp reduce_scatter (REDUCE_GRAD)"].set_index("stage")
    backward = compute[compute["phase"] == "backward"].groupby("stage")["end"].max().sort_index()
    scatters = scatters.sort_index()
    assert scatters["start"].to_numpy() == pytest.approx(backward.to_numpy())
    assert scatters["exposed"].all()  # a one-stage rank has no compute left to hide it behind
    updates = compute[compute["phase"] == "optimizer"].set_index("stage").sort_index()
    optimizer = stage_sums(table["optimizer"].to_numpy(), points) / 2  # the optimizer steps its 1/dp shard
    assert (updates["end"] - updates["start"]).to_numpy() == pytest.approx(optimizer + scatter)
    assert not (rows["collective"] == "fsdp reduce_scatter").any()  # not drawn twice


def test_four_stages_a_rank_are_gathered_as_often_as_torch_gathers_them(table):
    plan = fsdp(table, (3, 4, 5, 6, 7, 8, 9), schedule="interleaved", virtual_stages=4)
    predicted = plan.predicted
    rows = predicted[(predicted["phase"] == "collective")
                     & (predicted["collective"] == "fsdp all_gather (UNSHARD)")]
    expected = Counter()
    for order in rank_orders("interleaved", 2, 4, stages_per_rank=4):
        expected.update(s for s, k, _ in lowered(order, 4) if k == "UNSHARD")
    # a gather issued mid-step is drawn as its hidden part and its exposed part: count the gathers
    drawn = Counter()
    for (stage, start), group in rows.groupby(["stage", "start"]):
        if group["exposed"].all() and ((rows["stage"] == stage) & (rows["end"] == start)).any():
            continue  # the exposed tail of a gather already counted by its hidden part
        drawn[stage] += 1
    assert drawn == expected
    # the rank's later stages finish their backward first: their reduce-scatter hides behind the rest
    scatters = predicted[(predicted["phase"] == "collective")
                         & (predicted["collective"] == "fsdp reduce_scatter (REDUCE_GRAD)")]
    assert len(scatters) == 8
    assert (~scatters["exposed"]).sum() >= 2
    placed = {r[1]: r for r in predicted.attrs["fsdp"] if r[0] == "reduce_grad"}
    # the placement is shared by every frame and column taken from the timeline, never copied into them
    assert predicted["start"].attrs["fsdp"] is predicted.attrs["fsdp"] is scatters.attrs["fsdp"]
    rank = plan.rank_table
    points = [0, 3, 4, 5, 6, 7, 8, 9, len(rank)]
    updates = predicted[predicted["phase"] == "optimizer"].set_index("stage").sort_index()
    optimizer = stage_sums(table["optimizer"].to_numpy(), points) / 2
    scatter = stage_sums(rank["reduce_grad_seconds"].to_numpy(), points)
    hidden = np.array([placed[s][4] for s in range(8)])
    assert (updates["end"] - updates["start"]).to_numpy() == pytest.approx(optimizer + scatter - hidden)


def test_without_fsdp_nothing_is_placed(table):
    plan = Plan(table, splits=(5,), devices=DEVICES, chunks=4, schedule="1f1b", executor="processes", batch=8,
                gpus_per_node=8, mesh={"pp": 2, "dp": 2}, data_parallel="ddp")
    assert "fsdp" not in plan.predicted.attrs
    assert not plan.rank_table["unshard_seconds"].any() and not plan.rank_table["reduce_grad_seconds"].any()


@pytest.mark.parametrize("schedule, expected", [("gpipe", {0: 1, 1: 1}), ("1f1b", {0: 3, 1: 4})])
def test_resharded_after_forward_a_backward_gathers_again_only_where_a_forward_came_since(table, schedule, expected):
    """With reshard_after_forward every forward gathers the stage again; a backward only where a
    forward resharded it since the stage's last backward (torch's stage keeps it unsharded from one
    backward to the next, until the last: GPipe's backwards gather once, as the profiler's trace of
    a run shows, tests/test_mesh_torchrun.py); 1F1B's stage 0 runs B3 right after B2."""
    plan = fsdp(table, (5,), schedule=schedule, reshard_after_forward=True)
    again = [r for r in plan.predicted.attrs["fsdp"] if r[0] == "regather"]
    assert {s: sum(1 for r in again if r[1] == s) for s in (0, 1)} == expected
    assert all(r[2][1] == "backward" for r in again)
    rows = plan.predicted[(plan.predicted["phase"] == "collective")
                          & (plan.predicted["collective"] == "fsdp all_gather")]
    assert len(rows) >= 8 + sum(expected.values())  # every forward's gathers, and those backwards'
