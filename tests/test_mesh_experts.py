"""Mixtures of experts in the mesh: the experts folded over the same GPUs as the attention
(Megatron-Core's parallel folding, torchtitan's sparse mesh), ``ep × etp`` refused where it does not
fold (the degrees that would, named), a GPU's training memory held against Megatron-LM's
``theoretical_memory_usage`` with its expert fix, the routed activations a rank keeps, the search
over ``ep`` and ``etp`` under the memory cap, and every mixture of experts of the zoo planned with
``ep > 1``."""
from __future__ import annotations

import logging
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

import pipexplore
from pipexplore.devices import Mesh
from pipexplore.models import experts
from pipexplore.models.meta import count_layers
from pipexplore.predict.collectives import linear_cost
from pipexplore.predict.memory import stage_memory
from pipexplore.predict.mesh_costs import mesh_layer_table
from pipexplore.widgets.state import ExplorerState
from tests.zoo_models import MOE, on_meta

logging.getLogger("transformers").setLevel(logging.ERROR)

# The published shapes, as the models' config.json files on the Hugging Face Hub give them
# (mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, deepseek-ai/DeepSeek-V3;
# the Megatron-LM arguments THUDM/slime's scripts/models/qwen3-30B-A3B.sh and qwen3-235B-A22B.sh
# train the two Qwen3 models with say the same; DeepseekV3Config's defaults are DeepSeek-V3's),
# cut to four layers: the memory of a stage is its layers', and a layer's shape is the model's.
MIXTRAL_8X7B = ("MixtralConfig", "MixtralForCausalLM",
                dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     num_local_experts=8, num_experts_per_tok=2, vocab_size=32000))
QWEN3_30B_A3B = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                      vocab_size=151936))
QWEN3_235B_A22B = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                   dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_attention_heads=64,
                        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                        vocab_size=151936))
DEEPSEEK_V3 = ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(first_k_dense_replace=1))
SHAPES = {"mixtral-8x7b": MIXTRAL_8X7B, "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3-235b-a22b": QWEN3_235B_A22B,
          "deepseek-v3": DEEPSEEK_V3}


def build(shape, layers: int = 4):
    config_class, model_class, options = shape
    config = getattr(transformers, config_class)(**options, num_hidden_layers=layers)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, model_class)(config).to(torch.bfloat16)


def ids(rows: int = 2, tokens: int = 64):
    return torch.zeros(rows, tokens, dtype=torch.long, device="meta")


# ---- the mesh -----------------------------------------------------------------------------------


def test_the_experts_fold_as_megatron_core_places_them():
    """Megatron-Core's own rank generator (``parallel_state.RankGenerator``, the order
    ``tp-cp-ep-dp-pp`` it builds both the attention's and the experts' groups with) gives the
    groups the mesh gives: attention on tp × cp × dp × pp, experts on etp × ep × edp × pp."""
    from megatron.core.parallel_state import RankGenerator

    for spec, devices in (({"tp": 2, "pp": 8, "dp": 16, "ep": 32}, 256), ({"tp": 4, "pp": 2, "dp": 4, "ep": 4,
                                                                           "etp": 2}, 32),
                          ({"tp": 2, "pp": 2, "dp": 2, "cp": 2, "ep": 2, "etp": 2}, 16)):
        mesh = Mesh.of(spec, devices, experts=128)
        assert mesh.edp == mesh.tp * mesh.cp * mesh.dp // (mesh.ep * mesh.etp)
        dense = RankGenerator(tp=mesh.tp, ep=1, dp=mesh.dp, pp=mesh.pp, cp=mesh.cp, order="tp-cp-ep-dp-pp")
        folded = RankGenerator(tp=mesh.etp, ep=mesh.ep, dp=mesh.edp, pp=mesh.pp, cp=1, order="tp-cp-ep-dp-pp")
        for ours, theirs, generator in (("tp", "tp", dense), ("dp", "dp", dense), ("pp", "pp", dense),
                                        ("etp", "tp", folded), ("ep", "ep", folded), ("edp", "dp", folded)):
            groups = sorted({mesh.group(ours, r) for r in range(mesh.size)})
            assert groups == sorted(tuple(g) for g in generator.get_ranks(theirs)), (spec, ours)
    assert Mesh.of({"tp": 2, "pp": 8, "dp": 16, "ep": 32}, 256).describe() == "tp 2 · pp 8 · dp 16 · ep 32"
    assert Mesh(tp=2, dp=2, ep=2, etp=2).describe(" ") == "tp 2 pp 1 dp 2 ep 2 etp 2"


