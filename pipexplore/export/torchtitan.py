"""A plan as the command that runs it with torchtitan 0.3.0: its trainer's module and config, and
the arguments its config manager reads (tyro's ``--section.field value`` over the config
registry's defaults; activation checkpointing as the ``activation-checkpoint:<policy>``
subcommand): a boolean as its flag or its ``no_`` flag, a list of lists as its lists comma-joined.

What is written: the mesh (``--parallelism.tensor_parallel_degree``, ``pipeline_parallel_degree``,
``context_parallel_degree``, data parallelism as ``data_parallel_shard_degree`` for FSDP or
``data_parallel_replicate_degree`` for DDP, FSDP's ``fsdp_reshard_after_forward`` and
``enable_sequence_parallel``), the pipeline (``pipeline_parallel_schedule``,
``pipeline_parallel_microbatch_size``, and ``module_fqns_per_model_part``: the plan's stages as
torchtitan's Llama names its modules, ``tok_embeddings``, ``layers.N``, ``norm``, ``output``), the
batch (``--training.local_batch_size``: a replica's rows; ``global_batch_size``; ``seq_len``) and
activation checkpointing (``full`` where the plan checkpoints every micro-batch, else ``none``).

torchtitan builds its own model from a config registry function: the model must be one of its
Llama 3 flavors (:data:`TORCHTITAN_LLAMA3`, checked against the Hugging Face config's shape), or it
is refused by name, as are ZeRO-1 (torchtitan shards with FSDP or replicates) and schedules torch's
pipelining does not name.

Example::

    print(torchtitan_command(plan, config=model.config))
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["torchtitan_command", "torchtitan_fqns", "TORCHTITAN_VERSION", "TORCHTITAN_LLAMA3",
           "TORCHTITAN_SCHEDULES"]

#: The torchtitan release the command is written for (its config manager's flags and registry names).
TORCHTITAN_VERSION = "0.3.0"
#: torchtitan 0.3.0's Llama 3 flavors (``torchtitan/models/llama3``): config registry function and
#: shape (hidden size, decoder layers, attention heads, key-value heads, vocabulary, FFN width).
TORCHTITAN_LLAMA3 = {
    "llama3_8b": (4096, 32, 32, 8, 128256, 14336),
    "llama3_70b": (8192, 80, 64, 8, 128256, 28672),
    "llama3_405b": (16384, 126, 128, 8, 128256, 53248),
}
#: The plan's schedules as torch's ``get_schedule_class`` names them (what torchtitan reads).
TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "looped-bfs": "LoopedBFS",
                        "interleaved-zero-bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble",
                        "dualpipev": "DualPipeV"}
_NAMES = [(re.compile(r"^model\.embed_tokens$"), "tok_embeddings"),
          (re.compile(r"^model\.layers\.(\d+)$"), r"layers.\1"),
          (re.compile(r"^model\.norm$"), "norm"), (re.compile(r"^lm_head$"), "output")]


def _registry_config(config: Any) -> str:
    """The config registry function of torchtitan's Llama 3 whose shape is ``config``'s, or a ValueError."""
    model_type = getattr(config, "model_type", None)
    if model_type != "llama":
        raise ValueError(f"torchtitan builds its own model from its config registry: {model_type or 'this model'} is "
                         f"not one this export writes (Llama 3: {', '.join(TORCHTITAN_LLAMA3)}); export 'torchrun' "
                         "or 'megatron'")
    shape = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
             getattr(config, "num_key_value_heads", None) or config.num_attention_heads, config.vocab_size,
             config.intermediate_size)
    for name, known in TORCHTITAN_LLAMA3.items():
        if known == shape:
            return name
    raise ValueError(f"torchtitan {TORCHTITAN_VERSION}'s Llama 3 flavors are {', '.join(TORCHTITAN_LLAMA3)}; this "
                     f"model's shape (hidden {shape[0]}, {shape[1]} layers, {shape[2]} heads, {shape[3]} key-value "
                     f"heads, vocabulary {shape[4]}, FFN {shape[5]}) is none of them: add a config registry function "
                     "for it to torchtitan, or export 'torchrun' or 'megatron'")


def torchtitan_fqns(table: Any, splits: list[int]) -> list[list[str]]:
    """The plan's stages as torchtitan's Llama names its modules (those with no module there, a
    rotary embedding's, left out)."""
    names = [str(n) for n in table["name"]]
    points = [0, *splits, len(names)]
    parts = []
    for a, b in zip(points, points[1:]):
        part = []
        for name in names[a:b]:
            for pattern, theirs in _NAMES:
                if pattern.match(name):
                    part.append(pattern.sub(theirs, name))
                    break
        parts.append(part)
    return parts


def torchtitan_command(plan: Any, *, config: Any = None, nodes: int = 0) -> str:
    """The command that trains ``plan``'s model with torchtitan (the module docstring): ``torchrun``
    on each node (``nodes``: default the plan's), then torchtitan's trainer with its arguments.

    Raises:
        ValueError: a model, data parallelism or schedule torchtitan does not run, named.
    """
    registry = _registry_config(config)
    if plan.data_parallel == "zero1":
        raise ValueError("torchtitan shards a replica's state with FSDP or replicates it (DDP, HSDP); ZeRO-1 is "
                         "Megatron-LM's distributed optimizer: plan data_parallel='fsdp' or 'ddp', or export "
                         "'megatron'")
    if plan.schedule not in TORCHTITAN_SCHEDULES:
        raise ValueError(f"torchtitan runs torch's schedules ({', '.join(TORCHTITAN_SCHEDULES)}), "
                         f"not {plan.schedule!r}")
    mesh = plan.mesh_or_pipeline
    table = plan.layer_table
    rows = int(plan.step_batch)  # type: ignore[arg-type]
    sequence = int(table.attrs.get("tokens_per_sample", 0)) or None
    fqns = torchtitan_fqns(table, list(plan.splits))
    if any(not part for part in fqns):
        raise ValueError("a stage holds no module torchtitan's Llama has (only the rotary embedding): move its split")
    ranks = mesh.tp * mesh.pp * mesh.dp * mesh.cp
    per_node = min(ranks, int(getattr(plan, "gpus_per_node", 8) or 8))
    nodes = nodes or max(1, ranks // per_node)
    parallelism = {
        "data_parallel_replicate_degree": mesh.dp if plan.data_parallel == "ddp" else 1,
        "data_parallel_shard_degree": mesh.dp if plan.data_parallel == "fsdp" else 1,
        "fsdp_reshard_after_forward": "always" if plan.reshard_after_forward else "never",
        "tensor_parallel_degree": mesh.tp,
        "enable_sequence_parallel": bool(plan.sequence_parallel and mesh.tp > 1),
        "context_parallel_degree": mesh.cp,
        "pipeline_parallel_degree": mesh.pp,
        "pipeline_parallel_schedule": TORCHTITAN_SCHEDULES[plan.schedule],
        "pipeline_parallel_microbatch_size": rows // plan.chunks,
        "module_fqns_per_model_part": " ".join(",".join(part) for part in fqns),  # a stage's names, comma-joined
    }
    training = {"local_batch_size": rows, "global_batch_size": rows * mesh.dp}
    if sequence:
        training["seq_len"] = sequence
    lines = [f"torchrun --nnodes {nodes} --nproc-per-node {per_node} -m torchtitan.train",
             f"--module llama3 --config {registry}"]
    lines += [(f"--parallelism.{key}" if value else f"--parallelism.no_{key}") if isinstance(value, bool)
              else f"--parallelism.{key} {value}" for key, value in parallelism.items()]
    lines += [f"--training.{key} {value}" for key, value in training.items()]
    lines.append("activation-checkpoint:full" if plan.checkpoint == "always" else "activation-checkpoint:none")
    head = (f"# torchtitan {TORCHTITAN_VERSION}: a pipexplore plan, {mesh.describe()} ({plan.data_parallel}), "
            f"{plan.schedule}, {plan.chunks} micro-batches a replica; on each node (--node-rank, --rdzv-endpoint "
            "as your cluster gives them):\n")
    return head + " \\\n  ".join(lines) + "\n"

