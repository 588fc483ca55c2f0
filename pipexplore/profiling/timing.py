"""Timing a layer's calls: timers that wait for the device (and can flush its caches first), the
spread of repeated times, lines fitted to the costs at several micro-batch sizes, and the small
tensor helpers the profiler uses."""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from pipexplore.samples import TensorOrTensors
from pipexplore.skip.tracker import SkipTracker

__all__ = ["Timer", "CacheFlush", "flush_bytes", "CPU_CACHES", "detach", "synchronize", "nbytes", "first_rows", "spent",
           "spread", "fit_line", "fit_columns", "popping"]


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


#: Where Linux describes the first CPU's caches (``index*/size``, ``index*/shared_cpu_list``).
CPU_CACHES = "/sys/devices/system/cpu/cpu0/cache"


def flush_bytes(device: torch.device) -> int:
    """Bytes a buffer written between timed calls needs to push a kernel's operands out of the
    caches it could otherwise find them in: on CUDA twice the L2 (256 MiB where its size cannot be
    read: what triton's ``do_bench`` writes), on a CPU eight times the largest cache private to a
    core (its L2, from ``/sys``; 32 MiB where that cannot be read). A CPU's shared last-level cache
    (tens to hundreds of MiB on a server) keeps what fits, as it does for a layer within a model."""
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return 2 * int(size) if size else 256 * 2**20
    private = 0
    try:
        for index in (name for name in os.listdir(CPU_CACHES) if name.startswith("index")):
            with open(os.path.join(CPU_CACHES, index, "shared_cpu_list")) as f:
                shared = f.read().strip()
            with open(os.path.join(CPU_CACHES, index, "size")) as f:
                text = f.read().strip().upper()
            if "," in shared or "-" in shared:
                continue  # shared with other cores: the last level, it keeps what fits
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            private = max(private, int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        private = 0
    return 8 * private if private else 32 * 2**20


class CacheFlush:
    """Called before a timed call, writes a buffer of :func:`flush_bytes` on ``device`` so that the
    call finds its weights and inputs in memory, not in a cache the previous call warmed: a layer
    timed again and again alone otherwise runs from cache, faster than it runs between the layers of
    a model whose neighbours stream more than the cache (15 % to 4× on a CPU core, the small layers
    most), and the roofline, whose memory term is memory bandwidth, learns a bandwidth the model
    never reaches. The write is not timed."""

    def __init__(self, device: torch.device, nbytes: Optional[int] = None) -> None:
        self.buffer = torch.empty(nbytes if nbytes is not None else flush_bytes(device), dtype=torch.uint8,
                                  device=device)

    def __call__(self) -> None:
        self.buffer.fill_(1)
        synchronize(self.buffer.device)


class Timer:
    """Wall and process-CPU seconds of repeated calls: the CPU time over the wall time is the
    number of cores the work keeps busy (≈0 for a sleep, ≈ the intra-op threads for a GEMM).
    ``flush``: called before each timed call, outside the timing (a :class:`CacheFlush`)."""

    def __init__(self, device: torch.device, flush: Optional[Callable[[], None]] = None) -> None:
        self.device = device
        self.flush = flush
        self.wall: list[float] = []
        self.cpu = 0.0

    def __call__(self, work: Callable[[], Any]) -> Any:
        if self.flush is not None:
            self.flush()
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


def popping(skips: Mapping[Any, Optional[Tensor]]) -> SkipTracker:
    """A skip tracker holding fresh leaves of ``skips``: what a layer that pops them reads, as if
    the layers before it had just stashed them (a stashed None stays None)."""
    tracker = SkipTracker()
    tracker.tensors.update({key: None if t is None else detach(t) for key, t in skips.items()})  # type: ignore[misc]
    return tracker