def test_a_mesh_that_does_not_fold_the_experts_is_refused_naming_the_degrees_that_would():
    with pytest.raises(ValueError, match=r"ep 64 × etp 1 = 64 does not divide tp·cp·dp = 32, the GPUs of a pipeline "
                                         r"stage .*: with etp 1, ep can be 1, 2, 4, 8, 16, 32$"):
        Mesh.of({"tp": 2, "pp": 8, "dp": 16, "ep": 64}, 256, experts=128)
    with pytest.raises(ValueError, match=r"ep 2 × etp 3 = 6 does not divide tp·cp·dp = 32.*: with etp 1, ep can be "
                                         r"1, 2, 4, 8, 16, 32; with etp 2, ep can be 1, 2, 4, 8, 16$"):
        Mesh.of({"tp": 2, "pp": 8, "dp": 16, "ep": 2, "etp": 3}, 256, experts=128)
    with pytest.raises(ValueError, match=r"ep 8 does not divide the model's 60 routed experts .*: with etp 1, ep can "
                                         r"be 1, 2, 4$"):
        Mesh.of({"tp": 2, "pp": 2, "dp": 4, "ep": 8}, 16, experts=60)
    with pytest.raises(ValueError, match=r"this model has none .*: leave ep and etp at 1"):
        Mesh.of({"tp": 2, "pp": 2, "dp": 4, "ep": 2}, 16, experts=0)
    with pytest.raises(ValueError, match=r"ep \(expert parallelism\) is a whole number of ranks from 1, got 0"):
        Mesh.of({"tp": 2, "pp": 2, "dp": 4, "ep": 0}, 16)
    with pytest.raises(ValueError, match=r"unknown dimension 'edp': the mesh has tp \(tensor\), pp \(pipeline\), dp "
                                         r"\(data\), cp \(context\), ep \(expert\), etp \(expert-tensor\)"):
        Mesh.of({"tp": 2, "pp": 2, "dp": 4, "edp": 2}, 16)
    with pytest.raises(ValueError, match=r"ep 4 × etp 1 = 4 does not divide tp·cp·dp = 2"):
        Mesh(tp=2, ep=4)


def test_the_experts_count_comes_from_the_config_under_each_familys_name():
    found = {}
    for name in sorted(MOE):
        model, _ = on_meta(name)
        info = experts.routed_experts(model)
        assert info is not None and len(info.modules) >= 1 and all(n.endswith(".experts") for n in info.modules)
        assert len(info.routers) == len(info.modules)
        found[name] = (info.count, info.top_k)
    assert found == {"deepseek_v3": (256, 8), "mixtral": (8, 2), "qwen2_moe": (60, 4)}
    assert experts.routed_experts(on_meta("llama")[0]) is None


