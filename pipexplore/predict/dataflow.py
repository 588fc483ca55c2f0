"""A schedule as a dependency graph, and its timeline as the graph's longest path, level by level.

While no device is asked for more than all of it at once, every action of a predicted step starts
as soon as its worker is free and its inputs are there::

    start = max(end of the worker's previous action + gap,
                end of its first input + copy,  end of its second input + copy)

— a longest path over a graph that depends only on the schedule's shape (schedule, stages,
micro-batches, checkpointing, the executor's workers), not on any cost. :class:`ActionGraph` builds
that graph once (its inputs wired by array lookups) and, when first timed, sorts its actions level
by level (every input of a level sits in an earlier one; Kahn's order, in C where
``pipexplore.predict._sharing`` was built), so :meth:`ActionGraph.times` times a whole step with a few
array operations per level: a drag that moves a split re-times the same graph. Where the timed step does ask a device for more
than all of it (stages sharing a host's cores or a GPU, at once), :func:`oversubscribed` says so,
and the event loop of :func:`pipexplore.simulate` models the slowdown instead.

An action's inputs, as :func:`pipexplore.simulate` runs them: a forward's is the previous stage's
forward of its micro-batch; a backward's (input-grad's, recompute's) are its own forward and the
next stage's backward (input-grad) of the micro-batch; a weight-grad's is its own input-grad; an
optimizer step's (``O``, one per stage, micro-batch ``-1``) is its stage's last backward-side
action (B, I or W) in its worker's order.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

try:  # the compiled longest path (built by setup.py); the array passes below where it was not
    from pipexplore.predict import _sharing
except ImportError:  # pragma: no cover - depends on the install
    _sharing = None  # type: ignore[assignment]  # mypy types an imported module as never None

__all__ = ["ActionGraph", "oversubscribed", "KINDS", "FORWARD", "BACKWARD", "RECOMPUTE", "INPUT_GRAD", "WEIGHT_GRAD",
           "OPTIMIZER", "OPTIMIZER_MICRO"]

Action = tuple[int, str, int]  # (stage, kind, micro-batch)
#: Forward, backward, recompute, input- and weight-gradient, and the stage's optimizer step.
KINDS = ("F", "B", "R", "I", "W", "O")
#: The kind numbers of the graph's arrays.
FORWARD, BACKWARD, RECOMPUTE, INPUT_GRAD, WEIGHT_GRAD, OPTIMIZER = range(len(KINDS))
KIND_NUMBER = {kind: n for n, kind in enumerate(KINDS)}
#: The micro-batch number of an optimizer step (it belongs to none), in the graph and in timelines.
OPTIMIZER_MICRO = -1


@dataclass(frozen=True, eq=False)
class ActionGraph:
    """The actions of one step and what each waits for.

    ``queues`` holds each worker's actions in the order it runs them; actions are numbered queue
    after queue in that order. The arrays hold one entry per action: its ``stage``, ``kind``
    (index in ``KINDS``), ``micro``-batch, ``lane`` (the worker), and three inputs as action
    numbers — ``after`` (the worker's previous action), ``first`` and ``second`` (data inputs) —
    where ``len(graph)`` means "none" (the sentinel, which ends at 0). ``heads`` and ``tails``
    are the first and last action of each worker with something to do. The levels are found
    when first timed (:attr:`level`): a schedule that only the event loop times never pays for them.
    """

    queues: tuple[tuple[Action, ...], ...]
    stage: np.ndarray
    kind: np.ndarray
    micro: np.ndarray
    lane: np.ndarray
    after: np.ndarray
    first: np.ndarray
    second: np.ndarray
    heads: np.ndarray
    tails: np.ndarray

    @classmethod
    def build(cls, queues: Sequence[Sequence[Action]], stages: int, grad_kind: str = "B") -> "ActionGraph":
        """The graph of ``queues`` (one per worker). ``grad_kind``: what carries the gradient to the
        stage before (``I`` for zero-bubble), or else, for a micro-batch that stage runs whole, ``B``."""
        queued = tuple(tuple(q) for q in queues)
        actions = [a for q in queued for a in q]
        none = len(actions)
        lane = np.repeat(np.arange(len(queued), dtype=np.int64), [len(q) for q in queued])
        # Actions are numbered queue after queue: the worker's previous action is the number before.
        after = np.arange(-1, none - 1, dtype=np.int64)
        ends = np.cumsum([0, *map(len, queued)])
        busy = np.array([len(q) > 0 for q in queued], dtype=bool)
        after[ends[:-1][busy]] = none
        stage_of, kind_of, micro_of = (list(column) for column in zip(*actions)) if actions else ([], [], [])
        stage = np.array(stage_of, dtype=np.int64)
        kind = np.array([KIND_NUMBER[k] for k in kind_of], dtype=np.int64)
        micro = np.array(micro_of, dtype=np.int64)
        # Every action as one integer, and a table from it to the action's number (``none``: no worker runs it).
        reach = max(stages, int(stage.max()) + 1 if none else 0) + 1
        micros = (int(micro.max()) if none else 0) + 2  # micro-batch -1 (an optimizer step) and the last
        key = lambda s, k, i: (s * len(KINDS) + k) * micros + i + 1  # noqa: E731
        number = np.full(reach * len(KINDS) * micros, none, dtype=np.int64)
        mine = key(stage, kind, micro)
        number[mine] = np.arange(none)
        if none and np.unique(mine).size != none:
            raise ValueError("a schedule lists an action twice")
        first = np.full(none, none, dtype=np.int64)
        second = np.full(none, none, dtype=np.int64)

        def wire(into: np.ndarray, where: np.ndarray, s: np.ndarray, k, fallback=None) -> None:
            """``into[where]`` = the number of action (s, k, the same micro-batch); where no worker runs
            it, the ``fallback`` kind's, else a ValueError naming the first action left waiting."""
            found = number[key(s, k, micro[where])]
            if fallback is not None:
                found = np.where(found < none, found, number[key(s, fallback, micro[where])])
            missing = np.flatnonzero(found == none)
            if missing.size:
                n, wanted = int(where[missing[0]]), KINDS[fallback if fallback is not None else k]
                raise ValueError(f"{actions[n]} waits for {(int(s[missing[0]]), wanted, int(micro[n]))}, "
                                 f"which no worker runs")
            into[where] = found

        forwards = np.flatnonzero((kind == FORWARD) & (stage > 0))
        wire(first, forwards, stage[forwards] - 1, FORWARD)
        weights = np.flatnonzero(kind == WEIGHT_GRAD)
        wire(first, weights, stage[weights], INPUT_GRAD)
        grads = np.flatnonzero(np.isin(kind, (BACKWARD, RECOMPUTE, INPUT_GRAD)))
        wire(first, grads, stage[grads], FORWARD)
        # The next stage's gradient: its I, or its whole B (DualPipeV runs both kinds).
        grads = grads[stage[grads] < stages - 1]
        carried = KINDS.index(grad_kind)
        wire(second, grads, stage[grads] + 1, BACKWARD if grad_kind == "I" else INPUT_GRAD, carried)
        # Each stage's last backward-side action (B, I or W) in its worker's order: what its optimizer
        # step waits for (a stage's backward-side actions all run on one worker).
        backward_side = np.flatnonzero(np.isin(kind, (BACKWARD, INPUT_GRAD, WEIGHT_GRAD)))
        last_backward = np.full(reach, -1, dtype=np.int64)
        np.maximum.at(last_backward, stage[backward_side], backward_side)
        steps = np.flatnonzero(kind == OPTIMIZER)
        stepped = last_backward[stage[steps]]
        first[steps[stepped >= 0]] = stepped[stepped >= 0]
        return cls(queues=queued, stage=stage, kind=kind, micro=micro, lane=lane, after=after, first=first,
                   second=second, heads=ends[:-1][busy], tails=ends[1:][busy] - 1)

    def __len__(self) -> int:
        return len(self.stage)

    @property
    def longest_queue(self) -> int:
        """The most actions one worker runs: the fewest levels the graph can have."""
        return max(map(len, self.queues), default=0)

    @functools.cached_property
    def stage_lanes(self) -> list[set[int]]:
        """Per stage, the workers that run some of its actions."""
        lanes: list[set[int]] = [set() for _ in range(int(self.stage.max()) + 1 if len(self) else 0)]
        workers = len(self.queues)
        for pair in np.unique(self.stage * workers + self.lane).tolist():
            lanes[pair // workers].add(pair % workers)
        return lanes

    @functools.cached_property
    def level(self) -> np.ndarray:
        """Each action's level: one more than the highest of its inputs'. Raises ``ValueError`` if
        the schedule can never finish (a worker waits for an action that waits for it)."""
        return _levels(self.after, self.first, self.second)

    @property
    def depth(self) -> int:
        """Levels: how many array passes :meth:`times` makes."""
        return int(self.level.max()) + 1 if len(self) else 0

    @functools.cached_property
    def _by_level(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int]]]:
        """The actions in level order, their three inputs renumbered to it, and each level's bounds."""
        none = len(self)
        order = np.argsort(self.level, kind="stable")
        renumber = np.empty(none + 1, dtype=np.int64)
        renumber[order] = np.arange(none)
        renumber[none] = none
        bounds = np.concatenate([[0], np.cumsum(np.bincount(self.level, minlength=self.depth))]).tolist()
        return (order, renumber[self.after[order]], renumber[self.first[order]], renumber[self.second[order]],
                list(zip(bounds[:-1], bounds[1:])))

    def times(self, seconds: np.ndarray, first_wait: np.ndarray, second_wait: np.ndarray,
              gap: float = 0.0, compiled: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Start and end of every action: ``seconds`` each takes, the time between the end of its
        first (second) input and when it may start (copies, hand-offs), and the ``gap`` a worker
        leaves between two of its actions. One pass of array operations per level, or (where
        ``pipexplore.predict._sharing`` was built and ``compiled``) one pass in C in the same level order:
        the same operations, the same times bit for bit."""
        n = len(self)
        order, after, first, second, levels = self._by_level
        seconds, first_wait, second_wait = seconds[order], first_wait[order], second_wait[order]
        after_wait = np.where(after < n, gap, 0.0)
        end = np.zeros(n + 1)
        start = np.empty(n)
        if _sharing is not None and compiled:  # the same operations, action by action in C
            f64 = [np.ascontiguousarray(a, dtype=np.float64) for a in (seconds, after_wait, first_wait, second_wait)]
            _sharing.times(after, first, second, f64[0], f64[1], f64[2], f64[3], start, end)
        else:
            for lo, hi in levels:
                t = end[after[lo:hi]]
                t += after_wait[lo:hi]
                u = end[first[lo:hi]]
                u += first_wait[lo:hi]
                np.maximum(t, u, out=t)
                u = end[second[lo:hi]]
                u += second_wait[lo:hi]
                np.maximum(t, u, out=t)
                start[lo:hi] = t
                t += seconds[lo:hi]
                end[lo:hi] = t
        in_order_start, in_order_end = np.empty(n), np.empty(n)
        in_order_start[order], in_order_end[order] = start, end[:n]
        return in_order_start, in_order_end


def _levels(after: np.ndarray, first: np.ndarray, second: np.ndarray, compiled: bool = True) -> np.ndarray:
    """Each action's level: one more than the highest of its inputs' (Kahn's order), in C where
    ``pipexplore.predict._sharing`` was built and ``compiled``, else in Python (the same levels: tests)."""
    none = len(after)
    if _sharing is not None and compiled:
        level = np.empty(none, dtype=np.int64)
        i64 = [np.ascontiguousarray(a, dtype=np.int64) for a in (after, first, second)]
        placed = _sharing.levels(i64[0], i64[1], i64[2], level)
    else:
        level, placed = _python_levels(after, first, second)
    if placed != none:
        raise ValueError("the schedule deadlocks: some worker waits for an action that waits for it")
    return level


def _python_levels(after: np.ndarray, first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, int]:
    none = len(after)
    inputs = np.stack([after, first, second], axis=1)
    waiting = (inputs < none).sum(axis=1)
    users: list[list[int]] = [[] for _ in range(none)]
    for n, row in enumerate(inputs.tolist()):
        for m in row:
            if m < none:
                users[m].append(n)
    level = [0] * none
    waiting = waiting.tolist()
    ready = [n for n in range(none) if waiting[n] == 0]
    placed = 0
    while ready:
        n = ready.pop()
        placed += 1
        for u in users[n]:
            if level[u] <= level[n]:
                level[u] = level[n] + 1
            waiting[u] -= 1
            if not waiting[u]:
                ready.append(u)
    return np.asarray(level, dtype=np.int64), placed


def oversubscribed(graph: ActionGraph, resource: np.ndarray, share: np.ndarray, start: np.ndarray,
                   end: np.ndarray) -> bool:
    """Whether, at some moment of a timed ``graph``, the actions running on one resource (an
    integer per stage) ask for more than all of it (their ``share`` summed over 1). An action that
    ends when another starts does not overlap it. Workers run one action at a time, so only
    resources where two workers are busy at once are looked at action by action."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for r, a, b in zip(resource[graph.stage[graph.heads]].tolist(), start[graph.heads].tolist(),
                       end[graph.tails].tolist()):
        spans.setdefault(r, []).append((a, b))
    shared = []
    for r, group in spans.items():
        reach = -math.inf  # the latest end of the spans begun so far on this resource
        for a, b in sorted(group):
            if a < reach:
                shared.append(r)
                break
            reach = max(reach, b)
    if not shared:
        return False
    of_action = resource[graph.stage]
    mine = np.isin(of_action, shared) & (share > 0)
    if not mine.any():
        return False
    where, share, start, end = of_action[mine], share[mine], start[mine], end[mine]
    times = np.concatenate([start, end])
    delta = np.concatenate([share, -share])
    order = np.lexsort((delta, times, np.concatenate([where, where])))  # what ends before what starts
    # Each resource's shares sum to zero over its actions, so one running sum restarts per resource.
    return bool(np.cumsum(delta[order]).max() > 1.0 + 1e-9)

