"""Saved-tensor bytes: what autograd keeps for backward, counted as it is saved."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

__all__ = ["SavedBytes", "tensor_bytes"]


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or nested tuples and lists of them)."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    return 0


class SavedBytes:
    """Counts the bytes autograd saves for backward while :meth:`hooks` is active, each storage
    once, leaving out ``module``'s parameters and buffers (saved as views, e.g. a transposed
    weight, they share the parameter's storage): the activation memory a forward leaves behind.

    Example::

        saved = SavedBytes(model)
        with saved.hooks():
            loss = model(x).sum()
        saved.total          # bytes kept until loss.backward()
    """

    def __init__(self, module: Optional[nn.Module] = None) -> None:
        self.total = 0
        self._seen: set[tuple[int, int, int]] = set()
        self._weights: set[int] = set()
        if module is not None:
            self._weights = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}

    def pack(self, t: Tensor) -> Tensor:
        if isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in self._weights:
            return t
        # A view counts for its own elements (a micro-batch is a view of the whole batch).
        key = (t.data_ptr(), t.numel(), t.element_size())
        if key not in self._seen:
            self._seen.add(key)
            self.total += t.numel() * t.element_size()
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
