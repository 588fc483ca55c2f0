"""A plan as the arguments Megatron-LM's ``pretrain_gpt.py`` reads: the mesh, the batch, the
pipeline's layers, recomputation, and the model's shape.

The pipeline's layers: Megatron-LM splits its decoder layers evenly over the pipeline ranks, the
embedding with the first stage and the loss (final norm and output layer) with the last. A plan
split so needs no more (``--num-layers-per-virtual-pipeline-stage`` for an interleaved one); any
other split is written as ``--pipeline-model-parallel-layout``, Megatron-Core's grammar: a stage's
layers as ``E`` (embedding), ``t`` (a decoder layer), ``L`` (the loss), stages separated by ``|``,
virtual stages in order (``Et*3|t*4|t*4|t*2L``).

The model's shape comes from a Hugging Face config of the Llama family (Llama, Mistral, Qwen2,
Qwen3: RMSNorm, SwiGLU, rotary positions, grouped-query attention; Qwen2's query-key-value bias,
Qwen3's query-key norm and head width) or of its mixtures of experts (Mixtral, Qwen2-MoE,
Qwen3-MoE); another model is refused by name (Megatron-LM builds its own model from these
arguments, so they must say what it is).

A mixture of experts adds Megatron-Core's MoE arguments: the routed experts and the experts a
token goes to (the plan's, ``--num-experts``, ``--moe-router-topk``), the mesh's expert degrees
(``--expert-model-parallel-size`` ep, ``--expert-tensor-parallel-size`` etp), the plan's dispatcher
(all-to-all, or the flex dispatcher with its HybridEP or DeepEP backend) and grouped GEMMs, an expert's width (``--moe-ffn-hidden-size``), the shared expert
(Qwen2-MoE's, gated), which decoder layers are MoE (``--moe-layer-freq`` where some are dense), the
router's normalisation (``--moe-router-pre-softmax`` where the config does not renormalise the
top-k) and its auxiliary load-balancing loss (``aux_loss``, the config's coefficient); a plan that
hides its all-to-alls behind another micro-batch's compute (``moe_overlap``) asks for Megatron-Core's
``--overlap-moe-expert-parallel-comm`` (in bf16), or is refused where Megatron-Core would refuse it.
A dense plan gains none of them.

Example::

    print(megatron_arguments(plan, config=model.config, sequence=4096))
"""
from __future__ import annotations

from typing import Any, Optional

import pandas as pd

__all__ = ["megatron_arguments", "megatron_layout", "megatron_moe", "MEGATRON_MODELS"]

#: The Hugging Face model types whose shape the arguments write (the Llama family, dense and MoE).
MEGATRON_MODELS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
_QKV_BIAS = ("qwen2", "qwen2_moe")  # their attention's query, key and value projections hold a bias
_QK_NORM = ("qwen3", "qwen3_moe")  # an RMSNorm on each head's query and key


def _block_rows(table: pd.DataFrame) -> list[int]:
    """The rows of the decoder layers: the most frequent type among the rows with parameters."""
    holding = table[table["param_bytes"] > 0]
    kind = holding["type"].value_counts().idxmax()
    return [i for i, t in enumerate(table["type"]) if t == kind]


def megatron_layout(table: pd.DataFrame, splits: list[int]) -> str:
    """The plan's stages in Megatron-Core's layout grammar (the module docstring).

    Raises:
        ValueError: a stage other than the first holds the embedding, or one other than the last
            the loss (Megatron-LM places them so), or the decoder layers are not one run of rows.
    """
    blocks = _block_rows(table)
    if blocks != list(range(blocks[0], blocks[-1] + 1)):
        raise ValueError("Megatron-LM's layout is a run of decoder layers between the embedding and the loss; "
                         "this model's layers of that kind are not contiguous")
    points = [0, *splits, len(table)]
    params = table["param_bytes"].to_numpy()
    stages = []
    for s, (a, b) in enumerate(zip(points, points[1:])):
        embedding = any(params[r] > 0 for r in range(a, min(b, blocks[0])))
        loss = any(params[r] > 0 for r in range(max(a, blocks[-1] + 1), b))
        layers = sum(1 for r in range(a, b) if blocks[0] <= r <= blocks[-1])
        if embedding and s != 0:
            raise ValueError(f"stage {s} holds the embedding: Megatron-LM places it with the first stage")
        if loss and s != len(points) - 2:
            raise ValueError(f"stage {s} holds the output layer: Megatron-LM places it with the last stage")
        stages.append(("E" if embedding or s == 0 else "") + ("t" * layers if layers < 3 else f"t*{layers}")
                      + ("L" if loss or s == len(points) - 2 else ""))
    return "|".join(stages)


