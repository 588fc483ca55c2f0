"""The processor-sharing event loop: a step's actions timed while stages share a device.

While the actions running on one device ask for more than all of it (stages on one host's
cores, or on one GPU), each runs slower in proportion: every action on that device advances at
the same rate, and ends when the device's clock has advanced by its seconds. The loop starts an
action when its worker is free and its inputs (plus the copy and the hand-off) have arrived,
and emits each action, and each copy before a forward, as it ends (:class:`Records`).

The loop is compiled (``pipexplore/predict/_sharing.c``, built at install) and written here in Python
(:func:`sharing_loop`): the reference the compiled one equals bit for bit (tests), and what runs
where no compiler was found. :func:`pipexplore.predict.simulator.simulate` runs it only where
some device can be asked for more than all of it (:func:`may_oversubscribe`); elsewhere the
schedule's longest path gives the same timeline faster (:mod:`pipexplore.predict.dataflow`).
"""
from __future__ import annotations

import heapq
import math
from typing import NamedTuple, Optional

import numpy as np

from pipexplore.predict.dataflow import BACKWARD, FORWARD, INPUT_GRAD, ActionGraph

try:  # the compiled loop; the Python one runs where it was not built
    from pipexplore.predict import _sharing
except ImportError:  # pragma: no cover - depends on the install
    _sharing = None  # type: ignore[assignment]  # mypy types an imported module as never None

__all__ = ["ActionCosts", "Records", "processor_sharing", "sharing_loop", "loop_layout", "may_oversubscribe"]


class ActionCosts(NamedTuple):
    """Per action of a graph: its ``seconds``, the ``share`` of its device it asks for, the ``copy``
    of its input from the stage before (forwards), and the time from the end of its first (second)
    input to when it may start (the copy and the hand-off)."""

    seconds: np.ndarray
    share: np.ndarray
    copy: np.ndarray
    first_wait: np.ndarray
    second_wait: np.ndarray


class Records(NamedTuple):
    """What the processor-sharing loop emits, row by row in the order it emits them: the action,
    its start and end, and whether the row is the copy before that action (a forward's input)."""

    action: np.ndarray
    start: np.ndarray
    end: np.ndarray
    copy: np.ndarray


def processor_sharing(graph: ActionGraph, costs: ActionCosts, gap: float, resource: list[str],
                       compiled: Optional[bool] = None) -> Records:
    """The step as an event loop: what :func:`simulate` runs when stages that share a device ask
    for more than all of it at once. ``compiled``: the C loop (default where it was built), or the
    Python one (``False``); both give the same records bit for bit."""
    if compiled is None:
        compiled = _sharing is not None
    if not compiled:
        return sharing_loop(graph, costs, gap, resource)
    if _sharing is None:
        raise RuntimeError("pipexplore.predict._sharing (the compiled event loop) was not built with this install")
    n = len(graph)
    device, devices, lanes_at, lane_list = loop_layout(graph, resource)
    out_action = np.empty(2 * n, dtype=np.int64)
    out_start, out_end = np.empty(2 * n), np.empty(2 * n)
    out_copy = np.empty(2 * n, dtype=np.int8)

    def f64(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float64)

    def i64(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.int64)

    rows = _sharing.run(
        f64(costs.seconds), f64(costs.share), f64(costs.first_wait), f64(costs.second_wait), f64(costs.copy),
        i64(graph.first), i64(graph.second), i64(graph.stage), i64(graph.kind),
        np.array([len(q) for q in graph.queues], dtype=np.int64), device, devices, lanes_at, lane_list,
        float(gap), FORWARD, BACKWARD, INPUT_GRAD, out_action, out_start, out_end, out_copy)
    return Records(out_action[:rows], out_start[:rows], out_end[:rows], out_copy[:rows].astype(bool))


def loop_layout(graph: ActionGraph, resource: list[str]) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """How the event loop numbers what it shares: each stage's device (by first appearance in
    ``resource``), how many devices, and the workers of each stage as bounds (``lanes_at``, S + 1)
    into one list (``lanes``, ascending per stage). The C loop and the page's port take these."""
    S = len(resource)
    names = list(dict.fromkeys(resource))
    device = np.array([names.index(r) for r in resource], dtype=np.int64)
    lanes = graph.stage_lanes + [set()] * (S - len(graph.stage_lanes))
    lanes_at = np.cumsum([0, *map(len, lanes)]).astype(np.int64)
    lane_list = np.array([q for queue in lanes for q in sorted(queue)], dtype=np.int64)
    return device, len(names), lanes_at, lane_list


