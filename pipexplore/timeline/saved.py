"""Tensor bytes: what autograd keeps for backward, counted as it is saved, and what a value holds."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

__all__ = ["SavedBytes", "tensor_bytes", "storage_key"]


def storage_key(t: Tensor) -> int:
    """What tells storages apart, on meta too (where every ``data_ptr`` is 0): the storage's own address."""
    try:
        return int(t.untyped_storage()._cdata)
    except Exception:  # a tensor without a plain storage (a subclass, a sparse tensor)
        return id(t)


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor or any pytree of them: tuples, lists, dicts), each
    counted for its own elements, once: the same tensor (or the same view of one storage) met twice
    counts once; two views of one storage count each (a micro-batch is a view of the batch).

    Example::

        tensor_bytes((x, x, {"y": y}))     # x.nbytes + y.nbytes
    """
    seen: set[tuple[Any, ...]] = set()
    total = 0
    for t in tree_flatten(value)[0]:
        if isinstance(t, Tensor):
            key = (storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


class SavedBytes:
    """Counts the bytes autograd saves for backward while :meth:`hooks` is active, each view for
    its own elements (not its whole storage: :class:`pipexplore.models.opcount.SavedStorageBytes`
    counts those, on meta), leaving out ``module``'s parameters and buffers (saved as views, e.g. a transposed
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
