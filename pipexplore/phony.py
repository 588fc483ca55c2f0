"""Phony tensors: empty tensors that carry only autograd ordering edges."""
from __future__ import annotations

import threading

import torch
from torch import Tensor

__all__ = ["get_phony"]

_phonies: dict[tuple[torch.device, bool], Tensor] = {}
_lock = threading.Lock()


def get_phony(device: torch.device, *, requires_grad: bool) -> Tensor:
    """A cached empty tensor on ``device``.

    Phonies cost no memory and no compute; joining one into the main lane of an autograd
    graph makes backward respect an order that data dependencies alone would not. Return a
    ``.detach()`` of it from an autograd function so the cached one never gets a grad_fn.
    """
    key = (device, requires_grad)
    try:
        return _phonies[key]
    except KeyError:
        with _lock:
            phony = torch.empty(0, device=device, requires_grad=requires_grad)
            return _phonies.setdefault(key, phony)
