"""A published mixture-of-experts table predicted from documented defaults: Megatron-Bridge's DGX-H100 MoE rows.

The table: NVIDIA Megatron-Bridge, ``docs/performance-summary-archive.md``, "26.04.01 NeMo Container",
pre-training, DGX-H100, sequence 4,096, tokens a second a GPU (its footnote: "In MoE training
benchmarks, we force-balance the token distribution among experts and all benchmarks are
token-dropless"):

=================  =====  =========  ============  ===========================  ============
model              GPUs   precision  batch / mb    mesh                         tokens/s/GPU
=================  =====  =========  ============  ===========================  ============
GPT-OSS 120B       64     BF16       1,280 / 1     TP 1 · PP 4 · EP 8           5,824
Qwen3-30B-A3B      16     FP8        1,024 / 1     TP 1 · PP 1 · EP 16          8,960
Qwen3-235B-A22B    256    FP8        8,192 / 1     TP 2 · PP 8 · VP 4 · EP 32   1,712
=================  =====  =========  ============  ===========================  ============

Each row is planned from documented defaults only; nothing is fitted to the table.

- **The models**: the shapes of their config.json on the Hugging Face Hub, built from ``transformers``'
  own config classes (:func:`gpt_oss_120b`, :func:`qwen3_moe`) on the meta device in bf16.
- **The runs**: Megatron-Bridge's performance recipes as they stood for that container (commit
  17a381f9 of NVIDIA-NeMo/Megatron-Bridge, "2604_patch_perf_summary", 2026-05-16):
  ``scripts/performance/configs/{gpt_oss,qwen}/*_workload_base_configs.py`` (``*_H100_*_V2``: the
  mesh, batch, ``moe_a2a_overlap``, ``recompute_modules``), ``*_llm_pretrain.py`` (the H100
  functions) and the recipes they start from, ``src/megatron/bridge/recipes/{gpt_oss,qwen}/``:

  * data parallelism: ``use_distributed_optimizer=True`` (ZeRO-1: ``data_parallel="zero1"``),
    ``overlap_grad_reduce``/``overlap_param_gather`` True (planned exposed at the step's end: the
    predictor has no overlap of them), AdamW with fp32 master weights and states
    (``main_params_dtype``/``exp_avg_dtype`` float32: ``mixed_precision=True``);
  * recomputation: none for Qwen3 (``set_qwen3_common_configs``: ``recompute_granularity=None``);
    GPT-OSS ``recompute_modules=["layernorm", "moe_act"]`` (``GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V1``;
    ``scripts/performance/utils/overrides.py`` makes it ``recompute_granularity="selective"``): the
    layer's two RMSNorms and its experts' activation run again in its backward. The explorer's
    checkpoint modes recompute whole stages, so the plan keeps ``checkpoint="never"`` and each decoder
    layer's backward gains those modules' forward, counted by torch and costed by the same roofline
    as the layer's own (:func:`recomputed_seconds`, :func:`with_recompute`: 0.86 ms a layer a
    micro-batch on the H100, 0.35 of it the norms);
  * pipeline: GPT-OSS 36 layers over 4 stages, 9 each (``account_for_embedding_in_pipeline_split``
    False), 1F1B; Qwen3-235B 94 layers over 8 ranks × 4 virtual stages with the embedding and the
    loss counted as a layer each (``account_for_*_in_pipeline_split`` True: 96 = 32 × 3), Megatron's
    interleaved schedule; Qwen3-30B one stage;
  * ``sequence_parallel``: on where TP > 1 (``WorkloadBaseConfig.sequence_parallel``);
  * the experts' all-to-all: ``moe_a2a_overlap`` True for Qwen3-235B (``overlap_moe_expert_parallel_comm``,
    ``delay_wgrad_compute``: hidden behind another micro-batch's compute), False for the others.
    Planned so: ``moe_overlap=True`` for Qwen3-235B only (:mod:`pipexplore.predict.moe_overlap`: in
    Megatron's 1F1B each backward pairs with the forward after it, and only what a pair's all-to-all
    takes beyond the other's compute is exposed), every all-to-all exposed in the others; each row
    also prints the bound with no all-to-all at all;
  * the dispatcher: Qwen3-30B's ``moe_token_dispatcher_type="flex"`` with
    ``moe_flex_dispatcher_backend="hybridep"`` (``QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1``;
    ``qwen3_30b_a3b_pretrain_config_h100`` sets the type), planned with ``moe_dispatcher="hybridep"``
    (:mod:`pipexplore.predict.moe_dispatch`: a token crosses to the other node once if any of its
    8 experts is there, 1 − C(64, 8)/C(128, 8) = 0.997 copies, not 4; NVLink once to each GPU holding
    any, 5.77 copies, not 3.5); ``alltoall`` for Qwen3-235B (``qwen3_235b_a22b_pretrain_config_h100``)
    and GPT-OSS (``gpt_oss_120b_pretrain_config``; its H100 preset names no flex backend);
  * FP8: ``bf16_with_fp8_current_scaling_mixed`` with ``first_last_layers_bf16=False``:
    Transformer Engine runs every transformer layer's linear GEMMs (attention projections,
    experts' grouped GEMMs) in FP8, attention itself and the output layer in bf16. Planned by
    giving those GEMMs the ``float8`` dtype, whose peak the catalogue's H100 holds (1,979 TFLOP/s
    dense, its datasheet's), before they are costed (:func:`fp8_gemms`); their operands' bytes stay
    as counted (bf16). The router's GEMM is no Transformer Engine module (Megatron-Core's, at
    Megatron-LM 2d1fa8d3, ``moe_utils.RouterGatingLinearFunction``: ``te_general_gemm`` in the
    router's dtype, the input's where ``moe_router_dtype`` is unset, as Qwen3's bridge leaves it):
    it stays bf16.
    ``--bf16`` plans every row in bf16 instead.
  * FP8 current scaling's quantisation (:func:`fp8_quantise_ops`, added to each decoder layer's
    kernels by :func:`with_quantisation` and costed as the package costs every memory-bound kernel:
    ``device_fixed`` a launch beside its bytes at the H100's 3.35 TB/s × 0.90, the host's 4.5 µs
    launch where the device outpaces it). What Transformer Engine does, from its docs
    (``docs/features/low_precision_training/fp8_current_scaling/fp8_current_scaling.rst``: a
    quantisation "requires reading the tensor twice", once for its amax and once to scale and
    cast; "on Ada and Hopper, the backward pass requires a transposed FP8 tensor";
    ``performance_considerations/performance_considerations.rst``: the forward GEMM takes input and
    weight rowwise, the weight gradient's takes output gradient and input columnwise, the input
    gradient's the output gradient rowwise and the weight columnwise, and on Hopper a columnwise
    FP8 tensor is a physical transpose, made with the rowwise one in one kernel where it can) and
    its code as the recipes pin it (Megatron-Bridge 17a381f9's ``pyproject.toml``: TransformerEngine
    ``release_v2.15``, tag v2.15, 42b84005; its ``3rdparty/Megatron-LM`` submodule: Megatron-LM 2d1fa8d3):
    ``Float8CurrentScalingQuantizer::quantize_impl`` (``pytorch/csrc/quantizer.cpp``) launches
    ``zero_amax_kernel``, ``amax_kernel`` (``common/recipe/current_scaling.cu``),
    ``compute_scale_from_amax_kernel`` and the cast — four kernels, 2 bytes an element read for
    the amax, then 2 read and 1 written a layout (cast-transpose: both, 4); ``rmsnorm_fwd``
    (``csrc/extensions/normalization.cpp``, ``FUSED_NORM_AMAX_FP8``) has the norm write its bf16
    output and its amax, then ``quantize_with_amax`` (two kernels: the scale, the cast);
    ``GroupedLinear``'s ``split_quantize`` quantises each expert's tokens by its own quantiser,
    one at a time (``cast.cpp``'s ``multi_tensor_quantize_impl``: the fused multi-tensor
    cast-transpose is delayed scaling's only). So, a layer a micro-batch of ``T`` tokens
    (``linear_qkv`` a ``TELayerNormColumnParallelLinear``, ``linear_proj`` a ``TERowParallelLinear``,
    the experts' ``linear_fc1``/``linear_fc2`` ``TEGroupedLinear``s; ``E/ep`` experts a GPU on ``T·k``
    token copies):

    - forward: ``linear_qkv``'s input, cast-transposed after the norm's amax (4 bytes an element,
      2 kernels); ``linear_proj``'s, amax and a rowwise cast (5, 4: Megatron-Core's ``attention.py``
      sets ``save_original_input`` on it for every FP8 recipe but delayed scaling, so the forward
      makes no columnwise copy); ``linear_fc1``'s and ``linear_fc2``'s, amax and cast-transpose
      (6, 4 an expert);
    - backward: each output gradient, amax and cast-transpose (6, 4; 4 an expert for the experts',
      ``base.py``'s ``grad_output_preprocess``), and ``linear_proj``'s input again, columnwise (5, 4);
    - with sequence parallelism (Qwen3-235B's TP 2): ``linear_qkv``'s input and ``linear_proj``'s
      output gradient are quantised rowwise on the rank's ``T/tp`` rows after an all-reduce of their
      amax over the TP group (``layernorm_linear.py``/``linear.py`` set ``with_amax_reduction`` where
      sequence parallel gathers; a 4-byte all-reduce costed by the NCCL model), all-gathered in FP8,
      and transposed after it (2 bytes an element of the whole ``T``, one kernel: ``distributed.py``'s
      ``_all_gather_fp8``; the doc: "the rowwise tensor is gathered first, then transposed").

    On the H100 that adds, a layer a micro-batch, Qwen3-30B 671 + 965 MB and 70 + 76 launches
    (0.84 ms, device-bound), Qwen3-235B 663 + 1,011 MB and 39 + 47 (0.74 ms). Not counted: the
    weights' quantisation, once a step, not a micro-batch (Megatron-Core's TE modules pass
    ``is_first_microbatch``, and Bridge's ``bf16_with_fp8_current_scaling_mixed`` keeps the weights
    FP8 with ``fp8_param_gather=True``: the optimizer casts them; Qwen3-30B's transposes of them
    move about 5.4 GB a step, ~2 ms of 26 s); the GEMMs reading 1-byte operands; the FP8 halving
    of sequence parallelism's gathers.
  * The router and the token permutation are counted as ``transformers`` runs them (eager: the
    gate, softmax, top-k and renormalisation; a sort, gathers and an index-add around the grouped
    GEMMs), more bytes than Megatron-Core's fused kernels (``moe_router_fusion``,
    ``moe_permute_fusion`` True) move. Not counted: the load-balancing loss's few kernels on the
    ``T × E`` scores (Qwen3's bridge: ``moe_router_load_balancing_type="aux_loss"``, coefficient
    1e-3) and the forced balancing's random logits (``RandomSTE``), and HybridEP's preprocessing
    (its all-gather of the routing map and the host's wait on it before each dispatch: a
    synchronisation the kernel model has no term for).
- **Attention**: Megatron runs Transformer Engine's fused (flash) attention. Qwen3's
  ``scaled_dot_product_attention`` is counted so already (the causal half of the square). GPT-OSS
  (attention sinks, so no SDPA in ``transformers``) gets :func:`fused_sink_attention`: the same
  kernel, its sink (a scalar a head in the softmax's denominator) left out of the count, and its
  sliding-window layers (window 128) counted as a flash kernel of 128-query tiles computes them:
  each tile against its own 128 keys and the tile before.
- **The devices**: the catalogue's ``H100`` (datasheet peaks, links: NVLink 450 GB/s a direction
  inside a node, 400 Gb/s InfiniBand a GPU across; its documented efficiency defaults), 8 GPUs a node.

Predicted tokens a second a GPU = batch × 4,096 / predicted step / GPUs. Run:
``python benchmarks/megatron_bridge_moe.py`` (``--rows gpt-oss,qwen3-30b`` for some rows;
``--bf16``). The prediction is computed on this machine's CPU; no GPU is used.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F

SEQUENCE = 4096
DEVICE = "H100"


@dataclass(frozen=True)
class Row:
    """One row of the table and the recipe's settings for it."""

    key: str
    model: str
    gpus: int
    precision: str
    batch: int
    micro: int
    tp: int
    pp: int
    vp: int
    ep: int
    published: float
    checkpoint: str
    a2a_overlap: bool
    dispatcher: str = "alltoall"
    recompute: tuple[str, ...] = ()


