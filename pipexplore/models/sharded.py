"""A block as tensor parallelism shards it, counted on a fake process group: one rank's work.

The plan comes from the model: a Hugging Face model's own ``config.base_model_tp_plan`` (module
names under its base model: ``layers.*.self_attn.q_proj``) and its class's ``_tp_plan`` (the head:
``lm_head``), else ``tp_plan=`` given in the same form, module-name patterns with ``*`` for an
index::

    {"transformer.h.*.mlp.dense_h_to_4h": "colwise", "transformer.h.*.mlp.dense_4h_to_h": "rowwise"}

Each style is applied by torch's own tensor parallelism (``parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel``) on a copy of the block on the meta device, over a
``DeviceMesh`` of a fake process group (torch's ``fake`` backend with ``FakeStore``: one process
stands for the whole group, and nothing is allocated). The module that holds column-sharded
projections gets its input as one replicated ``DTensor`` (as torchtitan's ``PrepareModuleInput``
does), so its gradient is all-reduced once, not once a projection: Megatron-LM's ``f`` and ``g``,
an all-reduce forward and one backward a sharded attention or MLP.

:func:`pipexplore.models.opcount.count_call` then counts the copy as it counts any block, its
operators on each rank's local shard, and the collectives ``DTensor`` runs (with their bytes)::

    plan = tensor_parallel_plan(model)                     # {"model.layers.*.self_attn.q_proj": "colwise", …}
    check_plan(model, plan, tp=4)                          # refuses what cannot be sharded so
    with fake_group(4) as mesh:
        rank_block = shard(block, "model.layers.0", plan, mesh)
        count = count_call(rank_block, *on_meta((args, kwargs)))  # opcount.on_meta

Sequence parallelism changes no FLOP and no ring's bytes (each all-reduce of a block's activations
becomes a reduce-scatter and an all-gather of the same tensor: Korthikanti et al. 2022); what it
divides is the activations a rank keeps, counted by :func:`pipexplore.predict.memory.stage_memory`.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from pipexplore.models.opcount import meta_copy

__all__ = ["STYLES", "tensor_parallel_plan", "style_of", "check_plan", "check_heads", "fake_group", "shard",
           "rank_param_bytes", "key_value_bytes"]

#: The plan's styles this counts, by the name Hugging Face's plans give them, with the torch style
#: applied: ``colwise`` ``ColwiseParallel()``, ``colwise_gather`` ``ColwiseParallel(output_layouts=Replicate())``,
#: ``rowwise`` ``RowwiseParallel()``, ``rowwise_from_replicated`` ``RowwiseParallel(input_layouts=Replicate())``
#: (an embedding's vocabulary sharded). ``packed_*``: a fused projection (q|k|v, gate|up) sharded as one
#: (the same bytes and FLOPs a rank); ``rowwise_split_input``: rowwise, its input already split (torch's
#: default); ``replicated_with_grad_allreduce`` and ``replicate``: parameters
#: whole on every rank (a norm's), nothing applied.
STYLES = {"colwise": "colwise", "packed_colwise": "colwise", "rowwise": "rowwise", "packed_rowwise": "rowwise",
          "rowwise_split_input": "rowwise",
          "colwise_gather_output": "colwise_gather", "embedding_rowwise": "rowwise_from_replicated",
          "replicated_with_grad_allreduce": "", "replicate": ""}
_COLWISE = {"colwise", "packed_colwise", "colwise_gather_output"}


def tensor_parallel_plan(model: nn.Module, tp_plan: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The tensor-parallel plan of ``model`` as patterns of its own module names: ``tp_plan`` where
    given, else its config's ``base_model_tp_plan`` under its base model's name and its class's
    ``_tp_plan`` (the head); ``{}`` where it has none."""
    if tp_plan is not None:
        if not isinstance(tp_plan, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in tp_plan.items()):
            raise ValueError("tp_plan maps module-name patterns to styles, "
                             "{'transformer.h.*.mlp.dense_h_to_4h': 'colwise', …}, got " + repr(tp_plan)[:120])
        return dict(tp_plan)
    plan: dict[str, str] = {}
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    under = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    plan.update({f"{under}{pattern}": style for pattern, style in base.items()})
    plan.update(dict(getattr(type(model), "_tp_plan", None) or {}))
    return plan