def test_qwen3_moe_plans_on_256_h100s_with_ep_32_and_a_dense_model_refuses_ep():
    """The issue's example: ``explore(qwen3_moe_on_meta, ids, devices=["H100"] * 256, mesh={"tp": 2,
    "pp": 8, "dp": 16, "ep": 32})`` plans (the 235B-A22B shape, cut to 16 layers here)."""
    model = build(QWEN3_235B_A22B, layers=16)
    ex = pipexplore.explore(model, ids(16, 256), devices=["H100"] * 256, chunks=8, schedule="1f1b",
                            mesh={"tp": 2, "pp": 8, "dp": 16, "ep": 32}, data_parallel="zero1",
                            optimizer=torch.optim.AdamW, mixed_precision=True)
    plan = ex.plan
    assert plan.mesh == Mesh(tp=2, pp=8, dp=16, ep=32) and plan.mesh.edp == 1 and plan.num_stages == 8
    assert plan.layer_table.attrs["experts"] == {"count": 128, "top_k": 8}
    collectives = set(plan.predicted["collective"])
    assert {"tp all_reduce", "ep all_to_all", "dp reduce_scatter + all_gather"} <= collectives
    assert any("etp 1 × ep 32 × edp 1 × pp 8" in note for note in ex.notes)
    # a rank's routed FLOPs are its tokens' share whatever ep is: half the whole model's at tp 2
    table = plan.layer_table
    block = table["expert_params"].to_numpy() > 0
    assert (table["rank_forward_flops"][block] < 0.51 * table["forward_flops"][block]).all()
    before = plan
    with pytest.raises(ValueError, match=r"ep 3 × etp 1 = 3 does not divide tp·cp·dp = 32"):
        ex.set_mesh({"tp": 2, "pp": 8, "dp": 16, "ep": 3})
    assert ex.plan is before
    llama, sample = on_meta("llama")
    with pytest.raises(ValueError, match=r"routed experts, and this layer table counts none"):
        ExplorerState(llama, sample, devices=["H100"] * 8, chunks=2, mesh={"tp": 2, "pp": 2, "dp": 2, "ep": 2})
    with pytest.raises(ValueError, match=r"routed experts, and this layer table counts none"):
        ExplorerState(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), torch.zeros(4, 4),
                      devices=["cpu", "cpu"], mesh={"pp": 1, "dp": 2, "ep": 2})
    with pytest.raises(ValueError, match=r"expert-tensor parallelism is planned for devices from the catalogue"):
        ExplorerState(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), torch.zeros(4, 4),
                      devices=["cpu"] * 4, mesh={"pp": 1, "dp": 4, "ep": 2, "etp": 2})


