"""Models that do not fit: layer tables counted on meta tensors (pipexplore.models.meta) and
timed block by block on a device that holds one block at a time (pipexplore.models.blockwise)."""
from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn
import transformers  # the test extra (declared: a missing one fails)

from pipexplore.models import blockwise, trace
from pipexplore.models.blockwise import profile_blockwise
from pipexplore.models.meta import COUNT_COLUMNS, count_layers
from pipexplore.models.opcount import OP_COLUMNS
from pipexplore.profiling.sequential import FIT_COLUMNS, LAYER_COLUMNS

logging.getLogger("transformers").setLevel(logging.ERROR)

ROWS, SEQ, VOCAB, HIDDEN = 4, 16, 64, 32


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 8))


def llama_config() -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                    vocab_size=VOCAB, tie_word_embeddings=False, attn_implementation="eager",
                                    use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def meta_llama() -> nn.Module:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(llama_config())


def all_meta(model: nn.Module) -> bool:
    return all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def test_sequential_counts_each_linear_and_shares_identical_layers():
    with torch.device("meta"):
        model = mlp()
    sample = torch.empty(8, 16, device="meta")
    table = count_layers(model, sample)
    assert list(table.columns) == COUNT_COLUMNS
    assert list(table["name"]) == [name for name, _ in model.named_children()]
    for k, layer in enumerate(model):
        if isinstance(layer, nn.Linear):  # every input is floating, so every Linear computes its input's gradient
            assert table["forward_flops"][k] == 2 * 8 * layer.in_features * layer.out_features
            assert table["backward_flops"][k] == 2 * table["forward_flops"][k]
    assert table["kind"][2] == table["kind"][4] != table["kind"][0]  # Linear(32, 32) on the same input, twice
    assert table["kind"][1] == table["kind"][3] == table["kind"][5]  # every ReLU sees 8 × 32
    assert table.loc[2].drop(["name", "order"]).equals(table.loc[4].drop(["name", "order"]))
    assert table["params"][0] == 16 * 32 + 32 and table["param_bytes"][0] == 4 * (16 * 32 + 32)
    assert table["grad_bytes"].equals(table["param_bytes"])
    assert table["output_bytes"][0] == 8 * 32 * 4
    assert table["saved_bytes"][1] > 0 and table["uncounted"].eq("").all() and table["stash"].eq("").all()
    ops = table.attrs["ops"]
    assert list(ops.columns) == [*OP_COLUMNS, "outside"] and ops.attrs["rows"] == 8
    assert table.attrs["batch"] == 8 and table.attrs["source"] == "counted" and table.attrs["notes"] == []
    first = ops[ops["kind"] == table["kind"][0]]
    backward = first[first["phase"] == "backward"]
    assert set(backward["grad"]) == {"input", "weight"}
    mm = first[(first["op"] == "aten.addmm")].iloc[0]
    assert mm["fixed_bytes"] == 4 * (16 * 32 + 32) and mm["row_bytes"] == 4 * 8 * (16 + 32)
    weight_grad = backward[(backward["op"] == "aten.mm") & (backward["grad"] == "weight")].iloc[0]
    assert weight_grad["fixed_bytes"] == 4 * 16 * 32  # it writes the weight's gradient
    # Counted at 2 rows, scaled to the batch of 8: FLOPs and bytes are linear in the rows.
    half = count_layers(model, sample, microbatch_rows=2)
    assert half.attrs["ops"].attrs["rows"] == 2
    for column in ("forward_flops", "backward_flops", "output_bytes", "saved_bytes"):
        assert half[column].tolist() == table[column].tolist()
    assert all_meta(model)


