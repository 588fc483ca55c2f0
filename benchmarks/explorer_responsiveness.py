"""Explorer responsiveness: from a ``splits`` change to the new predicted figure, in Python.

256 layers, 8 stages, 32 micro-batches (goal ≤ 50 ms). The layer table is synthetic (no
profiling), so what is timed is validation, re-simulation, the strip's stage totals, the stage
table and the figure update. Prints the median and the slowest of 20 changes, per schedule.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import pandas as pd
import torch
from torch import nn

from common import machine

from pipexplore.widgets import Explorer


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


if __name__ == "__main__":
    main()