def test_a_mixture_of_experts_here_folds_its_experts_over_ep_ranks_of_this_machine():
    """Planned for this machine's CPUs (what the exported script runs: tests/test_torchrun_experts.py):
    the whole model timed here, the count's expert columns beside it; each rank steps half the experts,
    and every mixture-of-experts layer's dispatch and combine are gloo's all-to-alls over loopback, on
    the collectives lane."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import moe_hooks
    from pipexplore.predict.collectives import collective_seconds
    from pipexplore.predict.mesh_costs import mesh_layer_table

    model = moe_hooks.build_model()
    ids, target = moe_hooks.get_batch()
    options = dict(devices=["cpu"] * 4, chunks=2, loss_fn=moe_hooks.loss_fn, target=target)
    ex = ExplorerState(model, ids, mesh={"pp": 2, "dp": 2, "ep": 2}, **options)
    table = ex.plan.layer_table
    assert table.attrs["experts"] == {"count": moe_hooks.EXPERTS, "top_k": 2}
    assert (table["expert_param_bytes"] > 0).sum() == 2  # the two decoder layers
    lane = ex.plan.predicted[ex.plan.predicted["phase"] == "collective"]
    assert set(lane["collective"]) >= {"ep all_to_all"} and lane["device"].str.endswith(" · collectives").all()
    rank = mesh_layer_table(table, ex.plan.mesh, ex.plan.devices)
    dense = mesh_layer_table(table, ex.plan.mesh.__class__.of({"pp": 2, "dp": 2}, 4), ex.plan.devices)
    block = table["expert_param_bytes"].to_numpy() > 0
    # a rank steps its dense parameters and half of each layer's experts
    held = (table["param_bytes"] - table["expert_param_bytes"] / 2) / table["param_bytes"]
    step_end = rank["dp_seconds"].to_numpy()
    np.testing.assert_allclose((rank["optimizer"] - step_end)[block], (dense["optimizer"] - dense["dp_seconds"])[block]
                               * held[block], rtol=1e-9)
    # each layer's two all-to-alls each way cost gloo's ring over loopback at a micro-batch's bytes
    rows = float(table.attrs["rows"][0])
    point = float((table["dispatch_bytes"][block] / table.attrs["batch"]).iloc[0]) * rows
    assert rank["ep_seconds"][block].to_numpy() == pytest.approx(
        [4 * collective_seconds("all_to_all", point, ["cpu", "cpu"]) * table.attrs["batch"] / rows] * 2, rel=1e-6)


# ---- memory a GPU, held against Megatron-LM --------------------------------------------------------


def megatron_parameters(shape) -> SimpleNamespace:
    """Megatron-LM's parameter terms of one layer (``compute_weight_and_optimizer_memory`` in
    megatron/training/theoretical_memory_usage.py, NVIDIA/Megatron-LM a7c9e8c44a, #4687 "Make weight
    and optimizer memory estimation take into account expert parallelism correctly"), written out
    from the model's config: attention (multi-latent for DeepSeek-V3), the dense MLP, a shared
    expert, the routed experts, two RMSNorms and the router; SwiGLU everywhere, no biases, the
    vocabulary unpadded (as the Hugging Face model holds it)."""
    c = getattr(transformers, shape[0])(**shape[2])
    h = c.hidden_size
    if getattr(c, "kv_lora_rank", None):  # multi-latent attention, its q and kv down-projections with their norms
        a, nope, rope, v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        attention = (c.q_lora_rank * (h + a * (nope + rope) + 1) + c.kv_lora_rank * (h + a * (nope + v) + 1)
                     + h * rope + a * v * h)
    else:
        d = getattr(c, "head_dim", None) or h // c.num_attention_heads
        attention = 2 * h * d * (c.num_attention_heads + c.num_key_value_heads)
    count = next(getattr(c, f) for f in ("n_routed_experts", "num_local_experts", "num_experts")
                 if getattr(c, f, None))
    routed_ffn = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    shared_ffn = (getattr(c, "n_shared_experts", 0) or 0) * routed_ffn
    return SimpleNamespace(attention=attention, dense_mlp=3 * h * c.intermediate_size, shared=3 * h * shared_ffn,
                           routed=3 * h * routed_ffn * count, norms=2 * h, router=h * count, embedding=h * c.vocab_size,
                           final_norm=h)


def megatron_stage_bytes(terms, *, dense: int, moe: int, embedding: bool, head: bool, tp: int, dp: int, ep: int,
                         etp: int, distributed_optimizer: bool) -> float:
    """Megatron-LM's weight and optimizer bytes of a GPU holding ``dense`` and ``moe`` layers (and the
    ``embedding``, the output layer ``head``): its three kinds of parameter (#4687) — tensor-parallel
    (attention, dense MLP, shared experts, embedding: ``/tp``), replicated (norms, routers) and routed
    experts (``/(etp·ep)``) — at 18 bytes a parameter, or ``6 + 12/d`` with the distributed optimizer
    (``d`` the data-parallel size for the first two, the expert-data-parallel size
    ``world / (etp·ep·pp) = tp·dp / (etp·ep)`` for the experts). Its estimator counts the most loaded
    shard (the first stage, the embedding on it; the output layer only where pp = 1): the head stage
    here adds the output layer as the first adds the embedding."""
    def per_parameter(d: int) -> float:
        return 6 + 12 / d if distributed_optimizer else 18

    tensor = (terms.attention + terms.dense_mlp) * dense + (terms.attention + terms.shared) * moe
    tensor += terms.embedding * (int(embedding) + int(head))
    replicated = terms.norms * (dense + moe) + terms.router * moe + terms.final_norm * int(head)
    routed = terms.routed * moe
    edp = tp * dp // (etp * ep)
    return (tensor / tp + replicated) * per_parameter(dp) + routed / (etp * ep) * per_parameter(edp)


MEMORY_CASES = [("mixtral-8x7b", dict(tp=1, dp=8, ep=8, etp=1), True),
                ("mixtral-8x7b", dict(tp=2, dp=4, ep=4, etp=2), False),
                ("mixtral-8x7b", dict(tp=4, dp=2, ep=8, etp=1), True),
                ("qwen3-30b-a3b", dict(tp=2, dp=8, ep=8, etp=1), True),
                ("qwen3-30b-a3b", dict(tp=1, dp=16, ep=16, etp=1), False),
                ("qwen3-235b-a22b", dict(tp=2, dp=16, ep=32, etp=1), True),
                ("qwen3-235b-a22b", dict(tp=4, dp=8, ep=8, etp=4), True),
                ("qwen3-235b-a22b", dict(tp=2, dp=16, ep=1, etp=1), False),
                ("deepseek-v3", dict(tp=2, dp=64, ep=64, etp=1), True),
                ("deepseek-v3", dict(tp=1, dp=32, ep=32, etp=1), False),
                ("deepseek-v3", dict(tp=8, dp=32, ep=256, etp=1), True)]


@pytest.fixture(scope="module")
def counted():
    """Each shape's layer table, counted once on meta (4 layers: DeepSeek-V3's first dense)."""
    return {name: count_layers(build(shape), ids()) for name, shape in SHAPES.items()}


@pytest.mark.parametrize("name, mesh, zero1", MEMORY_CASES,
                         ids=[f"{n}-tp{m['tp']}-dp{m['dp']}-ep{m['ep']}-etp{m['etp']}-{'zero1' if z else 'ddp'}"
                              for n, m, z in MEMORY_CASES])
def test_weights_and_optimizer_a_gpu_are_megatrons_with_its_expert_fix(counted, name, mesh, zero1):
    """Each stage of a two-stage pipeline (the embedding and two layers; two layers and the head),
    with mixed-precision AdamW: parameters, gradients and optimizer state a GPU within 1 % of
    Megatron-LM's estimate, the experts over ep × etp, their state over edp."""
    table = counted[name]
    names = list(table["name"])
    split = names.index("model.layers.2")
    held = stage_memory(table, [split], peak_activations=[0.0, 0.0], optimizer=torch.optim.AdamW, mixed_precision=True,
                        data_parallel="zero1" if zero1 else "ddp", **mesh)
    terms = megatron_parameters(SHAPES[name])
    dense_first = 1 if name == "deepseek-v3" else 0  # DeepSeek-V3's first layer is dense (first_k_dense_replace)
    for stage, layers in ((0, dict(dense=dense_first, moe=2 - dense_first, embedding=True, head=False)),
                          (1, dict(dense=0, moe=2, embedding=False, head=True))):
        ours = float(held.loc[stage, ["param_bytes", "grad_bytes", "optimizer_bytes"]].sum())
        megatron = megatron_stage_bytes(terms, **layers, **mesh, distributed_optimizer=zero1)
        assert abs(ours - megatron) / megatron < 0.01, (stage, ours / 2**30, megatron / 2**30)


