"""A tensor-parallel rank, counted by torch itself: each block sharded by ``parallelize_module`` on a
fake process group, its FLOPs a rank, its collectives (equal to what ``CommDebugMode`` sees torch's
own modules run) and its parameter bytes; each attention at a rank's share of its heads (BLOOM's
and Phi-3's fused projections, every zoo architecture with a plan); the model's own
``base_model_tp_plan`` or one given; and every plan that cannot shard a model refused by name."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.distributed as dist
import transformers

from pipexplore.models import sharded
from pipexplore.models.meta import RANK_COLUMNS, count_layers
from pipexplore.models.opcount import count_call
from tests.zoo_models import TP_PLANS, ZOO

logging.getLogger("transformers").setLevel(logging.ERROR)

HIDDEN, SEQ, ROWS = 256, 64, 4


def llama(layers: int = 2, **changes):
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=HIDDEN, intermediate_size=688,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1024, **changes)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(config)


def ids(rows: int = ROWS, seq: int = SEQ):
    return torch.zeros(rows, seq, dtype=torch.long, device="meta")


@pytest.fixture(autouse=True)
def no_group_left():
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized(), "the count left its fake process group behind"


def _blocks(table):
    return table[table["type"] == "LlamaDecoderLayer"]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_rank_computes_a_tp_th_of_each_block_and_holds_a_tp_th_of_its_weights(tp):
    model = llama()
    whole, rank = count_layers(model, ids()), count_layers(model, ids(), tp=tp)
    assert rank.attrs["tp"] == tp and whole.attrs["tp"] == 1
    for column in ("forward_flops", "backward_flops", "param_bytes", "saved_bytes"):  # the whole model's, kept
        assert rank[column].tolist() == whole[column].tolist(), column
    blocks = _blocks(rank)
    assert (blocks["rank_forward_flops"] == blocks["forward_flops"] / tp).all()
    assert (blocks["rank_backward_flops"] == blocks["backward_flops"] / tp).all()
    norms = 2 * HIDDEN * 4  # two RMSNorm weights, whole on every rank
    assert (blocks["rank_param_bytes"] == (blocks["param_bytes"] - norms) / tp + norms).all()
    head = rank[rank["name"] == "lm_head"].iloc[0]  # the class's own plan: colwise, its output gathered
    assert head["rank_param_bytes"] == head["param_bytes"] / tp


def _torch_sharded_block(model, mesh):
    """The block as torchtitan's plan shards it, written out with torch's own styles."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    import copy
    block = copy.deepcopy(model.model.layers[0])
    replicated = dict(input_kwarg_layouts={"hidden_states": Replicate()},
                      desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=False)
    parallelize_module(block, mesh, {
        "self_attn": PrepareModuleInput(**replicated), "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(), "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                  use_local_output=False),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    return block


class _Tracker:
    """What ``CommDebugMode`` reads of its module tracker to count collectives, and nothing more: its
    own tracker follows every module's forward by global hooks, and fails on modules that are called
    outside its hierarchy (transformers' kernel functions wrapped as modules, 5.25 on), leaving its
    hooks behind. The counts, by kind and phase, need only whether autograd runs the backward."""

    name, activation_checkpointing, module_parents_dict = "Global", False, {"Global": ["Global"]}

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


def test_the_collectives_a_rank_runs_are_what_comm_debug_mode_sees_torchs_modules_run():
    from torch.distributed.tensor.debug import CommDebugMode

    model, tp = llama(), 4
    hidden = torch.empty(ROWS, SEQ, HIDDEN, device="meta")
    kwargs = {"position_embeddings": model.model.rotary_emb(hidden, torch.arange(SEQ, device="meta")[None]),
              "attention_mask": None}
    with sharded.fake_group(tp) as mesh:
        reference = CommDebugMode()
        reference.advanced_module_tracker = _Tracker()
        with reference:
            count_call(_torch_sharded_block(model, mesh), (hidden,), kwargs)
        ours = count_call(sharded.shard(model.model.layers[0], "model.layers.0", sharded.tensor_parallel_plan(model),
                                        mesh), (hidden,), kwargs)
    expected = {str(op).split(".")[-1]: n for op, n in reference.get_comm_counts().items()}
    assert expected == {"all_reduce": 4}  # Megatron-LM's f and g: one forward and one backward a half-block
    by_phase = {phase: sum(counts.values()) for phase, counts in reference.comm_module_counts["Global"].items()}
    assert by_phase == {"forward": 2, "backward": 2}
    seen = [r for r in ours.records if r["collective"]]
    assert len(seen) == 4 and {r["collective"] for r in seen} == {"all_reduce"}
    assert [r["phase"] for r in seen] == ["forward", "forward", "backward", "backward"]
    assert all(r["row_bytes"] + r["fixed_bytes"] == ROWS * SEQ * HIDDEN * 4 for r in seen)  # the activations, fp32


def test_the_ops_frame_costs_each_collective_over_the_tensor_parallel_group():
    from pipexplore.predict.collectives import Group, ops_collective_seconds, ring_seconds

    table = count_layers(llama(), ids(), tp=2)
    ops = table.attrs["ops"]
    collectives = ops[ops["collective"] != ""]
    assert set(collectives["collective"]) == {"all_reduce", "all_gather"}  # the head's output gathered
    group = Group(2, 1e-11, 3e-6)
    seconds = ops_collective_seconds(ops, ops.attrs["rows"], group)
    for index, row in collectives.iterrows():
        position = ops.index.get_loc(index)
        assert seconds[position] == pytest.approx(ring_seconds(row["collective"], row["fixed_bytes"] + row["row_bytes"],
                                                               2, 1e-11, 3e-6))
    assert (seconds[(ops["collective"] == "").to_numpy()] == 0).all()
    with pytest.raises(ValueError, match="no group to cost them over"):
        ops_collective_seconds(ops, 4, None)


def test_a_plan_given_shards_a_model_whose_config_has_none():
    config = transformers.OPTConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=1024,
                                    ffn_dim=1024, word_embed_proj_dim=256)
    with torch.device("meta"):
        model = transformers.OPTForCausalLM(config)
    assert not sharded.tensor_parallel_plan(model)  # OPT's config carries none
    layers = "model.decoder.layers.*."
    plan = {f"{layers}self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")}
    plan.update({f"{layers}self_attn.out_proj": "rowwise", f"{layers}fc1": "colwise", f"{layers}fc2": "rowwise"})
    table = count_layers(model, ids(), tp=2, tp_plan=plan)
    blocks = table[table["type"] == "OPTDecoderLayer"]
    assert len(blocks) == 2
    ratio = blocks["forward_flops"] / blocks["rank_forward_flops"]
    assert ((ratio > 1.98) & (ratio < 2.1)).all(), ratio  # its matmuls halve


