"""Runtime: one thread per device serves the pools of its backends, oldest task first."""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any, Optional, Union

import pandas as pd
import torch

from pipexplore.backend.expert import ExpertBackend
from pipexplore.backend.task_pool import TaskPool
from pipexplore.timeline import COLUMNS

__all__ = ["Runtime", "BATCH_COLUMNS"]

#: The common timeline columns, then the pool, the batch's rows and how long its oldest task waited.
BATCH_COLUMNS = COLUMNS + ["pool", "batch_size", "tasks", "wait"]


class Runtime:
    """Serve ``backends`` (name → :class:`ExpertBackend`) until :meth:`shutdown`.

    Each device (``device``, or each backend's own) gets one thread; it repeatedly takes a batch
    from the ready pool whose oldest task has waited longest and processes it. Every batch is
    recorded in :attr:`timeline` (phase ``forward``/``backward``, ``microbatch`` = batch number)
    with its pool, size and queue wait. Usable as a context manager.
    """

    def __init__(self, backends: dict[str, ExpertBackend], *, device: Optional[Union[str, torch.device]] = None,
                 stages: Optional[dict[str, int]] = None) -> None:
        self.backends = dict(backends)
        self.stages = stages or {name: k for k, name in enumerate(self.backends)}
        groups: dict[torch.device, list[tuple[str, str, TaskPool]]] = defaultdict(list)
        for name, backend in self.backends.items():
            where = torch.device(device) if device is not None else backend.device
            groups[where].append((name, "forward", backend.forward_pool))
            groups[where].append((name, "backward", backend.backward_pool))
        self._groups = dict(groups)
        self._wakeups = {d: threading.Condition() for d in self._groups}
        self._listeners = {d: self._notifier(d) for d in self._groups}
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._records: list[tuple] = []
        self._origin = time.perf_counter()
        self.errors: list[BaseException] = []

    def _notifier(self, device: torch.device) -> Any:
        condition = self._wakeups[device]

        def notify() -> None:
            with condition:
                condition.notify_all()
        return notify

    def start(self) -> "Runtime":
        if self._threads:
            raise RuntimeError("the runtime is already started")
        self._origin = time.perf_counter()
        self._stop.clear()
        for device, pools in self._groups.items():
            for _, _, pool in pools:
                pool.open()
                pool.add_listener(self._listeners[device])
        for device in self._groups:
            thread = threading.Thread(target=self._serve, args=(device,), name=f"pipexplore-runtime-{device}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the threads (after the batch in hand), join them, fail every pending task."""
        self._stop.set()
        for condition in self._wakeups.values():
            with condition:
                condition.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        self._threads.clear()
        for device, pools in self._groups.items():
            for _, _, pool in pools:
                pool.remove_listener(self._listeners[device])
                pool.shutdown("the runtime was shut down before this task ran")

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _serve(self, device: torch.device) -> None:
        pools = self._groups[device]
        condition = self._wakeups[device]
        batches = 0
        while not self._stop.is_set():
            now = time.perf_counter()
            ready = [(pool.ready_at(), name, kind, pool) for name, kind, pool in pools]
            waiting = [(at, name, kind, pool) for at, name, kind, pool in ready if at is not None]
            due = [entry for entry in waiting if entry[0] <= now]
            if not due:
                with condition:
                    if self._stop.is_set():
                        break
                    wake = min((entry[0] for entry in waiting), default=None)
                    condition.wait(timeout=None if wake is None else max(0.0, wake - now))
                continue
            # The ready pool whose oldest task has waited longest.
            _, name, kind, pool = min(due, key=lambda e: e[3].oldest_submitted() or float("inf"))
            batch = pool.take_batch()
            if not batch:
                continue
            start = time.perf_counter()
            pool.process_batch(batch)
            end = time.perf_counter()
            rows = sum(task.size for task in batch)
            self._records.append((0, self.stages.get(name, 0), str(device), batches, kind,
                                  start - self._origin, end - self._origin, "measured", pool.name, rows, len(batch),
                                  start - batch[0].submitted))
            batches += 1

    def clock(self) -> float:
        """Seconds since this runtime's origin, on the clock its :attr:`timeline` is measured with."""
        return time.perf_counter() - self._origin

    @property
    def timeline(self) -> pd.DataFrame:
        """One row per batch processed, in the common schema plus ``pool, batch_size, tasks, wait``."""
        return pd.DataFrame(list(self._records), columns=BATCH_COLUMNS)
