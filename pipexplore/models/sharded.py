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

Each rank computes its share of the heads, as Megatron-LM and torchtitan (``n_heads // tp`` at
parallelize time) give it. On the rank's copy of a module holding projections whose output stays
column-sharded (an attention), what counts its heads is divided by ``tp``: its attributes
(:data:`HEAD_COUNTS`), the widths they make (:data:`HEAD_WIDTHS`, where heads × a head's width) and
its ``config``'s (a copy of its own); its per-head inputs come at the rank's heads (BLOOM's and MPT's
ALiBi, T5's position bias), and a per-head table it holds is sharded by heads (T5's relative
position bias). So code that reshapes by its head count runs on the rank's shard: BLOOM's fused
``query_key_value`` viewed as heads/tp × (q, k, v), Phi-3's ``qkv_proj`` split at heads/tp and
key-value heads/tp (a rank's q|k|v widths; which columns hold which matters to no count).
Transformers' plans gather such a fused output and split it again (``colwise_gather_output`` then
``rowwise_split_input`` in one module: every rank computes every head); counted here as Megatron-LM
shards it, ``colwise`` then ``rowwise``. GPT-2's ``Conv1D`` is sharded as the ``nn.Linear`` it is.
Refused by name (:func:`check_plan`): such a module whose heads ``tp`` does not divide.

:func:`pipexplore.models.opcount.count_call` then counts the copy as it counts any block, its
operators on each rank's local shard, and the collectives ``DTensor`` runs (with their bytes)::

    plan = tensor_parallel_plan(model)                     # {"model.layers.*.self_attn.q_proj": "colwise", …}
    check_plan(model, plan, tp=4)                          # refuses what cannot be sharded so
    with fake_group(4) as mesh:
        rank_block = shard(block, "model.layers.0", plan, mesh)
        count = count_call(rank_block, *on_meta((args, kwargs)))  # opcount.on_meta

Sequence parallelism changes no FLOP and no ring's bytes (each all-reduce of a block's activations
becomes a reduce-scatter and an all-gather of the same tensor: Korthikanti et al. 2022); what it
divides is the activations a rank keeps: :func:`pipexplore.predict.mesh_costs.mesh_layer_table` keeps
1/tp of each layer's saved activations (and of its outputs) on a rank.
"""
from __future__ import annotations

import contextlib
import copy
import re
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from pipexplore.models.opcount import meta_copy

__all__ = ["STYLES", "HEAD_COUNTS", "HEAD_WIDTHS", "tensor_parallel_plan", "style_of", "check_plan", "check_heads",
           "fake_process_group", "fake_group", "shard", "rank_param_bytes", "key_value_bytes"]

#: The plan's styles this counts, by the name Hugging Face's plans give them, with the torch style
#: applied: ``colwise`` ``ColwiseParallel()``, ``colwise_gather`` ``ColwiseParallel(output_layouts=Replicate())``,
#: ``rowwise`` ``RowwiseParallel()``, ``rowwise_from_replicated`` ``RowwiseParallel(input_layouts=Replicate())``
#: (an embedding's vocabulary sharded). ``packed_*``: a fused projection (q|k|v, gate|up) sharded as one
#: (the same bytes and FLOPs a rank); ``rowwise_split_input``: rowwise, its input the rank's shard (the
#: module docstring: beside ``colwise_gather_output`` a rank keeps its share); ``replicated_with_grad_allreduce``
#: and ``replicate``: parameters whole on every rank (a norm's), nothing applied; ``mla_kv_a_proj``:
#: multi-latent attention's key-value down-projection, whole on every rank, the gradient of its
#: rotary part (which no sharded projection reads) all-reduced.
STYLES = {"colwise": "colwise", "packed_colwise": "colwise", "rowwise": "rowwise", "packed_rowwise": "rowwise",
          "rowwise_split_input": "rowwise",
          "colwise_gather_output": "colwise_gather", "embedding_rowwise": "rowwise_from_replicated",
          "replicated_with_grad_allreduce": "", "replicate": "", "mla_kv_a_proj": ""}
_COLWISE = {"colwise", "packed_colwise", "colwise_gather_output"}
#: Styles whose output a rank keeps column-sharded: the module holding them computes its share of heads.
_SHARDED_OUT = {"colwise", "packed_colwise"}

#: A module's attributes that count its heads: each divided by ``tp`` on a rank's copy.
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head", "n_heads",
               "n_kv_heads", "kv_heads")
#: Its widths divided with them where they are heads × a head's width (what it reshapes the sharded output by).
HEAD_WIDTHS = ("hidden_size", "embed_dim", "split_size", "all_head_size", "inner_dim", "kv_dim")
_HEAD_DIMS = ("head_dim", "attention_head_size", "key_value_proj_dim", "head_size")


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


def _rank_styles(planned: Mapping[str, str]) -> dict[str, str]:
    """``planned`` (module name: style), each ``colwise_gather_output`` beside a ``rowwise_split_input``
    in one module read ``colwise``: the fused output a rank keeps its share of (the module docstring)."""
    splitting = {n.rpartition(".")[0] for n, style in planned.items() if style == "rowwise_split_input" and n}
    return {n: "colwise" if style == "colwise_gather_output" and n and n.rpartition(".")[0] in splitting else style
            for n, style in planned.items()}


def _head_parents(planned: Mapping[str, str]) -> list[str]:
    """The modules holding projections whose output a rank keeps column-sharded (``planned`` read
    by :func:`_rank_styles`): each computes its rank's share of heads."""
    return sorted({n.rpartition(".")[0] for n, style in _rank_styles(planned).items() if style in _SHARDED_OUT and n})


