"""A mixture of experts' dispatcher: ``alltoall`` sends each routed copy, ``hybridep``/``deepep`` a token once a
destination node and GPU; the copies against a hand computation and a sampled routing, a planned plan's
exchange against the collectives model by hand, the option refused where it enters. The routing imbalance
(``capacity_factor``) as an explore option: the busiest ep rank's all-to-alls and experts' kernels by hand, kept by
a new mesh and the mesh search, refused by name where it cannot be."""
from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import transformers

import pipexplore
from pipexplore import timeline as tl
from pipexplore.models.profile import profile_model
from pipexplore.plan import Plan
from pipexplore.predict.collectives import linear_cost
from pipexplore.predict.mesh_costs import mesh_layer_table
from pipexplore.predict.moe_dispatch import dispatch_copies
from pipexplore.predict.simulator import simulate
from pipexplore.widgets.options import ExploreOptions

HIDDEN, TOKENS, ROWS = 256, 512, 2  # a micro-batch of 2 rows of 512 tokens


def _none_of(part: int, experts: int = 128, top_k: int = 8) -> float:
    """The probability that none of a token's top_k experts (drawn without replacement) is one of a part's
    ``part`` experts: the product of the draws' chances of missing it."""
    p = 1.0
    for i in range(top_k):
        p *= (experts - part - i) / (experts - i)
    return p


def test_the_copies_a_gpu_sends_are_one_a_destination_node_and_gpu():
    """ep 16 over 2 nodes, 128 experts, top-8: the all-to-all sends 8 copies, the 8 · 8/16 = 4 of
    them whose experts sit on the other node across; HybridEP sends a token across once when the
    other node holds any of its experts (64 of them: 1 − P(none of 64)), and over NVLink once to
    each GPU of 8 experts that holds any, but the one the token arrives at, on both nodes:
    2 · 7 · (1 − P(none of 8))."""
    assert dispatch_copies(128, 8, 16, 2) == pytest.approx((4.0, 3.5))
    across, nvlink = dispatch_copies(128, 8, 16, 2, "hybridep")
    assert across == pytest.approx(1 - _none_of(64), rel=1e-12) and across == pytest.approx(0.99691, abs=1e-5)
    assert nvlink == pytest.approx(2 * 7 * (1 - _none_of(8)), rel=1e-12)
    assert dispatch_copies(128, 8, 16, 2, "deepep") == (across, nvlink)
    # one node (ep 8): nothing crosses; one GPU a node (ep 4 over 4 nodes): nothing over NVLink
    assert dispatch_copies(128, 4, 8, 1, "hybridep") == (0.0, pytest.approx(7 * (1 - _none_of(16, top_k=4))))
    assert dispatch_copies(128, 4, 4, 4, "hybridep") == (pytest.approx(3 * (1 - _none_of(32, top_k=4))), 0.0)
    with pytest.raises(ValueError, match="moe_dispatcher"):
        dispatch_copies(128, 8, 16, 2, "nccl")
    with pytest.raises(ValueError, match="split evenly"):
        dispatch_copies(128, 8, 12, 8, "hybridep")


def test_the_expectation_holds_against_routing_drawn_at_random():
    """Balanced routing as Megatron forces it (random scores, their top-8): a token of GPU 0 on
    node 0 (GPUs 0–7 hold experts 0–63, 8 each) reaches node 1 when any expert is ≥ 64; over
    NVLink it goes to each GPU holding one of its experts but GPU 0 (its own) and GPU 8 (its peer
    on node 1, where it arrives)."""
    torch.manual_seed(0)
    top = torch.rand(40000, 128).topk(8, dim=1).indices
    gpus = torch.zeros(len(top), 16, dtype=torch.bool).scatter_(1, top // 8, True)
    across = gpus[:, 8:].any(dim=1).float().mean().item()
    nvlink = (gpus.sum(dim=1) - gpus[:, 0].long() - gpus[:, 8].long()).float().mean().item()
    expected = dispatch_copies(128, 8, 16, 2, "hybridep")
    assert across == pytest.approx(expected[0], abs=0.002)
    assert nvlink == pytest.approx(expected[1], rel=0.01)
    assert (top >= 64).sum(dim=1).float().mean().item() == pytest.approx(dispatch_copies(128, 8, 16, 2)[0], rel=0.01)


def _qwen3_moe():
    """Two Qwen3-MoE layers (128 experts, top-8, hidden 256) on meta, in bf16."""
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, intermediate_size=512, moe_intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=64, num_experts=128, num_experts_per_tok=8, vocab_size=1000)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)


