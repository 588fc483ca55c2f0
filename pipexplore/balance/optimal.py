"""The exact min–max contiguous partition of layer costs, evened out among its ties."""
from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np

__all__ = ["optimal_splits", "join_first", "balance_cost", "check_partitions", "largest_stage"]

# Rows × candidates evaluated at once before the DP switches to sampled rows (monotone minima).
_DENSE_LIMIT = 32_768


def check_partitions(num_layers: int, partitions: int) -> None:
    """Refuse a partition count that ``num_layers`` layers cannot fill (one layer per partition at least).

    Example::

        check_partitions(8, 2)    # fine
        check_partitions(2, 3)    # ValueError: more partitions (3) than layers (2) ...
    """
    if num_layers == 0:
        raise ValueError("cannot balance an empty module: it has no layers")
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1, got {partitions}")
    if partitions > num_layers:
        raise ValueError(f"more partitions ({partitions}) than layers ({num_layers}): each partition needs a layer")


def largest_stage(costs: Sequence[float], splits: Sequence[int]) -> float:
    """The largest stage sum of ``costs`` cut at ``splits`` (the layers that begin a stage).

    Example::

        largest_stage([1, 2, 3, 4], [3])    # 6.0: stages 1+2+3 and 4
    """
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    bounds = np.array([0, *splits, len(costs)])
    return float(np.max(prefix[bounds[1:]] - prefix[bounds[:-1]]))


def join_first(values: Union[Sequence[float], np.ndarray], first: int) -> np.ndarray:
    """``values`` (one per layer) with layers ``0 … first-1`` as one, their sum: the layers no later
    stage may begin at (:func:`pipexplore.splits.first_runnable_layer`), for a split search that
    then adds ``first - 1`` to every split it finds. ``values`` as they are for ``first`` ≤ 1.

    Example::

        join_first([1, 2, 3, 4], 3)    # array([6., 4.])
    """
    array = np.asarray(values, dtype=np.float64)
    return np.r_[array[:first].sum(), array[first:]] if first > 1 else array


def optimal_splits(costs: Union[Sequence[float], np.ndarray], partitions: int, *, first: int = 1) -> list[int]:
    """The split points of the contiguous partition of ``costs`` into ``partitions`` stages whose
    largest stage sum is smallest (exactly); among the partitions that reach it, the one with the
    smallest sum of squared stage sums, so that the other stages are as even as they can be.
    ``first``: no split before it (layers ``0 … first-1`` stay in the first stage: those a stage
    run in another process cannot be without, :func:`pipexplore.splits.first_runnable_layer`).

    Identical layers give stages that differ by at most one layer: 8 over 2 stages give ``[4]``,
    1,000 over 64 give stages of 15 and 16 layers.

    Two passes over (stages, layers): first the optimal largest stage ``M`` (dynamic programming
    where the best cut for each prefix is found by bisection, vectorised), then the least sum of
    squares among partitions whose stages all stay within ``M`` (dynamic programming over the
    cuts each stage can take; each row's minimum is found among the few candidates within ``M``,
    or, when there are many, by sampled rows whose minima bound the others', the cost matrix being
    Monge). 1,000 layers × 64 stages take about 5 ms, 25 ms when one layer dominates the rest.

    Example::

        optimal_splits([1, 1, 1, 1, 1, 1, 1, 1], 2)   # [4]
        optimal_splits([4, 1, 1, 1, 1], 2)             # [1]: 4 | 4
        optimal_splits([1, 1, 1, 1, 1, 1, 1, 1], 2, first=6)   # [6]
    """
    if first > 1:  # the first layers as one
        return [point + first - 1 for point in optimal_splits(join_first(costs, first), partitions)]
    values = np.asarray(costs, dtype=np.float64)
    n = len(values)
    check_partitions(n, partitions)
    if np.any(values < 0) or not np.all(np.isfinite(values)):
        raise ValueError("costs must be finite and non-negative")
    if partitions == 1:
        return []
    if not values.any():
        values = np.ones(n)  # nothing to balance: even the stages by layers
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    return _even_splits(prefix, partitions, _min_max(prefix, partitions))


def balance_cost(costs: Sequence[float], partitions: int) -> list[int]:
    """Layers per partition (a ``balance``) minimising the largest partition's total cost, the
    others as even as they can be.

    Example::

        balance_cost([1, 1, 1, 1], 2)   # [2, 2]
    """
    from pipexplore.splits import splits_to_balance

    return splits_to_balance(optimal_splits(costs, partitions), len(costs))


def _min_max(prefix: np.ndarray, partitions: int) -> float:
    """The smallest largest stage sum over contiguous partitions into ``partitions`` stages.

    ``best[j]`` is the optimum over the first ``j`` layers with ``k`` stages; for a prefix ``j``
    the last stage's sum shrinks and ``best[i]`` grows as the cut ``i`` moves right, so the best
    cut is where they cross (bisection). O(partitions × n log n), vectorised.
    """
    n = len(prefix) - 1
    best = prefix.copy()
    js = np.arange(n + 1)
    for k in range(2, partitions + 1):
        # Valid cuts i for prefix j: k-1 <= i <= j-1. g(i) = best[i] + prefix[i] is nondecreasing on them.
        g = best + prefix
        g[: k - 1] = -np.inf
        lo, hi = k - 1, np.maximum(js - 1, k - 1)
        first = np.clip(np.searchsorted(g, prefix, side="left"), lo, hi)
        before = np.clip(first - 1, lo, hi)
        cost_first = np.maximum(best[first], prefix - prefix[first])
        cost_before = np.maximum(best[before], prefix - prefix[before])
        new_best = np.minimum(cost_before, cost_first)
        new_best[:k] = np.inf  # fewer layers than stages
        best = new_best
    return float(best[n])


