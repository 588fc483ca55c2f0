"""The fastest contiguous split whose every stage fits its memory: exact, for the slowest stage.

A stage of layers ``i … j-1`` at stage index ``s`` costs ``time[i:j].sum()`` seconds and holds::

    static[i:j].sum() + max_k (a_sk · inp[i] + b_sk · act[i:j].sum())

bytes: its layers' parameters, gradients and optimizer state, and at its peak the activations
the schedule keeps in flight there. ``inp[i]`` is what a stage starting at layer ``i`` receives
(what a checkpointed micro-batch keeps), ``act`` what each layer saves for its backward, and
``(a_sk, b_sk)`` the micro-batch shares a stage holds each way after each of its actions
(:func:`held_shares`: a 1F1B first stage ``p`` micro-batches, the last one; GPipe all ``m``).
The in-flight shares depend on the stage's index, so the constraint is not the same for every
stage, and moving a stage's first layer changes what it receives: the best split under memory
is not the time-balanced one moved about, and a greedy cut is not exact.

:func:`capped_splits` minimises the slowest stage subject to every stage's bytes ≤ its cap:

1. The time-balanced split (:func:`pipexplore.balance.optimal_splits`, its ties evened out) where
   it fits: nothing is faster.
2. Otherwise a threshold search over the slowest stage ``T``: a split with every stage within
   ``T`` and its cap exists iff the last layer is reachable in ``S`` stages, where from a cut
   ``i`` stage ``s`` reaches every ``j`` up to ``min(time end, memory end)`` (both grow with
   ``j``; a running maximum over the cuts reached finds the next stage's in a few array passes).
   The optimum is one of the stage sums ``time[i:j].sum()``: probes drawn from those still
   between the largest infeasible and the smallest feasible, many at once, until none is left.
3. The split is read back from the last stage, each stage's start chosen among the cuts that
   keep the rest feasible nearest an even share of the time before it.

Exact for this objective (tests: equal to brute force over every split). Where nothing fits,
:func:`least_over` gives the split whose stages exceed their caps by the least.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from pipexplore.balance import optimal_splits

__all__ = ["StageMemory", "capped_splits", "least_over", "stage_bytes", "held_shares"]

#: Threshold probes tried at once (a round shrinks the candidates between the bounds about this much).
_PROBES = 24


def held_shares(stage: np.ndarray, kind: np.ndarray, micro: np.ndarray, fractions: Sequence[float], stop: int,
                stages: int) -> list[np.ndarray]:
    """Per stage, the ``(a, b)`` shares it may hold at its peak: after each of its actions in the
    order it runs them, ``a`` micro-batches' inputs (checkpointed, between forward and recompute)
    and ``b`` micro-batches' activations, each micro-batch counted by its ``fractions`` share; only
    the points no other dominates (``(0, 0)`` for a stage that runs nothing).

    ``stage``/``kind``/``micro``: the schedule's actions in each stage's order (kind letters
    ``F B R I W O``); micro-batches ``0 … stop-1`` are checkpointed. As
    :func:`pipexplore.predict.frames.held_activations` counts them: a forward keeps its
    activations (its input when checkpointed), a recompute brings them back, a backward or
    input-grad frees them."""
    stage = np.asarray(stage, dtype=np.int64)
    kind = np.asarray(kind)
    micro = np.asarray(micro, dtype=np.int64)
    share = np.asarray(fractions, dtype=float)[np.maximum(micro, 0)]
    ckpt = micro < stop
    forward, recompute, backward = kind == "F", kind == "R", (kind == "B") | (kind == "I")
    da = np.where(forward & ckpt, share, 0.0) - np.where(backward & ckpt, share, 0.0)
    db = (np.where(forward & ~ckpt, share, 0.0) + np.where(recompute, share, 0.0)
          - np.where(backward, share, 0.0))
    order = np.argsort(stage, kind="stable")  # each stage's actions, in its order
    stage, da, db = stage[order], da[order], db[order]
    a, b = _group_cumsum(stage, da), _group_cumsum(stage, db)
    a, b = np.maximum(np.round(a, 12), 0.0), np.maximum(np.round(b, 12), 0.0)
    # The points no other of the same stage dominates: by stage, a descending, then b descending; a
    # point stays where its b is above every b before it in its stage (their a is at least its).
    order = np.lexsort((-b, -a, stage))
    stage, a, b = stage[order], a[order], b[order]
    first = np.r_[True, stage[1:] != stage[:-1]] if len(stage) else np.zeros(0, dtype=bool)
    offset = np.cumsum(first) * (float(b.max(initial=0.0)) + 1.0)  # a running maximum that restarts per stage
    running = np.maximum.accumulate(b + offset) - offset
    before = np.where(first, -np.inf, np.r_[-np.inf, running[:-1]])
    keep = b > before
    stage, a, b = stage[keep], a[keep], b[keep]
    bounds = np.searchsorted(stage, np.arange(stages + 1))
    return [np.stack([a[lo:hi], b[lo:hi]], axis=1) if hi > lo else np.zeros((1, 2))
            for lo, hi in zip(bounds[:-1], bounds[1:])]


def _group_cumsum(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """A running sum of ``values`` that starts again where ``group`` (sorted) changes."""
    total = np.cumsum(values)
    if not len(total):
        return total
    first = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    before = np.r_[0.0, total[first[1:] - 1]]
    return total - np.repeat(before, np.diff(np.r_[first, len(total)]))


class StageMemory:
    """What a stage of each possible range holds: per layer ``static`` bytes (parameters,
    gradients, optimizer state), ``act`` (saved for backward) and ``inp`` (what a stage starting
    there receives); per stage its ``shares`` (:func:`held_shares`) and ``caps`` (bytes)."""

    def __init__(self, static: Union[Sequence[float], np.ndarray], act: Union[Sequence[float], np.ndarray],
                 inp: Union[Sequence[float], np.ndarray], shares: Sequence[np.ndarray], caps: Sequence[float]) -> None:
        self.static = np.concatenate([[0.0], np.cumsum(np.asarray(static, dtype=float))])
        self.act = np.concatenate([[0.0], np.cumsum(np.asarray(act, dtype=float))])
        self.inp = np.asarray(inp, dtype=float)
        self.shares = [np.asarray(p, dtype=float).reshape(-1, 2) for p in shares]
        self.caps = np.asarray(caps, dtype=float)
        if len(self.caps) != len(self.shares):
            raise ValueError(f"{len(self.caps)} caps for {len(self.shares)} stages")
        self._ends: dict[tuple, np.ndarray] = {}

    @property
    def layers(self) -> int:
        return len(self.inp)

    def bytes(self, s: int, i: int, j: int) -> float:
        """Bytes stage ``s`` holds at its peak with layers ``i … j-1``."""
        held = self.shares[s] @ np.array([self.inp[i], self.act[j] - self.act[i]])
        return float(self.static[j] - self.static[i] + max(0.0, held.max()))

    def ends(self, s: int, extra: np.ndarray = np.zeros(1)) -> np.ndarray:
        """For every start ``i`` (rows: each of ``extra`` bytes over the cap), the last ``j`` such that
        stage ``s`` with layers ``i … j-1`` fits its cap (``i`` where even one layer does not)."""
        key = (self.shares[s].tobytes(), float(self.caps[s]), extra.tobytes())
        if key in self._ends:
            return self._ends[key]
        n = self.layers
        starts = np.arange(n + 1)
        limit = np.full((len(extra), n + 1), n, dtype=np.int64)
        for a, b in self.shares[s]:
            levels = self.static + b * self.act  # nondecreasing in j
            room = (self.caps[s] + extra[:, None] + (levels - np.r_[a * self.inp, 0.0])[None, :])
            found = np.searchsorted(levels, room.ravel(), side="right").reshape(room.shape) - 1
            limit = np.minimum(limit, found)
        result = np.maximum(limit, starts[None, :])
        result[:, n] = n
        self._ends[key] = result
        return result


def stage_bytes(memory: StageMemory, splits: Sequence[int]) -> np.ndarray:
    """Bytes each stage holds at its peak, split at ``splits``."""
    points = [0, *splits, memory.layers]
    return np.array([memory.bytes(s, i, j) for s, (i, j) in enumerate(zip(points, points[1:]))])


def _time_ends(prefix: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """Per limit (rows) and start ``i``: the last ``j`` with ``prefix[j] - prefix[i] <= limit``."""
    n = len(prefix) - 1
    found = np.searchsorted(prefix, (prefix[None, :] + limits[:, None]).ravel(), side="right")
    found = found.reshape(len(limits), n + 1) - 1
    found = np.clip(found, np.arange(n + 1)[None, :], n)
    for _ in range(4):  # the same float test as a stage sum (prefix differences), not prefix + limit
        over = (found > np.arange(n + 1)[None, :]) & (prefix[found] - prefix[None, :] > limits[:, None])
        under = (found < n) & (prefix[np.minimum(found + 1, n)] - prefix[None, :] <= limits[:, None])
        if not (over.any() or under.any()):
            break
        found = found - over + under
    return found


def _reach(time_ends: np.ndarray, memory: StageMemory, stages: int, extra: np.ndarray = np.zeros(1),
           keep: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
    """Whether the last layer is reachable in ``stages`` stages, per row of ``time_ends`` (one row
    per time limit; ``extra``: bytes allowed over the caps, one per row or one for all); with
    ``keep``, every stage's reachable cuts."""
    rows, width = time_ends.shape
    reach = np.zeros((rows, width), dtype=bool)
    reach[:, 0] = True
    kept = [reach]
    positions = np.arange(width)
    for s in range(stages):
        end = np.minimum(time_ends, memory.ends(s, extra))
        furthest = np.maximum.accumulate(np.where(reach, end, -1), axis=1)
        nxt = np.zeros_like(reach)
        nxt[:, 1:] = furthest[:, :-1] >= positions[None, 1:]
        reach = nxt
        if keep:
            kept.append(reach)
    return reach[:, -1], kept


