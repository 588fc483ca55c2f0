"""Fork and join: explicit ordering edges between autograd lanes."""
from __future__ import annotations

import torch
from torch import Tensor

from pipexplore.microbatch import Batch
from pipexplore.phony import get_phony

__all__ = ["fork", "join", "depend"]


def fork(input: Tensor) -> tuple[Tensor, Tensor]:
    """Branch a phony off ``input``: its backward waits for the phony's gradient too."""
    if torch.is_grad_enabled() and input.requires_grad:
        return _Fork.apply(input)  # type: ignore[no-any-return]
    return input, get_phony(input.device, requires_grad=False)


class _Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        phony = get_phony(input.device, requires_grad=False)
        return input.detach(), phony.detach()

    @staticmethod
    def backward(ctx, grad_input: Tensor, grad_grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad_input


def join(input: Tensor, phony: Tensor) -> Tensor:
    """Merge ``phony`` into ``input``: the phony's branch runs backward after ``input``'s."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        return _Join.apply(input, phony)  # type: ignore[no-any-return]
    return input


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: Tensor, phony: Tensor) -> Tensor:  # type: ignore[override]
        return input.detach()

    @staticmethod
    def backward(ctx, grad_input: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad_input, None


def depend(fork_from: Batch, join_to: Batch) -> None:
    """Make ``fork_from`` run backward only after ``join_to`` has."""
    fork_from[0], phony = fork(fork_from[0])
    join_to[0] = join(join_to[0], phony)
