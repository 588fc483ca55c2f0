"""Balance: choose the contiguous partition whose slowest (or largest) stage is smallest, exactly.

Example::

    from pipexplore.balance import balance_by_time
    balance = balance_by_time(4, model, sample, timeout=1.0)
    pipe = GPipe(model, balance, chunks=8)
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from pipexplore.microbatch import TensorOrTensors

__all__ = ["balance_cost", "balance_by_time", "balance_by_size", "optimal_splits"]

Device = Union[torch.device, str]


def optimal_splits(costs: Sequence[float], partitions: int) -> list[int]:
    """The split points of the contiguous partition of ``costs`` minimising the largest stage sum.

    Exact: dynamic programming over (stages, layers) where the best cut for each prefix is found by
    bisection, since the previous stage count's optimum grows and the last stage's sum shrinks as
    the cut moves right. O(partitions × n log n), vectorised.
    """
    values = np.asarray(costs, dtype=np.float64)
    n = len(values)
    _check(n, partitions)
    if np.any(values < 0) or not np.all(np.isfinite(values)):
        raise ValueError("costs must be finite and non-negative")
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    # best[i]: the optimal largest stage over the first i layers with k stages (k-1 before the loop).
    best = prefix.copy()
    best[0] = 0.0
    cuts = np.zeros((partitions, n + 1), dtype=np.int64)
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
        take_before = cost_before <= cost_first
        new_best = np.where(take_before, cost_before, cost_first)
        cuts[k - 1] = np.where(take_before, before, first)
        new_best[:k] = np.inf  # fewer layers than stages
        best = new_best
    splits, j = [], n
    for k in range(partitions, 1, -1):
        j = int(cuts[k - 1][j])
        splits.append(j)
    return sorted(splits)


def _check(num_layers: int, partitions: int) -> None:
    if num_layers == 0:
        raise ValueError("cannot balance an empty module: it has no layers")
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1, got {partitions}")
    if partitions > num_layers:
        raise ValueError(f"more partitions ({partitions}) than layers ({num_layers}): each partition needs a layer")


def balance_cost(costs: Sequence[float], partitions: int) -> list[int]:
    """Layers per partition (a ``balance``) minimising the largest partition's total cost."""
    from pipexplore.splits import splits_to_balance

    return splits_to_balance(optimal_splits(costs, partitions), len(costs))


def balance_by_time(partitions: int, module: nn.Sequential, sample: TensorOrTensors, *,
                    timeout: float = 1.0, device: Device = torch.device("cuda")) -> list[int]:
    """A balance by profiled time (forward + backward of each layer), as in torchgpipe.

    The layers run one after another on ``device`` (the CPU when CUDA is not available) for
    about ``timeout`` seconds; each layer's median time is its cost.
    """
    from pipexplore.profile import profile

    _check(len(module), partitions)
    table = profile(module, sample, device=_resolve(device), timeout=timeout)
    return balance_cost((table["forward"] + table["backward"]).tolist(), partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: TensorOrTensors, *, chunks: int = 1,
                    param_scale: float = 2.0, device: Device = torch.device("cuda")) -> list[int]:
    """A balance by memory: each layer's activation bytes per micro-batch plus ``param_scale`` ×
    its parameter bytes (2 for SGD with momentum: weights and their gradients; 4 for Adam)."""
    from pipexplore.profile import profile

    _check(len(module), partitions)
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    table = profile(module, input, device=_resolve(device), repeats=1, timeout=None)
    sizes = table["output_bytes"] / chunks + param_scale * table["param_bytes"]
    return balance_cost(sizes.tolist(), partitions)


def _resolve(device: Optional[Device]) -> torch.device:
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return device
