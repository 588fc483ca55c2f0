"""Explorer responsiveness, in Python: a ``splits`` change to the new predicted figure, and profiling.

1. 256 layers, 8 stages, 32 micro-batches (goal ≤ 50 ms). The layer table is synthetic (no
   profiling), so what is timed is validation, re-simulation, the strip's stage totals, the stage
   table and the timeline's scene. Prints the median and the slowest of 20 changes, per schedule.
2. Profiling a 256-layer model (256 × Linear 64 + GELU, batch 64, 8 CPU stages, 8 chunks) as the
   explorer does (goal ≤ 2 s), side by side: the repeated blocks timed together and their ratios
   measured once (the default) and every layer on its own (``same_work_once=False``),
   alternating, 3 rounds.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import pandas as pd
import torch
from torch import nn

from common import machine

from pipexplore.host import stage_threads
from pipexplore.profiling.sequential import profile
from pipexplore.widgets import Explorer


def profile_256() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(256)])
    sample = torch.randn(64, 64)
    threads = stage_threads(["cpu"] * 8)
    profile(model, sample, microbatch_rows=[8, 64], threads=threads)  # first-use costs, not timed
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(3):
        for once in (True, False):
            start = time.perf_counter()
            profile(model, sample, microbatch_rows=[8, 64], threads=threads, same_work_once=once)
            seconds[once].append(time.perf_counter() - start)
    once, each = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(f"profile 256 layers (Linear 64 + GELU, rows 8 and 64): {once:.2f} s with repeated blocks timed "
          f"together, {each:.2f} s with every layer on its own (ratio {each / once:.2f})")


def main() -> None:
    n, stages = 256, 8
    rng = np.random.default_rng(0)
    table = pd.DataFrame({
        "name": [str(k) for k in range(n)], "type": "Linear", "param_bytes": 4096.0, "output_bytes": 1e6,
        "forward": rng.random(n) * 1e-3, "backward": rng.random(n) * 2e-3, "stash": "", "pop": "",
    })
    model = nn.Sequential(*[nn.Identity() for _ in range(n)])
    splits = [32 * k for k in range(1, stages)]
    print(f"machine: {machine()}")
    for schedule in ("gpipe", "1f1b", "zero-bubble"):
        explorer = Explorer(model, torch.zeros(32, 1), layer_table=table, devices=["cpu"] * stages, chunks=32,
                            splits=splits, schedule=schedule)
        times = []
        for k in range(20):
            moved = list(splits)
            moved[k % (stages - 1)] += 1 + k % 3
            start = time.perf_counter()
            explorer.splits = moved
            times.append(time.perf_counter() - start)
        print(f"{schedule:12} split change → predicted figure: median {statistics.median(times) * 1e3:.1f} ms, "
              f"max {max(times) * 1e3:.1f} ms (256 layers, 8 stages, 32 micro-batches)")
    profile_256()


if __name__ == "__main__":
    main()
