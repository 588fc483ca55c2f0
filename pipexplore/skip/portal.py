"""Portals: carry a skip tensor between partitions, hidden from autograd.

::

    stash partition                          pop partition
    ── Join ── (main lane)        ── Fork ── Join ──       ── Fork ── f(x, skip) ──
        │                             │        │              │
    PortalBlue  ····· tensor ·····  PortalCopy ·· tensor ·· PortalOrange
    (hides it)                   (copy stream)             (hands it back)

In backward the gradient takes the same way back: PortalOrange puts it in the portal,
PortalCopy copies it to the stash device, PortalBlue hands it to the stashed tensor.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pipexplore.copy import Copy
from pipexplore.phony import get_phony
from pipexplore.stream import AbstractStream, get_device

__all__ = ["Portal"]


class Portal:
    """One skip tensor of one micro-batch, with how many more uses keep it alive."""

    def __init__(self, tensor: Optional[Tensor], tensor_life: int) -> None:
        self.put_tensor(tensor, tensor_life)
        self.grad: Optional[Tensor] = None

    def blue(self) -> Tensor:
        """Hide the tensor: returns a phony to join to the stash partition's main lane."""
        tensor = self.use_tensor()
        if tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalBlue.apply(self, tensor)  # type: ignore[no-any-return]

    def orange(self, phony: Tensor) -> Optional[Tensor]:
        """Hand the tensor back, given a phony forked from the pop partition's main lane."""
        self.check_tensor_life()
        if self.tensor is None:
            return self.use_tensor()
        return PortalOrange.apply(self, phony)  # type: ignore[no-any-return]

    def copy(self, prev_stream: AbstractStream, next_stream: AbstractStream, phony: Tensor) -> Tensor:
        """Copy the tensor to ``next_stream``'s device; returns a phony to join."""
        if self.tensor is None:
            return get_phony(torch.device("cpu"), requires_grad=False)
        return PortalCopy.apply(self, prev_stream, next_stream, phony)  # type: ignore[no-any-return]

    def check_tensor_life(self) -> None:
        if self.tensor_life <= 0:
            raise RuntimeError("the tensor in this portal has been freed after its last use")

    def put_tensor(self, tensor: Optional[Tensor], tensor_life: int) -> None:
        self.tensor_life = tensor_life
        self.tensor = tensor if tensor_life > 0 else None

    def use_tensor(self) -> Optional[Tensor]:
        self.check_tensor_life()
        tensor = self.tensor
        self.tensor_life -= 1
        if self.tensor_life <= 0:
            self.tensor = None
        return tensor

    def put_grad(self, grad: Tensor) -> None:
        self.grad = grad

    def use_grad(self) -> Tensor:
        if self.grad is None:
            raise RuntimeError("the gradient in this portal has been used or was never set")
        grad, self.grad = self.grad, None
        return grad


class PortalBlue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, portal: Portal, tensor: Tensor) -> Tensor:  # type: ignore[override]
        ctx.portal = portal
        return get_phony(tensor.device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx, grad_phony: Tensor) -> tuple[None, Tensor]:  # type: ignore[override]
        return None, ctx.portal.use_grad()


class PortalOrange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, portal: Portal, phony: Tensor) -> Tensor:  # type: ignore[override]
        ctx.portal = portal
        tensor = portal.use_tensor()
        assert tensor is not None
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, None]:  # type: ignore[override]
        ctx.portal.put_grad(grad)
        return None, None


class PortalCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, portal: Portal, prev_stream: AbstractStream, next_stream: AbstractStream,  # type: ignore[override]
                phony: Tensor) -> Tensor:
        ctx.portal = portal
        assert portal.tensor is not None
        (portal.tensor,) = Copy.forward(ctx, prev_stream, next_stream, portal.tensor)
        return get_phony(get_device(next_stream), requires_grad=False).detach()

    @staticmethod
    def backward(ctx, grad_phony: Tensor) -> tuple[None, None, None, None]:  # type: ignore[override]
        portal = ctx.portal
        assert portal.grad is not None
        _, _, portal.grad = Copy.backward(ctx, portal.grad)
        return None, None, None, None