def test_megatrons_most_loaded_shard_is_the_first_stage(counted):
    """Megatron-LM's own total for Qwen3-235B-A22B's 94 layers on pp 2 (the most loaded shard: 47
    layers, the embedding; #4687's three kinds), against a first stage of ours of 47 layers: the
    per-layer bytes of the four-layer count, times 47, and the embedding's."""
    table, terms = counted["qwen3-235b-a22b"], megatron_parameters(QWEN3_235B_A22B)
    tp, dp, ep, pp, layers = 2, 16, 32, 2, 94
    names = list(table["name"])
    first = names.index("model.layers.0")
    per_layer = stage_memory(table.iloc[first:first + 1], [], peak_activations=[0.0], optimizer=torch.optim.AdamW,
                             mixed_precision=True, tp=tp, dp=dp, ep=ep, data_parallel="zero1").iloc[0]
    embedding = stage_memory(table.iloc[:first], [], peak_activations=[0.0], optimizer=torch.optim.AdamW,
                             mixed_precision=True, tp=tp, dp=dp, ep=ep, data_parallel="zero1").iloc[0]
    columns = ["param_bytes", "grad_bytes", "optimizer_bytes"]
    ours = float(per_layer[columns].sum()) * layers / pp + float(embedding[columns].sum())
    edp = tp * dp // ep
    tensor = (terms.attention + terms.shared) * layers / pp + terms.embedding  # (no dense layer, no shared expert)
    replicated = (terms.norms + terms.router) * layers / pp + terms.final_norm / pp
    routed = terms.routed * layers / pp
    megatron = (tensor / tp + replicated) * (6 + 12 / dp) + routed / ep * (6 + 12 / edp)
    assert abs(ours - megatron) / megatron < 0.01, (ours / 2**30, megatron / 2**30)


