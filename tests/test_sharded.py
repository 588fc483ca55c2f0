"""A tensor-parallel rank, counted by torch itself: each block sharded by ``parallelize_module`` on a
fake process group, its FLOPs a rank, its collectives (equal to what ``CommDebugMode`` sees torch's
own modules run) and its parameter bytes; the model's own ``base_model_tp_plan`` or one given; and
every plan that cannot shard a model refused by name."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.distributed as dist
import transformers

from pipexplore.models import sharded
from pipexplore.models.meta import count_layers
from pipexplore.models.opcount import count_call

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


def test_a_model_whose_code_reads_whole_shapes_is_refused_by_name():
    config = transformers.BloomConfig(n_layer=2, hidden_size=256, n_head=8, vocab_size=1024)
    with torch.device("meta"):
        model = transformers.BloomForCausalLM(config)
    plan = {"transformer.h.*.self_attention.query_key_value": "colwise",
            "transformer.h.*.self_attention.dense": "rowwise"}
    with pytest.raises(ValueError, match=r"transformer.h.0 \(BloomBlock\) does not run sharded by the tensor-parallel "
                                         r"plan at tp=2: .*whole model's shapes"):
        count_layers(model, ids(), tp=2, tp_plan=plan)


def test_tp_that_does_not_divide_the_heads_is_refused_with_the_tps_that_do():
    with pytest.raises(ValueError, match=r"tp=3 does not divide the model's 8 attention heads .*tp can be 1, 2, 4, 8"):
        count_layers(llama(), ids(), tp=3)
    with pytest.raises(ValueError, match=r"tp=8 does not divide the model's 4 key-value heads"):
        count_layers(llama(), ids(), tp=8)


def test_a_model_without_a_plan_is_told_how_to_give_one():
    config = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=8, vocab_size=1024)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match=r"carries no tensor-parallel plan .*give one as tp_plan="):
        count_layers(model, ids(), tp=2)
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.c_attn \(Conv1D\): torch's tensor parallelism shards "
                                         r"nn.Linear and nn.Embedding"):
        count_layers(model, ids(), tp=2, tp_plan={"transformer.h.*.attn.c_attn": "colwise"})


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
    from tests.zoo_models import ZOO

    config_class, model_class, layers = ZOO[name]
    config = getattr(transformers, config_class)(**{key: 2 for key in layers})
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, model_class)(config)


#: The zoo's architectures whose config carries a tensor-parallel plan, and what becomes of it at tp=2:
#: sharded, or refused naming why (experts sharded by Hugging Face's own kernels; a fused projection
#: its code splits by the whole model's head count).
ZOO_PLANS = {**{name: "sharded" for name in ("codegen", "cohere", "gemma", "gemma2", "gpt_neox", "gptj", "granite",
                                             "llama", "mistral", "olmo", "phi", "qwen2", "qwen3", "starcoder2")},
             "deepseek_v3": "style 'moe_tp_experts'", "mixtral": "style 'moe_tp_experts'",
             "qwen2_moe": "style 'moe_tp_experts'", "phi3": "does not run sharded by the tensor-parallel plan"}


def test_the_zoo_plans_are_every_config_in_the_zoo_that_carries_one():
    from tests.zoo_models import ZOO

    carrying = {name for name, (config_class, _, layers) in ZOO.items()
                if getattr(getattr(transformers, config_class)(**layers), "base_model_tp_plan", None)}
    assert carrying == set(ZOO_PLANS)


@pytest.mark.parametrize("name", sorted(ZOO_PLANS))
def test_each_zoo_plan_shards_every_module_it_names(name):
    """The plan a zoo config carries, applied by torch at tp=2: every module it names in a block is
    sharded (a DTensor weight, half of it a rank) and the block's FLOPs a rank are half its own."""
    from torch.distributed.tensor import DTensor, Shard

    model = _zoo_model(name)
    plan = sharded.tensor_parallel_plan(model)
    sample = torch.zeros(2, 32, dtype=torch.long, device="meta")
    if ZOO_PLANS[name] != "sharded":
        with pytest.raises(ValueError, match=ZOO_PLANS[name]):
            count_layers(model, sample, tp=2)
        return
    table = count_layers(model, sample, tp=2)
    blocks = table[table["rank_forward_flops"] > 0]
    assert len(blocks) >= 2 and (blocks["rank_forward_flops"] * 2 == blocks["forward_flops"]).all()
    block_name = str(blocks["name"].iloc[0])
    block = dict(model.named_modules())[block_name]
    named = [sub for sub, _ in block.named_modules() if sub and sharded.STYLES.get(
        sharded.style_of(plan, f"{block_name}.{sub}") or "")]
    assert named, f"the plan names nothing in {block_name}"
    with sharded.fake_group(2) as mesh:
        rank_block = sharded.shard(block, block_name, plan, mesh)
        modules = dict(rank_block.named_modules())
        for sub in named:
            weight = modules[sub].weight
            assert isinstance(weight, DTensor) and isinstance(weight.placements[0], Shard), sub
            assert weight.to_local().numel() * 2 == weight.numel(), sub


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