def _furthest(prefix: np.ndarray, start: int, limit: float) -> int:
    """The last ``j`` with ``prefix[j] - prefix[start] <= limit`` (the same float test as the DP's)."""
    n = len(prefix) - 1
    j = min(n, max(start, int(np.searchsorted(prefix, prefix[start] + limit, side="right")) - 1))
    while j < n and prefix[j + 1] - prefix[start] <= limit:
        j += 1
    while j > start and prefix[j] - prefix[start] > limit:
        j -= 1
    return j


def _nearest(prefix: np.ndarray, end: int, limit: float) -> int:
    """The first ``i`` with ``prefix[end] - prefix[i] <= limit``."""
    i = max(0, min(end, int(np.searchsorted(prefix, prefix[end] - limit, side="left"))))
    while i > 0 and prefix[end] - prefix[i - 1] <= limit:
        i -= 1
    while i < end and prefix[end] - prefix[i] > limit:
        i += 1
    return i


def _cut_ranges(prefix: np.ndarray, partitions: int, limit: float) -> tuple[list[int], list[int]]:
    """For each cut ``t`` (after ``t`` stages), the positions it can take in a partition whose
    stages all stay within ``limit``: ``lo[t] .. hi[t]`` (reachable from the left with ``t``
    stages, and the rest coverable by the other ``partitions - t``)."""
    n = len(prefix) - 1
    reach, cover = [0], [n]
    for _ in range(partitions):
        reach.append(min(n, max(reach[-1] + 1, _furthest(prefix, reach[-1], limit))))
        cover.append(max(0, min(cover[-1] - 1, _nearest(prefix, cover[-1], limit))))
    lo = [max(t, cover[partitions - t]) for t in range(partitions + 1)]
    hi = [min(reach[t], n - (partitions - t)) for t in range(partitions + 1)]
    return lo, hi


def _row_minima(previous: np.ndarray, previous_lo: int, prefix: np.ndarray, rows: np.ndarray,
                first: np.ndarray, last: np.ndarray, limit: float) -> tuple[np.ndarray, np.ndarray]:
    """For each ``j`` of ``rows``: min over ``i`` in ``first..last`` of ``previous[i] + (prefix[j] - prefix[i])²``
    (infinite past ``limit``), and its leftmost ``i``."""
    lengths = last - first + 1
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    total = int(lengths.sum())
    row = np.repeat(np.arange(len(rows)), lengths)
    i = np.arange(total) - np.repeat(starts - first, lengths)
    span = prefix[rows[row]] - prefix[i]
    value = previous[i - previous_lo] + span * span
    value[span > limit] = np.inf
    best = np.minimum.reduceat(value, starts)
    position = np.where(value == best[row], np.arange(total), total)
    return best, i[np.minimum.reduceat(position, starts)]


def _even_splits(prefix: np.ndarray, partitions: int, limit: float) -> list[int]:
    """Among partitions whose stages all stay within ``limit``, the one with the least sum of
    squared stage sums (ties: the earliest cuts)."""
    lo, hi = _cut_ranges(prefix, partitions, limit)
    slack = 4 * np.finfo(np.float64).eps * float(prefix[-1])  # candidates a rounding away; the DP tests each exactly
    cost = prefix[lo[1]: hi[1] + 1] ** 2
    choices: list[np.ndarray] = []
    for t in range(2, partitions + 1):
        rows = np.arange(lo[t], hi[t] + 1)
        first = np.searchsorted(prefix, prefix[rows] - limit - slack, side="left")
        first = np.maximum(first, lo[t - 1])
        last = np.minimum(rows - 1, hi[t - 1])
        first = np.minimum(first, last)
        if int((last - first + 1).sum()) <= _DENSE_LIMIT or len(rows) < 16:
            cost, choice = _row_minima(cost, lo[t - 1], prefix, rows, first, last, limit)
        else:
            cost, choice = _monotone_row_minima(cost, lo[t - 1], prefix, rows, first, last, limit)
        choices.append(choice)
    splits, j = [], len(prefix) - 1
    for t in range(partitions, 1, -1):
        j = int(choices[t - 2][j - lo[t]])
        splits.append(j)
    return sorted(splits)


def _monotone_row_minima(previous: np.ndarray, previous_lo: int, prefix: np.ndarray, rows: np.ndarray,
                         first: np.ndarray, last: np.ndarray, limit: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_row_minima` for many rows × many candidates: the matrix is Monge, so the leftmost
    minimum moves right with the row; minima of every ``√rows``-th row bound the others'."""
    step = max(2, int(math.isqrt(len(rows))))
    sampled = np.unique(np.concatenate([np.arange(0, len(rows), step), [len(rows) - 1]]))
    _, sampled_choice = _row_minima(previous, previous_lo, prefix, rows[sampled], first[sampled], last[sampled], limit)
    block = np.searchsorted(sampled, np.arange(len(rows)), side="right") - 1
    after = np.minimum(block + 1, len(sampled) - 1)
    narrow_first = np.maximum(first, sampled_choice[block])
    narrow_last = np.minimum(last, sampled_choice[after])
    broken = narrow_first > narrow_last  # only where rounding broke the Monge order: search the whole row
    narrow_first = np.where(broken, first, narrow_first)
    narrow_last = np.where(broken, last, narrow_last)
    return _row_minima(previous, previous_lo, prefix, rows, narrow_first, narrow_last, limit)