def _rope_theta(config: Any) -> float:
    """The rotary base: transformers 5 keeps it in ``rope_parameters``, earlier releases as ``rope_theta``."""
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta") or getattr(config, "rope_theta", None) or 10000)


def _even(table: pd.DataFrame, splits: list[int], stages: int) -> bool:
    """Whether the split is Megatron-LM's own: the decoder layers evenly, the rest with the ends."""
    blocks = _block_rows(table)
    if len(blocks) % stages:
        return False
    per = len(blocks) // stages
    return list(splits) == [blocks[k * per] for k in range(1, stages)]


def _runs(flags: list[int]) -> str:
    """A list of 0s and 1s as the Python expression Megatron-LM's ``--moe-layer-freq`` evaluates
    (``[0]*3+[1]*58``)."""
    runs: list[list[int]] = []
    for flag in flags:
        if runs and runs[-1][0] == flag:
            runs[-1][1] += 1
        else:
            runs.append([flag, 1])
    return "+".join(f"[{flag}]*{count}" for flag, count in runs)


def megatron_moe(plan: Any, config: Any) -> list[str]:
    """The plan's Megatron-Core MoE arguments (the module docstring); none for a dense plan (its
    layer table counts no routed experts)."""
    table = plan.layer_table
    experts = table.attrs.get("experts")
    if not experts:
        return []
    mesh = plan.mesh_or_pipeline
    lines = [f"--num-experts {experts['count']}", f"--moe-router-topk {experts['top_k']}",
             f"--expert-model-parallel-size {mesh.ep}", f"--expert-tensor-parallel-size {mesh.etp}",
             *_dispatcher_flags(getattr(plan, "moe_dispatcher", "alltoall")), "--moe-grouped-gemm",
             f"--moe-ffn-hidden-size {getattr(config, 'moe_intermediate_size', None) or config.intermediate_size}"]
    shared = getattr(config, "shared_expert_intermediate_size", None)
    if shared:  # Qwen2-MoE's shared expert, scaled by a sigmoid gate
        lines += [f"--moe-shared-expert-intermediate-size {shared}", "--moe-shared-expert-gate"]
    routed = table["expert_params"].to_numpy() > 0
    flags = [int(routed[r]) for r in _block_rows(table)]
    if not all(flags):
        lines.append(f"--moe-layer-freq \"{_runs(flags)}\"")
    if getattr(config, "norm_topk_prob", True) is False:  # softmax over every expert, the top k kept as they are
        lines.append("--moe-router-pre-softmax")
    coefficient = getattr(config, "router_aux_loss_coef", None)
    if coefficient is not None:
        lines += ["--moe-router-load-balancing-type aux_loss", f"--moe-aux-loss-coeff {coefficient:g}"]
    if getattr(plan, "moe_overlap", False):
        lines += _overlap_flags(plan, mesh)
    return lines


def _dispatcher_flags(dispatcher: str) -> list[str]:
    """How the plan's tokens reach their experts, as Megatron-Core names it: its all-to-all
    dispatcher, or the flex dispatcher with the plan's backend (``hybridep``, ``deepep``: a token
    sent once a destination node, then over NVLink)."""
    if dispatcher == "alltoall":
        return ["--moe-token-dispatcher-type alltoall"]
    return ["--moe-token-dispatcher-type flex", f"--moe-flex-dispatcher-backend {dispatcher}"]


def _overlap_flags(plan: Any, mesh: Any) -> list[str]:
    """``--overlap-moe-expert-parallel-comm`` for a plan that hides its all-to-alls behind another
    micro-batch's compute (``moe_overlap``), with ``--bf16``: Megatron-Core runs the overlap only with
    expert parallelism, without full recomputation, in bf16 or fp16, and across pipeline stages only
    in its interleaved schedule (``TransformerConfig.__post_init__``); a plan it would refuse is
    refused here by name."""
    if mesh.ep < 2:
        raise ValueError("moe_overlap: Megatron-LM overlaps the all-to-alls only with expert parallelism; "
                         "plan ep ≥ 2 or moe_overlap=False")
    if plan.checkpoint == "always":
        raise ValueError("moe_overlap: Megatron-LM overlaps the all-to-alls only without full recomputation; "
                         "plan checkpoint='never' or 'except_last', or moe_overlap=False")
    if mesh.pp > 1 and plan.schedule != "interleaved":
        raise ValueError(f"moe_overlap: across {mesh.pp} pipeline stages Megatron-LM overlaps the all-to-alls only "
                         f"in its interleaved schedule, not {plan.schedule!r}; plan schedule='interleaved'")
    return ["--overlap-moe-expert-parallel-comm", "--bf16"]


