"""Each mixture-of-experts block of a model as one rank of a tp × ep mesh runs it, counted by torch on the meta device."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from torch import nn

from pipexplore.models.ep_rank import ExpertParallel, Exchange, GROUPED_GEMMS, exchanges, fake_meshes
from pipexplore.models.experts import RoutedExperts, routed_experts
from pipexplore.models.opcount import Count, count_call, meta_copy, on_meta

__all__ = ["ExpertLayer", "expert_parallel", "count_expert_layers", "layer_exchange_bytes"]


@dataclass
class ExpertLayer:
    """A mixture-of-experts block as an expert-parallel rank runs it: its ``name``, its ``count``
    (every operator of the rank's copy: attention and router per the tensor-parallel plan, the
    local experts' grouped GEMMs at the rank's tokens), its ``exchanges`` (the all-to-alls) and the
    FLOPs of its local experts' grouped GEMMs by phase (``expert_flops``)."""

    name: str
    count: Count
    exchanges: list[Exchange] = field(default_factory=list)
    expert_flops: dict[str, float] = field(default_factory=dict)
    routed_rows: int = 0  #: the rows the rank's local experts compute (its received tokens)


def expert_parallel(block: nn.Module, name: str, info: RoutedExperts, mesh: Any, *, tp_share: int = 1,
                    capacity_factor: float = 1.0) -> list[ExpertParallel]:
    """Put an :class:`ExpertParallel` over ``mesh`` in place of each routed experts' module of
    ``block`` (named ``name``; ``info``: the model's :func:`pipexplore.models.experts.routed_experts`),
    in place. Returns them."""
    placed = []
    for sub, module in list(block.named_modules()):
        if sub and f"{name}.{sub}" in info.modules:
            parent, _, child = sub.rpartition(".")
            wrapper = ExpertParallel(module, mesh, count=info.count, tp_share=tp_share,
                                     capacity_factor=capacity_factor)
            setattr(block.get_submodule(parent) if parent else block, child, wrapper)
            placed.append(wrapper)
    return placed


def _expert_flops(count: Count) -> dict[str, float]:
    return {phase: float(sum(r["flops"] for r in count.records if r["phase"] == phase and r["op"] in GROUPED_GEMMS))
            for phase in ("forward", "backward")}


def count_expert_layers(model: nn.Module, sample: Any, *, ep: int, tp: int = 1,
                        tp_plan: Optional[dict[str, str]] = None, capacity_factor: float = 1.0,
                        microbatch_rows: Optional[int] = None) -> list[ExpertLayer]:
    """Each mixture-of-experts block of ``model`` (the first of each kind) as one rank of ``tp``
    tensor-parallel and ``ep`` expert-parallel ranks runs it on ``sample`` (at ``microbatch_rows``
    rows, default the whole batch), on the meta device over one fake process group
    (:func:`fake_meshes`): its attention and router as the tensor-parallel plan shards them
    (:func:`pipexplore.models.sharded.shard`), its routed experts as :class:`ExpertParallel` (the
    rank's ``1/tp`` of the tokens with sequence parallelism, ``capacity_factor``: the busiest
    rank's share). Empty for a model without routed experts.

    Raises:
        ValueError: ``ep`` that does not divide the experts, a ``capacity_factor`` out of 1 … ep, a
            tensor-parallel plan that cannot shard the model.
    """
    from pipexplore.models import sharded
    from pipexplore.models.hf import cache_off
    from pipexplore.models.inputs import sample_rows
    from pipexplore.models.meta import capture, rows_of
    from pipexplore.training import Training

    info = routed_experts(model)
    if info is None:
        return []
    batch = sample_rows(sample)
    rows = batch if microbatch_rows is None else int(microbatch_rows)
    plan = sharded.tensor_parallel_plan(model, tp_plan) if tp > 1 else {}
    if tp > 1:
        sharded.check_plan(model, plan, tp)
    copied = meta_copy(model)
    with cache_off(copied):  # (training reads no key-value cache)
        cap = capture(copied, on_meta(rows_of(sample, batch, rows)), Training.of(None), backward=False)
    layers: list[ExpertLayer] = []
    seen: set[tuple] = set()
    with fake_meshes(tp, ep) as (tp_mesh, ep_mesh):
        if ep_mesh is None:
            raise ValueError("ep is 1: every expert is on every rank and no token is exchanged; count with ep > 1")
        for k in cap.order:
            name, block = cap.blocks[k]
            call = cap.calls[k]
            if call.signature in seen or not any(m.startswith(f"{name}.") for m in info.modules):
                continue
            seen.add(call.signature)
            rank_block = sharded.shard(block, name, plan, tp_mesh) if tp > 1 else meta_copy(block)
            expert_parallel(rank_block, name, info, ep_mesh, tp_share=tp, capacity_factor=capacity_factor)
            log = exchanges({ep_mesh.get_group().group_name: "ep"})
            with log:
                count = count_call(rank_block, *on_meta((call.args, call.kwargs)))
            wrappers = [m for m in rank_block.modules() if isinstance(m, ExpertParallel)]
            layers.append(ExpertLayer(name, count, list(log.log), _expert_flops(count),
                                      sum(w.routed_rows for w in wrappers)))
    return layers


def layer_exchange_bytes(layers: Sequence[ExpertLayer], phase: str) -> list[int]:
    """Bytes of each layer's token all-to-alls in ``phase`` that cross the links (dispatch and combine)."""
    return [sum(e.bytes for e in layer.exchanges if e.phase == phase and e.step != "counts") for layer in layers]