def _pattern(name: str) -> "re.Pattern[str]":
    return re.compile("^" + re.escape(name).replace(r"\*", r"\d+") + "$")


def style_of(plan: Mapping[str, str], name: str) -> Optional[str]:
    """The style ``plan`` gives the module named ``name`` (None: not sharded)."""
    for pattern, style in plan.items():
        if _pattern(pattern).match(name):
            return style
    return None


def check_heads(model: nn.Module, tp: int) -> None:
    """Refuse a ``tp`` that does not divide the attention heads or the key-value heads of
    ``model``'s config (each rank computes whole heads)."""
    config = getattr(model, "config", None)
    for field, what in (("num_attention_heads", "attention heads"), ("n_head", "attention heads"),
                        ("num_key_value_heads", "key-value heads")):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads > 0 and heads % tp:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0 and d <= 64]
            raise ValueError(f"tp={tp} does not divide the model's {heads} {what} ({field}): each tensor-parallel "
                             f"rank computes whole heads; tp can be {', '.join(map(str, divisors))}")


def check_plan(model: nn.Module, plan: Mapping[str, str], tp: int) -> None:
    """Refuse, with what was expected, a plan that cannot shard ``model`` over ``tp`` ranks: none
    at all where ``tp > 1``, a pattern that matches no module, a style this does not count, a
    module torch's tensor parallelism cannot shard (not an ``nn.Linear`` or ``nn.Embedding``), a
    sharded width ``tp`` does not divide, heads ``tp`` does not divide."""
    if tp == 1:
        return
    if not plan:
        raise ValueError(f"tp={tp}: {type(model).__name__} carries no tensor-parallel plan (its config has no "
                         "base_model_tp_plan): give one as tp_plan={'<module pattern>': 'colwise' | 'rowwise', …}, "
                         "'*' for a layer's index, e.g. {'transformer.h.*.mlp.dense_h_to_4h': 'colwise', "
                         "'transformer.h.*.mlp.dense_4h_to_h': 'rowwise'}")
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        users = [p for p, s in plan.items() if s in unknown][:3]
        raise ValueError(f"tensor-parallel style{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"(of {', '.join(users)}) cannot be counted with torch's parallelize_module here: plan "
                         f"tp=1, or give tp_plan= with the styles {', '.join(STYLES)}")
    check_heads(model, tp)
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        matched = [name for name in modules if _pattern(pattern).match(name)]
        if not matched:
            raise ValueError(f"tensor-parallel plan entry {pattern!r} matches no module of {type(model).__name__} "
                             f"(its modules are named like {', '.join(list(modules)[1:4])}, …)")
        if not STYLES[style]:
            continue
        for name in matched:
            module = modules[name]
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                raise ValueError(f"{name} ({type(module).__name__}): torch's tensor parallelism shards nn.Linear and "
                                 f"nn.Embedding with {style!r}, not a {type(module).__name__}: plan it 'replicate' "
                                 "or name its projections")
            weight = module.weight
            width = weight.shape[0] if (style in _COLWISE) == isinstance(module, nn.Linear) else weight.shape[1]
            if width % tp:
                raise ValueError(f"{name}: tp={tp} does not divide the width it shards ({width}, {style}): "
                                 "choose a tp that divides it")


@contextlib.contextmanager
def fake_group(tp: int) -> Iterator[Any]:
    """A ``DeviceMesh`` of ``tp`` ranks on a fake process group, this process its rank 0 (torch's
    ``fake`` backend: collectives run nothing); the group is destroyed on leaving.

    Raises:
        RuntimeError: a process group is already initialised in this process (the count needs its own).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("counting a tensor-parallel rank needs a process group of its own, and one is already "
                           "initialised in this process: plan in a process that has none")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _torch_style(style: str) -> Any:
    """The torch style :data:`STYLES` names for ``style``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kind = STYLES[style]
    if kind.startswith("colwise"):
        return ColwiseParallel(output_layouts=Replicate()) if kind == "colwise_gather" else ColwiseParallel()
    return RowwiseParallel(input_layouts=Replicate()) if kind == "rowwise_from_replicated" else RowwiseParallel()


