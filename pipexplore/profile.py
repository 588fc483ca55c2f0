"""Layer profiles: what each layer of an ``nn.Sequential`` costs, as a DataFrame."""
from __future__ import annotations

import statistics
import time
from typing import Any, Optional, Union

import pandas as pd
import torch
from torch import Tensor, nn

from pipexplore.microbatch import Batch, TensorOrTensors, tensors_in
from pipexplore.skip.skippable import Skippable
from pipexplore.skip.tracker import SkipTracker, use_skip_tracker

__all__ = ["profile", "LAYER_COLUMNS"]

LAYER_COLUMNS = ["name", "type", "param_bytes", "output_bytes", "forward", "backward", "stash", "pop",
                 "stash_keys", "pop_keys"]


def _keys(pairs: Any) -> str:
    """Skip names qualified by namespace (``name@id``), so that isolated names pair up right."""
    return ",".join(f"{name}@{'' if ns is None else ns.id.hex[:12]}" for ns, name in pairs)


def _detach(value: TensorOrTensors) -> TensorOrTensors:
    def one(t: Tensor) -> Tensor:
        t = t.detach()
        return t.requires_grad_() if t.is_floating_point() else t

    if torch.is_tensor(value):
        return one(value)  # type: ignore[arg-type]
    return tuple(one(t) for t in value)  # type: ignore[union-attr]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _whole_model_seconds(module: nn.Sequential, value: TensorOrTensors, target: torch.device,
                         repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds of the whole model, run as one chain."""
    forward_times, backward_times = [], []
    for _ in range(repeats):
        with use_skip_tracker(SkipTracker()), torch.enable_grad():
            _sync(target)
            t0 = time.perf_counter()
            output = module(_detach(value))
            _sync(target)
            t1 = time.perf_counter()
            outs = [t for t in tensors_in(output) if t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            _sync(target)
            t2 = time.perf_counter()
        module.zero_grad(set_to_none=True)
        forward_times.append(t1 - t0)
        backward_times.append(t2 - t1)
    return statistics.median(forward_times), statistics.median(backward_times)


def profile(module: nn.Sequential, sample: TensorOrTensors, *, device: Optional[Union[torch.device, str]] = None,
            repeats: int = 5, timeout: Optional[float] = None, calibrate: bool = True) -> pd.DataFrame:
    """Profile every layer of ``module`` on ``sample`` (one mini-batch), one layer at a time.

    Returns one row per layer: ``name``, ``type``, ``param_bytes``, ``output_bytes`` (the
    layer's outputs and the skip tensors it stashes, for the whole ``sample``), ``forward`` and
    ``backward`` seconds (medians over ``repeats``, or as many repeats as fit in ``timeout``
    seconds for the whole model), ``stash`` and ``pop`` (skip names, comma-separated) and
    ``stash_keys``/``pop_keys`` (the same, qualified by namespace: ``name@id``).
    Skippable layers get the tensors they pop from the layers that stashed them. The module
    keeps its device unless ``device`` is given, in which case it is moved there.

    A layer timed alone runs with its weights and inputs hot in cache, so the per-layer times
    add up to less than a pass through the whole model. With ``calibrate`` (the default) the
    whole model is also timed, and the forward and backward columns are scaled so that each
    adds up to it: the relative costs are the layers', the total is the model's.

    Example::

        table = pipexplore.profile(model, torch.randn(64, 128))
        table[["name", "forward", "backward"]]
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"profile needs an nn.Sequential, got {type(module).__name__}")
    if len(module) == 0:
        raise ValueError("cannot profile an empty module: it has no layers")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if device is not None:
        module.to(device)
    first_param = next(module.parameters(), None)
    target = torch.device(device) if device is not None else (first_param.device if first_param is not None
                                                               else tensors_in(sample)[0].device)
    deadline = None if timeout is None else time.perf_counter() + timeout
    per_layer_budget = None if timeout is None else timeout / len(module)

    value: TensorOrTensors = Batch(sample).call(lambda v: v).tensor_or_tensors
    value = _detach(tuple(t.to(target) for t in value) if isinstance(value, tuple) else value.to(target))
    model_input = value
    skips: dict[Any, Tensor] = {}
    rows = []
    training = module.training
    for name, layer in module.named_children():
        forward_times, backward_times = [], []
        output: Any = None
        stashed: dict[Any, Tensor] = {}
        start_layer = time.perf_counter()
        for k in range(max(repeats, 1) if deadline is None else 10_000):
            tracker = SkipTracker()
            tracker.tensors.update({key: _detach(t) for key, t in skips.items()})  # type: ignore[misc]
            _sync(target)
            t0 = time.perf_counter()
            with use_skip_tracker(tracker), torch.enable_grad():
                output = layer(value)
            _sync(target)
            t1 = time.perf_counter()
            stashed = {key: t for key, t in tracker.tensors.items() if key not in skips}
            outs = [t for t in tensors_in(output) + list(stashed.values()) if t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            _sync(target)
            t2 = time.perf_counter()
            forward_times.append(t1 - t0)
            backward_times.append(t2 - t1 if outs else 0.0)
            layer.zero_grad(set_to_none=True)
            if k + 1 >= repeats and (per_layer_budget is None or time.perf_counter() - start_layer >= per_layer_budget):
                break
        if isinstance(layer, Skippable):
            for ns_name in layer.poppable():
                skips.pop(ns_name, None)
        skips.update({key: t.detach() for key, t in stashed.items()})
        rows.append({
            "name": name,
            "type": type(layer).__name__,
            "param_bytes": _bytes(list(layer.parameters())),
            "output_bytes": _bytes(tensors_in(output)) + _bytes(list(stashed.values())),
            "forward": statistics.median(forward_times),
            "backward": statistics.median(backward_times),
            "stash": ",".join(n for _, n in layer.stashable()) if isinstance(layer, Skippable) else "",
            "pop": ",".join(n for _, n in layer.poppable()) if isinstance(layer, Skippable) else "",
            "stash_keys": _keys(layer.stashable()) if isinstance(layer, Skippable) else "",
            "pop_keys": _keys(layer.poppable()) if isinstance(layer, Skippable) else "",
        })
        value = _detach(output)
    module.train(training)
    table = pd.DataFrame(rows, columns=LAYER_COLUMNS)
    if calibrate:
        whole_forward, whole_backward = _whole_model_seconds(module, model_input, target, repeats)
        for column, whole in (("forward", whole_forward), ("backward", whole_backward)):
            total = float(table[column].sum())
            if total > 0 and whole > 0:
                table[column] = table[column] * (whole / total)
    return table
