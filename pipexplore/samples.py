"""Samples as a user holds them (a tensor, a tuple of tensors, a dict of keyword inputs): rows, tensors, device."""
from __future__ import annotations

import typing
from typing import Union

import torch
from torch import Tensor

__all__ = ["Tensors", "TensorOrTensors", "Sample", "tensors_in", "batch_size", "to_device"]

Tensors = tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]
#: A mini-batch as a user holds it: a tensor, a tuple of tensors, or a dict of keyword inputs (a traced model's).
Sample = Union[Tensor, Tensors, typing.Mapping[str, typing.Any]]


def tensors_in(value: typing.Any) -> list[Tensor]:
    """Every tensor in a value: a tensor, or nested tuples, lists and dicts of them."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def batch_size(value: Sample) -> int:
    """Rows of a mini-batch: dim 0 of the tensor, of the first tensor of a tuple, or of the first
    tensor of a dict of keyword inputs (a traced model's ``{'input_ids': ..., ...}``)."""
    if isinstance(value, typing.Mapping):
        return int(tensors_in(dict(value))[0].size(0))
    return int((value if isinstance(value, Tensor) else value[0]).size(0))


def to_device(value: typing.Any, device: torch.device) -> typing.Any:
    """Move a tensor, or each tensor of a (nested) tuple or dict (a traced model's keyword
    inputs), to ``device``; anything else as it is."""
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
