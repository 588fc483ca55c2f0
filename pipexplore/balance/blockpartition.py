"""torchgpipe's ``blockpartition.solve``: a sequence cut into contiguous blocks, the largest block smallest."""
from __future__ import annotations

from typing import Sequence, TypeVar

from pipexplore.balance.optimal import optimal_splits

__all__ = ["solve"]

T = TypeVar("T", int, float)


def solve(sequence: Sequence[T], partitions: int = 1) -> list[list[T]]:
    """Split ``sequence`` into ``partitions`` contiguous, non-empty blocks whose largest sum is
    the smallest possible (exactly, unlike torchgpipe's heuristic), the other blocks as even as
    they can be.

    Example::

        solve([1, 2, 3, 4, 5, 6], partitions=2)    # [[1, 2, 3, 4], [5, 6]]
    """
    if partitions < 1:
        raise ValueError(f"partitions must be a positive integer, got {partitions} (< 1): give the number of blocks")
    if len(sequence) < partitions:
        raise ValueError(f"sequence is shorter than intended partitions ({len(sequence)} < {partitions}): "
                         "every block needs at least one element; ask for fewer partitions")
    bounds = [0, *optimal_splits(list(sequence), partitions), len(sequence)]
    return [list(sequence[a:b]) for a, b in zip(bounds, bounds[1:])]
