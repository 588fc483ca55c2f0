"""Tensor schemas for batches (shape without the batch dimension, dtype) and nested structures."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch

__all__ = ["BatchTensorProto", "nested_flatten", "nested_pack", "nested_map"]


@dataclass(frozen=True, init=False)
class BatchTensorProto:
    """A batch of tensors of one shape: ``BatchTensorProto(8)`` is a batch of 8-vectors.

    Device-agnostic: only the shape after the batch dimension, the dtype and whether the
    tensor takes gradients are described.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def __init__(self, *shape: int, dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "requires_grad", bool(requires_grad))

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> "BatchTensorProto":
        if tensor.dim() < 1:
            raise ValueError("a batch tensor needs a batch dimension (dim 0)")
        return cls(*tensor.shape[1:], dtype=tensor.dtype, requires_grad=tensor.requires_grad)

    def make_empty(self, batch_size: int, device: Optional[Union[str, torch.device]] = None) -> torch.Tensor:
        return torch.empty((batch_size, *self.shape), dtype=self.dtype, device=device,
                           requires_grad=self.requires_grad and self.dtype.is_floating_point)

    def describe(self) -> str:
        return f"[*, {', '.join(map(str, self.shape))}] {str(self.dtype).replace('torch.', '')}".replace("[*, ]", "[*]")

    def check(self, tensor: Any, name: str = "tensor") -> None:
        """Raise ``ValueError`` saying what differs when ``tensor`` is not a batch of this schema."""
        if not torch.is_tensor(tensor):
            raise ValueError(f"{name}: expected a tensor {self.describe()}, got {type(tensor).__name__}")
        got = f"[{', '.join(map(str, tensor.shape))}] {str(tensor.dtype).replace('torch.', '')}"
        if tensor.dim() != len(self.shape) + 1 or tuple(tensor.shape[1:]) != self.shape:
            raise ValueError(f"{name}: expected shape {self.describe()}, got {got}")
        if tensor.dtype != self.dtype:
            raise ValueError(f"{name}: expected dtype {self.describe()}, got {got}")


def nested_flatten(structure: Any) -> Iterator[Any]:
    """The leaves of nested tuples, lists and dicts (dicts in sorted key order)."""
    if isinstance(structure, (tuple, list)):
        for item in structure:
            yield from nested_flatten(item)
    elif isinstance(structure, dict):
        for key in sorted(structure):
            yield from nested_flatten(structure[key])
    else:
        yield structure


def nested_pack(flat: Any, structure: Any) -> Any:
    """Rebuild ``structure``'s nesting with the leaves taken from ``flat`` in order."""
    iterator = iter(flat)

    def pack(node: Any) -> Any:
        if isinstance(node, (tuple, list)):
            return type(node)(pack(item) for item in node)
        if isinstance(node, dict):
            return {key: pack(node[key]) for key in sorted(node)}
        return next(iterator)

    packed = pack(structure)
    leftover = sum(1 for _ in iterator)
    if leftover:
        raise ValueError(f"{leftover} values more than the structure holds")
    return packed


def nested_map(fn: Callable[[Any], Any], structure: Any) -> Any:
    return nested_pack(map(fn, nested_flatten(structure)), structure)
