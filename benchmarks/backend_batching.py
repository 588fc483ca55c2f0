"""Expert backends: what batching buys. Many callers send small tasks to one backend; the pool
either processes one task at a time (``max_batch_size`` = a task's rows) or merges pending tasks
into batches of up to 256 rows. Forward and backward (with an SGD step), interleaved rounds.
Prints tasks per second and the ratio batched / one-at-a-time.
"""
from __future__ import annotations

import statistics
import threading
import time

import torch
from torch import nn

from common import machine

from pipexplore.backend import BatchTensorProto, ExpertBackend, Runtime

CALLERS, TASK_ROWS, TASKS_PER_CALLER, WIDTH = 32, 4, 8, 1024


def backend(max_batch_size: int) -> ExpertBackend:
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
    return ExpertBackend("mlp", expert, torch.optim.SGD(expert.parameters(), lr=1e-3),
                         args_schema=(BatchTensorProto(WIDTH),), max_batch_size=max_batch_size)


def round_trip(b: ExpertBackend) -> tuple[float, int]:
    """Seconds for every caller to run its forward and backward tasks; batches formed."""
    def caller() -> None:
        for _ in range(TASKS_PER_CALLER):
            x = torch.randn(TASK_ROWS, WIDTH)
            (y,) = b.forward_pool.submit_task(x).result()
            b.backward_pool.submit_task(x, torch.ones_like(y)).result()

    runtime = Runtime({"mlp": b})
    with runtime:
        threads = [threading.Thread(target=caller) for _ in range(CALLERS)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
    return seconds, len(runtime.timeline)


def main() -> None:
    print(f"machine: {machine()}")
    print(f"{CALLERS} callers × {TASKS_PER_CALLER} tasks of {TASK_ROWS} rows, MLP {WIDTH}-{WIDTH}-{WIDTH}, "
          "forward + backward each")
    single, batched = backend(TASK_ROWS), backend(256)
    times: dict[str, list[float]] = {"one at a time": [], "batched": []}
    batches: dict[str, int] = {}
    for _ in range(5):
        for name, b in (("one at a time", single), ("batched", batched)):
            seconds, formed = round_trip(b)
            times[name].append(seconds)
            batches[name] = formed
    tasks = CALLERS * TASKS_PER_CALLER * 2
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:14} {tasks / median:8.0f} tasks/s  ({median * 1e3:.0f} ms a round, {batches[name]} batches "
              f"for {tasks} tasks)")
    print(f"ratio batched / one at a time: "
          f"{statistics.median(times['one at a time']) / statistics.median(times['batched']):.2f}")


if __name__ == "__main__":
    main()