def test_the_plan_holds_a_gpus_share_as_megatron_does():
    """Through the explorer: Qwen3-235B-A22B's shape (4 layers) on 16 H100s, tp 2 · pp 2 · dp 4 ·
    ep 8, ZeRO-1: the stage table's training state a GPU is Megatron-LM's, stage by stage."""
    ex = pipexplore.explore(build(QWEN3_235B_A22B), ids(8, 128), devices=["H100"] * 16, chunks=4,
                            schedule="1f1b", mesh={"tp": 2, "pp": 2, "dp": 4, "ep": 8}, data_parallel="zero1",
                            optimizer=torch.optim.AdamW, mixed_precision=True)
    stages = ex.stage_table()
    layers = [int(s.split("–")[1]) - int(s.split("–")[0]) + 1 for s in stages["layers"]]
    assert len(layers) == 2
    terms = megatron_parameters(QWEN3_235B_A22B)
    blocks = list(ex.plan.layer_table["expert_params"] > 0)
    for stage, row in stages.iterrows():
        points = [0, *ex.plan.splits, len(blocks)]
        moe = sum(blocks[points[stage]:points[stage + 1]])
        megatron = megatron_stage_bytes(terms, dense=0, moe=moe, embedding=stage == 0, head=stage == 1, tp=2, dp=4,
                                        ep=8, etp=1, distributed_optimizer=True)
        ours = float(row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"])
        assert abs(ours - megatron) / megatron < 0.01, (stage, ours / 2**30, megatron / 2**30)


def test_fsdp_shards_the_experts_over_edp_and_gathers_a_layer_at_a_time(counted):
    """Under FSDP a GPU keeps 1/(dp·cp) of its dense shard and 1/edp of its experts' shard, and
    gathers one layer at a time: its dense 1/tp, its routers whole, its experts' 1/(ep·etp)."""
    table = counted["qwen3-30b-a3b"]
    names = list(table["name"])
    split = names.index("model.layers.2")
    held = stage_memory(table, [split], peak_activations=[0.0, 0.0], mixed_precision=True, tp=2, dp=8, ep=1,
                        data_parallel="fsdp").iloc[1]
    blocks = table.iloc[split:]
    dense = blocks["params"] - blocks["expert_params"] - blocks["router_params"]
    layer = dense * 2 / 2 + blocks["router_params"] * 2 + blocks["expert_params"] * 2
    assert held["gathered_bytes"] == pytest.approx(float(layer.max()))  # a block: its experts whole at ep 1
    expected = float((dense * 2 / 2 / 8 + blocks["router_params"] * 2 / 8 + blocks["expert_params"] * 2 / 16).sum())
    assert held["param_bytes"] == pytest.approx(expected)  # the experts over edp = tp·dp / ep = 16 ranks


# ---- what a rank runs ---------------------------------------------------------------------------------


def test_a_rank_holds_and_reduces_its_experts_over_edp_and_exchanges_its_tokens_over_ep(counted):
    table = count_layers(build(QWEN3_30B_A3B), ids(8, 128), microbatch_rows=2, tp=2)
    table = table.assign(forward_a=0.0, forward_b=0.0, backward_a=0.0, backward_b=0.0, forward=0.0, backward=0.0,
                         optimizer=1.0)
    devices = [f"H100:{i}" for i in range(32)]
    moe = (table["expert_params"] > 0).to_numpy()
    folded = {ep: mesh_layer_table(table, Mesh(tp=2, pp=2, dp=8, ep=ep), devices, data_parallel="zero1")
              for ep in (1, 4, 16)}
    # the activations a rank keeps: 1/tp of the model's (sequence parallelism), whatever ep is
    for ep, rank in folded.items():
        assert rank["saved_bytes"].to_numpy() == pytest.approx(table["saved_bytes"].to_numpy() / 2)
    assert (folded[1]["ep_seconds"] == 0).all()
    assert (folded[4]["ep_seconds"][moe] > 0).all() and (folded[4]["ep_seconds"][~moe] == 0).all()
    # the exchange: a micro-batch's routed tokens of a GPU (top_k copies of its 1/tp of the tokens)
    # to the ep group and back, forward and backward: 4 all-to-alls of them
    mesh = Mesh(tp=2, pp=2, dp=8, ep=4)
    row = table["dispatch_bytes"].to_numpy()[moe][0] / table.attrs["batch"] / 2
    latency, per_byte = linear_cost("all_to_all", row * 2, [devices[r] for r in mesh.group("ep", 0)])
    batch = table.attrs["batch"]
    first = int(np.flatnonzero(moe)[0])
    assert folded[4]["ep_seconds"].iloc[first] == pytest.approx(4 * (latency * batch / 2 + per_byte * row * batch))
    assert folded[4]["forward_b"].iloc[first] == pytest.approx(2 * per_byte * row)
    # with ep = tp·dp = 16 each expert's shard has no replica (edp 1): only the dense gradients are reduced
    assert folded[16]["dp_seconds"].sum() < folded[4]["dp_seconds"].sum() < folded[1]["dp_seconds"].sum()
    # the optimizer steps this GPU's shards (the table's 1 second a rank's whole): the dense 1/dp of its
    # tp shard, the experts' 1/edp of 1/ep
    block = table[moe].iloc[0]
    dense = block["rank_param_bytes"] - block["rank_expert_param_bytes"]
    for ep in (1, 4, 16):
        edp = 2 * 8 // ep
        held = dense / 8 + block["expert_param_bytes"] / ep / edp
        stepped = folded[ep]["optimizer"].iloc[first] - folded[ep]["dp_seconds"].iloc[first]  # (its collectives)
        assert stepped == pytest.approx(held / block["rank_param_bytes"])


def test_the_routed_activations_are_top_k_copies_of_a_ranks_tokens():
    """Megatron-LM #6782's correction: a rank keeps ``top_k`` routed copies of its own ``1/tp`` of
    the tokens, which expert parallelism trades but never divides. The count's saved bytes of a
    mixture-of-experts layer grow by the same bytes a token for each expert more it is routed to,
    and a rank keeps ``1/tp`` of them at any ep."""
    h, ffn, tokens = 1024, 256, 2 * 128
    saved = {}
    for top_k in (2, 4, 8):
        shape = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 dict(hidden_size=h, moe_intermediate_size=ffn, num_experts=16, num_experts_per_tok=top_k,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=1024))
        table = count_layers(build(shape, layers=1), ids(2, 128))
        saved[top_k] = float(table.loc[table["name"] == "model.layers.0", "saved_bytes"].iloc[0])
    per_copy = (saved[4] - saved[2]) / (2 * tokens)
    assert (saved[8] - saved[4]) / (4 * tokens) == pytest.approx(per_copy)
    # Hugging Face's grouped-GEMM experts keep, a routed copy: 2 bf16 values of its width and 4 of the
    # expert's (the sorted input and the combined output; the gate-up output and the activation's
    # input and output), and its index and weight
    assert 2 * (2 * h + 4 * ffn) <= per_copy <= 2 * (2 * h + 4 * ffn) + 64