BLOOM_ATTENTION = {"transformer.h.*.self_attention.query_key_value": "colwise",
                   "transformer.h.*.self_attention.dense": "rowwise"}
BLOOM_MLP = {"transformer.h.*.mlp.dense_h_to_4h": "colwise", "transformer.h.*.mlp.dense_4h_to_h": "rowwise"}


def bloom(**shape):
    config = transformers.BloomConfig(**{"n_layer": 2, "hidden_size": HIDDEN, "n_head": 8, "vocab_size": 1024, **shape})
    with torch.device("meta"):
        return transformers.BloomForCausalLM(config)


def _block_collectives(table, kind_of):
    ops = table.attrs["ops"]
    kind = table[table["type"] == kind_of]["kind"].iloc[0]
    return ops[(ops["kind"] == kind) & (ops["collective"] != "")]


def test_bloom_reshapes_by_its_rank_s_heads_and_computes_a_quarter_of_each_block_at_tp_4():
    """BLOOM's attention views its fused query_key_value output by its head count and adds ALiBi of
    (batch·heads) rows: on a rank's copy both are its heads/tp (Megatron-LM's heads per partition),
    so each block computes a quarter of its matmuls and runs Megatron-LM's f and g twice."""
    model, tp, hidden = bloom(), 4, HIDDEN
    table = count_layers(model, ids(), tp=tp, tp_plan={**BLOOM_ATTENTION, **BLOOM_MLP})
    blocks = table[table["type"] == "BloomBlock"]
    assert len(blocks) == 2
    for phase in ("forward", "backward"):
        assert blocks[f"rank_{phase}_flops"].to_numpy() == pytest.approx(blocks[f"{phase}_flops"] / tp, rel=1e-12)
    h = hidden
    whole = (2 * h + 3 * h * h + 3 * h + h * h + h + 2 * h + 4 * h * h + 4 * h + 4 * h * h + h) * 4
    held = (2 * h + (3 * h * h + 3 * h) / tp + h * h / tp + h + 2 * h + (4 * h * h + 4 * h) / tp + 4 * h * h / tp + h) * 4
    assert (blocks["param_bytes"] == whole).all() and (blocks["rank_param_bytes"] == held).all()  # biases of rows whole
    seen = _block_collectives(table, "BloomBlock")
    assert list(seen["collective"]) == ["all_reduce"] * 4
    assert list(seen["phase"]) == ["forward", "forward", "backward", "backward"]
    assert ((seen["row_bytes"] + seen["fixed_bytes"]) == ROWS * SEQ * hidden * 4).all()  # the activations, fp32


