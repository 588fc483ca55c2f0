"""TaskPool: callers submit tasks; batches of their rows are processed together and split back."""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from pipexplore.backend.schema import BatchTensorProto

__all__ = ["Task", "TaskPool"]


@dataclass
class Task:
    """One caller's tensors (all with the same number of rows) and its future."""

    tensors: tuple[torch.Tensor, ...]
    future: Future
    size: int
    submitted: float = field(default_factory=time.perf_counter)


class TaskPool:
    """Merge pending tasks into batches of at most ``max_batch_size`` rows for ``process_func``.

    ``process_func(*batched_tensors)`` returns a tuple of tensors whose dim 0 has the batch's
    rows; row ``k`` of each output goes back to the task that sent row ``k``.

    A task that is larger than ``max_batch_size``, or that does not match ``schema``, fails its
    own future at once and never joins a batch. A batch whose processing raises is split in
    halves and each half retried (bisection), so a task that passes the schema but makes the
    layer fail fails only its own future; the others get their results. A pool is *ready* when
    it holds ``min_batch_size`` rows, or when its oldest task has waited ``timeout`` seconds (at
    once when ``timeout`` is None).

    Example::

        pool = TaskPool(lambda x: (x * 2,), max_batch_size=64)
        future = pool.submit_task(torch.ones(3, 8))
        # a Runtime serves the pool: future.result() == (tensor of 2s,)
    """

    def __init__(self, process_func: Callable[..., Sequence[torch.Tensor]], max_batch_size: int, *,
                 min_batch_size: int = 1, timeout: Optional[float] = None, name: str = "pool",
                 schema: Optional[Sequence[BatchTensorProto]] = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if not 1 <= min_batch_size <= max_batch_size:
            raise ValueError(f"min_batch_size must be between 1 and max_batch_size ({max_batch_size}), "
                             f"got {min_batch_size}")
        self.process_func = process_func
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.timeout = timeout
        self.name = name
        self.schema = list(schema) if schema is not None else None
        self._tasks: deque[Task] = deque()
        self._rows = 0
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self._closed: Optional[str] = None

    # -- callers --------------------------------------------------------------------------
    def submit_task(self, *tensors: torch.Tensor) -> Future:
        """Queue one task; its future's result is the tuple of its rows of each output."""
        future: Future = Future()
        try:
            size = self._check(tensors)
        except ValueError as exc:
            future.set_exception(exc)
            return future
        with self._lock:
            if self._closed is not None:
                future.set_exception(RuntimeError(f"{self.name}: {self._closed}"))
                return future
            self._tasks.append(Task(tuple(t.detach() for t in tensors), future, size))
            self._rows += size
            listeners = list(self._listeners)
        for notify in listeners:
            notify()
        return future

    def _check(self, tensors: Sequence[torch.Tensor]) -> int:
        if not tensors:
            raise ValueError(f"{self.name}: a task needs at least one tensor")
        if self.schema is not None:
            if len(tensors) != len(self.schema):
                raise ValueError(f"{self.name}: expected {len(self.schema)} tensors, got {len(tensors)}")
            for k, (tensor, proto) in enumerate(zip(tensors, self.schema)):
                proto.check(tensor, f"{self.name}: input {k}")
        sizes = {int(t.size(0)) if torch.is_tensor(t) and t.dim() else -1 for t in tensors}
        if len(sizes) != 1 or -1 in sizes:
            raise ValueError(f"{self.name}: all tensors of a task need the same batch size (dim 0), "
                             f"got {sorted(sizes)}")
        size = sizes.pop()
        if size > self.max_batch_size:
            raise ValueError(f"{self.name}: a task of {size} rows is larger than max_batch_size "
                             f"({self.max_batch_size}); split it into smaller tasks")
        if size == 0:
            raise ValueError(f"{self.name}: a task needs at least one row")
        return size

    # -- the runtime ----------------------------------------------------------------------
    def add_listener(self, notify: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(notify)

    def remove_listener(self, notify: Callable[[], None]) -> None:
        with self._lock:
            if notify in self._listeners:
                self._listeners.remove(notify)

    def open(self) -> None:
        """Take tasks again after a :meth:`shutdown` (a new runtime serves the pool)."""
        with self._lock:
            self._closed = None

    def oldest_submitted(self) -> Optional[float]:
        """When the oldest pending task came in (``perf_counter`` seconds), or None."""
        with self._lock:
            return self._tasks[0].submitted if self._tasks else None

    def ready_at(self) -> Optional[float]:
        """The time from which the pool is ready to give a batch (None when it holds nothing)."""
        with self._lock:
            if not self._tasks:
                return None
            oldest = self._tasks[0].submitted
            if self._rows >= self.min_batch_size or self.timeout is None:
                return oldest
            return oldest + self.timeout

    def take_batch(self) -> list[Task]:
        """Pop the oldest tasks that fit in ``max_batch_size`` rows."""
        with self._lock:
            batch: list[Task] = []
            rows = 0
            while self._tasks and rows + self._tasks[0].size <= self.max_batch_size:
                task = self._tasks.popleft()
                rows += task.size
                batch.append(task)
            self._rows -= rows
            return batch

    def process_batch(self, batch: list[Task]) -> None:
        """Run ``process_func`` on the concatenated tasks and hand each task its rows; a failing
        batch of several tasks is retried in halves until the failing tasks are alone."""
        live = [task for task in batch if task.future.set_running_or_notify_cancel()]
        if live:
            self._process(live)

    def _process(self, live: list[Task]) -> None:
        try:
            columns = [torch.cat(column) for column in zip(*(task.tensors for task in live))]
            outputs = tuple(self.process_func(*columns))
            rows = sum(task.size for task in live)
            for k, output in enumerate(outputs):
                if not torch.is_tensor(output) or output.dim() == 0 or output.size(0) != rows:
                    raise RuntimeError(f"{self.name}: output {k} does not have the batch's {rows} rows")
            parts = [output.split([task.size for task in live]) for output in outputs]
        except Exception as exc:
            if len(live) > 1:  # which task made it fail? retry the halves apart
                half = len(live) // 2
                self._process(live[:half])
                self._process(live[half:])
                return
            live[0].future.set_exception(exc)
            return
        except BaseException as exc:  # an interrupt: no retry, every task of the batch fails with it
            for task in live:
                task.future.set_exception(exc)
            raise
        for k, task in enumerate(live):
            task.future.set_result(tuple(part[k] for part in parts))

    def shutdown(self, reason: str) -> None:
        """Refuse new tasks and fail every pending one with ``reason``."""
        with self._lock:
            self._closed = reason
            tasks, self._tasks, self._rows = list(self._tasks), deque(), 0
        for task in tasks:
            if task.future.set_running_or_notify_cancel():
                task.future.set_exception(RuntimeError(f"{self.name}: {reason}"))