def _read_back(prefix: np.ndarray, time_ends: np.ndarray, memory: StageMemory, stages: int, kept: list[np.ndarray],
               extra: np.ndarray = np.zeros(1)) -> list[int]:
    """The split, from the last stage back: each stage's start among the cuts that keep the
    stages before it feasible, nearest an even share of the time before its end."""
    n = len(prefix) - 1
    j, cuts = n, []
    for s in range(stages - 1, 0, -1):
        end = np.minimum(time_ends[0], memory.ends(s, extra)[0])
        candidates = np.flatnonzero(kept[s][0] & (np.arange(n + 1) < j) & (end >= j))
        target = prefix[j] * s / (s + 1)
        j = int(candidates[np.argmin(np.abs(prefix[candidates] - target))])
        cuts.append(j)
    return cuts[::-1]


def _bottleneck(prefix: np.ndarray, splits: Sequence[int]) -> float:
    points = np.array([0, *splits, len(prefix) - 1])
    return float(np.max(prefix[points[1:]] - prefix[points[:-1]]))


def capped_splits(time: Sequence[float], memory: StageMemory,
                  balanced: Optional[Sequence[int]] = None) -> Optional[list[int]]:
    """The split into ``len(memory.caps)`` stages whose slowest stage (the sum of ``time`` over its
    layers) is smallest, among those whose every stage fits its cap; None where none does.
    ``balanced``: ``optimal_splits(time, stages)`` where the caller has it.

    Example::

        memory = StageMemory(static, act, inp, shares=[[[0, 3]], [[0, 2]], [[0, 1]]], caps=[8e9] * 3)
        capped_splits(seconds, memory)    # [k1, k2], or None
    """
    stages = len(memory.caps)
    values = np.asarray(time, dtype=float)
    n = len(values)
    if stages > n:
        raise ValueError(f"more stages ({stages}) than layers ({n})")
    if stages == 1:
        return [] if stage_bytes(memory, [])[0] <= memory.caps[0] else None
    balanced = list(balanced) if balanced is not None else optimal_splits(values, stages)
    if np.all(stage_bytes(memory, balanced) <= memory.caps):
        return balanced
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    lower, upper = _bottleneck(prefix, balanced), float(prefix[-1])
    ok, _ = _reach(_time_ends(prefix, np.array([lower, upper])), memory, stages)
    if not ok[1]:
        return None
    best = lower if ok[0] else _threshold(prefix, memory, stages, lower, upper)
    ends = _time_ends(prefix, np.array([best]))
    _, kept = _reach(ends, memory, stages, keep=True)
    return _read_back(prefix, ends, memory, stages, kept)


