"""Which stages of a traced split read the model's inputs themselves.

torch's ``PipelineStage`` feeds the model's inputs to stage 0 only: a split whose later stage
reads an input itself (a Hugging Face model's ``labels``, read by the loss after the last block;
GPT-2's ``attention_mask``, prepared after ``transformer.wpe``) cannot run in processes or under
torchrun, while this process's executors deliver every input to every stage. From the graph of a
split (``pipe.split_gm``, stages ``submod_0`` … ``submod_{n-1}``)::

    inputs_past_first_stage(split(model, {"input_ids": ids, "labels": ids}, ["transformer.h.2"]))
    # {'labels': 1}
    first_runnable_split(split(gpt2, {"input_ids": ids, "attention_mask": mask}, names[1:]))
    # 2: with a stage at every candidate, the mask is read by stage 1 (after transformer.wpe):
    # a second stage may begin at candidate 2 (transformer.drop) at the earliest
"""
from __future__ import annotations

from typing import Any

__all__ = ["input_readers", "inputs_past_first_stage", "first_runnable_split", "outputs_before_last_stage"]


def input_readers(pipe: Any) -> dict[str, list[int]]:
    """Each model input (placeholder name) → the stages that read it directly, in order."""
    found: dict[str, set[int]] = {}
    for node in pipe.split_gm.graph.nodes:
        if node.op != "placeholder":
            continue
        for user in node.users:
            name = str(user.target)
            if user.op == "call_module" and name.startswith("submod_"):
                found.setdefault(node.name, set()).add(int(name.rsplit("_", 1)[1]))
    return {name: sorted(stages) for name, stages in found.items()}


def inputs_past_first_stage(pipe: Any) -> dict[str, int]:
    """The model's inputs that a stage after the first reads directly (name → first such stage):
    what makes the split unable to run in processes (empty: it can)."""
    return {name: min(s for s in stages if s > 0) for name, stages in input_readers(pipe).items()
            if any(s > 0 for s in stages)}


def first_runnable_split(pipe: Any) -> int:
    """For ``pipe`` split with a stage beginning at every candidate (stage ``k`` is candidate ``k``):
    the first candidate a second stage may begin at so that no later stage reads a model input,
    one past the last candidate that reads one (1 where only the first does)."""
    return 1 + max((s for stages in input_readers(pipe).values() for s in stages), default=0)


def outputs_before_last_stage(split_gm: Any) -> list[str]:
    """The model's outputs a stage before the last makes (an encoder's last hidden state, returned
    beside the decoder's logits), by the value's name: torch's stages hand loss_fn the last stage's
    outputs only."""
    import torch.fx as fx

    graph = getattr(split_gm, "split_gm", split_gm).graph
    stages = [n for n in graph.nodes if n.op == "call_module" and str(n.target).startswith("submod_")]
    if not stages:
        return []
    last = max(stages, key=lambda n: int(str(n.target).rsplit("_", 1)[1]))
    output = next(n for n in graph.nodes if n.op == "output")
    early = []
    for value in _leaves(output.args):
        source = value
        while source.op == "call_function" and source.args and isinstance(source.args[0], fx.Node):
            source = source.args[0]  # getitem of a stage's outputs: that stage
        if source.op == "call_module" and source is not last:
            early.append(value.name)
    return early


def _leaves(args: Any) -> list[Any]:
    import torch.fx as fx

    found: list[Any] = []

    def keep(node: Any) -> Any:
        found.append(node)
        return node

    fx.node.map_arg(args, keep)
    return found