#: The table (26.04.01 container, DGX-H100) and the recipes' settings (the module docstring).
TABLE = [
    Row("gpt-oss", "GPT-OSS 120B", 64, "bf16", 1280, 1, 1, 4, 1, 8, 5824, "never", False, "alltoall",
        ("layernorm", "moe_act")),
    Row("qwen3-30b", "Qwen3-30B-A3B", 16, "fp8", 1024, 1, 1, 1, 1, 16, 8960, "never", False, "hybridep"),
    Row("qwen3-235b", "Qwen3-235B-A22B", 256, "fp8", 8192, 1, 2, 8, 4, 32, 1712, "never", True, "alltoall"),
]


def fused_sink_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                         scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """GPT-OSS's attention as a fused (flash) kernel computes it, registered with ``transformers``
    as ``"fused_sinks"``: causal attention by ``scaled_dot_product_attention`` (its sink, one
    scalar a head added to the softmax's denominator, is no GEMM: left out); with a sliding window
    ``w`` the queries in tiles of ``w``, each against its own tile's keys and the tile before (the
    key tiles a flash kernel visits for that window), as one batched call."""
    b, h, s, d = query.shape
    groups = h // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    if sliding_window and s % sliding_window == 0 and s > sliding_window:
        w, tiles = sliding_window, s // sliding_window
        q = query.reshape(b, h, tiles, w, d).transpose(1, 2).reshape(b * tiles, h, w, d)
        k = key.reshape(b, h, tiles, w, d)
        v = value.reshape(b, h, tiles, w, d)
        k = torch.cat([torch.cat([k[:, :, :1], k[:, :, :-1]], dim=2), k], dim=-2)  # (the tile before, its own)
        v = torch.cat([torch.cat([v[:, :, :1], v[:, :, :-1]], dim=2), v], dim=-2)
        k = k.transpose(1, 2).reshape(b * tiles, h, 2 * w, d)
        v = v.transpose(1, 2).reshape(b * tiles, h, 2 * w, d)
        out = F.scaled_dot_product_attention(q, k, v, scale=scaling)
        out = out.reshape(b, tiles, h, w, d).transpose(1, 2).reshape(b, h, s, d)
    else:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def gpt_oss_120b() -> torch.nn.Module:
    """openai/gpt-oss-120b's config.json: 36 layers of hidden 2,880, 64 query and 8 key-value heads
    of 64, 128 experts of 2,880 a layer, top-4, sliding window 128 on every other layer,
    vocabulary 201,088 (Megatron-Bridge keeps the model's vocabulary over its null tokenizer's)."""
    import transformers
    from transformers import AttentionInterface

    AttentionInterface.register("fused_sinks", fused_sink_attention)
    config = transformers.GptOssConfig(num_hidden_layers=36, hidden_size=2880, intermediate_size=2880,
                                       num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                       num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
                                       vocab_size=201088)
    config._attn_implementation = "fused_sinks"
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GptOssForCausalLM(config).to(torch.bfloat16)