def _threshold(prefix: np.ndarray, memory: StageMemory, stages: int, lower: float, upper: float) -> float:
    """The smallest stage sum in ``(lower, upper]`` at which a split fits (``upper`` does, ``lower`` not)."""
    n = len(prefix) - 1
    rng = np.random.default_rng(0)
    starts = np.arange(n + 1)
    while True:
        # The stage sums strictly between the bounds: for each start, a run of ends.
        first = _time_ends(prefix, np.array([lower]))[0] + 1
        last = _time_ends(prefix, np.array([upper]))[0]
        last = np.where(prefix[last] - prefix[starts] >= upper, last - 1, last)  # strictly below upper
        counts = np.maximum(last - first + 1, 0)
        total = int(counts.sum())
        if total == 0:
            return upper
        if total <= _PROBES:
            picks = np.arange(total)
        else:
            picks = np.sort(rng.choice(total, size=_PROBES, replace=False))
        offsets = np.cumsum(counts)
        rows = np.searchsorted(offsets, picks, side="right")
        cols = first[rows] + picks - (offsets[rows] - counts[rows])
        probes = np.unique(prefix[cols] - prefix[rows])
        probes = probes[(probes > lower) & (probes < upper)]
        if not len(probes):
            return upper
        ok, _ = _reach(_time_ends(prefix, probes), memory, stages)
        if ok.any():
            upper = float(probes[np.argmax(ok)])
        bad = probes[~ok & (probes < upper)]
        if len(bad):
            lower = float(bad.max())


