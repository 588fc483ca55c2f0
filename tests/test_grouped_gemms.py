"""A mixture of experts' grouped GEMMs counted as their groups' GEMMs (an expert's tokens × its widths)
and costed by the kernel model's tiles and waves as the batch of those GEMMs, on a GPU holding all the
experts or ``1/ep`` of them (fewer groups, each on ``ep`` times the tokens)."""
from __future__ import annotations

import warnings

import pytest
import torch
import transformers

from pipexplore.devices import device_spec
from pipexplore.models.experts import regrouped
from pipexplore.models.meta import count_layers
from pipexplore.predict.kernels import gemm_seconds, gpu_kernels
from pipexplore.predict.roofline import op_seconds

HIDDEN, FFN, EXPERTS, TOP_K, ROWS, TOKENS = 1024, 512, 16, 4, 2, 512


@pytest.fixture(scope="module")
def grouped():
    """The experts' grouped GEMMs of one Qwen3-MoE layer counted on meta (2 rows of 512 tokens)."""
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=FFN, intermediate_size=FFN,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=64, num_experts=EXPERTS, num_experts_per_tok=TOP_K, vocab_size=1000)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    table = count_layers(model, torch.zeros(ROWS, TOKENS, dtype=torch.long, device="meta"))
    ops = table.attrs["expert_ops"]
    out = ops[ops["op"].astype(str) == "aten._grouped_mm"].copy()
    out.attrs = dict(ops.attrs)
    return out


def test_each_grouped_gemm_is_its_experts_gemms_of_their_tokens(grouped):
    """Balanced routing: each of the 16 experts gets 2·512·4/16 = 256 of the routed tokens. Forward:
    gate-and-up (256 × 1024 × 1024: N = 2·ffn), down (256 × 1024 × 512); backward the input
    gradients (M the tokens) and the weights' (K the tokens)."""
    per_expert = ROWS * TOKENS * TOP_K // EXPERTS
    shapes = sorted((p, int(b), float(m), int(n), float(k), rows) for p, b, m, n, k, rows in zip(
        grouped["phase"], grouped["gemm_batch"], grouped["gemm_m"], grouped["gemm_n"], grouped["gemm_k"],
        grouped["gemm_rows"]))
    assert shapes == sorted([
        ("forward", EXPERTS, per_expert, 2 * FFN, HIDDEN, "m"), ("forward", EXPERTS, per_expert, HIDDEN, FFN, "m"),
        ("backward", EXPERTS, per_expert, FFN, HIDDEN, "m"), ("backward", EXPERTS, HIDDEN, FFN, per_expert, "k"),
        ("backward", EXPERTS, per_expert, HIDDEN, 2 * FFN, "m"), ("backward", EXPERTS, HIDDEN, 2 * FFN, per_expert, "k")])
    flops = 2 * grouped["gemm_batch"] * grouped["gemm_m"] * grouped["gemm_n"] * grouped["gemm_k"]
    assert grouped["flops"].to_numpy() == pytest.approx(flops.to_numpy(dtype=float))


def _alone(row, ops):
    one = row.to_frame().T.infer_objects()
    one.attrs = dict(ops.attrs)
    return one


@pytest.mark.parametrize("share", [1, 4, 16])
def test_a_grouped_gemm_costs_what_the_kernel_model_gives_its_groups_gemms(grouped, share):
    """Each grouped GEMM alone on an H100 costs the host's launch plus what
    :func:`~pipexplore.predict.kernels.gemm_seconds` gives a batch of its groups' GEMMs (tiles,
    waves, its operands read once); a GPU holding 1/``share`` of the experts runs 16/share groups of
    share × the tokens (its weights 1/share: ``share_costs`` divides their bytes), at the counted
    rows and at twice them (each expert's tokens doubled)."""
    spec = device_spec("H100")
    launch = gpu_kernels(spec).launch_for(spec)
    ops = regrouped(grouped, share)
    ops["fixed_bytes"] = ops["fixed_bytes"].to_numpy(dtype=float) / share
    assert (ops["gemm_batch"] == EXPERTS // share).all()
    for (_, row), (_, counted) in zip(ops.iterrows(), grouped.iterrows()):
        for rows in (ROWS, 2 * ROWS):
            grow = rows / ROWS
            m = counted["gemm_m"] * (share * grow if counted["gemm_rows"] == "m" else 1)
            k = counted["gemm_k"] * (share * grow if counted["gemm_rows"] == "k" else 1)
            reference = gemm_seconds(int(m), int(counted["gemm_n"]), int(k), "bfloat16", spec,
                                     batch=EXPERTS // share, launch=0.0)
            assert float(op_seconds(_alone(row, ops), spec, rows).iloc[0]) == pytest.approx(launch + reference,
                                                                                            rel=1e-5)
