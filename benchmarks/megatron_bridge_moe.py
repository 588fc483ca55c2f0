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
    as counted, and TE's quantising kernels (a cast and amax over each GEMM's inputs) are not
    counted. ``--bf16`` plans every row in bf16 instead.
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


def _as_fp8(ops: Any) -> Any:
    """``ops`` with the decoder layers' linear GEMMs in ``float8`` (attention, the embedding and
    the output layer as counted)."""
    if ops is None or not len(ops):
        return ops
    layer = ops["kind"].astype(str).str.contains("DecoderLayer")
    gemm = ops["op"].astype(str).isin(_GEMMS) & (ops["flops"].fillna(0) > 0)
    attrs = dict(ops.attrs)
    out = ops.copy()
    out.loc[layer & gemm, "dtype"] = "float8"
    out.attrs = attrs
    return out


@contextlib.contextmanager
def fp8_gemms() -> Iterator[None]:
    """While inside, a planned layer table's count gives the transformer layers' linear GEMMs the
    ``float8`` dtype before they are costed (the catalogue's float8 peak), as Megatron-Bridge's
    FP8 recipes run them (the module docstring). The count itself is :func:`~pipexplore.models.meta.count_layers`'."""
    from pipexplore.models import profile

    counting = profile.count_layers

    def counted(*args: Any, **kwargs: Any) -> Any:
        table = counting(*args, **kwargs)
        for name in ("ops", "expert_ops"):
            if name in table.attrs:
                table.attrs[name] = _as_fp8(table.attrs[name])
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
    with fp8_gemms() if in_fp8 else contextlib.nullcontext():
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
