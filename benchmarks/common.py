"""Helpers the benchmarks share: interleaved timing and a machine description."""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable

import torch


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "no GPU"
    return f"{os.cpu_count()} CPU cores ({cpu}), {gpus}, torch {torch.__version__}, Python {platform.python_version()}"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved(contenders: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each contender, calls interleaved A B A B … in one run."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}
