"""Checkpointing: forward without keeping activations, recompute them during backward.

A checkpointed micro-batch runs its partition under ``no_grad`` (:class:`Checkpoint`); a
:class:`Recompute` node joined after it re-runs the partition with grad enabled just before
the checkpoint's backward needs it::

        ┌────────────┐
        │ Checkpoint │  forward under no_grad, saves inputs and RNG states
        └─────┰──────┘
              ┠ ─ ─ ─ ┐  fork
              ┃ ┌─────┴─────┐
              ┃ │ Recompute │  backward: replay forward with the saved RNG states
              ┃ └─────┬─────┘
              ┠ ─ ─ ─ ┘  join

Partitions that share a device (stages on one host's cores, or on one GPU) run at once in their
own threads and share its random generator. Each checkpointed forward of a partition that draws
then draws from a stream of its own, seeded from the shared generator, which its recomputation
replays; on a GPU, every random operator of such a partition that draws from the shared generator
takes the device's lock for the moment it draws (:class:`RNGGuard`; on a CPU no operator needs it). The
partitions' forwards still overlap. A partition that cannot draw (its dropouts' probabilities 0)
pays nothing.
"""
from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional, Union

import torch
from torch import Tensor

from pipexplore.dependency import fork, join
from pipexplore.microbatch import Batch
from pipexplore.samples import TensorOrTensors
from pipexplore.phony import get_phony
from pipexplore.rng_guard import RNGGuard, RNGStates, states as _states, set_states as _set_states

__all__ = ["is_checkpointing", "is_recomputing", "enable_checkpointing", "enable_recomputing", "checkpoint",
           "Checkpointing", "Checkpoint", "Recompute", "checkpointed_draws", "replayed_draws"]

Function = Callable[[TensorOrTensors], TensorOrTensors]


class _ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.is_checkpointing = False
        self.is_recomputing = False


_local = _ThreadLocal()


@contextmanager
def enable_checkpointing() -> Generator[None, None, None]:
    previous = _local.is_checkpointing
    _local.is_checkpointing = True
    try:
        yield
    finally:
        _local.is_checkpointing = previous


@contextmanager
def enable_recomputing() -> Generator[None, None, None]:
    previous = _local.is_recomputing
    _local.is_recomputing = True
    try:
        yield
    finally:
        _local.is_recomputing = previous


def is_checkpointing() -> bool:
    """Whether the current thread runs a checkpointed forward (under ``no_grad``).

    Layers that must behave differently the first time through use it::

        if not is_recomputing():
            self.counter += 1
    """
    return _local.is_checkpointing


def is_recomputing() -> bool:
    """Whether the current thread replays a checkpointed forward during backward."""
    return _local.is_recomputing


class Checkpointing:
    """Checkpoint one partition on one micro-batch, and schedule its recomputation.

    ``rng_lock`` (an :class:`RNGGuard`, or a lock for a partition known to draw), when given: the
    partition shares its device's generator with partitions in other threads, so its forward
    draws from a stream of its own, which the recomputation replays (:meth:`RNGGuard.checkpointed`).
    """

    def __init__(self, function: Function, batch: Batch,
                 rng_lock: Optional[Union[threading.Lock, "RNGGuard"]] = None) -> None:
        self.function = function
        self.batch = batch
        self.rng_lock = rng_lock
        self.recomputed: deque[tuple[TensorOrTensors, tuple[Tensor, ...]]] = deque(maxlen=1)
        self.rng_states: deque[RNGStates] = deque(maxlen=1)

    def checkpoint(self) -> Batch:
        """Run the forward under ``no_grad``; its backward will use the recomputed graph."""
        input = tuple(self.batch)
        device = self.batch[0].device
        phony = get_phony(device, requires_grad=True)
        guard = self.rng_lock
        if guard is not None and not isinstance(guard, RNGGuard):
            guard = self.rng_lock = RNGGuard(guard, device, True)
        output = Checkpoint.apply(phony, self.recomputed, self.rng_states, guard, self.function, self.batch.atomic,
                                  *input)
        if isinstance(output, tuple):
            output = tuple(x if x.is_floating_point() else x.detach() for x in output)
        return Batch(output)

    def recompute(self, batch: Batch) -> None:
        """Join a :class:`Recompute` node after ``batch`` (this checkpoint's output)."""
        input = tuple(self.batch)
        batch[0], phony = fork(batch[0])
        phony = Recompute.apply(phony, self.recomputed, self.rng_states, self.rng_lock, self.function,
                                self.batch.atomic, *input)
        batch[0] = join(batch[0], phony)


