"""A plan as the arguments Megatron-LM's ``pretrain_gpt.py`` reads: the mesh, the batch, the
pipeline's layers, recomputation, and the model's shape.

The pipeline's layers: Megatron-LM splits its decoder layers evenly over the pipeline ranks, the
embedding with the first stage and the loss (final norm and output layer) with the last. A plan
split so needs no more (``--num-layers-per-virtual-pipeline-stage`` for an interleaved one); any
other split is written as ``--pipeline-model-parallel-layout``, Megatron-Core's grammar: a stage's
layers as ``E`` (embedding), ``t`` (a decoder layer), ``L`` (the loss), stages separated by ``|``,
virtual stages in order (``Et*3|t*4|t*4|t*2L``).

The model's shape comes from a Hugging Face config of the Llama family (Llama, Mistral, Qwen2,
Qwen3: RMSNorm, SwiGLU, rotary positions, grouped-query attention); another model is refused by
name (Megatron-LM builds its own model from these arguments, so they must say what it is).

Example::

    print(megatron_arguments(plan, config=model.config, sequence=4096))
"""
from __future__ import annotations

from typing import Any, Optional

import pandas as pd

__all__ = ["megatron_arguments", "megatron_layout", "MEGATRON_MODELS"]

#: The Hugging Face model types whose shape the arguments write (the Llama family).
MEGATRON_MODELS = ("llama", "mistral", "qwen2", "qwen3")


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


def _even(table: pd.DataFrame, splits: list[int], stages: int) -> bool:
    """Whether the split is Megatron-LM's own: the decoder layers evenly, the rest with the ends."""
    blocks = _block_rows(table)
    if len(blocks) % stages:
        return False
    per = len(blocks) // stages
    return list(splits) == [blocks[k * per] for k in range(1, stages)]


def megatron_arguments(plan: Any, *, config: Any = None, sequence: Optional[int] = None) -> str:
    """The plan's Megatron-LM arguments, one a line, ready to append to ``pretrain_gpt.py``: the
    mesh (``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
    ``--context-parallel-size``, ``--sequence-parallel``), data parallelism
    (``--use-distributed-optimizer`` for ZeRO-1, ``--use-torch-fsdp2`` for FSDP), the batch
    (``--micro-batch-size``, ``--global-batch-size``: every replica's rows), the pipeline's layers
    (the module docstring), ``--recompute-granularity full`` where every micro-batch is checkpointed,
    and the model's shape from ``config`` (a Hugging Face config of :data:`MEGATRON_MODELS`) with
    ``--seq-length`` ``sequence``.

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
    lines += ["--swiglu", "--normalization RMSNorm", "--position-embedding-type rope",
              "--disable-bias-linear", f"--rotary-base {int(getattr(config, 'rope_theta', 10000))}"]
    if not getattr(config, "tie_word_embeddings", False):
        lines.append("--untie-embeddings-and-output-weights")
    sequence = sequence or int(table.attrs.get("tokens_per_sample", 0)) or None
    if sequence:
        lines += [f"--seq-length {sequence}", f"--max-position-embeddings {sequence}"]
    head = (f"# Megatron-LM arguments for pretrain_gpt.py, from a pipexplore plan: {mesh.describe()} "
            f"({plan.data_parallel}), {plan.schedule}, {plan.chunks} micro-batches a replica\n")
    return head + " \\\n".join(lines) + "\n"