def megatron_arguments(plan: Any, *, config: Any = None, sequence: Optional[int] = None) -> str:
    """The plan's Megatron-LM arguments, one a line, ready to append to ``pretrain_gpt.py``: the
    mesh (``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
    ``--context-parallel-size``, ``--sequence-parallel``), data parallelism
    (``--use-distributed-optimizer`` for ZeRO-1, ``--use-torch-fsdp2`` for FSDP), the batch
    (``--micro-batch-size``, ``--global-batch-size``: every replica's rows), the pipeline's layers
    (the module docstring), ``--recompute-granularity full`` where every micro-batch is checkpointed,
    the model's shape from ``config`` (a Hugging Face config of :data:`MEGATRON_MODELS`) with
    ``--seq-length`` ``sequence``, and a mixture of experts' arguments (:func:`megatron_moe`).

    Raises:
        ValueError: a model Megatron-LM's GPT does not build (named), a schedule it does not run,
            a split its layout cannot say.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in MEGATRON_MODELS:
        raise ValueError(f"Megatron-LM builds its own model from these arguments: a {model_type or 'model'} "
                         f"config is not one this export writes ({', '.join(MEGATRON_MODELS)} are)")
    if plan.schedule not in ("1f1b", "interleaved", "gpipe"):
        raise ValueError(f"Megatron-LM runs 1F1B and its interleaved schedule, not {plan.schedule!r}: plan one of them")
    mesh = plan.mesh_or_pipeline
    table = plan.layer_table
    rows = int(plan.step_batch)  # type: ignore[arg-type]
    lines = [f"--tensor-model-parallel-size {mesh.tp}", f"--pipeline-model-parallel-size {mesh.pp}"]
    if mesh.cp > 1:
        lines.append(f"--context-parallel-size {mesh.cp}")
    if mesh.tp > 1 and plan.sequence_parallel:
        lines.append("--sequence-parallel")
    if plan.data_parallel == "zero1":
        lines.append("--use-distributed-optimizer")
    elif plan.data_parallel == "fsdp":
        lines.append("--use-torch-fsdp2")
    lines += [f"--micro-batch-size {rows // plan.chunks}", f"--global-batch-size {rows * mesh.dp}"]
    blocks = len(_block_rows(table))
    lines.append(f"--num-layers {blocks}")
    stages = plan.num_stages
    if plan.schedule == "interleaved" and _even(table, list(plan.splits), stages):
        lines.append(f"--num-layers-per-virtual-pipeline-stage {blocks // stages}")
    elif not _even(table, list(plan.splits), stages):
        lines.append(f"--pipeline-model-parallel-layout \"{megatron_layout(table, list(plan.splits))}\"")
    if plan.checkpoint == "always":
        lines += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    lines += [f"--hidden-size {config.hidden_size}", f"--ffn-hidden-size {config.intermediate_size}",
              f"--num-attention-heads {heads}"]
    if kv != heads:
        lines += ["--group-query-attention", f"--num-query-groups {kv}"]
    head_dim = getattr(config, "head_dim", None)
    if head_dim and head_dim * heads != config.hidden_size:
        lines.append(f"--kv-channels {head_dim}")
    if model_type in _QKV_BIAS:
        lines.append("--add-qkv-bias")
    if model_type in _QK_NORM:
        lines.append("--qk-layernorm")
    lines += ["--swiglu", "--normalization RMSNorm", "--position-embedding-type rope",
              "--disable-bias-linear", f"--rotary-base {int(_rope_theta(config))}"]
    if not getattr(config, "tie_word_embeddings", False):
        lines.append("--untie-embeddings-and-output-weights")
    sequence = sequence or int(table.attrs.get("tokens_per_sample", 0)) or None
    if sequence:
        lines += [f"--seq-length {sequence}", f"--max-position-embeddings {sequence}"]
    lines += megatron_moe(plan, config)
    head = (f"# Megatron-LM arguments for pretrain_gpt.py, from a pipexplore plan: {mesh.describe()} "
            f"({plan.data_parallel}), {plan.schedule}, {plan.chunks} micro-batches a replica\n")
    return head + " \\\n".join(lines) + "\n"