@pytest.fixture(scope="module")
def table():
    """Two Qwen3-MoE layers (128 experts, top-8, hidden 256) counted for 16 H100s, 4 rows of 512 tokens."""
    return profile_model(_qwen3_moe(), torch.zeros(4, TOKENS, dtype=torch.long, device="meta"),
                         devices=[f"H100:{i}" for i in range(16)], gpus_per_node=8, chunks=2)


def _plan(table, **options):
    return Plan(table, devices=tuple(f"H100:{i}" for i in range(16)), chunks=2, checkpoint="never", schedule="1f1b",
                executor="processes", batch=4, gpus_per_node=8, mesh={"dp": 16, "ep": 16}, **options)


def test_a_planned_ep_16_over_two_nodes_exchanges_a_token_once_a_node(table):
    """Each MoE layer: forward the split counts, the dispatch and the combine, backward their two
    gradients (5 all-to-alls, 4 of tokens), two micro-batches of 2 rows. The all-to-all's tensor is
    8 copies of a micro-batch's 1,024 tokens (4 MiB); HybridEP's legs: the copies across nodes as
    an all-to-all over the 16 GPUs whose half crosses, the copies over NVLink as one over node 0's
    8 GPUs (7/8 of it leaves each GPU); the slower is the exchange."""
    tokens = ROWS * TOKENS
    token_bytes = tokens * HIDDEN * 2
    point = 8 * token_bytes
    moe = table["expert_params"].to_numpy() > 0
    counted = table.attrs["expert_shares"]["exchange_bytes"][:, moe]
    assert (counted == 2 * point / ROWS).all()  # a row's dispatch and combine, each phase: 8 copies of its tokens
    group = [f"H100:{i}" for i in range(16)]

    def seconds(latency: float, rate: float, nbytes: float) -> float:  # 2 micro-batches of 5 calls, 4 of nbytes
        return 2 * (5 * latency + 4 * rate * nbytes)

    plain, default = _plan(table, moe_dispatcher="alltoall").rank_table, _plan(table).rank_table
    assert (plain["ep_seconds"].to_numpy() == default["ep_seconds"].to_numpy()).all()  # alltoall is the default
    assert plain["ep_seconds"][moe].to_numpy() == pytest.approx(seconds(*linear_cost("all_to_all", point, group),
                                                                        point))
    crossing = token_bytes * (1 - _none_of(64))  # a GPU's tokens, once to the other node where it holds an expert
    inside = token_bytes * 2 * 7 * (1 - _none_of(8))  # once to each other GPU of a node holding one
    legs = [(*linear_cost("all_to_all", crossing * 2, group), crossing * 2),
            (*linear_cost("all_to_all", inside * 8 / 7, group[:8]), inside * 8 / 7)]
    slower = max(legs, key=lambda leg: leg[0] + leg[1] * leg[2])
    for name in ("hybridep", "deepep"):
        deduplicated = _plan(table, moe_dispatcher=name).rank_table
        assert deduplicated["ep_seconds"][moe].to_numpy() == pytest.approx(seconds(*slower))
        assert (deduplicated["ep_seconds"][~moe] == 0).all()
    latency, rate = linear_cost("all_to_all", point, group)
    assert slower[0] + slower[1] * slower[2] < 0.6 * (latency + rate * point)  # a quarter of the bytes cross
    hybrid = _plan(table, moe_dispatcher="hybridep")
    assert hybrid.predicted["end"].max() < _plan(table).predicted["end"].max()
    assert "ep all_to_all" in set(hybrid.predicted["collective"])


def test_the_option_is_checked_where_it_enters(table):
    assert ExploreOptions.of(moe_dispatcher="hybridep").moe_dispatcher == "hybridep"
    assert ExploreOptions.of().moe_dispatcher == "alltoall"
    with pytest.raises(ValueError, match="moe_dispatcher"):
        ExploreOptions.of(moe_dispatcher="flex")
    with pytest.raises(ValueError, match="moe_dispatcher"):
        _plan(table, moe_dispatcher="nccl")
    plan = _plan(table)
    assert plan.with_options(moe_dispatcher="hybridep").rank_table["ep_seconds"].sum() < plan.rank_table[
        "ep_seconds"].sum()  # (a new rank table, not the cached one)


def test_explore_carries_the_dispatcher_to_its_plan_and_its_mesh_changes():
    ex = pipexplore.explore(_qwen3_moe(), torch.zeros(16, TOKENS, dtype=torch.long, device="meta"), devices=["H100"] * 16,
                            chunks=2, schedule="1f1b", mesh={"pp": 2, "dp": 8, "ep": 8}, moe_dispatcher="hybridep")
    assert ex.plan.moe_dispatcher == "hybridep"
    ex.set_mesh({"pp": 1, "dp": 16, "ep": 16})
    assert ex.plan.moe_dispatcher == "hybridep" and ex.plan.mesh.ep == 16


