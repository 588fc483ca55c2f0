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
"""
from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional, Union

import torch
from torch import Tensor

from pipexplore.dependency import fork, join
from pipexplore.microbatch import Batch, TensorOrTensors
from pipexplore.phony import get_phony

__all__ = ["is_checkpointing", "is_recomputing", "enable_checkpointing", "enable_recomputing", "checkpoint",
           "Checkpointing", "Checkpoint", "Recompute", "RNGGuard", "rng_locks", "has_randomness"]

Function = Callable[[TensorOrTensors], TensorOrTensors]
RNGStates = tuple[Tensor, Optional[Tensor]]


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

    ``rng_lock`` (a lock or an :class:`RNGGuard`), when given, is held while the RNG state is
    saved and the forward draws from it, so partitions that share a device in other threads
    cannot move the generator between the two (their dropout masks would not replay).
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
        phony = get_phony(self.batch[0].device, requires_grad=True)
        if self.rng_lock is None:
            output = Checkpoint.apply(phony, self.recomputed, self.rng_states, self.function, self.batch.atomic, *input)
        else:
            with self.rng_lock:
                output = Checkpoint.apply(
                    phony, self.recomputed, self.rng_states, self.function, self.batch.atomic, *input
                )
        if isinstance(output, tuple):
            output = tuple(x if x.is_floating_point() else x.detach() for x in output)
        return Batch(output)

    def recompute(self, batch: Batch) -> None:
        """Join a :class:`Recompute` node after ``batch`` (this checkpoint's output)."""
        input = tuple(self.batch)
        batch[0], phony = fork(batch[0])
        phony = Recompute.apply(phony, self.recomputed, self.rng_states, self.function, self.batch.atomic, *input)
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
    cpu_state = torch.get_rng_state()
    gpu_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    rng_states.append((cpu_state, gpu_state))


@contextmanager
def restore_rng_states(device: torch.device, rng_states: deque[RNGStates]) -> Generator[None, None, None]:
    cpu_state, gpu_state = rng_states.pop()
    gpu_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(gpu_devices):
        torch.set_rng_state(cpu_state)
        if gpu_state is not None:
            torch.cuda.set_rng_state(gpu_state, device)
        yield


class Checkpoint(torch.autograd.Function):
    """Forward under ``no_grad`` saving the RNG states; backward through the recomputed graph.

    Its node in the autograd graph is ``CheckpointBackward`` (one per checkpointed partition and
    micro-batch), as in torchgpipe.
    """

    @staticmethod
    def forward(ctx, phony: Tensor, recomputed: deque, rng_states: deque, function: Function,  # type: ignore[override]
                input_atomic: bool, *input: Tensor) -> TensorOrTensors:
        ctx.recomputed = recomputed
        save_rng_states(input[0].device, rng_states)
        with torch.no_grad(), enable_checkpointing():
            return function(input[0] if input_atomic else input)

    @staticmethod
    def backward(ctx, *grad_output: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        output, input_leaf = ctx.recomputed.pop()
        outputs = output if isinstance(output, tuple) else (output,)
        pairs = [(y, g) for y, g in zip(outputs, grad_output) if y.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        grads: list[Any] = [None, None, None, None, None]
        grads.extend(x.grad for x in input_leaf)
        return tuple(grads)


class Recompute(torch.autograd.Function):
    """A phony node whose backward replays the checkpointed forward (``RecomputeBackward``)."""

    @staticmethod
    def forward(ctx, phony: Tensor, recomputed: deque, rng_states: deque, function: Function,  # type: ignore[override]
                input_atomic: bool, *input: Tensor) -> Tensor:
        ctx.recomputed = recomputed
        ctx.rng_states = rng_states
        ctx.function = function
        ctx.input_atomic = input_atomic
        ctx.save_for_backward(*input)
        return phony.detach()

    @staticmethod
    def backward(ctx, *grad_output: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        input = ctx.saved_tensors
        input_leaf = tuple(x.detach().requires_grad_(x.requires_grad) for x in input)
        with restore_rng_states(input[0].device, ctx.rng_states):
            with torch.enable_grad(), enable_recomputing():
                output = ctx.function(input_leaf[0] if ctx.input_atomic else input_leaf)
        ctx.recomputed.append((output, input_leaf))
        return (None,) * (5 + len(input))


class RNGGuard:
    """The lock of a device's random generator, as one partition that shares the device takes it.

    A partition known to draw random numbers (dropout and kin, or ``uses_rng = True``) holds the
    lock whenever it is acquired. One not known to (its forward may still call
    ``F.dropout`` or ``torch.rand``) holds it the first time and compares the generator's state
    before and after: if the state moved it draws, and holds the lock from then on; if not, later
    acquisitions cost nothing. While a partition holds the lock no other drawing partition of the
    device moves the generator, so its saved state replays the same numbers on recomputation.

    Example::

        guard = RNGGuard(threading.Lock(), torch.device("cpu"), draws=None)
        with guard:
            y = partition(x)
        guard.draws    # True when the partition moved the CPU generator
    """

    def __init__(self, lock: threading.Lock, device: torch.device, draws: Optional[bool]) -> None:
        self.lock = lock
        self.device = device
        self.draws = draws
        self._local = threading.local()

    def acquire(self) -> None:
        stack = self._local.__dict__.setdefault("stack", [])
        if self.draws is False:
            stack.append(False)
            return
        self.lock.acquire()
        stack.append(_generator_state(self.device) if self.draws is None else True)

    def release(self) -> None:
        entry = self._local.stack.pop()
        if entry is False:
            return
        try:
            if entry is not True and self.draws is None:
                self.draws = not torch.equal(entry, _generator_state(self.device))
        finally:
            self.lock.release()

    def __enter__(self) -> "RNGGuard":
        self.acquire()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


def _generator_state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def rng_locks(partitions: list[torch.nn.Module], devices: list[torch.device]) -> list[Optional[RNGGuard]]:
    """One lock per device shared by several partitions, taken through each partition's
    :class:`RNGGuard` (``None`` for a partition alone on its device): held while a partition may
    draw random numbers, so recomputation replays the same dropout masks.

    Example::

        guards = rng_locks(partitions, [torch.device("cpu")] * len(partitions))
    """
    locks: dict[torch.device, threading.Lock] = {}
    shared = {d for d in devices if devices.count(d) > 1}
    return [RNGGuard(locks.setdefault(d, threading.Lock()), d, True if has_randomness(p) else None)
            if d in shared else None for p, d in zip(partitions, devices)]


def has_randomness(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds layers that draw from the RNG in training (dropout and kin)."""
    random_types: tuple[type, ...] = (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU)
    return any(isinstance(m, random_types) or getattr(m, "uses_rng", False) for m in module.modules())


