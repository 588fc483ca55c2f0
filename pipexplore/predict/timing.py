"""Timing a layer's calls: timers that wait for the device, the spread of repeated times, lines
fitted to the costs at several micro-batch sizes, and the small tensor helpers the profiler uses."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from pipexplore.microbatch import TensorOrTensors
from pipexplore.skip.tracker import SkipTracker

__all__ = ["Timer", "detach", "synchronize", "nbytes", "first_rows", "spent", "spread", "fit_line", "fit_columns",
           "popping"]


def detach(value: TensorOrTensors) -> TensorOrTensors:
    def one(t: Tensor) -> Tensor:
        t = t.detach()
        return t.requires_grad_() if t.is_floating_point() else t

    if torch.is_tensor(value):
        return one(value)  # type: ignore[arg-type]
    return tuple(one(t) for t in value)  # type: ignore[union-attr]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nbytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def first_rows(value: TensorOrTensors, rows: int) -> TensorOrTensors:
    if torch.is_tensor(value):
        return value[:rows]  # type: ignore[index]
    return tuple(t[:rows] for t in value)  # type: ignore[union-attr]


def spent(deadline: Optional[float]) -> bool:
    """Whether a profile's ``timeout`` (as a ``time.perf_counter`` deadline) has run out."""
    return deadline is not None and time.perf_counter() > deadline


def spread(times: list[float]) -> float:
    """Interquartile range over the median (0 when there are too few samples to tell)."""
    if len(times) < 3:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4)
    median = statistics.median(times)
    return (q3 - q1) / median if median > 0 else 0.0


class Timer:
    """Wall and process-CPU seconds of repeated calls: the CPU time over the wall time is the
    number of cores the work keeps busy (≈0 for a sleep, ≈ the intra-op threads for a GEMM)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.wall: list[float] = []
        self.cpu = 0.0

    def __call__(self, work: Callable[[], Any]) -> Any:
        synchronize(self.device)
        c0, t0 = time.process_time(), time.perf_counter()
        result = work()
        synchronize(self.device)
        self.wall.append(time.perf_counter() - t0)
        self.cpu += time.process_time() - c0
        return result

    @property
    def median(self) -> float:
        return statistics.median(self.wall) if self.wall else 0.0

    @property
    def cores(self) -> float:
        total = sum(self.wall)
        return self.cpu / total if total > 0 else 0.0


def fit_line(rows: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """``t(n) = a + b·n`` by least squares, with ``a, b ≥ 0``; one size: proportional (a = 0)."""
    n = np.asarray(rows, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if len(set(rows)) < 2:
        return 0.0, float(t.mean() / max(n.mean(), 1.0))
    b, a = np.polyfit(n, t, 1)
    if b < 0:
        return float(t.mean()), 0.0
    if a < 0:
        return 0.0, float((n * t).sum() / (n * n).sum())
    return float(a), float(b)


def fit_columns(table: pd.DataFrame, tables: Sequence[pd.DataFrame], rows: Sequence[int]) -> None:
    """Write ``forward_a``/``forward_b``/``backward_a``/``backward_b`` into ``table``: per layer, the
    line ``t(n) = a + b·n`` through its seconds in ``tables``, one table profiled per size in ``rows``.

    Example::

        fit_columns(table, [at_16_rows, at_64_rows], [16, 64])
    """
    for phase in ("forward", "backward"):
        fits = [fit_line(rows, [float(t[phase].iloc[k]) for t in tables]) for k in range(len(table))]
        table[f"{phase}_a"] = [a for a, _ in fits]
        table[f"{phase}_b"] = [b for _, b in fits]


def popping(skips: dict[Any, Tensor]) -> SkipTracker:
    """A skip tracker holding fresh leaves of ``skips``: what a layer that pops them reads, as if
    the layers before it had just stashed them."""
    tracker = SkipTracker()
    tracker.tensors.update({key: detach(t) for key, t in skips.items()})  # type: ignore[misc]
    return tracker


