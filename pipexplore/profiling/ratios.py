"""What a layer costs beside its plain forward and backward: its slowdown while its twin runs
(stages sharing the host), its forward without autograd (checkpointed micro-batches), and its
backward split into input and weight gradients (zero-bubble)."""
from __future__ import annotations

import math
import statistics
import threading
from typing import Any, Callable

import torch
from torch import Tensor, nn

from pipexplore.samples import TensorOrTensors, tensors_in
from pipexplore.profiling.timing import Timer as _Timer, detach as _detach, popping as _popping
from pipexplore.skip.tracker import use_skip_tracker

__all__ = ["contended_slowdown", "checkpointed_ratio", "without_autograd_ratio", "split_backward"]


def contended_slowdown(layer: nn.Module, value: TensorOrTensors, skips: dict[Any, Tensor], target: torch.device,
                        repeats: int, seconds: float = 0.0) -> tuple[float, float]:
    """How much slower a layer's forward and backward run while a second thread runs the same
    work at the same time: 1 when they overlap freely (sleeps, a host left free), 2 when they
    share the cores fully. Catches what CPU time cannot: intra-op threads that spin while they
    wait, the GIL, memory bandwidth.

    Measured in rounds that alternate two calls alone (in this thread) with three calls in each
    of two threads at once (the middle ones compared: the threads start and end a little apart),
    the first round dropped: how fast a shared machine runs drifts from one
    moment to the next, and a ratio of times taken far apart carries that drift (the shares of the
    same layer went 0.51 → 0.90 between two profiles when the twins ran once, apart from the
    calls alone). ``seconds``: one forward and backward's time, to bound the rounds to ~0.15 s
    (at least ``repeats + 1``, at most 12)."""
    rounds = max(repeats + 1, min(12, int(0.15 / (8 * seconds)) if seconds > 0 else repeats + 1))
    alone = (_Timer(target), _Timer(target))
    twins = [(_Timer(target), _Timer(target)) for _ in range(2)]
    errors: list[BaseException] = []

    def call(forward: _Timer, backward: _Timer) -> None:
        tracker = _popping(skips)
        with use_skip_tracker(tracker), torch.enable_grad():
            output = forward(lambda: layer(_detach(value)))
        outs = [t for t in tensors_in(output) + list(tracker.tensors.values()) if t is not None and t.requires_grad]
        backward(lambda: torch.autograd.backward(outs, [torch.ones_like(t) for t in outs]) if outs else None)

    def twin(barrier: threading.Barrier, timers: tuple[_Timer, _Timer]) -> None:
        torch.set_num_threads(threads_count)  # the caller's, in this new thread
        try:
            barrier.wait()
            for _ in range(3):  # the middle call is the one both threads run through at once
                call(*timers)
        except BaseException as exc:  # a layer that cannot run in two threads: no contention measured
            errors.append(exc)
            barrier.abort()

    threads_count = torch.get_num_threads()
    for _ in range(rounds):
        for _ in range(2):
            call(*alone)
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=twin, args=(barrier, pair), daemon=True) for pair in twins]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            break
    layer.zero_grad(set_to_none=True)
    if errors:
        return 1.0, 1.0

    def ratio(k: int) -> float:  # the first round of each side dropped (warm-up)
        together = statistics.median([w for pair in twins for w in pair[k].wall[4::3]])
        by_itself = statistics.median(alone[k].wall[2:])
        return together / by_itself if by_itself > 0 else 1.0

    return ratio(0), ratio(1)


def checkpointed_ratio(layer: nn.Module, value: TensorOrTensors, skips: dict[Any, Tensor], target: torch.device,
                        repeats: int) -> float:
    """What a checkpointed micro-batch's forward costs (without autograd: nothing kept for
    backward, as the executors run it) over the forward with autograd, timed in alternation."""
    def forward() -> Any:
        with use_skip_tracker(_popping(skips)):
            return layer(_detach(value))

    return without_autograd_ratio(forward, target, repeats)


def without_autograd_ratio(forward: Callable[[], Any], target: torch.device, repeats: int) -> float:
    """``forward()``'s time without autograd over its time with it, ``repeats`` + 1 calls of each
    in alternation (the first of each dropped)."""
    timers = (_Timer(target), _Timer(target))
    for _ in range(repeats + 1):
        for grad, timer in zip((False, True), timers):
            with torch.set_grad_enabled(grad):
                timer(forward)
    without, with_grad = (statistics.median(t.wall[1:]) for t in timers)
    return without / with_grad if with_grad > 0 else 1.0


def split_backward(layer: nn.Module, value: TensorOrTensors, skips: dict[Any, Tensor], target: torch.device,
                    repeats: int, backward: float) -> tuple[float, float]:
    """The input-gradient (I) and weight-gradient (W) passes of zero-bubble schedules, as the
    executors run them (``torch.distributed.pipelining``'s ``stage_backward_input`` then
    ``stage_backward_weight``), each over the plain ``backward`` seconds: ``(1, 0)`` for a layer
    without weights, ``(nan, nan)`` where they cannot be timed (no output or input that needs a
    gradient, or torch refuses the layer)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    params = [p for p in layer.parameters() if p.requires_grad]
    if not params:  # no weights: I is the whole backward, W nothing
        return 1.0, 0.0
    if backward <= 0:
        return math.nan, math.nan
    timers = (_Timer(target), _Timer(target))
    try:
        for _ in range(repeats + 1):
            tracker = _popping(skips)
            popped = [tracker.tensors[key] for key in skips]  # type: ignore[index]
            leaf = _detach(value)
            with use_skip_tracker(tracker), torch.enable_grad():
                output = layer(leaf)
            outs = [t for t in tensors_in(output) + [t for k, t in tracker.tensors.items() if k not in skips]
                    if t is not None and t.requires_grad]  # (a layer may stash None)
            inputs = [t for t in tensors_in(leaf) + popped if t is not None and t.requires_grad]
            if not outs or not inputs:
                return math.nan, math.nan
            _, groups = timers[0](lambda: stage_backward_input(outs, [torch.ones_like(t) for t in outs], inputs,
                                                               iter(params)))
            timers[1](lambda: stage_backward_weight(iter(params), groups))
        layer.zero_grad(set_to_none=True)
    except (RuntimeError, TypeError, ValueError, AttributeError):
        layer.zero_grad(set_to_none=True)
        return math.nan, math.nan
    return (statistics.median(timers[0].wall[1:]) / backward, statistics.median(timers[1].wall[1:]) / backward)


