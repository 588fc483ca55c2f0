"""benchmarks/megatron_bridge_moe.py: a row of Megatron-Bridge's MoE table planned, its printed line parsed."""
import re

import pandas as pd
import pytest
import torch

from benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def bridge():
    megatron_bridge_moe = benchmark_script("megatron_bridge_moe")
    return megatron_bridge_moe


def test_a_row_is_planned_and_its_printed_line_parses(bridge, capsys):
    assert bridge.main(["--rows", "qwen3-30b"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == bridge.HEADER and len(lines) == 3
    fields = lines[1].split()
    assert fields[:3] == ["Qwen3-30B-A3B", "16", "fp8"]
    step, compute, a2a, bubble, optim = map(float, fields[9:14])
    predicted, published = (float(f.replace(",", "")) for f in fields[14:16])
    error = float(fields[16].rstrip("%")) / 100
    assert published == 8960
    assert predicted == pytest.approx(1024 * 4096 / step / 16, rel=2e-3)  # tokens a second a GPU from the step
    assert error == pytest.approx(predicted / published - 1, abs=1e-3)
    assert compute > 0 and a2a > 0 and optim > 0
    assert compute + a2a + bubble + optim == pytest.approx(step, rel=0.01)  # one stage: the step is its GPU's
    hidden = float(fields[17].rstrip("%")) / 100
    assert hidden > error  # the all-to-all hidden can only be faster
    assert re.match(r"median \|error\| [\d.]+%, max [\d.]+%", lines[2])


def test_the_pipeline_splits_follow_megatron(bridge):
    names = ["model.embed_tokens", "model.rotary_emb", *(f"model.layers.{i}" for i in range(94)), "model.norm",
             "lm_head"]
    splits = bridge.stage_splits(names, 32, True)  # the embedding and the loss each count as a layer: 96 = 32 × 3
    assert len(splits) == 31 and names[splits[0]] == "model.layers.2" and names[splits[-1]] == "model.layers.92"
    names = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(36)), "model.norm", "lm_head"]
    assert [names[s] for s in bridge.stage_splits(names, 4, False)] == [
        "model.layers.9", "model.layers.18", "model.layers.27"]
    with pytest.raises(ValueError, match="evenly"):
        bridge.stage_splits(names, 5, False)


def test_fp8_marks_only_the_decoder_layers_linear_gemms(bridge):
    ops = pd.DataFrame({"kind": ["Qwen3MoeDecoderLayer-2"] * 3 + ["Linear-4"],
                        "op": ["aten.mm", "aten._grouped_mm", "aten._scaled_dot_product_efficient_attention",
                               "aten.mm"],
                        "dtype": ["bfloat16"] * 4, "flops": [1.0, 1.0, 1.0, 1.0]})
    ops.attrs["rows"] = 1
    marked = bridge._as_fp8(ops)
    assert list(marked["dtype"]) == ["float8", "float8", "bfloat16", "bfloat16"] and marked.attrs["rows"] == 1


def test_a_sliding_window_is_counted_as_its_tiles(bridge):
    from torch.utils.flop_counter import FlopCounterMode

    q = torch.zeros(1, 4, 1024, 64)
    kv = torch.zeros(1, 2, 1024, 64)

    def flops(window):
        with FlopCounterMode(display=False) as counter:
            out, _ = bridge.fused_sink_attention(None, q, kv, kv, None, sliding_window=window)
        assert out.shape == (1, 1024, 4, 64)
        return counter.get_total_flops()

    assert flops(128) == pytest.approx(flops(None) * 2 * 128 / 1024)  # 2w keys a query, against all of them


def test_gpt_oss_recomputes_its_norms_and_experts_activation_in_backward(bridge):
    """``recompute_modules=["layernorm", "moe_act"]``: a GPT-OSS layer's two RMSNorms (each, a
    token: its bf16 row cast to fp32 (3 × 2h bytes), squared (4), its mean read (2), scaled (4), by
    the weight (4), cast back (3): 20 × 2h, and 24 bytes of its per-token scale) and the experts'
    activation on 4 copies of each token (clamp, clamp, ×α, sigmoid, ×, +1, ×: 16 × 2I bytes a copy)
    run again in its backward; the row's plan adds them to each decoder layer's backward."""
    model = bridge.gpt_oss_120b()
    tokens, h, i = 256, 2880, 2880
    norms = bridge.recomputed_ops(model, ("layernorm",), tokens)
    act = bridge.recomputed_ops(model, ("moe_act",), tokens)
    assert (norms["row_bytes"].sum(), norms["fixed_bytes"].sum()) == (2 * tokens * (20 * 2 * h + 24), 2 * 2 * h)
    assert act["row_bytes"].sum() == 16 * tokens * 4 * 2 * i and (act["flops"] == 0).all()
    both = bridge.recomputed_seconds(model, ("layernorm", "moe_act"), tokens)
    apart = bridge.recomputed_seconds(model, ("layernorm",), tokens) + bridge.recomputed_seconds(model, ("moe_act",),
                                                                                              tokens)
    assert 0.9 * apart < both <= apart  # (issued back to back, the host's launches overlap the kernels before)
    bytes_ = norms["row_bytes"].sum() + norms["fixed_bytes"].sum() + act["row_bytes"].sum()
    assert both > bytes_ / 3.35e12  # no faster than the H100's HBM3 reads and writes them
    with pytest.raises(ValueError, match="core_attn"):
        bridge.recomputed_seconds(model, ("core_attn",), tokens)
    table = pd.DataFrame({"name": ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"],
                          "backward_b": [1.0, 2.0, 3.0, 4.0], "backward": [8.0, 16.0, 24.0, 32.0]})
    table.attrs["batch"] = 8
    added = bridge.with_recompute(table, 0.5)
    assert list(added["backward_b"]) == [1.0, 2.5, 3.5, 4.0] and list(added["backward"]) == [8.0, 20.0, 28.0, 32.0]
    rows = {r.key: r for r in bridge.TABLE}
    assert rows["gpt-oss"].recompute == ("layernorm", "moe_act") and not rows["qwen3-30b"].recompute
    assert [rows[k].dispatcher for k in ("gpt-oss", "qwen3-30b", "qwen3-235b")] == ["alltoall", "hybridep", "alltoall"]