# ---- the search --------------------------------------------------------------------------------------------


def test_the_search_folds_the_experts_every_way_under_the_memory_cap():
    from pipexplore.predict.mesh_search import factorisations

    meshes = factorisations(16, 8, 10, experts=8)
    assert Mesh(tp=2, pp=1, dp=8, ep=8, etp=2) in meshes and Mesh(tp=1, pp=2, dp=8, ep=8) in meshes
    assert all((m.tp * m.cp * m.dp) % (m.ep * m.etp) == 0 and 8 % m.ep == 0 and m.etp in (1, m.tp) for m in meshes)
    assert {m.ep for m in meshes} == {1, 2, 4, 8}
    model = build(QWEN3_30B_A3B)
    ex = pipexplore.explore(model, ids(8, 512), devices=["H100"] * 16, chunks=4, schedule="1f1b",
                            mesh={"tp": 2, "pp": 2, "dp": 4, "ep": 4}, optimizer=torch.optim.AdamW,
                            mixed_precision=True)
    cap = 12 * 2**30
    table = ex.search(mesh="auto", memory_cap=cap, data_parallel=["zero1"])
    assert set(table["ep"]) >= {2, 4, 8} and (table["etp"] > 1).any()
    assert ((table["tp"] * table["cp"] * table["dp"]) % (table["ep"] * table["etp"]) == 0).all()
    assert (128 % table["ep"] == 0).all() and (table["tp"] * table["pp"] * table["dp"] == 16).all()
    fitting = table[table["fits"]]
    assert len(fitting) and (fitting["peak_bytes"] <= cap).all()
    assert fitting["predicted_step_time"].is_monotonic_increasing
    over = [why for why in table.attrs["left_out"] if "its training state alone is" in why]
    assert over and all("over the cap" in why for why in over)
    assert any(" ep " not in why.split(",")[0] for why in over)  # ep 1 (every expert on every GPU) does not fit
    best = table[table["ep"] > 1].iloc[0]
    ex.apply(best)
    assert (ex.plan.mesh.ep, ex.plan.mesh.etp) == (best["ep"], best["etp"])
    assert ex.state.figures()["predicted_step_time"] == pytest.approx(best["predicted_step_time"])
    dense = pipexplore.explore(*on_meta("llama"), devices=["H100"] * 8, chunks=2, mesh={"tp": 2, "pp": 2, "dp": 2})
    with pytest.raises(ValueError, match=r"routed experts, and this model has none"):
        dense.search(mesh="auto", ep=[2])


