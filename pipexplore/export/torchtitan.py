"""A plan as the command that runs it with torchtitan 0.3.0: its trainer's module and config, and
the arguments its config manager reads (tyro's ``--section.field value`` over the config
registry's defaults; activation checkpointing as the ``activation-checkpoint:<policy>``
subcommand): a boolean as its flag or its ``no_`` flag, a list of lists as its lists comma-joined.

What is written: the mesh (``--parallelism.tensor_parallel_degree``, ``pipeline_parallel_degree``,
``context_parallel_degree``, data parallelism as ``data_parallel_shard_degree`` for FSDP or
``data_parallel_replicate_degree`` for DDP, FSDP's ``fsdp_reshard_after_forward`` and
``enable_sequence_parallel``), the pipeline (``pipeline_parallel_schedule``,
``pipeline_parallel_microbatch_size``, and ``module_fqns_per_model_part``: the plan's stages as
torchtitan's decoders name their modules, ``tok_embeddings``, ``layers.N``, ``norm``, ``lm_head``),
the batch (``--training.local_batch_size``: a replica's rows; ``global_batch_size``; ``seq_len``),
activation checkpointing (``full`` where the plan checkpoints every micro-batch, else ``none``) and,
for a mixture of experts, ``expert_parallel_degree`` (the mesh's ep).

torchtitan builds its own model from a config registry function: the model must be one of its
Llama 3 flavors (:data:`TORCHTITAN_LLAMA3`) or of its mixtures of experts (:data:`TORCHTITAN_MOE`:
Qwen3-MoE's, DeepSeek-V3's), checked against the Hugging Face config's shape, or it is refused by
name (the flavors that exist named), as are ZeRO-1 (torchtitan shards with FSDP or replicates),
schedules torch's pipelining does not name, and expert degrees its sparse mesh cannot take: it
shards no expert by tensor parallelism (no ``etp``), and its ``ep`` borrows from the ranks of
``dp_shard · cp · tp`` (under DDP, ``cp · tp``).

Example::

    print(torchtitan_command(plan, config=model.config))
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["torchtitan_command", "torchtitan_fqns", "TORCHTITAN_VERSION", "TORCHTITAN_LLAMA3", "TORCHTITAN_MOE",
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
_QWEN3_MOE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "dense_layers")
_DEEPSEEK_V3 = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size",
                "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "intermediate_size", "dense_layers")
#: torchtitan 0.3.0's mixtures of experts, by the Hugging Face model type whose shape they have:
#: its module, then each config registry function with its model's shape as that config's fields
#: (``dense_layers``: the leading decoder layers without experts; ``q_lora_rank`` 0: none).
TORCHTITAN_MOE: dict[str, tuple[str, dict[str, dict[str, int]]]] = {
    "qwen3_moe": ("qwen3", {
        "qwen3_moe_debug": dict(zip(_QWEN3_MOE, (256, 8, 16, 8, 128, 2048, 768, 64, 8, 0))),
        "qwen3_30b_a3b": dict(zip(_QWEN3_MOE, (2048, 48, 32, 4, 128, 151936, 768, 128, 8, 0))),
    }),
    "deepseek_v3": ("deepseek_v3", {
        "deepseek_v3_debugmodel": dict(zip(_DEEPSEEK_V3, (256, 6, 16, 2048, 0, 512, 128, 64, 128, 256, 8, 3, 2, 1024,
                                                          1))),
        "deepseek_v3_16b": dict(zip(_DEEPSEEK_V3, (2048, 27, 16, 102400, 0, 512, 128, 64, 128, 1408, 64, 6, 2, 10944,
                                                   1))),
        "deepseek_v3_671b": dict(zip(_DEEPSEEK_V3, (7168, 61, 128, 129280, 1536, 512, 128, 64, 128, 2048, 256, 8, 1,
                                                    18432, 3))),
    }),
}
#: The plan's schedules as torch's ``get_schedule_class`` names them (what torchtitan reads).
TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "looped-bfs": "LoopedBFS",
                        "interleaved-zero-bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble",
                        "dualpipev": "DualPipeV"}
_NAMES = [(re.compile(r"^model\.embed_tokens$"), "tok_embeddings"),
          (re.compile(r"^model\.layers\.(\d+)$"), r"layers.\1"),
          (re.compile(r"^model\.norm$"), "norm"), (re.compile(r"^lm_head$"), "lm_head")]


def _moe_flavors() -> str:
    return "; ".join(f"{', '.join(flavors)} ({module})" for module, flavors in TORCHTITAN_MOE.values())


def _moe_config(config: Any, table: Any) -> tuple[str, str]:
    """torchtitan's module and config registry function of the mixture of experts whose shape is
    ``config``'s (its decoder layers as ``table`` has them), or a ValueError naming those that exist."""
    model_type = getattr(config, "model_type", None)
    if model_type not in TORCHTITAN_MOE:
        raise ValueError(f"torchtitan {TORCHTITAN_VERSION} builds no {model_type or 'such'} mixture of experts: its "
                         f"MoE flavors are {_moe_flavors()}; export 'megatron' or 'torchrun'")
    module, flavors = TORCHTITAN_MOE[model_type]
    kind = table[table["param_bytes"] > 0]["type"].value_counts().idxmax()  # the decoder layers' type
    blocks = [i for i, t in enumerate(table["type"]) if t == kind]
    routed = table["expert_params"].to_numpy() > 0
    dense = next((k for k, r in enumerate(blocks) if routed[r]), len(blocks))
    if any(not routed[r] for r in blocks[dense:]):
        dense = -1  # dense layers among the experts' (a layer frequency): none of torchtitan's
    shape = {field: getattr(config, field, None) for field in next(iter(flavors.values()))}
    shape["dense_layers"] = dense
    if "q_lora_rank" in shape:
        shape["q_lora_rank"] = shape["q_lora_rank"] or 0
    for name, known in flavors.items():
        if known == shape:
            return module, name
    said = ", ".join(f"{field} {value}" for field, value in shape.items())
    raise ValueError(f"torchtitan {TORCHTITAN_VERSION}'s {model_type} flavors are {', '.join(flavors)}; this model's "
                     f"shape ({said}) is none of them: add a config registry function for it to torchtitan, or export "
                     "'megatron' or 'torchrun'")


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