def test_the_issue_s_plan_for_bloom_176b_counts_at_tp_4():
    """BLOOM-176B's shape (70 layers, 14336 wide, 112 heads, built on meta), its attention sharded
    as the issue planned it: a rank computes a quarter of each attention and the whole MLP, all-reducing
    the activations forward and backward once; its MLP sharded too, a quarter of each block."""
    model = bloom(n_layer=70, hidden_size=14336, n_head=112, vocab_size=250880)
    h, tokens, tp = 14336, 256, 4
    sample = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    table = count_layers(model, sample, tp=tp, tp_plan=BLOOM_ATTENTION)
    blocks = table[table["type"] == "BloomBlock"]
    assert len(blocks) == 70 and (blocks["param_bytes"] == (12 * h * h + 13 * h) * 4).all()
    mlp = 2 * tokens * h * 4 * h * 2  # two matmuls of h × 4h a token, forward
    assert blocks["rank_forward_flops"].to_numpy() == pytest.approx(
        (blocks["forward_flops"] - mlp) / tp + mlp, rel=1e-12)
    assert blocks["rank_backward_flops"].to_numpy() == pytest.approx(
        (blocks["backward_flops"] - 2 * mlp) / tp + 2 * mlp, rel=1e-12)  # the input's gradient and the weight's
    seen = _block_collectives(table, "BloomBlock")
    assert list(seen["collective"]) == ["all_reduce"] * 2 and set(seen["phase"]) == {"forward", "backward"}
    assert ((seen["row_bytes"] + seen["fixed_bytes"]) == tokens * h * 4).all()
    both = count_layers(model, sample, tp=tp, tp_plan={**BLOOM_ATTENTION, **BLOOM_MLP})
    blocks = both[both["type"] == "BloomBlock"]
    assert blocks["rank_forward_flops"].to_numpy() == pytest.approx(blocks["forward_flops"] / tp, rel=1e-12)
    assert len(_block_collectives(both, "BloomBlock")) == 4


def phi3(layers: int = 2):
    config = transformers.Phi3Config(num_hidden_layers=layers, hidden_size=HIDDEN, intermediate_size=688,
                                     num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
                                     pad_token_id=0)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.Phi3ForCausalLM(config)


