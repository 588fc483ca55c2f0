"""An optimizer step on a planned device: the bytes it reads and writes, and their seconds.

A step of SGD, SGD with momentum, Adam or AdamW is a pass over the parameters, their gradients
and the optimizer's states, bound by memory bandwidth on any accelerator: its seconds are those
bytes over the device's reachable bandwidth (:class:`~pipexplore.predict.roofline.Efficiency`).
What a step costs where the device is here is timed instead
(:func:`pipexplore.predict.optimizer_cost.optimizer_seconds`).

Example::

    optimizer_seconds(8_000_000_000, "bfloat16", "adamw", "H100", state_dtype="float32")
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from pipexplore.devices import device_spec, dtype_name
from pipexplore.predict.roofline import Efficiency, SpecLike

__all__ = ["OPTIMIZER_PASSES", "optimizer_bytes", "optimizer_seconds"]


#: Per optimizer: how many times a step reads or writes each parameter-sized tensor:
#: ``(parameter, gradient, state)`` — SGD reads p and g and writes p; momentum also reads and
#: writes its buffer; Adam and AdamW read p, g, m, v and write p, m, v.
OPTIMIZER_PASSES = {"sgd": (2, 1, 0), "momentum": (2, 1, 2), "adam": (2, 1, 4), "adamw": (2, 1, 4)}


def _itemsize(dtype: Union[str, torch.dtype]) -> int:
    name = dtype_name(dtype)
    if name == "float8":
        return 1
    if name == "tf32":
        return 4
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return found.itemsize


def _optimizer(name: Any) -> str:
    if isinstance(name, torch.optim.Optimizer):
        key = type(name).__name__.lower()
        if key == "sgd" and any(g.get("momentum", 0) for g in name.param_groups):
            key = "momentum"
    elif isinstance(name, type):
        key = name.__name__.lower()
    else:
        key = str(name).lower().replace("_", "-")
    key = {"sgd-momentum": "momentum", "sgd+momentum": "momentum"}.get(key, key)
    if key not in OPTIMIZER_PASSES:
        raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZER_PASSES)}")
    return key


def optimizer_bytes(param_count: int, dtype: Union[str, torch.dtype], optimizer_name: Any, *,
                    grad_dtype: Union[None, str, torch.dtype] = None,
                    state_dtype: Union[None, str, torch.dtype] = None) -> int:
    """Bytes one optimizer step moves: ``param_count ×`` (parameter passes × its size + gradient
    passes × the gradient's + state passes × the states') per :data:`OPTIMIZER_PASSES`. For
    Adam in bf16: ``P × (2·2 + 1·2 + 4·2) = 14·P`` bytes; with fp32 states (mixed precision):
    ``P × (2·2 + 2 + 4·4) = 22·P``."""
    p, g, s = OPTIMIZER_PASSES[_optimizer(optimizer_name)]
    size = _itemsize(dtype)
    return int(param_count) * (p * size + g * _itemsize(grad_dtype or dtype) + s * _itemsize(state_dtype or dtype))


def optimizer_seconds(param_count: int, dtype: Union[str, torch.dtype], optimizer_name: Any, spec: SpecLike, *,
                      grad_dtype: Union[None, str, torch.dtype] = None,
                      state_dtype: Union[None, str, torch.dtype] = None,
                      efficiency: Optional[Efficiency] = None) -> float:
    """Seconds an optimizer step takes over ``param_count`` parameters on ``spec``: a pass over
    parameters, gradients and states is bandwidth-bound, so
    ``optimizer_bytes(…) / (memory_bandwidth · bandwidth efficiency)`` (the spec's efficiency
    unless ``efficiency`` says). Launches are left out (a fused or foreach step launches a few
    kernels for all parameters), as is the arithmetic (a few FLOPs per byte moved).

    ``optimizer_name``: ``"sgd"``, ``"momentum"`` (SGD with momentum), ``"adam"``, ``"adamw"``,
    or a ``torch.optim`` optimizer (class or instance). States are in ``state_dtype`` (default: the
    parameters'), gradients in ``grad_dtype`` (default: the parameters').
    """
    spec = device_spec(spec)
    eff = efficiency if efficiency is not None else Efficiency()
    moved = optimizer_bytes(param_count, dtype, optimizer_name, grad_dtype=grad_dtype, state_dtype=state_dtype)
    return moved / (spec.memory_bandwidth * eff.bandwidth_for(spec))
