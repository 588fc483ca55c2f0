"""Autograd functions that copy tensors between devices and order streams."""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import torch
from torch import Tensor

from pipexplore.stream import AbstractStream, current_stream, get_device, record_stream, use_stream, wait_stream

__all__ = ["Copy", "Wait"]


class Copy(torch.autograd.Function):
    """Copy tensors to ``next_stream``'s device on the copy streams; gradients go back the same way."""

    @staticmethod
    def forward(ctx, prev_stream: AbstractStream, next_stream: AbstractStream, *input: Tensor):  # type: ignore[override]
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        next_device = get_device(next_stream)
        output_stream = current_stream(next_device)
        output = []
        with use_stream(prev_stream), use_stream(next_stream):
            for x in input:
                y = x.to(next_device, non_blocking=True)
                if y is x:
                    y = x.detach()
                output.append(y)
                record_stream(x, prev_stream)
                record_stream(y, output_stream)
        return tuple(output)

    @staticmethod
    def backward(ctx, *grad_output: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        prev_stream, next_stream = ctx.prev_stream, ctx.next_stream
        prev_device = get_device(prev_stream)
        input_stream = current_stream(prev_device)
        grad_input: deque[Tensor] = deque(maxlen=len(grad_output))
        with use_stream(prev_stream), use_stream(next_stream):
            for x in reversed(grad_output):
                y = x.to(prev_device, non_blocking=True)
                grad_input.appendleft(y)
                record_stream(x, next_stream)
                record_stream(y, input_stream)
        return (None, None) + tuple(grad_input)


class Wait(torch.autograd.Function):
    """Make ``next_stream`` wait for ``prev_stream``; in backward, the reverse.

    ``on_backward``, when given, is called as the gradient passes: the recorder marks the
    start or end of a stage's backward here, at no cost of an extra autograd node.
    """

    @staticmethod
    def forward(ctx, prev_stream: AbstractStream, next_stream: AbstractStream,  # type: ignore[override]
                on_backward: Optional[Callable[[], None]], *input: Tensor):
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        ctx.on_backward = on_backward
        wait_stream(next_stream, prev_stream)
        return tuple(x.detach() for x in input)

    @staticmethod
    def backward(ctx, *grad_input: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        wait_stream(ctx.prev_stream, ctx.next_stream)
        if ctx.on_backward is not None:
            ctx.on_backward()
        return (None, None, None) + grad_input