def test_holding_fewer_experts_reads_fewer_weights():
    """A GPU holding 1/(ep·etp) of a layer's experts reads that share of their weights: where the
    grouped GEMMs are bound by memory (few tokens an expert), its forward is faster at ep 8 than
    at ep 1, the FLOPs the same."""
    model = build(QWEN3_235B_A22B)
    ex = pipexplore.explore(model, ids(4, 256), devices=["H100"] * 16, chunks=4, schedule="1f1b",
                            mesh={"tp": 2, "pp": 2, "dp": 4})
    table = ex.plan.layer_table
    shares = table.attrs["expert_shares"]
    assert {2, 4, 8, 16, 128} <= set(shares["shares"].tolist())
    change = dict(zip(shares["columns"], shares["changes"][shares["shares"].tolist().index(8)]))
    moe = (table["expert_params"] > 0).to_numpy()
    assert (change["forward_a"][moe] < 0).all() and (change["forward_a"][~moe] == 0).all()
    one = mesh_layer_table(table, Mesh(tp=2, pp=2, dp=4), ex.plan.devices)
    eight = mesh_layer_table(table, Mesh(tp=2, pp=2, dp=4, ep=8), ex.plan.devices)
    compute = eight["forward_a"] + eight["forward_b"] * table.attrs["rows"][0]
    whole = one["forward_a"] + one["forward_b"] * table.attrs["rows"][0]
    exchange = eight["ep_seconds"] / 2 / (table.attrs["batch"] / table.attrs["rows"][0])
    assert (compute[moe] - exchange[moe] < whole[moe]).all()


# ---- the zoo ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MOE))
def test_every_mixture_of_experts_of_the_zoo_plans_with_expert_parallelism(name):
    """Mixtral, Qwen2-MoE and DeepSeek-V3, from their configs' defaults (4 layers) on meta, planned
    on 16 H100s at tp 2 · pp 2 · dp 4 · ep 4: a GPU holds a quarter of each layer's experts, the
    tokens go to them by all-to-all, the prediction is finite."""
    model, sample = on_meta(name)
    ex = pipexplore.explore(model, sample, devices=["H100"] * 16, chunks=4, schedule="1f1b",
                            mesh={"tp": 2, "pp": 2, "dp": 4, "ep": 4}, data_parallel="zero1",
                            optimizer=torch.optim.AdamW)
    plan = ex.plan
    assert plan.mesh.ep == 4 and math.isfinite(ex.state.figures()["predicted_step_time"])
    assert "ep all_to_all" in set(plan.predicted["collective"])
    table = plan.layer_table
    folded = ex.stage_table()
    whole = stage_memory(table, list(plan.splits), peak_activations=[0.0, 0.0], optimizer=torch.optim.AdamW, tp=2,
                         dp=4)
    routed = [float(table["expert_param_bytes"].to_numpy()[a:b].sum())
              for a, b in zip([0, *plan.splits], [*plan.splits, len(table)])]
    for stage in (0, 1):  # its experts a quarter, not all of them: 3/4 of their bytes gone from each GPU
        assert whole.loc[stage, "param_bytes"] - folded.loc[stage, "param_bytes"] == pytest.approx(
            routed[stage] * 3 / 4, rel=1e-6)


# ---- at scale -----------------------------------------------------------------------------------------------------


@pytest.mark.timing  # a bound in seconds: runs alone (scripts/test.sh)
def test_qwen3_235b_on_256_h100s_explores_and_searches_within_the_goals():
    """benchmarks/moe_at_scale.py's measurement, once, in a fresh interpreter: ``explore`` of the
    full Qwen3-235B-A22B shape (94 layers) on 256 H100s with ``ep 32`` within 10 s and 2 GiB, the
    search over every mesh and folding of its experts (ZeRO-1 and FSDP) within 30 s."""
    import pathlib
    import sys

    benchmarks = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(benchmarks))
    try:
        import moe_at_scale
    finally:
        sys.path.remove(str(benchmarks))
    figures = moe_at_scale.measure()
    assert figures["explore"] <= 10 and figures["peak_gib"] <= 2, figures
    assert figures["search"] <= 30 and figures["folded"] > 0, figures