def _experts(plan: Any, data_parallel: str) -> None:
    """Refuse the expert degrees torchtitan's sparse mesh (``pp, dp_replicate, efsdp, ep``) cannot take."""
    mesh = plan.mesh_or_pipeline
    if mesh.etp > 1:
        raise ValueError(f"torchtitan {TORCHTITAN_VERSION} shards no expert by tensor parallelism (its experts are "
                         f"whole on each of their ep ranks): the plan's etp {mesh.etp} cannot be written; plan etp=1, "
                         "or export 'megatron' (--expert-tensor-parallel-size)")
    sparse = mesh.tp * mesh.cp * (mesh.dp if data_parallel == "fsdp" else 1)
    if sparse % mesh.ep:
        raise ValueError(f"torchtitan's ep borrows from the ranks of dp_shard · cp · tp = {sparse} (its data "
                         f"parallelism is {data_parallel}, outside the experts' mesh): the plan's ep {mesh.ep} does not "
                         "divide them; plan data_parallel='fsdp', an ep dividing cp · tp, or export 'megatron'")


def torchtitan_fqns(table: Any, splits: list[int]) -> list[list[str]]:
    """The plan's stages as torchtitan's decoders name their modules (those with no module there, a
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
    table = plan.layer_table
    moe = bool(table.attrs.get("experts"))
    module, registry = _moe_config(config, table) if moe else ("llama3", _registry_config(config))
    if plan.data_parallel == "zero1":
        raise ValueError("torchtitan shards a replica's state with FSDP or replicates it (DDP, HSDP); ZeRO-1 is "
                         "Megatron-LM's distributed optimizer: plan data_parallel='fsdp' or 'ddp', or export "
                         "'megatron'")
    if plan.schedule not in TORCHTITAN_SCHEDULES:
        raise ValueError(f"torchtitan runs torch's schedules ({', '.join(TORCHTITAN_SCHEDULES)}), "
                         f"not {plan.schedule!r}")
    if moe:
        _experts(plan, plan.data_parallel)
    mesh = plan.mesh_or_pipeline
    rows = int(plan.step_batch)  # type: ignore[arg-type]
    sequence = int(table.attrs.get("tokens_per_sample", 0)) or None
    fqns = torchtitan_fqns(table, list(plan.splits))
    if any(not part for part in fqns):
        raise ValueError("a stage holds no module torchtitan's decoder has (only the rotary embedding): move its split")
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
    if moe:
        parallelism["expert_parallel_degree"] = mesh.ep
    training = {"local_batch_size": rows, "global_batch_size": rows * mesh.dp}
    if sequence:
        training["seq_len"] = sequence
    lines = [f"torchrun --nnodes {nodes} --nproc-per-node {per_node} -m torchtitan.train",
             f"--module {module} --config {registry}"]
    lines += [(f"--parallelism.{key}" if value else f"--parallelism.no_{key}") if isinstance(value, bool)
              else f"--parallelism.{key} {value}" for key, value in parallelism.items()]
    lines += [f"--training.{key} {value}" for key, value in training.items()]
    lines.append("activation-checkpoint:full" if plan.checkpoint == "always" else "activation-checkpoint:none")
    head = (f"# torchtitan {TORCHTITAN_VERSION}: a pipexplore plan, {mesh.describe()} ({plan.data_parallel}), "
            f"{plan.schedule}, {plan.chunks} micro-batches a replica; on each node (--node-rank, --rdzv-endpoint "
            "as your cluster gives them):\n")
    return head + " \\\n  ".join(lines) + "\n"

