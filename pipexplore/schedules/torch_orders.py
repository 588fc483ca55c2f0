"""The orders of torch's multi-stage schedules, rank by rank, as ``torch.distributed.pipelining`` makes them.

Each function gives one rank's compute actions, ``(stage, kind, micro-batch)``, in the order
torch 2.13's schedule class runs them (its ``pipeline_order`` without the idle steps; the
lowering to sends and receives keeps that order). Ported from ``torch/distributed/pipelining/
schedules.py``: :func:`looped_bfs_order` (``ScheduleLoopedBFS``), :func:`interleaved_1f1b_order`
(``ScheduleInterleaved1F1B``, and with ``zero_bubble`` ``ScheduleInterleavedZeroBubble``, which
with one stage per rank is ZB-H1), :func:`zbv_order` (``ScheduleZBVZeroBubble``) and
:func:`dualpipev_order` (``ScheduleDualPipeV``). :mod:`pipexplore.schedules` names them; tests
compare each with torch's own ``_schedule_visualizer.get_schedule_ops``.

This module imports no other part of pipexplore.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

__all__ = ["Order", "looped_bfs_order", "interleaved_1f1b_order", "zbv_order", "dualpipev_order", "rounds"]

Order = list[tuple[int, str, int]]  # (stage, kind, micro-batch), in the order a rank runs them


def rounds(ranks: int, microbatches: int) -> tuple[int, int]:
    """The interleaved schedules' rounds and micro-batches per round, as torch counts them
    (``max(1, m // ranks)`` rounds: torch runs any ``m`` that the rounds divide)."""
    number = max(1, microbatches // ranks)
    return number, microbatches // number


def looped_bfs_order(rank: int, ranks: int, local: int, m: int) -> Order:
    """Breadth-first: every micro-batch through the rank's first stage, then its next, …; then the
    backwards, last stage first, last micro-batch first."""
    stages = range(rank, ranks * local, ranks)
    return ([(s, "F", i) for s in stages for i in range(m)]
            + [(s, "B", i) for s in reversed(stages) for i in reversed(range(m))])


def interleaved_1f1b_order(rank: int, ranks: int, local: int, m: int, *, zero_bubble: bool = False) -> Order:
    """Interleaved 1F1B (``zero_bubble``: its zero-bubble variant, ZB1P, the backward split in I
    and W, a rank's W held back until ``rank`` of its I's are done) over ``local`` stages per rank
    (stage ``k·ranks + rank``), as torch's ``_get_1f1b_rank_ops`` orders them."""
    _, per_round = rounds(ranks, m)
    warmup = min((local - 1) * per_round + (1 if zero_bubble else 2) * (ranks - 1 - rank), m * local)
    steady = m * local - warmup

    def forward_stage(step: int) -> int:
        return (step // per_round) % local * ranks + rank

    def backward_stage(step: int) -> int:
        return (local - 1 - ((step - warmup) // per_round) % local) * ranks + rank

    count: dict[tuple[str, int], int] = defaultdict(int)

    def next_of(kind: str, stage: int) -> tuple[int, str, int]:
        count[(kind, stage)] += 1
        return stage, kind, count[(kind, stage)] - 1

    backward = "I" if zero_bubble else "B"
    order: Order = []
    backward_steps: list[int] = []
    weights = 0
    for op in range(warmup + steady + warmup):
        if op < warmup + steady:
            order.append(next_of("F", forward_stage(op)))
        if op >= warmup:
            order.append(next_of(backward, backward_stage(op)))
            backward_steps.append(op)
            if zero_bubble and op - warmup >= rank:
                order.append(next_of("W", backward_stage(backward_steps[weights])))
                weights += 1
    if zero_bubble:
        order += [next_of("W", backward_stage(op)) for op in backward_steps[weights:]]
    return order


def zbv_order(rank: int, ranks: int, m: int) -> Order:
    """ZB-V: two stages per rank in a V (``rank`` and ``2·ranks − 1 − rank``), the backward split
    in I and W, as torch's ``ScheduleZBVZeroBubble`` orders them (it plans for at least
    ``2·ranks − 1`` micro-batches and drops those past ``m``)."""
    n = max(2 * ranks - 1, m)
    down, up = rank, 2 * ranks - 1 - rank
    order: Order = []
    count: dict[tuple[str, int], int] = defaultdict(int)

    def add(stage: int, kind: str, micro: int | None = None) -> None:
        if micro is None:
            micro = count[(kind, stage)]
            count[(kind, stage)] += 1
        order.append((stage, kind, micro))

    for _ in range(2 * (ranks - rank) - 1):
        add(down, "F")
    for _ in range(rank):
        add(up, "F")
        add(down, "F")
    for _ in range(ranks - rank):
        add(up, "F")
        add(up, "I")
        add(up, "W")
    while count[("F", up)] < count[("F", down)] or count[("F", down)] < n:
        if count[("F", down)] < n:
            add(down, "F")
        add(down, "I")
        add(down, "W")
        add(up, "F")
        add(up, "I")
        add(up, "W")
    w_down, w_up = count[("I", down)], count[("I", up)]
    for _ in range(rank):
        add(down, "I")
        add(up, "I")
    for _ in range(ranks - rank):
        add(down, "I")
        add(down, "W", w_down)
        w_down += 1
    order += [(up, "W", i) for i in range(w_up, count[("I", up)])]
    order += [(down, "W", i) for i in range(w_down, count[("I", down)])]
    return [action for action in order if action[2] < m]


def dualpipev_order(rank: int, ranks: int, m: int) -> Order:
    """DualPipeV (DeepSeek's DualPipe folded into a V: stages ``rank`` and ``2·ranks − 1 − rank``),
    as torch's ``ScheduleDualPipeV`` orders it. Its overlapped pairs (``OVERLAP_F_B``: a forward of
    one stage with a full backward of the other) are listed as the forward, then the backward:
    torch runs a pair's two actions one after the other unless a custom function is registered for
    ``OVERLAP_F_B`` (which overlaps them, e.g. one's compute with the other's communication).
    Micro-batches whose backward is full run ``B``; the others (the cooldown's second half) run
    ``I`` then, later, ``W``."""
    down, up = rank, 2 * ranks - 1 - rank
    order: Order = []
    count: dict[tuple[int, str], int] = defaultdict(int)
    weights: list[tuple[int, int]] = []  # (stage, micro-batch) whose W is still to run

    def add(stage: int, kind: str) -> None:
        # A full backward takes the micro-batch the I counter is at, and counts as an I and a W.
        micro = count[(stage, "I" if kind == "B" else kind)]
        order.append((stage, kind, micro))
        if kind == "B":
            count[(stage, "I")] += 1
            count[(stage, "W")] += 1
        else:
            count[(stage, kind)] += 1
            if kind == "I":
                weights.append((stage, micro))

    def add_weight() -> None:
        if weights:
            stage, micro = weights.pop(0)
            order.append((stage, "W", micro))
            count[(stage, "W")] += 1

    def overlap(forward: int, backward: int) -> None:  # F;B, run one after the other
        add(forward, "F")
        add(backward, "B")

    for _ in range(2 * (ranks - rank - 1)):
        add(down, "F")
    for _ in range(rank + 1):
        add(down, "F")
        add(up, "F")
    for _ in range(ranks - rank - 1):
        add(up, "I")
        add_weight()
        add(up, "F")
    for i in range(m - 2 * ranks + rank + 1):
        if i == 0 and rank == ranks - 1:  # not overlapped, to shrink the bubble (as torch has it)
            add(down, "F")
            add(up, "B")
        else:
            overlap(down, up)
        overlap(up, down)
    for _ in range(ranks - rank - 1):
        add(up, "B")
        overlap(up, down)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        add(up, "I" if split else "B")
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        add(down, "I" if split else "B")
    for _ in range(ranks - rank - 1):
        add_weight()
        add(down, "I" if split else "B")
    for _ in range(rank + 1):
        add_weight()
    return order


#: Each multi-stage schedule's order for one rank: ``(rank, ranks, stages per rank, micro-batches)``.
MULTI_STAGE_ORDERS: dict[str, Callable[[int, int, int, int], Order]] = {
    "interleaved": interleaved_1f1b_order,
    "looped-bfs": looped_bfs_order,
    "interleaved-zero-bubble": lambda r, p, v, m: interleaved_1f1b_order(r, p, v, m, zero_bubble=True),
    "zbv": lambda r, p, v, m: zbv_order(r, p, m),
    "dualpipev": lambda r, p, v, m: dualpipev_order(r, p, m),
}