# ---- routing imbalance: capacity_factor ----------------------------------------------------------

ON_AN_EP_MESH = dict(devices=["H100"] * 16, chunks=2, schedule="1f1b", mesh={"pp": 2, "dp": 8, "ep": 8})


def _ids(rows: int = 16):
    return torch.zeros(rows, TOKENS, dtype=torch.long, device="meta")


@pytest.fixture(scope="module")
def balanced_and_hot():
    """The same Qwen3-MoE planned at pp 2 · dp 8 · ep 8 on 16 H100s, balanced and at capacity_factor 2."""
    return (pipexplore.explore(_qwen3_moe(), _ids(), **ON_AN_EP_MESH),
            pipexplore.explore(_qwen3_moe(), _ids(), **ON_AN_EP_MESH, capacity_factor=2))


def test_explore_plans_the_busiest_ep_rank_at_the_capacity_factor_given(balanced_and_hot):
    """At capacity_factor 2 the plan's rank table is ``mesh_layer_table``'s at 2 on the same layer table, and
    its step that table's simulated step. Each MoE layer's all-to-alls (two micro-batches of 8 rows, 5 calls,
    4 of tokens, over the 8 GPUs of node 0) move twice the bytes: one all-to-all's tensor is 8 copies of a
    micro-batch's 4,096 tokens (16 MiB) balanced, 32 MiB at 2, each costed at its own size; the experts'
    token-bound seconds grow by one more share of their kernels (the table's ``expert_b``)."""
    balanced, hot = balanced_and_hot
    plan = balanced.plan
    assert plan.capacity_factor == 1.0 and hot.plan.capacity_factor == 2.0
    assert ExploreOptions.of().capacity_factor == 1.0 and hot.options.capacity_factor == 2.0
    assert hot.plan.splits == plan.splits and hot.plan.mesh == plan.mesh
    by_hand = mesh_layer_table(plan.layer_table, plan.mesh, plan.devices, gpus_per_node=8, capacity_factor=2.0)
    pd.testing.assert_frame_equal(hot.plan.rank_table, by_hand)
    simulated = simulate(by_hand, list(plan.splits), **plan.simulate_options())
    assert tl.step_time(hot.plan.predicted) == tl.step_time(simulated)
    assert tl.step_time(hot.plan.predicted) == pytest.approx(0.0058876, rel=1e-4)
    assert tl.step_time(plan.predicted) == pytest.approx(0.0047111, rel=1e-4)

    moe = plan.layer_table["expert_params"].to_numpy() > 0
    assert moe.sum() == 2
    group = [f"H100:{i}" for i in range(8)]
    assert [plan.devices[r] for r in plan.mesh.group("ep", 0)] == group
    point = 8 * 8 * TOKENS * HIDDEN * 2  # 8 copies of a micro-batch's tokens, bf16
    for factor, table in ((1, plan.rank_table), (2, hot.plan.rank_table)):
        latency, rate = linear_cost("all_to_all", factor * point, group)
        assert table["ep_seconds"][moe].to_numpy() == pytest.approx(2 * (5 * latency + 4 * rate * factor * point),
                                                                    rel=1e-12)
        assert (table["ep_seconds"][~moe] == 0).all()
    assert hot.plan.rank_table["ep_seconds"][moe].to_numpy() == pytest.approx(7.8869e-4, rel=1e-4)
    assert plan.rank_table["ep_seconds"][moe].to_numpy() == pytest.approx(4.5808e-4, rel=1e-4)
    hot_kernels = np.asarray(plan.layer_table.attrs["expert_shares"]["expert_b"], dtype=float)
    assert (hot_kernels[:, moe] > 0).all() and (hot_kernels[:, ~moe] == 0).all()
    def compute(table, phase):  # a layer's seconds a row beyond its all-to-alls
        return (table[f"{phase}_b"] - table[f"ep_{phase}_b"]).to_numpy()

    for i, phase in enumerate(("forward", "backward")):
        assert compute(hot.plan.rank_table, phase) == pytest.approx(compute(plan.rank_table, phase) + hot_kernels[i],
                                                                    rel=1e-12, abs=1e-18)
    # a what-if of routing, not a dropping policy: Megatron-LM's arguments are the balanced plan's
    assert hot.export("megatron") == balanced.export("megatron")
    assert "capacity-factor" not in hot.export("megatron")