def _replicated_input(mesh: Any) -> Any:
    """A forward pre-hook that hands a module its hidden states (the first floating tensor given,
    positional or ``hidden_states``) as one replicated ``DTensor``: its projections share it, and its
    gradient is all-reduced once (torchtitan's ``PrepareModuleInput``)."""
    from torch.distributed.tensor import DTensor, Replicate

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        def wrap(t: Any) -> Any:
            return DTensor.from_local(t, mesh, [Replicate()], run_check=False)

        for i, value in enumerate(args):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not hasattr(value, "placements"):
                return (*args[:i], wrap(value), *args[i + 1:]), kwargs
        value = kwargs.get("hidden_states")
        if isinstance(value, torch.Tensor) and not hasattr(value, "placements"):
            return args, {**kwargs, "hidden_states": wrap(value)}
        return args, kwargs

    return hook


def _input_shard(tp: int) -> Any:
    """A forward pre-hook that hands a row-sharded module counted on its own its rank's ``1/tp`` of
    its input's last dimension (what the column-sharded layer before leaves a rank)."""
    def hook(module: nn.Module, args: tuple) -> tuple:
        if args and isinstance(args[0], torch.Tensor) and not hasattr(args[0], "placements"):
            x = args[0]
            return (x.narrow(-1, 0, x.shape[-1] // tp), *args[1:])
        return args

    return hook


def shard(block: nn.Module, name: str, plan: Mapping[str, str], mesh: Any, *, gather_once: bool = True) -> nn.Module:
    """A copy of ``block`` (named ``name`` in its model) on the meta device, its modules that
    ``plan`` names sharded over ``mesh`` by torch's ``parallelize_module``; ``gather_once``: each
    module holding column-sharded projections takes its input replicated once (the module docstring)."""
    from torch.distributed.tensor.parallel import parallelize_module

    rank_block = meta_copy(block)
    styles: dict[str, Any] = {}
    parents: set[str] = set()
    for sub, _ in rank_block.named_modules():
        style = style_of(plan, f"{name}.{sub}" if sub else name)
        if style is None or not STYLES.get(style):
            continue
        styles[sub] = _torch_style(style)
        if style in _COLWISE and sub:
            parents.add(sub.rpartition(".")[0])
    if "" in styles:  # the block is one sharded module (a Sequential's layer)
        sharded = parallelize_module(rank_block, mesh, styles[""])
        if STYLES[style_of(plan, name) or ""] == "rowwise":  # its input is its rank's shard of the layer before's
            sharded.register_forward_pre_hook(_input_shard(mesh.size()), prepend=True)
        return sharded
    if styles:
        parallelize_module(rank_block, mesh, styles)
    if gather_once:
        modules = dict(rank_block.named_modules())
        for parent in parents:
            if parent and not isinstance(modules[parent], (nn.Linear, nn.Embedding)):
                modules[parent].register_forward_pre_hook(_replicated_input(mesh), with_kwargs=True)
    return rank_block


def rank_param_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters one rank holds (a ``DTensor``'s local shard)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def key_value_bytes(model: nn.Module, ops: Any, kinds: Any, tokens: int) -> Optional[Any]:
    """Per layer (``kinds``: each layer's kind in ``ops``), the bytes of the keys and values its
    attention computes a row of ``tokens`` tokens, whole (every key-value head), in the model's
    dtype: what context parallelism gathers across its ranks (Llama 3's all-gather of K and V).
    A layer attends where its kind runs an attention operator (``scaled_dot_product``, or a
    softmax); the widths come from the model's config (``num_key_value_heads`` × ``head_dim``).
    None where the config does not say them."""
    import numpy as np

    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    if not (isinstance(kv_heads, int) and isinstance(head_dim, int)):
        return None
    param = next(iter(model.parameters()), None)
    size = param.element_size() if param is not None and param.is_floating_point() else 4
    attends = set(ops.loc[ops["op"].str.contains("scaled_dot_product|attention|_softmax", regex=True), "kind"])
    per_row = 2 * kv_heads * head_dim * tokens * size
    return np.array([per_row if kind in attends else 0 for kind in kinds], dtype=float)