def test_tiny_llama_on_meta_has_the_tracers_rows_and_the_embedding_and_loss_outside():
    model = meta_llama()
    ids = torch.zeros(ROWS, SEQ, dtype=torch.long, device="meta")
    table = count_layers(model, {"input_ids": ids, "labels": ids}, loss_fn=lambda out, _: out.loss)
    assert all_meta(model)  # nothing was materialised
    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(llama_config())
    real_ids = torch.randint(1, VOCAB, (ROWS, SEQ))
    traced = trace.candidates(real, {"input_ids": real_ids, "labels": real_ids}, loss_fn=lambda out, _: out.loss,
                              repeats=1, warmup=0)
    assert list(table["name"]) == list(traced["name"])  # execution order: rotary_emb before the layers
    assert sorted(table["name"]) == sorted(name for name, _ in trace.candidate_modules(model))
    assert list(table["stash"]) == list(traced["stash"]) and list(table["pop"]) == list(traced["pop"])
    layers = table[table["name"].str.startswith("model.layers.")]
    assert len(layers) == 3 and layers["kind"].nunique() == 1
    assert layers.drop(columns=["name", "order", "stash", "pop", "stash_keys", "pop_keys"]).nunique().max() == 1
    tokens = ROWS * SEQ
    h, ffn, kv = HIDDEN, 64, HIDDEN // 2
    projections = 2 * tokens * (h * h + 2 * h * kv + h * h + 3 * h * ffn)
    attention = 2 * 2 * ROWS * 4 * SEQ * SEQ * (h // 4)
    assert layers["forward_flops"].iloc[0] == projections + attention
    assert layers["backward_flops"].iloc[0] == 2 * (projections + attention)
    head = table.iloc[-1]
    assert head["name"] == "lm_head" and head["forward_flops"] == 2 * tokens * h * VOCAB
    assert head["kind"].endswith("+outside:lm_head")  # the loss runs after the last candidate: the last row's
    ops = table.attrs["ops"]
    loss_ops = set(ops[ops["kind"] == head["kind"]]["op"])
    assert {"aten._log_softmax", "aten.nll_loss_forward", "aten.nll_loss_backward"} <= loss_ops
    first = table.iloc[0]  # the mask and positions are built before the first candidate: the first row's
    assert first["name"] == "model.embed_tokens" and first["kind"].endswith("+outside:model.embed_tokens")
    assert first["forward_kernels"] > 1 and first["backward_kernels"] == 1 and first["backward_flops"] == 0
    assert table["param_bytes"].sum() == sum(p.numel() * 4 for p in model.parameters())
    # The same model with real weights and tokens counts the same (eager attention, no dropout).
    real_table = count_layers(real, {"input_ids": real_ids, "labels": real_ids}, loss_fn=lambda out, _: out.loss)
    for column in ("kind", "forward_flops", "backward_flops", "saved_bytes", "output_bytes", "forward_kernels"):
        assert real_table[column].tolist() == table[column].tolist(), column


@torch.library.custom_op("pipexplore_test::mystery_mm", mutates_args=())
def mystery_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


@mystery_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


mystery_mm.register_autograd(lambda ctx, grad: (grad @ ctx.w.t(), ctx.x.t() @ grad),
                             setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0])
                             or setattr(ctx, "w", inputs[1]))


class Mystery(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mystery_mm(x, self.weight)


def test_an_operator_without_a_flop_formula_is_an_unknown_cost_not_zero():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), Mystery(), nn.ReLU())
    table = count_layers(model, torch.empty(4, 16, device="meta"))
    assert math.isnan(table["forward_flops"][1]) and table["uncounted"][1] == "pipexplore_test.mystery_mm"
    assert table["backward_flops"][1] == 2 * 2 * 4 * 16 * 16  # its backward is two counted matmuls
    assert table["forward_flops"][0] == 2 * 4 * 16 * 16 and table["uncounted"][0] == ""
    assert table["forward_flops"][2] == 0  # elementwise: 0 FLOPs, not unknown
    assert any("1 (Mystery)" in note and "mystery_mm" in note for note in table.attrs["notes"])
    assert table.attrs["ops"]["flops"].isna().sum() == 1


