"""Training memory a GPU on a mesh, held against Megatron-LM's theoretical memory
(``theoretical_memory_usage``: weights and optimizer with and without its distributed optimizer)
and Korthikanti et al. 2022 (activations with tensor and sequence parallelism), for a GPT and a
Llama shape counted on meta, at three meshes each."""
from __future__ import annotations

import pytest
import torch
import transformers  # the test extra

from pipexplore.devices import Mesh
from pipexplore.models.meta import count_layers
from pipexplore.predict.memory import stage_memory
from pipexplore.predict.mesh_costs import mesh_layer_table

S, MICRO = 128, 2
MESHES = [dict(tp=1, dp=1, zero=False), dict(tp=2, dp=4, zero=True), dict(tp=8, dp=2, zero=False)]


def gpt():
    config = transformers.GPT2Config(n_embd=1024, n_head=16, n_layer=4, vocab_size=1024, n_positions=S,
                                     activation_function="gelu", attn_implementation="eager")
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config).to(torch.bfloat16), config


def llama():
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                                      num_key_value_heads=4, num_hidden_layers=4, vocab_size=1024)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16), config


def megatron_block_parameters(config, *, swiglu: bool, norm_size: int, groups: int) -> float:
    """Megatron-LM's parameters of one transformer layer (its compute_weight_and_optimizer_memory)."""
    h = config.hidden_size
    ffn = getattr(config, "intermediate_size", None) or 4 * h
    attention = 2 * h * h * (1 + groups / config.num_attention_heads)
    return 2 * h * (ffn * (1.5 if swiglu else 1.0) + norm_size) + attention


@pytest.mark.parametrize("shape", ["gpt", "llama"])
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"tp{m['tp']}-dp{m['dp']}-{'zero1' if m['zero'] else 'ddp'}")
def test_weights_and_optimizer_a_gpu_are_megatrons(shape, mesh):
    model, config = gpt() if shape == "gpt" else llama()
    ids = torch.zeros(4 * MICRO, S, dtype=torch.long, device="meta")
    table = count_layers(model, ids, microbatch_rows=MICRO)
    names = list(table["name"])
    block = "transformer.h" if shape == "gpt" else "model.layers"
    splits = [names.index(f"{block}.1"), names.index(f"{block}.3")]  # the middle stage: blocks 1 and 2
    held = stage_memory(table, splits, peak_activations=[0.0] * 3, optimizer=torch.optim.AdamW,
                        mixed_precision=True, tp=mesh["tp"], dp=mesh["dp"],
                        data_parallel="zero1" if mesh["zero"] else "ddp").iloc[1]
    layer = megatron_block_parameters(config, swiglu=shape == "llama", norm_size=2 if shape == "gpt" else 1,
                                      groups=getattr(config, "num_key_value_heads", config.num_attention_heads))
    per_parameter = 6 + 12 / mesh["dp"] if mesh["zero"] else 18  # Megatron: bytes a parameter
    megatron = 2 * layer / mesh["tp"] * per_parameter
    ours = held["param_bytes"] + held["grad_bytes"] + held["optimizer_bytes"]
    assert abs(ours - megatron) / megatron < 0.01, (ours, megatron)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_activations_a_gpu_are_korthikantis_with_tensor_and_sequence_parallelism(tp):
    """Per layer and micro-batch s·b·h·(34 + 5·a·s/h) bytes (16-bit, dropout on, eager attention,
    GELU, no recomputation), divided by t with sequence parallelism (Korthikanti et al. 2022, Table 2):
    the rank table's, whose timeline the stage table's activations are read from, taken as they are."""
    model, config = gpt()
    ids = torch.zeros(4 * MICRO, S, dtype=torch.long, device="meta")
    table = count_layers(model, ids, microbatch_rows=MICRO)
    names = list(table["name"])
    splits = [names.index("transformer.h.1"), names.index("transformer.h.3")]
    h, a = config.n_embd, config.n_head
    saved = table["saved_bytes"].to_numpy() / 4  # a micro-batch's (the table counts the whole batch of 4)
    middle = float(saved[splits[0]:splits[1]].sum())
    per_layer = S * MICRO * h * (34 + 5 * a * S / h)
    assert abs(middle - 2 * per_layer) / (2 * per_layer) < 0.01  # the count is Korthikanti's, unsharded
    rank = mesh_layer_table(table, Mesh(tp=tp), [f"H100:{i}" for i in range(tp)])
    kept = float(rank["saved_bytes"].to_numpy()[splits[0]:splits[1]].sum()) / 4  # a GPU's, a micro-batch
    assert abs(kept - 2 * per_layer / tp) / (2 * per_layer / tp) < 0.01
    with_sp = stage_memory(table, splits, peak_activations=[0.0, kept, 0.0], tp=tp).iloc[1]
    assert with_sp["activation_bytes"] == kept
    if tp > 1:  # without sequence parallelism: refused, not guessed
        with pytest.raises(ValueError, match="plan it with sequence_parallel=True"):
            stage_memory(table, splits, peak_activations=[0.0, middle, 0.0], tp=tp, sequence_parallel=False)


def test_fsdp_shards_everything_and_gathers_a_layer_at_a_time():
    model, _ = llama()
    ids = torch.zeros(4 * MICRO, S, dtype=torch.long, device="meta")
    table = count_layers(model, ids, microbatch_rows=MICRO)
    names = list(table["name"])
    splits = [names.index("model.layers.1"), names.index("model.layers.3")]
    options = dict(peak_activations=[0.0] * 3, optimizer=torch.optim.AdamW, mixed_precision=True)
    whole = stage_memory(table, splits, **options).iloc[1]
    sharded = stage_memory(table, splits, dp=4, data_parallel="fsdp", **options).iloc[1]
    kept = stage_memory(table, splits, dp=4, data_parallel="fsdp", reshard_after_forward=False, **options).iloc[1]
    for column in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert sharded[column] == pytest.approx(whole[column] / 4)
    assert sharded["gathered_bytes"] == pytest.approx(whole["param_bytes"] / 2)  # one of the stage's two blocks
    assert kept["gathered_bytes"] == pytest.approx(whole["param_bytes"])
    with pytest.raises(ValueError, match="unknown data_parallel 'zero3': ddp, zero1, fsdp"):
        stage_memory(table, splits, data_parallel="zero3", **options)
