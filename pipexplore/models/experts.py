"""A mixture of experts' routed experts: how many a model has, where they are, what a rank computes.

The count comes from the model's config, under whichever name its family gives it
(:data:`EXPERT_COUNTS`: Mixtral's ``num_local_experts``, Qwen's ``num_experts``, DeepSeek's
``n_routed_experts``, …), and the experts each token is routed to from its ``num_experts_per_tok``
(:data:`TOP_K`). The modules holding the routed experts are the ones the config's expert-parallel
plan dispatches to (``base_model_ep_plan``: ``"layers.*.mlp.experts": "ep_dispatch_experts"``),
else the modules named ``experts`` whose parameters are stacked one slice an expert (Hugging
Face's ``gate_up_proj`` of shape ``(experts, 2·ffn, hidden)``). Shared experts (Qwen2-MoE's
``shared_expert``, DeepSeek-V3's ``shared_experts``) and the router are dense: tensor parallelism
shards the one and keeps the other whole, as Megatron-Core does::

    info = routed_experts(model)    # RoutedExperts(count=128, top_k=8, modules=('model.layers.0.mlp.experts', …))
    expert_parameters(model.model.layers[3], info)   # (params, bytes) of the block's routed experts

The mesh folds the experts over the same GPUs as the attention (Megatron-Core's parallel folding,
torchtitan's sparse mesh): a pipeline stage's ``tp · cp · dp`` GPUs hold its experts as
``etp × ep × edp``. Whatever ``ep`` and ``etp`` are, a GPU's experts compute its own tokens' share
of the routed work: with sequence parallelism it holds ``1/tp`` of the tokens, sends each of their
``top_k`` copies to the rank of its expert and takes as many back (the all-to-all trades tokens, it
removes none), and ``etp`` gathers ``etp`` times the tokens for ``1/etp`` of each expert's width.
:func:`share_tokens` gives a tensor-parallel rank's copy of a block that share: its experts'
modules see ``1/tp`` of the tokens, so the count of the rank
(:func:`pipexplore.models.meta.count_layers` with ``tp``) is its routed FLOPs.
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from pipexplore.models.ep_rank import rows_as

__all__ = ["EXPERT_COUNTS", "TOP_K", "RoutedExperts", "routed_experts", "expert_parameters", "router_parameters",
           "share_tokens",
           "divisors", "inputs_of", "count_experts", "share_costs", "regrouped", "SHARE_COLUMNS", "dispatch_bytes"]

#: The config fields that count a model's routed experts, by family (the first set is taken).
EXPERT_COUNTS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts", "num_routed_experts",
                 "n_experts")
#: The config fields that say how many experts each token is routed to.
TOP_K = ("num_experts_per_tok", "moe_topk", "top_k", "moe_top_k", "num_selected_experts")
_DISPATCH = "ep_dispatch_experts"


def _whole(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True)
class RoutedExperts:
    """A model's routed experts: ``count`` a mixture-of-experts layer, ``top_k`` a token, the names
    of the ``modules`` holding them (one a layer) and of the ``routers`` choosing them (whole on every
    rank, as Megatron-Core keeps its router: a weight of one row an expert beside the experts)."""

    count: int
    top_k: int
    modules: tuple[str, ...]
    routers: tuple[str, ...] = ()

    def as_attrs(self) -> dict[str, Any]:
        """What a layer table says of them (``table.attrs['experts']``)."""
        return {"count": self.count, "top_k": self.top_k}


def divisors(n: int, limit: Optional[int] = None) -> list[int]:
    """The divisors of ``n`` (up to ``limit``), smallest first."""
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def _pattern(name: str) -> "re.Pattern[str]":
    return re.compile("^" + re.escape(name).replace(r"\*", r"\d+") + "$")


def _stacked(module: nn.Module, count: int) -> bool:
    """Whether ``module`` holds its experts stacked: every parameter of its own a slice an expert."""
    own = list(module.parameters(recurse=False))
    return bool(own) and all(p.dim() >= 2 and p.shape[0] == count for p in own)


def routed_experts(model: nn.Module) -> Optional[RoutedExperts]:
    """The routed experts of ``model`` (the module docstring), None for a model without: its
    config names no expert count, or no module holds them.

    Raises:
        ValueError: a config that counts experts but says not how many a token is routed to.
    """
    config = getattr(model, "config", None)
    count = next((c for c in (_whole(getattr(config, f, None)) for f in EXPERT_COUNTS) if c), None)
    if config is None or count is None or count < 2:
        return None
    top_k = next((k for k in (_whole(getattr(config, f, None)) for f in TOP_K) if k), None)
    if top_k is None:
        raise ValueError(f"{type(config).__name__} counts {count} routed experts and names none of "
                         f"{', '.join(TOP_K)}: how many experts a token is routed to is not known")
    modules = dict(model.named_modules())
    plan = getattr(config, "base_model_ep_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    under = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    patterns = [_pattern(f"{under}{p}") for p, style in plan.items() if style == _DISPATCH]
    found = [name for name in modules if any(p.match(name) for p in patterns)]
    if not found:  # no plan: the modules named experts holding stacked experts
        found = [name for name, module in modules.items()
                 if name.rpartition(".")[2] == "experts" and _stacked(module, count)]
    if not found:
        return None
    routers = []
    for name in found:  # the experts' siblings holding a weight of one row an expert
        parent = name.rpartition(".")[0]
        for child, module in (modules[parent].named_children() if parent in modules else ()):
            weight = getattr(module, "weight", None)
            full = f"{parent}.{child}" if parent else child
            if full != name and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == count:
                routers.append(full)
    return RoutedExperts(count, top_k, tuple(found), tuple(routers))


def _sums(modules: list[nn.Module]) -> tuple[int, int, int]:
    params = {id(p): p for m in modules for p in m.parameters()}.values()
    return (sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params),
            sum(p.numel() * p.element_size() for p in params if p.requires_grad))


def expert_parameters(block: nn.Module, name: str, info: Optional[RoutedExperts]) -> tuple[int, int, int]:
    """Parameters, their bytes and the bytes that train, of the routed experts in ``block`` (named
    ``name`` in its model; ``info``: the model's :func:`routed_experts`); zeros without."""
    return _sums(_inside(block, name, info))


def router_parameters(block: nn.Module, name: str, info: Optional[RoutedExperts]) -> tuple[int, int]:
    """Parameters and their bytes of the routers in ``block`` (named ``name``); zeros without."""
    if info is None:
        return 0, 0
    routers = [m for sub, m in block.named_modules() if (f"{name}.{sub}" if sub else name) in info.routers]
    return _sums(routers)[:2]


def dispatch_bytes(args: tuple, kwargs: dict, top_k: int) -> float:
    """Bytes of the tokens a block called with ``args`` and ``kwargs`` dispatches to its experts:
    ``top_k`` copies of its hidden states (its ``hidden_states``, else its first floating input)."""
    from torch.utils._pytree import tree_flatten

    given = kwargs.get("hidden_states")
    hidden = given if isinstance(given, torch.Tensor) else next(
        (t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    return float(top_k * hidden.numel() * hidden.element_size()) if hidden is not None else 0.0


def _rankrows_as(tp: int) -> tuple[Any, Any]:
    """A pre-hook giving an experts' module ``1/tp`` of its tokens (every tensor input whose first
    dimension is the tokens': the hidden states, the routed indices and weights), and a hook
    giving its output back the whole tokens' shape."""
    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        first = next((v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor) and v.dim()), None)
        if first is None:
            return args, kwargs
        tokens = first.shape[0]
        share = max(1, math.ceil(tokens / tp))
        module._pipexplore_tokens = tokens  # type: ignore[assignment]

        def cut(v: Any) -> Any:
            return rows_as(v, share) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == tokens else v

        return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        tokens = getattr(module, "_pipexplore_tokens", None)
        if isinstance(output, torch.Tensor) and tokens is not None and output.dim() and output.shape[0] != tokens:
            return rows_as(output, tokens)
        return output

    return before, after


def share_tokens(rank_block: nn.Module, name: str, info: Optional[RoutedExperts], tp: int) -> int:
    """Give the routed experts of ``rank_block`` (a tensor-parallel rank's copy of the block named
    ``name``) the rank's ``1/tp`` of the tokens (the module docstring), in place. Returns how many
    experts' modules it found."""
    if info is None or tp == 1:
        return 0
    found = 0
    for sub, module in rank_block.named_modules():
        if (f"{name}.{sub}" if sub else name) in info.modules:
            before, after = _rankrows_as(tp)
            module.register_forward_pre_hook(before, with_kwargs=True)
            module.register_forward_hook(after, with_kwargs=True)
            found += 1
    return found


def _inside(block: nn.Module, name: str, info: Optional[RoutedExperts]) -> list[nn.Module]:
    if info is None:
        return []
    return [m for sub, m in block.named_modules() if (f"{name}.{sub}" if sub else name) in info.modules]


@contextlib.contextmanager
def inputs_of(block: nn.Module, name: str, info: Optional[RoutedExperts]) -> Iterator[list[tuple]]:
    """While inside, each routed experts' module of ``block`` (named ``name``) records its first
    call's ``(module, args, kwargs)`` (as given it, before any other hook) into the list yielded."""
    seen: list[tuple] = []
    handles = []
    for module in _inside(block, name, info):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not any(s[0] is module for s in seen):
                seen.append((module, args, kwargs))

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def count_experts(seen: Sequence[tuple]) -> Any:
    """The routed experts' own kernels (:func:`pipexplore.models.opcount.count_call` of each module
    :func:`inputs_of` saw, on its inputs: its hooks, such as a rank's token share, apply), as one
    :class:`~pipexplore.models.opcount.Count`; None where it saw none. After them, the all-to-alls
    an expert-parallel rank runs around them at those tokens, counted by torch
    (:func:`pipexplore.models.ep_rank.count_exchange`: records whose ``collective`` is
    ``all_to_all``), where the module's weights are stacked one slice an expert."""
    from pipexplore.models.ep_rank import count_exchange
    from pipexplore.models.opcount import Count, count_call

    if not seen:
        return None
    records: list[dict[str, Any]] = []
    for module, args, kwargs in seen:
        given: list[tuple] = []  # the inputs its own hooks hand it (a rank's share of the tokens)

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not given:
                given.append((args, kwargs))

        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            records += count_call(module, args, kwargs).records
        finally:
            handle.remove()
        exchange = count_exchange(module, *given[0]) if given else None
        if exchange is not None:
            records += exchange.records
    return Count(records)


def share_costs(expert_ops: Any, table: Any, spec: Any, *, efficiency: Any = None, group: Any = None,
                shares: Sequence[int] = ()) -> dict[str, Any]:
    """What a GPU's routed experts save when it holds ``1/d`` of them, for each ``d`` of ``shares``
    (``ep · etp``): its grouped GEMMs read and write ``1/d`` of the experts' weights and weight
    gradients (their ``fixed_bytes``), the FLOPs and the tokens' bytes its own, and run ``1/d`` of
    the groups, each on ``d`` times the tokens (:func:`regrouped`). For each ``d``
    (``"shares"``), the change (negative) to each of ``table``'s layers' ``forward_a``,
    ``forward_b``, ``backward_a`` and ``backward_b`` (``"columns"``; ``"changes"``: shares × those
    four × layers, one array, cheap to copy with the table's ``attrs``), fitted as
    :func:`pipexplore.predict.roofline.planned_layer_costs` fits them (through the table's
    ``attrs['rows']`` sizes, or zero rows and the one), from the roofline of ``expert_ops`` (the
    count's ``attrs['expert_ops']``: the experts' kernels, by their layer's kind). Empty where there
    are none."""
    import numpy as np

    from pipexplore.predict.roofline import kind_seconds

    if expert_ops is None or not len(expert_ops):
        return {}

    sizes = list(table.attrs.get("rows") or ())
    points = [float(n) for n in (sizes if len(sizes) > 1 else [0, *sizes])]
    x = np.asarray(points)
    kinds = table["kind"].to_numpy()

    def fitted(ops: Any) -> dict[str, np.ndarray]:
        per = [kind_seconds(ops, spec, n, efficiency=efficiency, group=group) for n in points]
        out = {}
        for phase in ("forward", "backward"):
            t = np.stack([f[phase].reindex(kinds).fillna(0.0).to_numpy(dtype=float) for f in per], axis=1)
            design = np.stack([np.ones_like(x), x], axis=1)
            coef = np.linalg.lstsq(design, t.T, rcond=None)[0]
            out[f"{phase}_a"], out[f"{phase}_b"] = coef[0], coef[1]
        return out

    attrs = dict(expert_ops.attrs)
    exchange = _exchange_columns(expert_ops, kinds)
    if "collective" in expert_ops:  # the exchange is costed over the ep group's links, not as a kernel
        expert_ops = expert_ops[expert_ops["collective"].fillna("").astype(str) != "all_to_all"]
    expert_ops = expert_ops.assign(flops=expert_ops["flops"].fillna(0.0))  # (a lower bound, as the table's)
    expert_ops.attrs = attrs
    whole = fitted(expert_ops)
    kept = [d for d in sorted(set(shares)) if d > 1]
    changes = np.zeros((len(kept), len(SHARE_COLUMNS), len(table)))
    for i, d in enumerate(kept):
        held = regrouped(expert_ops, d)
        held["fixed_bytes"] = held["fixed_bytes"].to_numpy(dtype=float) / d
        held.attrs = dict(expert_ops.attrs)
        part = fitted(held)
        changes[i] = [part[column] - whole[column] for column in SHARE_COLUMNS]
    return {"shares": np.asarray(kept, dtype=int), "columns": SHARE_COLUMNS, "changes": changes,
            "expert_b": np.stack([whole["forward_b"], whole["backward_b"]]), **exchange}


def regrouped(expert_ops: Any, share: int) -> Any:
    """``expert_ops`` (the experts' kernels counted with every expert on the rank's tokens) as a GPU
    holding ``1/share`` of the experts runs its grouped GEMMs (``aten._grouped_mm``, their groups'
    shapes: :func:`pipexplore.models.opcount.grouped_gemm_shape`): ``1/share`` of the groups, each
    expert receiving ``share`` times the tokens (every rank of its ``ep`` group sends it its share,
    balanced), so the same FLOPs in fewer, larger GEMMs; with ``etp`` each expert's width is taken
    whole (the groups of ``ep · etp``). A copy; the other kernels as they were."""
    import numpy as np

    out = expert_ops.copy()
    if share <= 1 or "gemm_batch" not in out:
        return out
    grows = out["gemm_rows"].fillna("").astype(str).to_numpy()
    grouped = ((out["op"].astype(str) == "aten._grouped_mm").to_numpy() & np.isin(grows, ("m", "k"))
               & (out["gemm_batch"].fillna(0).to_numpy(dtype=float) >= share))
    if not grouped.any():
        return out
    for dim, factor in (("batch", 1.0 / share), ("m", float(share)), ("k", float(share))):
        column = f"gemm_{dim}"
        values = out[column].fillna(0).to_numpy(dtype=float)
        at = grouped & ((grows == dim) if dim != "batch" else True)
        out[column] = np.where(at, values * factor, values)
    return out


def _exchange_columns(expert_ops: Any, kinds: Any) -> dict[str, Any]:
    """From the all-to-all records of ``expert_ops`` (:func:`count_experts`), per layer of ``kinds``
    and phase (forward, backward): ``exchange_bytes``, the bytes a row of the tokens' all-to-alls'
    tensors (the split counts' left out: they do not grow with the rows), and ``exchange_calls``,
    how many all-to-alls (the split counts' too). Empty where there are none."""
    import numpy as np

    if "collective" not in expert_ops:
        return {}
    a2a = expert_ops[expert_ops["collective"].fillna("").astype(str) == "all_to_all"]
    if not len(a2a):
        return {}
    rows = float(expert_ops.attrs.get("rows") or 1)
    tokens = a2a["dtype"].astype(str).str.contains("float|bfloat", regex=True)
    moved = (a2a["fixed_bytes"].to_numpy(dtype=float) + a2a["row_bytes"].to_numpy(dtype=float)) * tokens.to_numpy()
    frame = a2a.assign(moved=moved / rows, calls=1.0)
    out = np.zeros((2, len(kinds)))
    calls = np.zeros((2, len(kinds)))
    for i, phase in enumerate(("forward", "backward")):
        sums = frame[frame["phase"] == phase].groupby("kind", sort=False)[["moved", "calls"]].sum()
        out[i] = sums["moved"].reindex(kinds).fillna(0.0).to_numpy(dtype=float)
        calls[i] = sums["calls"].reindex(kinds).fillna(0.0).to_numpy(dtype=float)
    return {"exchange_bytes": out, "exchange_calls": calls}


#: The columns :func:`share_costs` changes, in its array's order.
SHARE_COLUMNS = ("forward_a", "forward_b", "backward_a", "backward_b")