def test_saved_activations_of_a_gpt_block_match_megatrons_formula():
    """Korthikanti et al. 2022 (eq. 1): a transformer layer keeps s·b·h·(34 + 5·a·s/h) bytes for
    backward in 16-bit with dropout on — layernorm inputs, QKV input, Q and K, softmax output, the
    attention dropout's one-byte mask and output, V, the output projection's input, the MLP's
    input, GELU input and output, three one-byte dropout masks. What the formula leaves out and
    the count holds: the two layernorms' statistics (mean and reciprocal standard deviation,
    fp32 per token: 16·s·b bytes). GPT-2's additive causal mask is added, not saved."""
    s, b, h, a = 64, 2, 128, 4
    config = transformers.GPT2Config(n_positions=s, n_embd=h, n_layer=2, n_head=a, vocab_size=VOCAB,
                                     activation_function="gelu", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                     attn_implementation="eager", use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
    model.train()
    table = count_layers(model, {"input_ids": torch.zeros(b, s, dtype=torch.long, device="meta")})
    blocks = table[table["name"].str.startswith("transformer.h.")]
    megatron = s * b * h * (34 + 5 * a * s / h)
    assert len(blocks) == 2 and blocks["kind"].nunique() == 1
    saved = float(blocks["saved_bytes"].iloc[0])
    assert abs(saved - megatron) / megatron < 0.02
    assert saved - megatron == 16 * s * b
    assert all_meta(model)


def test_blockwise_times_each_kind_once_one_block_at_a_time(monkeypatch):
    model = meta_llama()
    made: list[nn.Module] = []
    real_materialise = blockwise.materialise

    def watched(block: nn.Module, device: torch.device) -> nn.Module:
        assert all(all_meta(earlier) for earlier in made), "a block was still materialised"
        assert all_meta(model)
        made.append(real_materialise(block, device))
        return made[-1]

    monkeypatch.setattr(blockwise, "materialise", watched)
    ids = torch.zeros(ROWS, SEQ, dtype=torch.long, device="meta")
    table = profile_blockwise(model, {"input_ids": ids}, device="cpu", microbatch_rows=[2, 4], repeats=2)
    assert len(made) == 5  # embed_tokens, rotary_emb, one decoder layer for all three, norm, lm_head
    assert all(all_meta(block) for block in made) and all_meta(model)
    assert list(table.columns) == LAYER_COLUMNS + ["saved_bytes"] + FIT_COLUMNS + ["kind", "order"]
    counted = count_layers(model, {"input_ids": ids})
    assert list(table["name"]) == list(counted["name"])
    assert (table["forward"] > 0).all() and (table["backward"][table["name"] != "model.rotary_emb"] > 0).all()
    numbers = table[["forward", "backward", "forward_a", "forward_b", "backward_a", "backward_b", "share_forward",
                     "share_backward", "spread", "saved_bytes_per_row", "output_bytes_per_row"]]
    assert numbers.notna().all().all() and (numbers >= 0).all().all() and numbers.map(math.isfinite).all().all()
    assert table["input_grad_ratio"].isna().all() and (table["checkpointed_ratio"] > 0).all()
    layers = table[table["name"].str.startswith("model.layers.")]
    assert layers["forward"].nunique() == layers["kind"].nunique() == layers["checkpointed_ratio"].nunique() == 1
    # what autograd saves on the device is what the meta count says, block for block (the count's first and last
    # rows also hold what runs outside the blocks: the mask building, the loss)
    inside = ~counted["kind"].str.contains("+outside", regex=False)
    assert inside.sum() == 5 and table["saved_bytes"][inside].tolist() == counted["saved_bytes"][inside].tolist()
    assert table.attrs["rows"] == (2, 4) and table.attrs["batch"] == ROWS and table.attrs["notes"] == []


def test_blockwise_times_a_checkpointed_forward_without_autograd(monkeypatch):
    """A checkpointed micro-batch's forward runs without autograd (for GPT-2's block on a CPU,
    slower than with it): each kind's forward is timed both ways, and the prediction costs a
    checkpointed forward at the ratio."""
    import numpy as np

    from pipexplore.predict.costs import layer_seconds

    measured: list[tuple[float, list[bool]]] = []
    real = blockwise.without_autograd_ratio

    def watched(forward, device, repeats):
        modes: list[bool] = []

        def noting():
            modes.append(torch.is_grad_enabled())
            return forward()

        measured.append((real(noting, device, repeats), modes))
        return 0.5

    monkeypatch.setattr(blockwise, "without_autograd_ratio", watched)
    ids = torch.zeros(ROWS, SEQ, dtype=torch.long, device="meta")
    table = profile_blockwise(meta_llama(), {"input_ids": ids}, device="cpu", microbatch_rows=[2], repeats=1)
    assert len(measured) == 5  # each kind once
    assert all(ratio > 0 and math.isfinite(ratio) and modes == [False, True] * 2 for ratio, modes in measured)
    assert (table["checkpointed_ratio"] == 0.5).all()
    assert np.allclose(layer_seconds(table, 2, "checkpointed"), 0.5 * layer_seconds(table, 2, "forward"))


def test_blockwise_refuses_a_block_larger_than_the_device_before_allocating(monkeypatch):
    model = meta_llama()
    monkeypatch.setattr(blockwise, "available_memory", lambda device: 50_000)
    monkeypatch.setattr(blockwise, "materialise", lambda *args: pytest.fail("materialised before the check"))
    ids = torch.zeros(ROWS, SEQ, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"block 'model\.layers\.0' \(LlamaDecoderLayer\) needs .* GiB on cpu .*"
                                         r"more than the 4\.66e-05 GiB of memory available"):
        profile_blockwise(model, {"input_ids": ids}, device="cpu")
    assert all_meta(model)