def test_phi3s_fused_projections_count_at_a_rank_s_share():
    """Phi-3 splits its fused qkv_proj output at its config's head counts: a rank's copy reads them at
    its share (2 of 8 heads, 1 of 4 key-value heads at tp 4), so the fused q|k|v and gate|up its
    own plan gathers (colwise_gather_output, then rowwise_split_input) stay a rank's quarter, as
    a plan of colwise and rowwise shards them: a quarter of each block, Megatron-LM's f and g."""
    model, tp = phi3(), 4
    own = sharded.tensor_parallel_plan(model)
    assert own["model.layers.*.self_attn.qkv_proj"] == "colwise_gather_output"
    table = count_layers(model, ids(), tp=tp)
    blocks = table[table["type"] == "Phi3DecoderLayer"]
    for phase in ("forward", "backward"):
        assert blocks[f"rank_{phase}_flops"].to_numpy() == pytest.approx(blocks[f"{phase}_flops"] / tp, rel=1e-12)
    norms = 2 * HIDDEN * 4
    assert (blocks["rank_param_bytes"] == (blocks["param_bytes"] - norms) / tp + norms).all()
    seen = _block_collectives(table, "Phi3DecoderLayer")
    assert list(seen["collective"]) == ["all_reduce"] * 4  # nothing gathered inside the block
    assert ((seen["row_bytes"] + seen["fixed_bytes"]) == ROWS * SEQ * HIDDEN * 4).all()
    layers = "model.layers.*."
    megatron = {f"{layers}self_attn.qkv_proj": "colwise", f"{layers}self_attn.o_proj": "rowwise",
                f"{layers}mlp.gate_up_proj": "colwise", f"{layers}mlp.down_proj": "rowwise"}
    given = count_layers(model, ids(), tp=tp, tp_plan=megatron)  # (its head whole: this plan leaves lm_head out)
    assert given[given["type"] == "Phi3DecoderLayer"][RANK_COLUMNS].equals(blocks[RANK_COLUMNS])


class _Heads(torch.nn.Module):
    """An attention that reshapes by its own head count, which no config says."""

    def __init__(self, heads: int = 3, width: int = 48):
        super().__init__()
        self.num_heads, self.head_dim = heads, width // heads
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:-1], self.num_heads, 3, self.head_dim).unbind(-2)
        y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.out(y.transpose(1, 2).reshape(*x.shape[:-1], self.num_heads * self.head_dim))


def test_a_module_whose_heads_tp_does_not_divide_has_no_share_and_is_refused_by_name():
    model = torch.nn.Sequential(_Heads(), _Heads())
    sample = torch.randn(4, 16, 48)
    plan = {"*.qkv": "colwise", "*.out": "rowwise"}
    table = count_layers(model, sample, tp=3, tp_plan=plan)  # each rank one of the three heads
    assert (table["rank_forward_flops"] * 3 == table["forward_flops"]).all()
    with pytest.raises(ValueError, match=r"^0 \(_Heads\): tp=2 does not divide its 3 heads \(num_heads\), and each "
                                         r"tensor-parallel rank computes whole heads"):
        count_layers(model, sample, tp=2, tp_plan=plan)
    config = transformers.GPTBigCodeConfig(n_layer=2, n_embd=256, n_head=8, vocab_size=1024, multi_query=True)
    with torch.device("meta"):
        multi_query = transformers.GPTBigCodeForCausalLM(config)  # one key-value head, fused with the queries
    with pytest.raises(ValueError, match=r"tp=2 does not divide the model's 1 key-value heads"):
        count_layers(multi_query, ids(), tp=2, tp_plan=TP_PLANS["gpt_bigcode"])


def test_tp_that_does_not_divide_the_heads_is_refused_with_the_tps_that_do():
    with pytest.raises(ValueError, match=r"tp=3 does not divide the model's 8 attention heads .*tp can be 1, 2, 4, 8"):
        count_layers(llama(), ids(), tp=3)
    with pytest.raises(ValueError, match=r"tp=8 does not divide the model's 4 key-value heads"):
        count_layers(llama(), ids(), tp=8)


