"""Worker threads: one per partition, each running its partition's tasks in order."""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from queue import SimpleQueue
from types import TracebackType
from typing import Callable, Generator, Optional, Union, cast

import torch

from pipexplore.microbatch import Batch
from pipexplore.host import use_stage_threads
from pipexplore.timeline import thread_in_this_context
from pipexplore.stream import AbstractStream, use_device, use_stream

__all__ = ["Task", "spawn_workers", "join_all"]

ExcInfo = tuple[type[BaseException], BaseException, TracebackType]
# SimpleQueue: put and get in C, a hand-off between threads costs less than Queue's Python locking.
InQueue = SimpleQueue[Union["Task", Callable[[], None], None]]
OutQueue = SimpleQueue[tuple[bool, Union[tuple["Task", Batch], ExcInfo, None]]]


class Task:
    """One partition on one micro-batch: ``compute`` in the worker, then ``finalize`` (the
    recomputation's place in the graph), either back in the caller or, where the task has a
    ``then``, by the worker itself: ``then(task, ok, batch or exc_info)`` runs in the worker right
    after ``compute`` (it must not raise; the pipeline reports its own errors).

    The grad mode of the thread that made the task is used for both.
    """

    def __init__(self, stream: AbstractStream, *, compute: Callable[[], Batch],
                 finalize: Optional[Callable[[Batch], None]]) -> None:
        self.stream = stream
        self.key: tuple[int, int] = (0, 0)  # (micro-batch, partition), set by the pipeline
        self.then: Optional[Callable[["Task", bool, Union[Batch, ExcInfo]], None]] = None
        self._compute = compute
        self._finalize = finalize
        self._grad_enabled = torch.is_grad_enabled()

    def compute(self) -> Batch:
        with use_stream(self.stream), torch.set_grad_enabled(self._grad_enabled):
            return self._compute()

    def finalize(self, batch: Batch) -> None:
        if self._finalize is None:
            return
        with use_stream(self.stream), torch.set_grad_enabled(self._grad_enabled):
            self._finalize(batch)


def _worker(in_queue: InQueue, out_queue: OutQueue, device: torch.device) -> None:
    use_stage_threads()  # the host's cores shared among the partitions (pipexplore.host)
    with use_device(device):
        while True:
            task = in_queue.get()
            if task is None:
                break
            if not isinstance(task, Task):  # a pipeline's poke: start this partition's next task
                task()
                continue
            payload: Union[Batch, ExcInfo]
            try:
                ok, payload = True, task.compute()
            except BaseException:
                ok, payload = False, cast(ExcInfo, sys.exc_info())  # in an except block: never (None, None, None)
            if task.then is not None:
                task.then(task, ok, payload)
            elif ok:
                out_queue.put((True, (task, payload)))  # type: ignore[arg-type]
            else:
                out_queue.put((False, payload))  # type: ignore[arg-type]
            del task, payload


def join_all(threads: list[threading.Thread], on_interrupt: Optional[Callable[[], None]] = None) -> None:
    """Join every thread, even when interrupts (Ctrl-C) arrive meanwhile: the first calls
    ``on_interrupt`` (tell the workers to stop), the joins go on, and it is re-raised after them.

    Example::

        for t in threads: t.start()
        join_all(threads, stop.set)    # no thread is left running when this returns or raises
    """
    interrupt: Optional[BaseException] = None
    for thread in threads:
        while thread.is_alive():
            try:
                thread.join()
            except BaseException as exc:  # KeyboardInterrupt: stop the workers and wait for them
                if interrupt is None and on_interrupt is not None:
                    on_interrupt()
                interrupt = interrupt or exc
    if interrupt is not None:
        raise interrupt


@contextmanager
def spawn_workers(devices: list[torch.device],
                  name: str = "pipexplore") -> Generator[tuple[list[InQueue], OutQueue], None, None]:
    """Start one worker thread per entry of ``devices`` (one per partition); join them on exit.
    Yields each worker's task queue, and the one queue they all report into (results come as
    they are done; a task says which it was by its ``key``).

    Partitions that share a device get threads of their own, so they still overlap where the
    device allows (the CPU's cores, or host-side work while a GPU computes). The threads run in
    a copy of the caller's context: they record into the caller's ``record()`` block only.
    """
    in_queues: list[InQueue] = [SimpleQueue() for _ in devices]
    out_queue: OutQueue = SimpleQueue()
    threads = [thread_in_this_context(_worker, (iq, out_queue, d), name=f"{name}-partition{j}")
               for j, (iq, d) in enumerate(zip(in_queues, devices))]
    for t in threads:
        t.start()
    try:
        yield in_queues, out_queue
    finally:
        for q in in_queues:
            q.put(None)
        join_all(threads)