def qwen3_moe(key: str) -> torch.nn.Module:
    """Qwen/Qwen3-30B-A3B's and Qwen/Qwen3-235B-A22B's config.json: 48 layers of hidden 2,048, 32
    query and 4 key-value heads of 128, 128 experts of 768, top-8; and 94 layers of hidden 4,096,
    64 and 4 heads of 128, 128 experts of 1,536, top-8; both vocabulary 151,936, normalised top-k."""
    import transformers

    shape = (dict(hidden_size=2048, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                  intermediate_size=6144) if key == "qwen3-30b" else
             dict(hidden_size=4096, moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                  intermediate_size=12288))
    config = transformers.Qwen3MoeConfig(**shape, num_key_value_heads=4, head_dim=128, num_experts=128,
                                         num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936)
    config._attn_implementation = "sdpa"
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)


#: The linear GEMMs Transformer Engine runs in FP8 (forward and both gradients).
_GEMMS = ("aten.mm", "aten.addmm", "aten._grouped_mm")


def _as_fp8(ops: Any, experts: Optional[int] = None) -> Any:
    """``ops`` with the decoder layers' linear GEMMs in ``float8`` (attention, the embedding and
    the output layer as counted). ``experts``: the layer's routed experts; a plain GEMM with a
    dimension of that many is the router's (its logits, one an expert), which Megatron-Core runs
    outside Transformer Engine's modules (``router_gating_linear``, the input's dtype): kept bf16."""
    if ops is None or not len(ops):
        return ops
    layer = ops["kind"].astype(str).str.contains("DecoderLayer")
    gemm = ops["op"].astype(str).isin(_GEMMS) & (ops["flops"].fillna(0) > 0)
    if experts and "gemm_m" in ops:
        dims = ops[["gemm_m", "gemm_n", "gemm_k"]].fillna(0).to_numpy(dtype=float)
        router = (dims == float(experts)).any(axis=1) & ops["op"].astype(str).isin(("aten.mm", "aten.addmm")).to_numpy()
        gemm = gemm & ~router
    attrs = dict(ops.attrs)
    out = ops.copy()
    out.loc[layer & gemm, "dtype"] = "float8"
    out.attrs = attrs
    return out