def test_fp8_current_scaling_adds_te_quantisation_kernels_at_their_bytes(bridge):
    """Transformer Engine's FP8 current scaling on Hopper: each GEMM input and output gradient is
    quantised once (amax: 2 bytes an element read; cast-transpose: 2 read, 1 + 1 written; a cast
    to one layout: 2 read, 1 written), four kernels a quantiser (zero amax, amax, scale, cast), two
    after the norm that computed the amax, one quantiser an expert. A layer of hidden 64, 4 query
    and 2 key-value heads of 16, 8 experts of 32 top-2, on 128 tokens, ep 2 (4 experts a GPU, 256
    token copies), tp 1: each row's bytes and launches by hand, and on the catalogue's H100 the
    layer's phases grow by their kernels' device seconds (2 µs each) and bytes at 90 % of 3.35 TB/s
    (the layer is device-bound: its host is ahead)."""
    from types import SimpleNamespace

    from pipexplore.predict.roofline import kind_seconds

    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    q = bridge.fp8_quantise_ops(config, 128, tp=1, ep=2)
    assert list(zip(q["phase"], q["row_bytes"], q["kernels"])) == [
        ("forward", 128 * 64 * 4, 2),  # linear_qkv input: the norm's amax, cast-transpose
        ("forward", 128 * 64 * 5, 4),  # linear_proj input: amax + rowwise cast (save_original_input)
        ("forward", 256 * 64 * 6, 16),  # fc1 input: amax + cast-transpose, 4 experts
        ("forward", 256 * 32 * 6, 16),  # fc2 input
        ("backward", 256 * 64 * 6, 16),  # fc2 grad output
        ("backward", 256 * 64 * 6, 16),  # fc1 grad output (2 × 32 wide)
        ("backward", 128 * 64 * 6, 4),  # linear_proj grad output
        ("backward", 128 * 64 * 5, 4),  # linear_proj input again, columnwise
        ("backward", 128 * 128 * 6, 4),  # linear_qkv grad output ((4 + 2·2) × 16 wide)
    ]
    assert (q["flops"] == 0).all() and (q["collective"] == "").all()
    sharded = bridge.fp8_quantise_ops(config, 128, tp=2, ep=2)  # sequence parallel: rowwise, amax reduced, gathered
    assert list(zip(sharded["op"], sharded["row_bytes"], sharded["kernels"]))[:2] == [
        ("te.amax all_reduce", 0.0, 1), ("te.cast linear_qkv input", 64 * 64 * 3, 2)]
    assert list(sharded.loc[sharded["collective"] == "all_reduce", "fixed_bytes"]) == [4.0, 4.0]
    assert sharded.loc[sharded["op"] == "te.transpose linear_qkv input", "row_bytes"].item() == 128 * 64 * 2
    assert sharded.loc[sharded["op"] == "te.amax+cast_transpose linear_fc1 input", "row_bytes"].item() == 128 * 64 * 6

    layer = pd.DataFrame({"kind": ["Qwen3MoeDecoderLayer-2"] * 2, "phase": ["forward", "backward"],
                          "op": ["aten.add"] * 2, "dtype": ["bfloat16"] * 2, "flops": [0.0, 0.0],
                          "fixed_bytes": [0.0, 0.0], "row_bytes": [3.0e9, 6.0e9], "outside": [False, False]})
    layer.attrs["rows"] = 1
    added = bridge.with_quantisation(layer, q)
    assert added.attrs["rows"] == 1 and len(added) == 2 + len(q)
    before = kind_seconds(layer, "H100", 1).loc["Qwen3MoeDecoderLayer-2"]
    after = kind_seconds(added, "H100", 1).loc["Qwen3MoeDecoderLayer-2"]
    bandwidth = 3.35e12 * 0.90
    forward = 38 * 2e-6 + (32768 + 40960 + 98304 + 49152) / bandwidth
    backward = 44 * 2e-6 + (98304 + 98304 + 49152 + 40960 + 98304) / bandwidth
    assert after["forward"] - before["forward"] == pytest.approx(forward, rel=1e-9)
    assert after["backward"] - before["backward"] == pytest.approx(backward, rel=1e-9)


def test_the_router_gemms_stay_bf16(bridge):
    """Megatron-Core's router (``router_gating_linear``) is no Transformer Engine module: a
    decoder layer's plain GEMM with a dimension of the expert count keeps its dtype."""
    ops = pd.DataFrame({"kind": ["Qwen3MoeDecoderLayer-2"] * 3, "op": ["aten.mm", "aten.mm", "aten._grouped_mm"],
                        "dtype": ["bfloat16"] * 3, "flops": [1.0] * 3, "gemm_m": [4096.0, 4096.0, 256.0],
                        "gemm_n": [2048, 128, 1536], "gemm_k": [2048.0, 2048.0, 2048.0]})
    ops.attrs["rows"] = 1
    assert list(bridge._as_fp8(ops, 128)["dtype"]) == ["float8", "bfloat16", "float8"]
    assert list(bridge._as_fp8(ops)["dtype"]) == ["float8", "float8", "float8"]
