"""The same model and split through every executor, in one run: the autograd-driven GPipe module,
the in-process schedule executor per schedule, and one process per stage with
torch.distributed.pipelining. Prints the median step time (measured inside the step, process
start excluded), its bubble, and the ratio to GPipe (> 1: faster than GPipe).

Two models: layers that sleep known times (work that leaves the CPU free, as GPU kernels do: it
shows the schedules themselves) and an ordinary MLP (compute-bound on a 2-core CPU).
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from common import machine
from pipexplore.examples import SleepLayer as SleepFIW

import pipexplore
from pipexplore import timeline as tl
from pipexplore.plan import Plan
from pipexplore.executors.step import run_step


def mlp() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)])


def sleepy() -> nn.Sequential:
    return nn.Sequential(*[SleepFIW(0.005, 0.005, 0.005) for _ in range(4)])


def main() -> None:
    print(f"machine: {machine()}")
    for label, model, sample in (("sleep 4 layers × 5 ms (F, I, W)", sleepy(), torch.ones(8, 1)),
                                 ("MLP 8 × 512", mlp(), torch.randn(256, 512))):
        table = pipexplore.profile(copy.deepcopy(model), sample, repeats=2)
        splits = (len(model) // 2,)
        cases = [("GPipe module (autograd)", "gpipe", "autograd")]
        cases += [(f"threads · {s}", s, "threads") for s in ("gpipe", "1f1b", "zero-bubble")]
        cases += [(f"processes · {s}", s, "processes") for s in ("gpipe", "1f1b")]
        print(f"\n{label}: 2 stages on cpu,cpu, 4 chunks, checkpoint never")
        print(f"{'executor · schedule':28} {'step':>9} {'bubble':>7} {'vs GPipe':>9} {'wall':>8}")
        base = None
        for name, schedule, executor in cases:
            plan = Plan(table, splits, ("cpu", "cpu"), chunks=4, checkpoint="never", schedule=schedule,
                        executor=executor)
            steps, bubbles, walls = [], [], []
            for _ in range(1 if executor == "processes" else 5):
                start = time.perf_counter()
                result = run_step(model, sample, plan, warmup=1)
                walls.append(time.perf_counter() - start)
                steps.append(tl.step_time(result.timeline))
                bubbles.append(tl.bubble_fraction(result.timeline))
            step = statistics.median(steps)
            base = base or step
            print(f"{name:28} {step * 1e3:7.1f}ms {statistics.median(bubbles) * 100:6.1f}% {base / step:9.2f} "
                  f"{statistics.median(walls):7.1f}s")


if __name__ == "__main__":
    main()