def sharing_loop(graph: ActionGraph, costs: ActionCosts, gap: float, resource: list[str]) -> Records:
    """The processor-sharing event loop in Python: the reference for the compiled one
    (``_sharing.c``, the same steps), and what runs where that was not built."""
    # Per action as plain lists: the loop reads a few per action, and numpy scalars would cost it
    # more than its own work.
    took, asked, copy_of, first_wait, second_wait = (c.tolist() for c in costs)
    stage, kind = graph.stage.tolist(), graph.kind.tolist()
    first, second = graph.first.tolist(), graph.second.tolist()
    none = len(graph)
    end = [-1.0] * none + [0.0]  # -1: not yet done; the sentinel "no input" ended at 0
    rows_action: list[int] = []
    rows_start: list[float] = []
    rows_end: list[float] = []
    rows_copy: list[bool] = []

    lane_queues = graph.queues
    Q = len(lane_queues)
    S = len(resource)
    base = [0] * Q  # each queue's first action number (actions are numbered queue after queue)
    for q in range(1, Q):
        base[q] = base[q - 1] + len(lane_queues[q - 1])
    length = [len(queue) for queue in lane_queues]
    heads = [0] * Q
    free_at = [0.0] * Q
    # When an action of stage s ends, only the queues of stage s and of the stage it hands its
    # output to can have a next action become ready.
    stage_queues = graph.stage_lanes
    # Processor sharing with a virtual clock per device: while the actions on one device ask for
    # more than all of it (``asked`` > 1), each runs slower in proportion, so all of them advance
    # at the same rate, 1 / asked, and an action ends when its device's clock has advanced by its
    # seconds. Actions that ask for none of their device (sleeps, a GPU's host side) run at full
    # speed on a clock of their own (FREE).
    FREE = "\0free"
    clock: dict[str, float] = {}
    demand: dict[str, float] = {}
    finishing: dict[str, list] = {}  # resource -> heap of (clock at the end, order, queue)
    running: dict[int, tuple] = {}  # queue -> (resource, share, start, action)
    # Queues to look at now; queues waiting for a time: when (``timed``), and those times as a
    # heap (an entry whose queue has since been given another time, or none, is skipped).
    dirty = set(range(Q))
    timed: dict[int, float] = {}  # queue -> when
    wakes: list[tuple[float, int]] = []  # (when, queue)
    order = 0
    remaining = none
    now = 0.0
    eps = 1e-12
    push, pop = heapq.heappush, heapq.heappop  # looked up once, called per action

    def emit(n: int, start: float, end: float, copied: bool) -> None:
        rows_action.append(n)
        rows_start.append(start)
        rows_end.append(end)
        rows_copy.append(copied)

    while remaining:
        while wakes and wakes[0][0] <= now + eps:
            t, q = pop(wakes)
            if timed.get(q) == t:
                del timed[q]
                dirty.add(q)
        for q in sorted(dirty):
            if q in running or heads[q] >= length[q]:
                continue
            n = base[q] + heads[q]
            # When its inputs are there (the worker's previous action is: it is the queue's head).
            t = end[first[n]]
            if t < 0:
                continue
            t += first_wait[n]
            later = end[second[n]]
            if later < 0:
                continue
            later += second_wait[n]
            if later > t:
                t = later
            start = free_at[q] if free_at[q] > t else t
            if start > now + eps:
                if timed.get(q) != start:
                    timed[q] = start
                    push(wakes, (start, q))
                continue
            share = asked[n]
            r = resource[stage[n]] if share > 0 else FREE
            heap = finishing.get(r)
            if not heap:
                clock[r], demand[r], finishing[r] = 0.0, 0.0, []
                heap = finishing[r]
            push(heap, (clock[r] + took[n], order, q))
            order += 1
            demand[r] += share
            running[q] = (r, share, now, n)
            copy = copy_of[n]
            if copy > 0:
                done = end[first[n]]
                emit(n, done, done + copy, True)
        dirty.clear()
        while wakes and timed.get(wakes[0][1]) != wakes[0][0]:
            pop(wakes)  # stale
        wake = wakes[0][0] if wakes else math.inf
        # The next event: a wake-up, or the first end on a device's clock at its current rate.
        step = wake - now
        advancing = []
        for r, heap in finishing.items():
            if not heap:
                continue
            d = demand[r]
            rate = 1.0 / d if r != FREE and d > 1.0 else 1.0
            left = (heap[0][0] - clock[r]) / rate
            if left < step:
                step = left
            advancing.append((r, heap, rate))
        if not advancing:
            if wake == math.inf:
                raise RuntimeError("the schedule deadlocked: no stage can run its next action")
            now = wake
            continue
        now += step
        tolerance = eps * max(1.0, now)
        for r, heap, rate in advancing:
            at = clock[r] + step * rate
            clock[r] = at
            while heap and heap[0][0] - at <= tolerance:
                _, _, q = pop(heap)
                _, share, start, n = running.pop(q)
                demand[r] -= share
                heads[q] += 1
                remaining -= 1
                end[n] = now
                free_at[q] = now + gap
                emit(n, start, now, False)
                s, k = stage[n], kind[n]
                # What this action's end can make ready: its stage's actions (the next in its
                # queue, which is one of them; a backward waiting for its forward or recompute),
                # and the forward of the next stage after a forward, the backward of the previous
                # after a backward (or input-grad).
                dirty |= stage_queues[s]
                if k == FORWARD:
                    if s + 1 < S:
                        dirty |= stage_queues[s + 1]
                elif (k == BACKWARD or k == INPUT_GRAD) and s > 0:
                    dirty |= stage_queues[s - 1]
    return Records(np.array(rows_action, dtype=np.int64), np.array(rows_start), np.array(rows_end),
                   np.array(rows_copy, dtype=bool))


def may_oversubscribe(graph: ActionGraph, share: np.ndarray, resource: list[str]) -> tuple[bool, bool]:
    """Whether some device's workers, each at the most it ever asks for, add up to more than all
    of it (then they may, depending on timing; otherwise they never do); and whether such a
    device runs several stages (then they usually do: a crowded host, where the loop is the
    faster way; one stage's forward and backward workers, e.g. autograd's on a GPU, seldom do)."""
    device = np.unique(np.asarray(resource), return_inverse=True)[1]
    most = np.zeros((int(device.max()) + 1 if len(device) else 0, len(graph.queues)))
    np.maximum.at(most, (device[graph.stage], graph.lane), share)
    crowded = most.sum(axis=1) > 1.0
    stages_per_device = np.bincount(device, minlength=len(crowded))
    return bool(crowded.any()), bool((crowded & (stages_per_device > 1)).any())
