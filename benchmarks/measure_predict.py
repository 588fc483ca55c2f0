"""Measure-and-predict benchmarks, each measured side by side in one run.

1. Recording overhead: a GPipe step with ``pipexplore.record()`` ÷ without (interleaved; goal ≤ 1.01).
2. Balance: ``optimal_splits`` for 1,000 layers × 16 partitions (goal ≤ 50 ms).
3. Re-simulation after a split change: 256 layers × 8 stages × 32 micro-batches (goal ≤ 50 ms),
   per schedule; and 1,000 layers × 64 stages × 256 micro-batches (goal ≤ 20 ms) with a device per
   stage — the schedule's graph timed level by level against the processor-sharing event loop on
   the same plan — and with every stage on one CPU host (where the stages share its cores, which
   only the event loop models).
4. Prediction error: a GPipe step of ordinary layers (MLP) predicted from ``profile`` vs measured.
5. The GPipe module's measured forward bubble on uniform sleep layers against (p−1)/(m+p−1)
   (goal: within 2 points), and its measured step against the simulated one.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import pandas as pd
import torch
from torch import nn

from common import machine

import pipexplore.timeline as tl
from pipexplore import GPipe
from pipexplore.balance import optimal_splits
from pipexplore.profiling.sequential import profile
from pipexplore.predict.simulator import simulate
from pipexplore.splits import balance_to_splits


def mlp(width: int, depth: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])


def recording_overhead(devices: list[str], repeats: int) -> None:
    model = mlp(512, 8)
    pipe = GPipe(model, [8 // len(devices)] * len(devices), devices=devices, chunks=8, checkpoint="except_last")
    x = torch.randn(512, 512, device=pipe.devices[0])

    times: dict[str, list[float]] = {"without": [], "with": [], "resolve": []}

    def step() -> float:
        start = time.perf_counter()
        pipe(x).sum().backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(repeats + 2):
        times["without"].append(step())
        recorder = tl.record()
        rec = recorder.__enter__()
        times["with"].append(step())
        start = time.perf_counter()
        recorder.__exit__(None, None, None)
        times["resolve"].append(time.perf_counter() - start)
        assert len(rec.timeline) > 0
    t = {name: statistics.median(values[2:]) for name, values in times.items()}
    print(f"1. recording overhead (MLP 8×512, {len(devices)} stages, 8 chunks): "
          f"step without {t['without'] * 1e3:.1f} ms, "
          f"with {t['with'] * 1e3:.1f} ms, ratio {t['with'] / t['without']:.3f}; "
          f"resolving the timeline after the step {t['resolve'] * 1e3:.1f} ms")


def balance_speed() -> None:
    costs = np.random.default_rng(0).random(1000)
    times = []
    for _ in range(20):
        start = time.perf_counter()
        optimal_splits(costs, 16)
        times.append(time.perf_counter() - start)
    print(f"2. balance 1,000 layers × 16 partitions: {statistics.median(times) * 1e3:.2f} ms (median of 20)")


def simulation_speed() -> None:
    rng = np.random.default_rng(0)
    table = pd.DataFrame({"forward": rng.random(256), "backward": 2 * rng.random(256), "output_bytes": 1e6})
    splits = [32 * k for k in range(1, 8)]
    moved = list(splits)
    moved[3] += 1
    for schedule in ("gpipe", "1f1b", "zero-bubble", "interleaved"):
        kw = dict(virtual_stages=2, devices=[f"cuda:{d}" for d in range(4)]) if schedule == "interleaved" else {}
        times = []
        for k in range(10):
            start = time.perf_counter()
            simulate(table, moved if k % 2 else splits, chunks=32, schedule=schedule, **kw)
            times.append(time.perf_counter() - start)
        print(f"3. simulate 256 layers × 8 stages × 32 micro-batches, {schedule:12}: "
              f"{statistics.median(times) * 1e3:.1f} ms (median of 10)")
    large_simulation_speed()


def large_simulation_speed() -> None:
    """1,000 layers × 64 stages × 256 micro-batches, a split moved between repeats: a device per
    stage (the graph's longest path) and every stage on one CPU host (processor sharing), each
    with the compiled loops (``pipexplore.predict._sharing``) and with the Python ones, alternating."""
    import importlib

    simulate_module = importlib.import_module("pipexplore.predict.simulator")
    dataflow_module = importlib.import_module("pipexplore.predict.dataflow")
    compiled = simulate_module._sharing
    n, stages = 1000, 64
    rng = np.random.default_rng(0)
    table = pd.DataFrame({"forward": rng.random(n) * 1e-3, "backward": rng.random(n) * 2e-3, "output_bytes": 1e6})
    splits = [15 * k + 10 for k in range(1, stages)]

    def once(schedule: str, devices: list[str], k: int, use_compiled: bool) -> float:
        simulate_module._sharing = dataflow_module._sharing = compiled if use_compiled else None
        try:
            moved = list(splits)
            moved[k % (stages - 1)] += 1
            start = time.perf_counter()
            simulate(table, moved, chunks=256, schedule=schedule, devices=devices)
            return time.perf_counter() - start
        finally:
            simulate_module._sharing = dataflow_module._sharing = compiled

    gpus = [f"cuda:{d}" for d in range(stages)]
    for schedule in ("gpipe", "1f1b", "zero-bubble"):
        row = []
        for name, devices, repeats in (("a device per stage", gpus, 9), ("one CPU host", ["cpu"] * stages, 5)):
            simulate(table, splits, chunks=256, schedule=schedule, devices=devices)  # the graph, built once per shape
            times: dict[bool, list[float]] = {True: [], False: []}
            for k in range(repeats):
                for use_compiled in (True, False):
                    times[use_compiled].append(once(schedule, devices, k, use_compiled))
            c, py = statistics.median(times[True]), statistics.median(times[False])
            row.append(f"{name} {c * 1e3:.1f} ms (Python loops {py * 1e3:.0f} ms, {py / c:.1f}×)")
        print(f"3. simulate 1,000 layers × 64 stages × 256 micro-batches, {schedule:12}: " + "; ".join(row))


def prediction_error(devices: list[str], repeats: int) -> None:
    model = mlp(1024, 8)
    sample = torch.randn(256, 1024)
    # Profiled on one micro-batch: on a CPU a quarter of the batch is not a quarter of the time.
    table = profile(copy.deepcopy(model), sample.chunk(4)[0], repeats=5)
    balance = [8 // len(devices)] * len(devices)
    for checkpoint in ("never", "except_last"):
        pipe = GPipe(copy.deepcopy(model), balance, devices=devices, chunks=4, checkpoint=checkpoint)
        x = sample.to(pipe.devices[0])
        pipe(x).sum().backward()
        steps = []
        for _ in range(repeats):
            with tl.record() as rec:
                pipe(x).sum().backward()
            steps.append(tl.step_time(rec.timeline))
        measured = statistics.median(steps)
        predicted = tl.step_time(simulate(table, balance_to_splits(balance), chunks=4, checkpoint=checkpoint,
                                          devices=[str(d) for d in pipe.devices], batch=len(sample)))
        print(f"4. MLP 8×1024, {len(devices)} stages, 4 chunks, checkpoint={checkpoint}: predicted "
              f"{predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms, "
              f"error {(predicted / measured - 1) * 100:+.1f} %")


def forward_bubble(repeats: int) -> None:
    from pipexplore.examples import SleepLayer

    for p, m, seconds in ((2, 4, 0.01), (2, 4, 0.02), (3, 4, 0.05)):
        model = nn.Sequential(*[SleepLayer(seconds, seconds / 2, seconds / 2) for _ in range(p)])
        pipe = GPipe(model, balance=[1] * p, devices=["cpu"] * p, chunks=m, checkpoint="never")
        x = torch.ones(m, 1)
        pipe(x).sum().backward()
        bubbles, steps = [], []
        for _ in range(repeats):
            with tl.record() as rec:
                pipe(x).sum().backward()
            bubbles.append(tl.bubble_fraction(rec.timeline, phases=["forward"]))
            steps.append(tl.step_time(rec.timeline))
        theory = (p - 1) / (m + p - 1)
        table = pd.DataFrame({"forward": [seconds * m] * p, "backward": [seconds * m] * p, "output_bytes": [0] * p})
        predicted = tl.step_time(simulate(table, list(range(1, p)), chunks=m, checkpoint="never",
                                          cpu_stages_overlap=True))
        measured = statistics.median(steps)
        print(f"5. GPipe forward bubble, p={p} m={m}, {seconds * 1e3:.0f} ms sleep layers: measured "
              f"{statistics.median(bubbles) * 100:.1f} % vs theory {theory * 100:.1f} % "
              f"({(statistics.median(bubbles) - theory) * 100:+.1f} points); step predicted {predicted * 1e3:.1f} ms, "
              f"measured {measured * 1e3:.1f} ms ({(predicted / measured - 1) * 100:+.1f} %)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", default="cpu,cpu")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    devices = args.devices.split(",")
    print(f"machine: {machine()}")
    recording_overhead(devices, args.repeats)
    balance_speed()
    simulation_speed()
    prediction_error(devices, 7)
    forward_bubble(7)


if __name__ == "__main__":
    main()
