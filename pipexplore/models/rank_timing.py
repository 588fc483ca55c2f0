"""What a tensor-parallel rank's block costs here, timed: the block as torch's tensor parallelism
shards it (``DTensor`` over a fake process group, its parameters' values copied) run forward and
backward beside the whole block, on the block's own inputs of a micro-batch.

A rank computes its share of a layer's FLOPs; on a CPU, and for layers as small as those one tries
here, what it costs is mostly each operator's dispatch, which ``DTensor`` adds to (its sharding
propagation, its redistributions) and which no share of the FLOPs divides: a Llama decoder layer of
hidden 64 on 4 × 16 tokens ran its forward in 0.51 ms whole and in 4.4 ms as one of two ranks
(backward: 0.74 and 4.9 ms), where the FLOPs say half. :func:`timed_shares` measures that ratio once
a kind of block (its type and parameter bytes), alternating the two calls so that what the machine
does meanwhile falls on both. The fake group's collectives run nothing: they are costed apart
(:func:`pipexplore.models.rank_here.rank_here`).

Example::

    shares = timed_shares(model, first_rows, {"model.layers.0": "block"}, tp=2)   # {"model.layers.0": (8.5, 6.6)}
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn

from pipexplore.models import sharded
from pipexplore.models.hf import cache_off
from pipexplore.models.inputs import call_inputs

__all__ = ["timed_shares", "first_calls", "TIMED_SECONDS"]

#: The most seconds one kind of block is timed for (whole and rank together), after a first call of each.
TIMED_SECONDS = 0.5
#: Rounds of the two calls, at least and at most (the median of each is kept).
ROUNDS = (3, 9)


def first_calls(model: nn.Module, sample: Any, names: Sequence[str]) -> dict[str, tuple[tuple, dict]]:
    """The ``(args, kwargs)`` of the first call of each of ``model``'s modules ``names``, in a forward
    of ``sample`` without gradients (a Hugging Face model's KV cache off: :func:`~pipexplore.models.hf.cache_off`)."""
    modules = dict(model.named_modules())
    seen: dict[str, tuple[tuple, dict]] = {}
    hooks = []
    for name in names:
        def keep(module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            seen.setdefault(name, (args, kwargs))
        hooks.append(modules[name].register_forward_pre_hook(keep, with_kwargs=True))
    args, kwargs = call_inputs(sample)
    try:
        with torch.no_grad(), cache_off(model):
            model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _fresh(value: Any) -> Any:
    """``value`` with each floating tensor a new leaf that asks for its gradient, others as they are;
    what is neither a tensor, a container of them nor a plain value (a key-value cache) as None."""
    if torch.is_tensor(value):
        return value.detach().clone().requires_grad_(value.is_floating_point())
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _fresh(v) for k, v in value.items()}
    return value if value is None or isinstance(value, (bool, int, float, str, torch.dtype)) else None


def _output(value: Any) -> torch.Tensor:
    """The first tensor of a block's output, its rank's own shard where it is a ``DTensor``."""
    if isinstance(value, Mapping):
        value = next(iter(value.values()))
    while isinstance(value, (tuple, list)):
        value = value[0]
    return value.to_local() if hasattr(value, "to_local") else value


def _call(block: nn.Module, inputs: tuple[tuple, dict]) -> tuple[float, float]:
    """Seconds of one forward and one backward of ``block`` on fresh copies of ``inputs``."""
    args, kwargs = _fresh(inputs)
    began = time.perf_counter()
    out = _output(block(*args, **kwargs))
    forward = time.perf_counter()
    out.float().sum().backward()
    return forward - began, time.perf_counter() - forward


def _ratios(whole: nn.Module, rank: nn.Module, inputs: tuple[tuple, dict]) -> tuple[float, float]:
    """The rank's forward and backward seconds over the whole block's: medians of alternated calls."""
    first = [sum(_call(block, inputs)) for block in (whole, rank)]  # (each once: its first call warms it)
    rounds = int(min(max(TIMED_SECONDS // max(sum(first), 1e-9), ROUNDS[0]), ROUNDS[1]))
    times: dict[str, list[tuple[float, float]]] = {"whole": [], "rank": []}
    for _ in range(rounds):
        times["whole"].append(_call(whole, inputs))
        times["rank"].append(_call(rank, inputs))
    medians = {key: [statistics.median(t[phase] for t in value) for phase in (0, 1)] for key, value in times.items()}
    (forward, backward), (whole_forward, whole_backward) = medians["rank"], medians["whole"]
    return (forward / whole_forward if whole_forward > 0 else 1.0,
            backward / whole_backward if whole_backward > 0 else 1.0)


def timed_shares(model: nn.Module, sample: Any, kinds: Mapping[str, Hashable], *, tp: int,
                 tp_plan: Optional[dict[str, str]] = None) -> dict[str, tuple[float, float]]:
    """For each of ``model``'s blocks named in ``kinds``: the seconds one of ``tp`` tensor-parallel
    ranks spends in its forward and backward over the whole block's, timed here on ``sample`` (a
    micro-batch) once a kind of block (the module docstring); ``kinds`` gives each block's kind as
    :func:`~pipexplore.models.meta.count_layers` groups them (its ``kind`` column), and a block takes
    the first of its kind's ratios. A block that does not run sharded for real (the count then says
    its share) is left out.
    """
    modules = dict(model.named_modules())
    plan = sharded.tensor_parallel_plan(model, tp_plan)
    inputs = first_calls(model, sample, list(kinds))
    by_kind: dict[Hashable, Optional[tuple[float, float]]] = {}
    out: dict[str, tuple[float, float]] = {}
    with sharded.fake_group(tp) as mesh:
        for name, kind in kinds.items():
            if kind not in by_kind:
                by_kind[kind] = _timed(modules[name], name, plan, mesh, inputs.get(name))
            ratios = by_kind[kind]
            if ratios is not None:
                out[name] = ratios
    return out


def _timed(block: nn.Module, name: str, plan: Mapping[str, str], mesh: Any,
           inputs: Optional[tuple[tuple, dict]]) -> Optional[tuple[float, float]]:
    """:func:`_ratios` of ``block`` sharded as the count shards it (each module of column-sharded
    projections given its input replicated once, else each projection its own); None where it was
    not called or does not run so."""
    if inputs is None:
        return None
    for gather_once in (True, False):
        try:
            rank = sharded.shard(block, name, plan, mesh, gather_once=gather_once, on_meta=False)
            return _ratios(block, rank, inputs)
        except (RuntimeError, TypeError, ValueError, IndexError, AttributeError):
            continue
    return None