def test_a_model_without_a_plan_is_told_how_to_give_one_and_gpt2s_conv1d_shards_as_a_linear():
    """GPT-2 carries no plan; given one, its Conv1D projections (a linear layer, weight stored (in, out))
    shard as the nn.Linear they are, and its attention splits the fused c_attn at its split_size
    divided too: half of each block a rank. A module no style shards is still refused by name."""
    config = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=8, vocab_size=1024)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match=r"carries no tensor-parallel plan .*give one as tp_plan="):
        count_layers(model, ids(), tp=2)
    table = count_layers(model, ids(), tp=2, tp_plan=TP_PLANS["gpt2"])
    blocks = table[table["type"] == "GPT2Block"]
    assert (blocks["rank_forward_flops"] * 2 == blocks["forward_flops"]).all()
    assert (blocks["rank_backward_flops"] * 2 == blocks["backward_flops"]).all()
    assert len(_block_collectives(table, "GPT2Block")) == 4
    with pytest.raises(ValueError, match=r"transformer.h.0.ln_1 \(LayerNorm\): torch's tensor parallelism shards "
                                         r"nn.Linear and nn.Embedding"):
        count_layers(model, ids(), tp=2, tp_plan={"transformer.h.*.ln_1": "colwise"})


def test_a_plan_entry_that_matches_nothing_or_a_style_not_counted_is_refused_by_name():
    with pytest.raises(ValueError, match=r"plan entry 'model.layers.\*.attn.q' matches no module of LlamaForCausalLM"):
        count_layers(llama(), ids(), tp=2, tp_plan={"model.layers.*.attn.q": "colwise"})
    with pytest.raises(ValueError, match=r"style 'moe_tp_experts' \(of model.layers.\*.mlp.experts\) cannot be counted"):
        count_layers(llama(), ids(), tp=2, tp_plan={"model.layers.*.mlp.experts": "moe_tp_experts"})
    with pytest.raises(ValueError, match=r"tp=2 does not divide the width it shards \(687, colwise\)"):
        count_layers(_odd_llama(), ids(), tp=2)
    with pytest.raises(ValueError, match=r"tp is a whole number of ranks from 1, got 0"):
        count_layers(llama(), ids(), tp=0)


def _odd_llama():
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=HIDDEN, intermediate_size=687,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1024)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def test_counting_refuses_a_process_that_has_a_group_of_its_own():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="needs a process group of its own"):
            count_layers(llama(), ids(), tp=2)
    finally:
        dist.destroy_process_group()


def _zoo_model(name):
    config_class, model_class, layers = ZOO[name]
    config = getattr(transformers, config_class)(**{key: 2 for key in layers})
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, model_class)(config)


def _zoo_sample(name, config):
    if name == "vit":
        return torch.empty(2, 3, config.image_size, config.image_size, device="meta")
    rows = torch.zeros(2, 32, dtype=torch.long, device="meta")
    return {"input_ids": rows, "decoder_input_ids": rows} if name in ("t5", "bart") else rows


#: What becomes at tp=2 of each zoo architecture's plan (its config's own, else the one ``TP_PLANS`` gives):
#: ``half``, each block a rank computes half its FLOPs; ``kept``, less than the whole and more than
#: half, the plan keeping modules whole on every rank (the routers; Mixtral's and Qwen2-MoE's routed
#: experts, whole on each rank and computing its 1/tp of the tokens, as the mesh folds them:
#: tests/test_mesh_experts.py; DeepSeek-V3's multi-latent down-projections); or refused naming
#: why there is no share (Falcon's 71 heads; GPT-BigCode's one key-value head, fused with the queries).
ZOO_TP = {**{name: "half" for name in ZOO}, "mixtral": "kept", "qwen2_moe": "kept", "deepseek_v3": "kept",
          "falcon": r"tp=2 does not divide the model's 71 attention heads",
          "gpt_bigcode": r"tp=2 does not divide the model's 1 key-value heads"}


def test_the_zoo_plans_given_are_for_every_config_in_the_zoo_that_carries_none():
    carrying = {name for name, (config_class, _, layers) in ZOO.items()
                if getattr(getattr(transformers, config_class)(**layers), "base_model_tp_plan", None)}
    assert carrying == set(ZOO) - set(TP_PLANS) and len(carrying) == 18