def checkpoint(function: Function, input: TensorOrTensors) -> TensorOrTensors:
    """Run ``function(input)`` checkpointed, outside any pipeline.

    Example::

        y = checkpoint(block, x)   # activations of `block` are recomputed in backward
        y.sum().backward()
    """
    batch = Batch(input)
    chk = Checkpointing(function, batch)
    batch = chk.checkpoint()
    chk.recompute(batch)
    return batch.tensor_or_tensors


def save_rng_states(device: torch.device, rng_states: deque[RNGStates]) -> None:
    rng_states.append(_states(device))


@contextmanager
def restore_rng_states(device: torch.device, rng_states: deque[RNGStates]) -> Generator[None, None, None]:
    states = rng_states.pop()
    gpu_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(gpu_devices):
        _set_states(device, states)
        yield


@contextmanager
def checkpointed_draws(device: torch.device, rng_states: deque, guard: Optional[RNGGuard] = None
                       ) -> Generator[None, None, None]:
    """Within: a checkpointed forward, the start of its draws kept in ``rng_states`` for its
    recomputation: the device's generators' states, or (``guard``: a device shared with
    partitions in other threads) a stream of its own (:meth:`RNGGuard.checkpointed`)."""
    if guard is None:
        save_rng_states(device, rng_states)
        yield
        return
    with guard.checkpointed(rng_states):
        yield


@contextmanager
def replayed_draws(device: torch.device, rng_states: deque, guard: Optional[RNGGuard] = None
                   ) -> Generator[None, None, None]:
    """Within: the recomputation of a checkpointed forward, drawing what it drew
    (:func:`checkpointed_draws` kept where it started)."""
    if guard is None:
        with restore_rng_states(device, rng_states):
            yield
        return
    with guard.recomputing(rng_states):
        yield


class Checkpoint(torch.autograd.Function):
    """Forward under ``no_grad`` saving the RNG states; backward through the recomputed graph.

    Its node in the autograd graph is ``CheckpointBackward`` (one per checkpointed partition and
    micro-batch), as in torchgpipe.
    """

    @staticmethod
    def forward(ctx, phony: Tensor, recomputed: deque, rng_states: deque,  # type: ignore[override]
                guard: Optional[RNGGuard], function: Function, input_atomic: bool, *input: Tensor) -> TensorOrTensors:
        ctx.recomputed = recomputed
        with checkpointed_draws(input[0].device, rng_states, guard), torch.no_grad(), enable_checkpointing():
            return function(input[0] if input_atomic else input)

    @staticmethod
    def backward(ctx, *grad_output: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        output, input_leaf = ctx.recomputed.pop()
        outputs = output if isinstance(output, tuple) else (output,)
        pairs = [(y, g) for y, g in zip(outputs, grad_output) if y.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        grads: list[Any] = [None] * 6
        grads.extend(x.grad for x in input_leaf)
        return tuple(grads)


class Recompute(torch.autograd.Function):
    """A phony node whose backward replays the checkpointed forward (``RecomputeBackward``)."""

    @staticmethod
    def forward(ctx, phony: Tensor, recomputed: deque, rng_states: deque,  # type: ignore[override]
                guard: Optional[RNGGuard], function: Function, input_atomic: bool, *input: Tensor) -> Tensor:
        ctx.recomputed = recomputed
        ctx.rng_states = rng_states
        ctx.guard = guard
        ctx.function = function
        ctx.input_atomic = input_atomic
        ctx.save_for_backward(*input)
        return phony.detach()

    @staticmethod
    def backward(ctx, *grad_output: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        input = ctx.saved_tensors
        input_leaf = tuple(x.detach().requires_grad_(x.requires_grad) for x in input)
        with replayed_draws(input[0].device, ctx.rng_states, ctx.guard):
            with torch.enable_grad(), enable_recomputing():
                output = ctx.function(input_leaf[0] if ctx.input_atomic else input_leaf)
        ctx.recomputed.append((output, input_leaf))
        return (None,) * (6 + len(input))