def test_a_new_mesh_and_the_mesh_search_keep_the_capacity_factor():
    """set_mesh keeps the explorer's factor (or takes a new one); the search plans every candidate at it,
    leaving out, named, the meshes whose ep is below it (ep 1 here), never clamping it."""
    ex = pipexplore.explore(_qwen3_moe(), _ids(), **ON_AN_EP_MESH, capacity_factor=2)
    found = ex.search(mesh="auto", ep=[1, 2, 4])
    assert sorted(set(found["ep"])) == [2, 4] and len(found) == 17
    skipped = [why for why in found.attrs["left_out"] if "capacity_factor" in why]
    assert len(skipped) == 9 and all("to ep = 1, got 2 (" in why for why in skipped)  # tp 1, 2; pp 1, 2, 4; etp
    assert all(" · ep " not in why.partition(":")[0] for why in skipped)  # every one an ep-1 folding
    best = found.iloc[0]
    assert (best["tp"], best["pp"], best["dp"], best["ep"]) == (1, 1, 16, 2)
    ex.apply(best)
    assert ex.plan.capacity_factor == 2.0 and ex.plan.mesh.ep == 2
    assert tl.step_time(ex.plan.predicted) == pytest.approx(best["predicted_step_time"], rel=1e-9)
    ex.set_mesh({"pp": 1, "dp": 16, "ep": 16})
    assert ex.plan.capacity_factor == 2.0 and ex.plan.mesh.ep == 16
    with pytest.raises(ValueError, match=r"capacity_factor .* from 1 \(balanced\) to ep = 1, got 2 \(a factor "
                                         r"above 1 needs a mesh whose ep is at least it\)"):
        ex.set_mesh({"pp": 1, "dp": 16})
    assert ex.plan.mesh.ep == 16  # the plan as it was
    ex.set_mesh({"pp": 1, "dp": 16, "ep": 4}, capacity_factor=1.5)
    assert ex.plan.capacity_factor == 1.5 and ex.meshes.options["capacity_factor"] == 1.5


def _qwen3_dense():
    config = transformers.Qwen3Config(hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)


def test_a_capacity_factor_that_cannot_be_is_refused_by_name_with_what_would_do(monkeypatch):
    with pytest.raises(ValueError, match=r"capacity_factor is how many times its balanced share of the routed "
                                         r"tokens the busiest expert-parallel rank receives: from 1 \(balanced\) "
                                         r"to the mesh's ep, got 0.5"):
        ExploreOptions.of(capacity_factor=0.5)
    with pytest.raises(TypeError, match=r"capacity_factor must be a number from 1 \(balanced routing\) to the "
                                        r"mesh's ep, got True \(bool\)"):
        ExploreOptions.of(capacity_factor=True)
    with pytest.raises(TypeError, match=r"capacity_factor must be a number .* got '2' \(str\)"):
        ExploreOptions.of(capacity_factor="2")
    import pipexplore.widgets.state as state_module

    def never(*args, **kwargs):
        raise AssertionError("profiled before the options were checked")

    with monkeypatch.context() as patched:  # ep + 1 on an ep mesh: refused before anything is profiled
        patched.setattr(state_module, "profile_model", never)
        with pytest.raises(ValueError, match=r"capacity_factor .* to ep = 8, got 9 \(a factor above 1 needs a mesh "
                                             r"whose ep is at least it\)"):
            pipexplore.explore(_qwen3_moe(), _ids(), **ON_AN_EP_MESH, capacity_factor=9)
    dense = dict(devices=["H100"] * 2, chunks=2)
    with pytest.raises(ValueError, match=r"capacity_factor 2: routing imbalance is a mixture of experts' .* this "
                                         r"plan has no experts \(its layer table counts none\): leave "
                                         r"capacity_factor at 1"):
        pipexplore.explore(_qwen3_dense(), _ids(4), **dense, capacity_factor=2)
    ex = pipexplore.explore(_qwen3_dense(), _ids(4), **dense, capacity_factor=1)
    assert ex.plan.capacity_factor == 1.0 and "ep_seconds" not in ex.plan.rank_table
    with pytest.raises(ValueError, match=r"capacity_factor 1.5: .* this plan has no experts"):
        ex.plan.with_options(capacity_factor=1.5)
    moe = pipexplore.explore(_qwen3_moe(), _ids(), devices=["H100"] * 2, chunks=2)  # no mesh: ep 1
    with pytest.raises(ValueError, match=r"capacity_factor .* to ep = 1, got 2"):
        moe.plan.with_options(capacity_factor=2)