@pytest.mark.parametrize("name", sorted(ZOO))
def test_each_zoo_architecture_counts_at_a_rank_s_share_or_is_refused_by_name(name):
    """Each zoo architecture's plan, applied by torch at tp=2: every module it names in a block is
    sharded (a DTensor weight, half of it a rank), and the block's FLOPs a rank are half its own
    (less than the whole where the plan keeps modules whole); or refused naming why."""
    from torch.distributed.tensor import DTensor, Shard

    model = _zoo_model(name)
    plan = sharded.tensor_parallel_plan(model, TP_PLANS.get(name))
    sample = _zoo_sample(name, model.config)
    if ZOO_TP[name] not in ("half", "kept"):
        with pytest.raises(ValueError, match=ZOO_TP[name]):
            count_layers(model, sample, tp=2, tp_plan=TP_PLANS.get(name))
        return
    table = count_layers(model, sample, tp=2, tp_plan=TP_PLANS.get(name))
    modules = dict(model.named_modules())

    def named(block_name):
        return [sub for sub, _ in modules[block_name].named_modules()
                if sub and sharded.STYLES.get(sharded.style_of(plan, f"{block_name}.{sub}") or "")]

    blocks = table[[bool(named(str(n))) for n in table["name"]]]
    assert len(blocks) >= 2
    if ZOO_TP[name] == "half":
        assert (blocks["rank_forward_flops"] * 2 == blocks["forward_flops"]).all()
        assert (blocks["rank_backward_flops"] * 2 == blocks["backward_flops"]).all()
    else:
        ratio = blocks["forward_flops"] / blocks["rank_forward_flops"]
        assert ((ratio > 1.01) & (ratio < 2)).all(), ratio
    block_name = str(blocks["name"].iloc[0])
    with sharded.fake_group(2) as mesh:
        rank_block = sharded.shard(modules[block_name], block_name, plan, mesh)
        rank_modules = dict(rank_block.named_modules())
        for sub in named(block_name):
            weight = rank_modules[sub].weight
            assert isinstance(weight, DTensor) and isinstance(weight.placements[0], Shard), sub
            assert weight.to_local().numel() * 2 == weight.numel(), sub


def test_multi_latent_attentions_rotary_key_has_its_gradient_all_reduced():
    """DeepSeek-V3's own plan keeps its key-value down-projection whole on every rank
    (``mla_kv_a_proj``); the rotary key it makes reaches the attention past every sharded
    projection, so its gradient is all-reduced in backward, as Hugging Face's style does."""
    model = _zoo_model("deepseek_v3")
    rows, tokens, rope = 2, 32, model.config.qk_rope_head_dim
    assert sharded.tensor_parallel_plan(model)["model.layers.*.self_attn.kv_a_proj_with_mqa"] == "mla_kv_a_proj"
    table = count_layers(model, torch.zeros(rows, tokens, dtype=torch.long, device="meta"), tp=2)
    seen = _block_collectives(table, "DeepseekV3DecoderLayer")
    backward = seen[seen["phase"] == "backward"]
    assert (backward["row_bytes"] + backward["fixed_bytes"] == rows * tokens * rope * 4).sum() == 1


@pytest.mark.parametrize("on_meta", [True, False])
def test_causal_attention_counts_half_the_square(on_meta):
    """A causal kernel skips the blocks above the diagonal (FlashAttention-2's count): half of torch's
    formula, forward and backward, on meta (the memory-efficient kernel) and on the CPU (flash)."""
    from pipexplore.models.opcount import AsOnGPU, flop_counter

    device = "meta" if on_meta else "cpu"
    query = torch.randn(2, 4, 64, 16, device=device, requires_grad=True)
    counts = {}
    for causal in (False, True):
        counter = flop_counter()
        with counter, (AsOnGPU() if on_meta else warnings.catch_warnings()):
            out = torch.nn.functional.scaled_dot_product_attention(query, query, query, is_causal=causal)
            out.sum().backward()
        counts[causal] = sorted(counter.flop_counts["Global"].values())
    assert counts[False][0] == 4 * 2 * 4 * 64 * 64 * 16  # forward: two matmuls of the square
    assert [c * 2 for c in counts[True]] == counts[False]