#: Bytes an element of a bf16 tensor moves in Transformer Engine's FP8 current-scaling
#: quantisation on Hopper (the module docstring): its amax (a read of 2 bytes), a cast to one FP8
#: layout (2 read, 1 written), a cast-transpose to both layouts (2 read, 1 + 1 written), a transpose
#: of FP8 data already cast (1 read, 1 written).
AMAX, CAST, CAST_TRANSPOSE, TRANSPOSE = 2.0, 3.0, 4.0, 2.0
#: Kernels of one quantisation: ``Float8CurrentScalingQuantizer::quantize`` launches ``zero_amax_kernel``,
#: ``amax_kernel``, ``compute_scale_from_amax_kernel`` and the cast; ``quantize_with_amax`` (after a
#: norm that computed the amax) the last two.
QUANTIZE, WITH_AMAX = 4, 2


def fp8_quantise_ops(config: Any, tokens: int, tp: int = 1, ep: int = 1) -> Any:
    """The kernels Transformer Engine's FP8 current scaling adds to one decoder layer of a
    mixture of experts (Megatron-Core's: ``linear_qkv`` a ``TELayerNormColumnParallelLinear``,
    ``linear_proj`` a ``TERowParallelLinear``, the experts' ``linear_fc1``/``linear_fc2``
    ``TEGroupedLinear``s) on a micro-batch of ``tokens`` tokens, a GPU of ``tp`` tensor-parallel
    (sequence parallel where > 1) and ``ep`` expert-parallel ranks, as an ops frame (the layer kind
    left empty, ``kernels`` the launches a row stands for): each GEMM input and output gradient
    quantised once (the module docstring), ``elements × bytes an element`` of them
    (:data:`AMAX` …, :data:`QUANTIZE` …). ``config``: the model's (``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``num_experts`` (or
    ``num_local_experts``), ``num_experts_per_tok``, ``moe_intermediate_size`` (or
    ``intermediate_size``)). The weights are quantised once a step, not here."""
    import pandas as pd

    from pipexplore.models.opcount import OP_COLUMNS

    h, heads, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    top_k = config.num_experts_per_tok
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    if experts % ep or (heads * d) % tp or ((heads + 2 * kv) * d) % tp or tokens % tp:
        raise ValueError(f"tp={tp}, ep={ep} do not split the layer's heads, tokens or {experts} experts evenly")
    local = tokens // tp  # (sequence parallel: a tensor-parallel rank's share of the tokens)
    routed = local * top_k  # token copies the GPU's experts receive: as many as it sends (balanced routing)
    groups = experts // ep  # its experts, each group of tokens quantised by its own quantiser
    rows: list[dict[str, Any]] = []

    def add(phase: str, what: str, elements: float, per_element: float, kernels: int, grad: str = "") -> None:
        rows.append({"phase": phase, "op": f"te.{what}", "dtype": "bfloat16", "flops": 0.0, "fixed_bytes": 0.0,
                     "row_bytes": float(elements) * per_element, "grad": grad, "collective": "", "kernels": kernels})

    def amax_all_reduce(phase: str, grad: str = "") -> None:  # (the ranks' amaxes reduced: one fp32 each)
        rows.append({"phase": phase, "op": "te.amax all_reduce", "dtype": "float32", "flops": 0.0, "fixed_bytes": 4.0,
                     "row_bytes": 0.0, "grad": grad, "collective": "all_reduce", "kernels": 1})

    # forward: linear_qkv's input (its RMSNorm computed the amax), linear_proj's (rowwise only:
    # save_original_input), the experts' fc1 and fc2 inputs (one quantiser an expert)
    if tp == 1:
        add("forward", "cast_transpose linear_qkv input", tokens * h, CAST_TRANSPOSE, WITH_AMAX)
    else:  # rowwise only, all-gathered in FP8 after the ranks' amaxes are reduced
        amax_all_reduce("forward")
        add("forward", "cast linear_qkv input", local * h, CAST, WITH_AMAX)
    add("forward", "amax+cast linear_proj input", tokens * heads * d // tp, AMAX + CAST, QUANTIZE)
    add("forward", "amax+cast_transpose linear_fc1 input", routed * h, AMAX + CAST_TRANSPOSE, QUANTIZE * groups)
    add("forward", "amax+cast_transpose linear_fc2 input", routed * inter, AMAX + CAST_TRANSPOSE, QUANTIZE * groups)
    # backward: the output gradients (both layouts: dgrad and wgrad), linear_proj's input again
    # (columnwise, for its wgrad), and where sequence parallel gathers, the transposes after it
    add("backward", "amax+cast_transpose linear_fc2 grad output", routed * h, AMAX + CAST_TRANSPOSE,
        QUANTIZE * groups, "input")
    add("backward", "amax+cast_transpose linear_fc1 grad output", routed * 2 * inter, AMAX + CAST_TRANSPOSE,
        QUANTIZE * groups, "input")
    if tp == 1:
        add("backward", "amax+cast_transpose linear_proj grad output", tokens * h, AMAX + CAST_TRANSPOSE, QUANTIZE,
            "input")
    else:  # rowwise, all-gathered, transposed
        amax_all_reduce("backward", "input")
        add("backward", "amax+cast linear_proj grad output", local * h, AMAX + CAST, QUANTIZE, "input")
        add("backward", "transpose linear_proj grad output", tokens * h, TRANSPOSE, 1, "input")
    add("backward", "amax+cast linear_proj input", tokens * heads * d // tp, AMAX + CAST, QUANTIZE, "weight")
    add("backward", "amax+cast_transpose linear_qkv grad output", tokens * (heads + 2 * kv) * d // tp,
        AMAX + CAST_TRANSPOSE, QUANTIZE, "input")
    if tp > 1:
        add("backward", "transpose linear_qkv input", tokens * h, TRANSPOSE, 1, "weight")
    out = pd.DataFrame([{"kind": "", "gemm_batch": 0, "gemm_m": 0.0, "gemm_n": 0, "gemm_k": 0.0, "gemm_rows": "",
                         "outside": False, **r} for r in rows], columns=[*OP_COLUMNS, "outside", "kernels"])
    return out


def with_quantisation(ops: Any, quantise: Any) -> Any:
    """``ops`` with the rows of ``quantise`` (:func:`fp8_quantise_ops`, counted at the same
    rows) after each decoder-layer kind's own in each phase, costed as its kernels are
    (:func:`pipexplore.predict.roofline.op_seconds`: ``kernels`` launches, each ``device_fixed``
    beside the rows' bytes at the memory's bandwidth)."""
    import pandas as pd

    attrs = dict(ops.attrs)
    kinds = [k for k in dict.fromkeys(ops["kind"].astype(str)) if "DecoderLayer" in k]
    base = ops.assign(kernels=ops["kernels"] if "kernels" in ops else float("nan"))
    out = pd.concat([base, *(quantise.assign(kind=kind) for kind in kinds)], ignore_index=True)
    out["outside"] = out["outside"].astype(bool)
    out.attrs = attrs
    return out


@contextlib.contextmanager
def fp8_gemms(ep: int = 1, quantise: bool = True) -> Iterator[None]:
    """While inside, a planned layer table's count gives the transformer layers' linear GEMMs the
    ``float8`` dtype before they are costed (the catalogue's float8 peak), the router's excepted,
    as Megatron-Bridge's FP8 recipes run them (the module docstring), and, with ``quantise``, adds
    to each decoder layer the kernels Transformer Engine quantises their inputs and output
    gradients with (:func:`fp8_quantise_ops` at the count's tokens, its ``tp`` and ``ep``). The
    count itself is :func:`~pipexplore.models.meta.count_layers`'."""
    from pipexplore.models import profile

    counting = profile.count_layers

    def counted(*args: Any, **kwargs: Any) -> Any:
        table = counting(*args, **kwargs)
        experts = (table.attrs.get("experts") or {}).get("count")
        for name in ("ops", "expert_ops"):
            if name in table.attrs:
                table.attrs[name] = _as_fp8(table.attrs[name], experts)
        if quantise:
            model, sample = args[0], args[1]
            ops = table.attrs["ops"]
            tokens = int(ops.attrs["rows"]) * int(sample.shape[-1])
            table.attrs["ops"] = with_quantisation(ops, fp8_quantise_ops(model.config, tokens,
                                                                         int(kwargs.get("tp", 1)), ep))
        return table

    profile.count_layers = counted  # type: ignore[assignment]
    try:
        yield
    finally:
        profile.count_layers = counting  # type: ignore[assignment]


class _Activation(torch.nn.Module):
    """A routed experts' module's activation (GPT-OSS's ``_apply_gate``: the clamped SwiGLU between
    its two grouped GEMMs) as a module of its own, to count."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.gate = experts._apply_gate

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.gate(gate_up)


def recomputed_ops(model: torch.nn.Module, modules: tuple[str, ...], tokens: int) -> Any:
    """The kernels of the forward of a decoder layer's ``modules`` that Megatron-Core's selective
    recomputation (``recompute_granularity="selective"``, ``recompute_modules``) runs again in its
    backward, for a micro-batch of ``tokens`` tokens a GPU, as an ops frame of one row: ``layernorm``
    the layer's two norms (the input and the post-attention RMSNorm), ``moe_act`` the routed
    experts' activation on the ``top_k`` copies of the tokens the GPU's experts receive (balanced:
    as many as it sends). Counted by torch as the layer's own forward is
    (:func:`pipexplore.models.opcount.count_call` on meta)."""
    import pandas as pd

    from pipexplore.models.opcount import OP_COLUMNS, count_call

    unknown = sorted(set(modules) - {"layernorm", "moe_act"})
    if unknown:
        raise ValueError(f"recompute_modules {unknown} are not counted here (layernorm, moe_act are)")
    layer = model.model.layers[0]
    experts = layer.mlp.experts
    hidden = experts.hidden_size
    calls: list[tuple[torch.nn.Module, torch.Tensor]] = []
    if "layernorm" in modules:
        x = torch.empty(1, tokens, hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
        calls += [(layer.input_layernorm, x), (layer.post_attention_layernorm, x)]
    if "moe_act" in modules:
        top_k = model.config.num_experts_per_tok
        gate_up = torch.empty(tokens * top_k, 2 * experts.intermediate_size, dtype=torch.bfloat16, device="meta",
                              requires_grad=True)
        calls.append((_Activation(experts), gate_up))
    records = [r for module, x in calls for r in count_call(module, (x,), {}).records if r["phase"] == "forward"]
    ops = pd.DataFrame([{"kind": "recompute", **{c: r[c] for c in OP_COLUMNS[1:]}, "outside": False}
                        for r in records], columns=[*OP_COLUMNS, "outside"])
    ops.attrs["rows"] = 1
    return ops


def recomputed_seconds(model: torch.nn.Module, modules: tuple[str, ...], tokens: int) -> float:
    """Seconds of :func:`recomputed_ops` on the catalogue's H100, by the roofline that costs the
    layer's own forward (:func:`pipexplore.predict.roofline.op_seconds`)."""
    from pipexplore.predict.roofline import op_seconds

    ops = recomputed_ops(model, modules, tokens)
    return float(op_seconds(ops, DEVICE, 1).sum()) if len(ops) else 0.0


def with_recompute(table: Any, seconds: float) -> Any:
    """``table`` with each decoder layer's backward ``seconds`` longer a row (its ``backward_b``, and
    ``backward`` for the whole batch): what selective recomputation adds."""
    out = table.copy()
    out.attrs = dict(table.attrs)
    layer = out["name"].astype(str).str.match(r"model\.layers\.\d+$").to_numpy()
    out.loc[layer, "backward_b"] = out.loc[layer, "backward_b"] + seconds
    out.loc[layer, "backward"] = out.loc[layer, "backward"] + seconds * float(table.attrs.get("batch") or 1)
    return out


def stage_splits(names: list[str], chunks: int, embedding_and_loss_as_layers: bool) -> list[int]:
    """Where each of ``chunks`` pipeline chunks starts (the first excepted) in a table of ``names``:
    Megatron's even split of the decoder layers, the embedding with the first chunk and the output
    layer with the last; with ``account_for_embedding/loss_in_pipeline_split`` each counts as a layer."""
    blocks = [i for i, name in enumerate(names) if name.startswith("model.layers.")]
    units = len(blocks) + (2 if embedding_and_loss_as_layers else 0)
    if units % chunks:
        raise ValueError(f"{units} layers do not split evenly over {chunks} pipeline chunks")
    per = units // chunks
    shift = 1 if embedding_and_loss_as_layers else 0
    return [blocks[k * per - shift] for k in range(1, chunks)]


def predict(row: Row, fp8: bool = True) -> dict[str, Any]:
    """Plan ``row`` (the module docstring) and predict its step and tokens a second a GPU."""
    from pipexplore.models.profile import profile_model
    from pipexplore.plan import Plan

    started = time.perf_counter()
    model = gpt_oss_120b() if row.key == "gpt-oss" else qwen3_moe(row.key)
    dp = row.gpus // (row.tp * row.pp)
    rows = row.batch // dp
    chunks = rows // row.micro
    sample = torch.zeros(rows, SEQUENCE, dtype=torch.long, device="meta")
    devices = [f"{DEVICE}:{i}" for i in range(row.gpus)]
    in_fp8 = fp8 and row.precision == "fp8"
    with fp8_gemms(row.ep) if in_fp8 else contextlib.nullcontext():
        table = profile_model(model, sample, devices=devices, gpus_per_node=8, chunks=chunks, tp=row.tp,
                              optimizer=torch.optim.AdamW, mixed_precision=True)
    recomputed = recomputed_seconds(model, row.recompute, row.micro * SEQUENCE // row.tp) if row.recompute else 0.0
    if recomputed:
        table = with_recompute(table, recomputed / row.micro)
    stages = row.pp * row.vp
    splits = stage_splits(list(table["name"]), stages, row.key == "qwen3-235b") if stages > 1 else []

    def planned(table: Any) -> dict[str, float]:
        plan = Plan(table, splits=tuple(splits), devices=tuple(devices), chunks=chunks, checkpoint=row.checkpoint,
                    schedule="interleaved" if row.vp > 1 else "1f1b", virtual_stages=max(2, row.vp),
                    executor="processes", batch=rows, gpus_per_node=8,
                    mesh={"tp": row.tp, "pp": row.pp, "dp": dp, "ep": row.ep}, data_parallel="zero1",
                    sequence_parallel=row.tp > 1, moe_overlap=row.a2a_overlap, moe_dispatcher=row.dispatcher)
        return breakdown(plan.predicted, devices[0])

    out = planned(table)
    hidden = table.copy()
    hidden["dispatch_bytes"] = 0.0  # no routed tokens to exchange: the all-to-all hidden behind compute
    hidden.attrs = dict(table.attrs)
    shares = dict(hidden.attrs.get("expert_shares") or {})
    for key in ("exchange_bytes", "exchange_calls"):  # (where the count keeps the exchange it saw)
        if key in shares:
            shares[key] = np.zeros_like(np.asarray(shares[key], dtype=float))
    hidden.attrs["expert_shares"] = shares
    bound = planned(hidden)
    tokens = row.batch * SEQUENCE / out["step"] / row.gpus
    hidden_tokens = row.batch * SEQUENCE / bound["step"] / row.gpus
    return {"row": row, "dp": dp, "chunks": chunks, "recomputed": recomputed * chunks, **out, "predicted": tokens, "error": tokens / row.published - 1,
            "hidden_step": bound["step"], "hidden_predicted": hidden_tokens,
            "hidden_error": hidden_tokens / row.published - 1, "precision": "fp8" if in_fp8 else "bf16",
            "seconds": time.perf_counter() - started}


def breakdown(predicted: Any, device: str) -> dict[str, float]:
    """The predicted step and, on ``device`` (the first GPU: the first pipeline rank), its seconds
    of compute, of the experts' exposed all-to-all, of the optimizer with its step-end collectives,
    and the rest of the step (the pipeline's bubble)."""
    d = (predicted["end"] - predicted["start"]).to_numpy(dtype=float)
    step = float(predicted["end"].max() - predicted["start"].min())
    on = predicted["device"].astype(str).str.startswith(device + " ").to_numpy() | (
        predicted["device"].astype(str) == device).to_numpy()
    phase = predicted["phase"].astype(str).to_numpy()
    collective = predicted["collective"].fillna("").astype(str).to_numpy()
    exposed = predicted["exposed"].fillna(False).astype(bool).to_numpy() if "exposed" in predicted else True
    a2a = float(d[on & (collective == "ep all_to_all") & exposed].sum())  # (hidden behind compute: not counted)
    passes = float(d[on & ((phase == "forward") | (phase == "backward"))].sum())  # (their exposed all-to-all inside)
    step_end = np.char.startswith(collective.astype(str), "dp ")  # ZeRO-1's reduce-scatter and all-gather
    update = float(d[on & ((phase == "optimizer") | step_end)].sum())
    return {"step": step, "compute": passes - a2a, "a2a": a2a, "optimizer": update,
            "bubble": max(0.0, step - passes - update)}


HEADER = (f"{'model':<16} {'GPUs':>4} {'prec':>4} {'tp':>2} {'pp':>2} {'vp':>2} {'ep':>2} {'dp':>3} {'m':>4} "
          f"{'step s':>7} {'compute':>7} {'a2a':>6} {'bubble':>6} {'optim':>6} {'predicted':>9} {'published':>9} "
          f"{'error':>7} {'a2a hidden':>10} {'planned in':>10}")


def line(out: dict[str, Any]) -> str:
    """One printed row (``HEADER``'s columns): the predicted step and the first GPU's seconds of
    it (compute, the experts' exposed all-to-all, the bubble, the optimizer with ZeRO-1's
    collectives), tokens a second a GPU predicted and published, the error, and the error with no
    all-to-all at all (a bound)."""
    row = out["row"]
    return (f"{row.model:<16} {row.gpus:>4} {out['precision']:>4} {row.tp:>2} {row.pp:>2} {row.vp:>2} {row.ep:>2} "
            f"{out['dp']:>3} {out['chunks']:>4} {out['step']:>7.2f} {out['compute']:>7.2f} {out['a2a']:>6.2f} "
            f"{out['bubble']:>6.2f} {out['optimizer']:>6.2f} {out['predicted']:>9,.0f} {row.published:>9,.0f} "
            f"{out['error']:>+7.1%} {out['hidden_error']:>+10.1%} {out['seconds']:>9.1f}s")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(r.key for r in TABLE), help="comma-separated: "
                        + ", ".join(r.key for r in TABLE))
    parser.add_argument("--bf16", action="store_true", help="plan the FP8 rows in bf16")
    args = parser.parse_args(argv)
    wanted = args.rows.split(",")
    unknown = sorted(set(wanted) - {r.key for r in TABLE})
    if unknown:
        parser.error(f"unknown rows {unknown}")
    print(HEADER, flush=True)
    errors = []
    for row in (r for r in TABLE if r.key in wanted):
        out = predict(row, fp8=not args.bf16)
        errors.append(abs(out["error"]))
        print(line(out), flush=True)
    print(f"median |error| {statistics.median(errors):.1%}, max {max(errors):.1%} (goal: ≤ 15 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