def _whole(module: Any, attrs: tuple[str, ...]) -> dict[str, int]:
    """``module``'s positive whole-number attributes among ``attrs``."""
    found = {attr: getattr(module, attr, None) for attr in attrs}
    return {a: v for a, v in found.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def _check_share(module: nn.Module, name: str, tp: int) -> None:
    """Refuse ``module`` (named ``name``), which holds column-sharded projections, where ``tp`` does
    not divide one of its head counts: each rank computes whole heads."""
    for attr, heads in _whole(module, HEAD_COUNTS).items():
        if heads % tp:
            raise ValueError(f"{name} ({type(module).__name__}): tp={tp} does not divide its {heads} heads ({attr}), "
                             "and each tensor-parallel rank computes whole heads: its column-sharded projections have "
                             "no share at this tp: plan a tp that divides it, or leave its projections out of the plan")


def _is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D``: a linear layer whose weight is stored (in, out)."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def check_plan(model: nn.Module, plan: Mapping[str, str], tp: int) -> None:
    """Refuse, with what was expected, a plan that cannot shard ``model`` over ``tp`` ranks: none
    at all where ``tp > 1``, a pattern that matches no module (the model's own plan may name
    modules its config leaves out: Qwen2-MoE's dense MLPs), a style this does not count, a module
    torch's tensor parallelism cannot shard (not an ``nn.Linear``, ``nn.Embedding`` or GPT-2's
    ``Conv1D``, counted as the ``nn.Linear`` it is), a sharded width ``tp`` does not divide, heads
    ``tp`` does not divide."""
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
    own = tensor_parallel_plan(model)
    for pattern, style in plan.items():
        matched = [name for name in modules if _pattern(pattern).match(name)]
        if not matched and own.get(pattern) != style:
            raise ValueError(f"tensor-parallel plan entry {pattern!r} matches no module of {type(model).__name__} "
                             f"(its modules are named like {', '.join(list(modules)[1:4])}, …)")
        if not STYLES[style]:
            continue
        for name in matched:
            module = modules[name]
            if not isinstance(module, (nn.Linear, nn.Embedding)) and not _is_conv1d(module):
                raise ValueError(f"{name} ({type(module).__name__}): torch's tensor parallelism shards nn.Linear and "
                                 f"nn.Embedding (and GPT-2's Conv1D, an nn.Linear) with {style!r}, not a "
                                 f"{type(module).__name__}: plan it 'replicate' or name its projections")
            weight = module.weight  # an nn.Linear's is (out, in); an nn.Embedding's (rows, width); a Conv1D's (in, out)
            width = weight.shape[0] if (style in _COLWISE) == isinstance(module, nn.Linear) else weight.shape[1]
            if width % tp:
                raise ValueError(f"{name}: tp={tp} does not divide the width it shards ({width}, {style}): "
                                 "choose a tp that divides it")
    planned = {name: chosen for name in modules if (chosen := style_of(plan, name)) is not None}
    for parent in _head_parents(planned):
        if parent:
            _check_share(modules[parent], parent, tp)


@contextlib.contextmanager
def fake_process_group(world: int, counting: str) -> Iterator[None]:
    """Torch's ``fake`` process group of ``world`` ranks (collectives run nothing), this process its
    rank 0, for counting ``counting`` (said in the error); destroyed on leaving.

    Raises:
        RuntimeError: a process group is already initialised in this process (the count needs its own).
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(f"counting {counting} needs a process group of its own, and one is already "
                           "initialised in this process: plan in a process that has none")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_group(tp: int) -> Iterator[Any]:
    """A ``DeviceMesh`` of ``tp`` ranks on a fake process group (:func:`fake_process_group`).

    Raises:
        RuntimeError: a process group is already initialised in this process (the count needs its own).
    """
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(tp, "a tensor-parallel rank"):
        yield init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))


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


def _as_linear(conv: nn.Module) -> nn.Linear:
    """GPT-2's ``Conv1D`` as the ``nn.Linear`` it is, on the meta device (its shapes, FLOPs and bytes)."""
    weight, bias = conv.get_parameter("weight"), getattr(conv, "bias", None)
    linear = nn.Linear(weight.shape[0], weight.shape[1], bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.weight.requires_grad_(weight.requires_grad)
    if isinstance(bias, torch.Tensor):
        linear.bias.requires_grad_(bias.requires_grad)
    return linear


def _share_heads(module: nn.Module, name: str, tp: int) -> int:
    """Give ``module`` (a rank's copy holding column-sharded projections) its rank's share of heads:
    its head counts (:data:`HEAD_COUNTS`), the widths they make (:data:`HEAD_WIDTHS`) and those of
    its ``config`` divided by ``tp``, in place. Returns its whole query heads (0: it counts none).

    Raises:
        ValueError: ``tp`` does not divide one of its head counts (each rank computes whole heads).
    """
    _check_share(module, name, tp)
    counts = _whole(module, HEAD_COUNTS)
    config = getattr(module, "config", None)
    config_counts = _whole(config, HEAD_COUNTS) if config is not None else {}
    dims = _whole(module, _HEAD_DIMS) or _whole(config, ("head_dim",))
    hidden, heads = getattr(config, "hidden_size", None), config_counts.get("num_attention_heads")
    head_dim = next(iter(dims.values()), None) or (hidden // heads if isinstance(hidden, int) and heads else None)
    sizes = {v for v in (*counts.values(), *config_counts.values()) if v % tp == 0}
    for attr, width in _whole(module, HEAD_WIDTHS).items():
        if head_dim and width % head_dim == 0 and width // head_dim in sizes:
            setattr(module, attr, width // tp)
    for attr, count in counts.items():
        setattr(module, attr, count // tp)
    if config_counts:
        own = copy.copy(config)  # the rank's own: the model's and its other modules' stay whole
        for attr, count in config_counts.items():
            if count % tp == 0:
                setattr(own, attr, count // tp)
        setattr(module, "config", own)
    query = ("num_heads", "num_attention_heads", "n_head", "n_heads")
    return next((c for a, c in (*counts.items(), *config_counts.items()) if a in query), 0)


def _heads_input(heads: int, tp: int) -> Any:
    """A forward pre-hook handing a module computing ``heads // tp`` of ``heads`` heads its per-head
    inputs at that share: a (batch, heads, queries, keys) bias (T5's position bias) its first heads;
    a (heads, 1, keys) or (batch·heads, 1, keys) one (MPT's and BLOOM's ALiBi) its first rows, the
    shape of a rank's heads (the count reads shapes, and a meta tensor holds no values)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        given = kwargs.get("hidden_states")
        hidden = given if isinstance(given, torch.Tensor) else next(
            (v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
        rows = hidden.shape[0] if hidden is not None and hidden.dim() else 0

        def share(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or hasattr(t, "placements") or not t.is_floating_point() \
                    or (hidden is not None and t.shape == hidden.shape):
                return t
            if t.dim() == 4 and t.shape[1] == heads and t.shape[0] in (1, rows):
                return t.narrow(1, 0, heads // tp)
            if t.dim() == 3 and t.shape[1] == 1 and t.shape[0] in (heads, rows * heads):
                return t.narrow(0, 0, t.shape[0] // tp)
            return t

        return tuple(share(a) for a in args), {k: share(v) for k, v in kwargs.items()}

    return hook


class _AllReduceBackward(torch.autograd.Function):
    """The identity forward; backward, its gradient summed over the group (Megatron-LM's ``f``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = torch.ops._c10d_functional.all_reduce(grad.contiguous(), "sum", ctx.group_name)
        return torch.ops._c10d_functional.wait_tensor(reduced), None


def _rotary_reduced(rope: int, group_name: str) -> Any:
    """A forward hook on multi-latent attention's key-value down-projection (``mla_kv_a_proj``): the
    gradient of its last ``rope`` columns (the rotary key, read by no sharded projection) all-reduced."""
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        latent, rotary = output.split([output.shape[-1] - rope, rope], dim=-1)
        return torch.cat([latent, _AllReduceBackward.apply(rotary, group_name)], dim=-1)

    return hook


def shard(block: nn.Module, name: str, plan: Mapping[str, str], mesh: Any, *, gather_once: bool = True,
          on_meta: bool = True) -> nn.Module:
    """A copy of ``block`` (named ``name`` in its model) on the meta device (``on_meta=False``: where
    its parameters are, their values copied, to run it), its modules that
    ``plan`` names sharded over ``mesh`` by torch's ``parallelize_module``, each module holding
    projections whose output stays column-sharded at its rank's share of heads; ``gather_once``: each
    module holding column-sharded projections takes its input replicated once (the module docstring).

    Raises:
        ValueError: a module whose heads ``tp`` does not divide, or an ``mla_kv_a_proj`` whose
            attention does not say its rotary width (``qk_rope_head_dim``).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    tp = mesh.size()
    rank_block = meta_copy(block) if on_meta else copy.deepcopy(block)
    modules = dict(rank_block.named_modules())
    planned = _rank_styles({sub: style for sub in modules
                            if (style := style_of(plan, f"{name}.{sub}" if sub else name)) is not None
                            and style in STYLES})
    styles: dict[str, Any] = {}
    parents: set[str] = set()
    for sub, style in planned.items():
        if not STYLES[style]:
            continue
        if sub and _is_conv1d(modules[sub]):
            parent, _, child = sub.rpartition(".")
            modules[sub] = _as_linear(modules[sub])
            setattr(modules[parent], child, modules[sub])
        styles[sub] = _torch_style(style)
        if style in _COLWISE and sub:
            parents.add(sub.rpartition(".")[0])
    if "" in styles:  # the block is one sharded module (a Sequential's layer)
        sharded = parallelize_module(rank_block, mesh, styles[""])
        if STYLES[style_of(plan, name) or ""] == "rowwise":  # its input is its rank's shard of the layer before's
            sharded.register_forward_pre_hook(_input_shard(tp), prepend=True)
        return sharded
    for parent in _head_parents(planned):
        module = modules[parent]
        heads = _share_heads(module, f"{name}.{parent}" if parent else name, tp)
        if heads > 1:
            module.register_forward_pre_hook(_heads_input(heads, tp), with_kwargs=True)
            for child, table in module.named_children():  # a per-head table (T5's relative position bias)
                sub = f"{parent}.{child}" if parent else child
                if isinstance(table, nn.Embedding) and table.embedding_dim == heads and sub not in planned:
                    styles[sub] = ColwiseParallel()
    for sub, style in planned.items():
        if style == "mla_kv_a_proj":
            owner = modules[sub.rpartition(".")[0]]
            rope = getattr(owner, "qk_rope_head_dim", None) or getattr(getattr(owner, "config", None),
                                                                       "qk_rope_head_dim", None)
            if not isinstance(rope, int):
                raise ValueError(f"{name}.{sub}: planned 'mla_kv_a_proj', and its attention does not say the width of "
                                 "its rotary key (qk_rope_head_dim): plan it 'replicate'")
            modules[sub].register_forward_hook(_rotary_reduced(rope, mesh.get_group().group_name))
    if styles:
        parallelize_module(rank_block, mesh, styles)
    if gather_once:
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
