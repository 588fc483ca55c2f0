"""Every schedule's order of actions: what each stage's (or device's) worker runs, and when.

The vocabulary the predictor and the executors share: :mod:`pipexplore.predict.simulator` times
these orders, :mod:`pipexplore.executors.sequential` and :mod:`pipexplore.executors.traced` run
them. An action is a kind letter and a micro-batch: ``F`` forward, ``B`` backward, ``R`` recompute
(checkpointing), ``I``/``W`` input- and weight-gradient (zero-bubble). For two stages and four
micro-batches::

    gpipe   stage 0  F0 F1 F2 F3 B3 B2 B1 B0        1f1b   stage 0  F0 F1 B0 F2 B1 F3 B2 B3
            stage 1  F0 F1 F2 F3 B3 B2 B1 B0               stage 1  F0 B0 F1 B1 F2 B2 F3 B3

This module imports no other part of pipexplore.
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["SCHEDULES", "PHASES", "Action", "stage_orders", "interleaved_order", "worker_devices",
           "gpipe_order", "one_f_one_b_order", "zero_bubble_h1_order"]

#: The schedules the simulator and the in-process executors run.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
Action = tuple[str, int]  # (kind, micro-batch)
#: Each action kind's phase name in a timeline.
PHASES = {"F": "forward", "B": "backward", "R": "recompute", "I": "input_grad", "W": "weight_grad"}


def gpipe_order(stage: int, stages: int, m: int) -> list[Action]:
    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


def one_f_one_b_order(stage: int, stages: int, m: int) -> list[Action]:
    warmup = min(stages - stage - 1, m)
    order: list[Action] = [("F", i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", k) for k in range(m - warmup, m)]
    return order


def zero_bubble_h1_order(stage: int, stages: int, m: int) -> list[Action]:
    """ZB-H1: 1F1B with backward split in input-grad (I) and weight-grad (W).

    Stage ``s`` keeps up to ``s`` weight-grads pending: the last stages, which finish first,
    push their W's back so that the chain of I's towards stage 0 starts early, and the W's
    fill the drain's bubbles. Bubble per stage: (stages-1)·(F + I − W), against 1F1B's
    (stages-1)·(F + I + W).
    """
    warmup = min(stages - stage - 1, m)
    order: list[Action] = [("F", i) for i in range(warmup)]
    pending: list[int] = []
    for k in range(m):
        if warmup + k < m:
            order.append(("F", warmup + k))
        order.append(("I", k))
        pending.append(k)
        if len(pending) > stage:
            order.append(("W", pending.pop(0)))
    order += [("W", k) for k in pending]
    return order


def interleaved_order(device: int, devices: int, v: int, m: int) -> list[tuple[int, str, int]]:
    """Megatron's interleaved 1F1B for one device: ``(stage, kind, micro-batch)`` in order.

    The device holds stages ``device, device + devices, …`` (``v`` of them).
    """
    total = m * v

    def step(t: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(t, devices * v)
        chunk = within // devices
        if not forward:
            chunk = v - 1 - chunk
        return chunk * devices + device, group * devices + t % devices

    warmup = min((devices - device - 1) * 2 + (v - 1) * devices, total)
    order = []
    for t in range(warmup):
        s, i = step(t, True)
        order.append((s, "F", i))
    for k in range(total - warmup):
        s, i = step(warmup + k, True)
        order.append((s, "F", i))
        s, i = step(k, False)
        order.append((s, "B", i))
    for k in range(total - warmup, total):
        s, i = step(k, False)
        order.append((s, "B", i))
    return order


def stage_orders(schedule: str, stages: int, m: int) -> list[list[Action]]:
    """Each stage's actions in the order its worker runs them (``interleaved`` runs per device: :func:`interleaved_order`)."""
    build = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order, "zero-bubble": zero_bubble_h1_order}.get(schedule)
    if build is None:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    return [build(s, stages, m) for s in range(stages)]


def worker_devices(worker_orders: Sequence[Sequence[tuple[int, str, int]]], stage_devices: Sequence[Any]) -> list[Any]:
    """The device each worker runs on, from its ``(stage, kind, micro-batch)`` order: the device of
    its first stage (an interleaved worker's stages all share one). Workers with nothing to do are
    left out."""
    return [stage_devices[order[0][0]] for order in worker_orders if order]