def least_over(time: Sequence[float], memory: StageMemory, rounds: int = 5,
               balanced: Optional[list[int]] = None) -> tuple[list[int], float]:
    """Where no split fits: the split whose largest excess over its stage's cap is least (to
    about a millionth of it), and that excess in bytes. Among those, the fastest is not sought."""
    stages = len(memory.caps)
    values = np.asarray(time, dtype=float)
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    n = len(values)
    ends = np.full((1, n + 1), n, dtype=np.int64)
    if balanced is None:
        balanced = optimal_splits(values, stages) if stages > 1 else []
    over = stage_bytes(memory, balanced) - memory.caps
    finite = memory.caps[np.isfinite(memory.caps)]
    high = float(np.max(over)) * (1 + 1e-9) + 1e-9 * float(np.max(np.abs(finite), initial=1.0))  # (rounding)
    low, found = 0.0, False
    for _ in range(rounds):
        extras = np.linspace(low, high, _PROBES + 1)[1:]
        ok, _ = _reach(np.repeat(ends, len(extras), axis=0), memory, stages, extras)
        if not ok.any():
            break
        index = int(np.argmax(ok))
        high, low, found = float(extras[index]), float(extras[index - 1]) if index else low, True
    if not found:  # the balanced split is as close as the search can tell
        return balanced, float(np.max(over))
    extra = np.array([high])
    _, kept = _reach(ends, memory, stages, extra, keep=True)
    splits = _read_back(prefix, ends, memory, stages, kept, extra) if stages > 1 else []
    return splits, float(np.max(stage_bytes(memory, splits) - memory.caps))
