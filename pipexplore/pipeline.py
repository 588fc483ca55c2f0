"""The GPipe schedule: micro-batch ``i`` on partition ``j`` runs in clock tick ``i + j``'s order,
each task as soon as the ticks before it have given it what it needs."""
from __future__ import annotations

import functools
import queue
import sys
import threading
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Generator, Iterable, Optional, Sequence, Union, cast

import torch
from torch import Tensor, nn

from pipexplore.timeline import recorder as _recording
from pipexplore.cancel import check_cancelled
from pipexplore.checkpoint import Checkpointing, is_recomputing
from pipexplore.rng_guard import RNGGuard
from pipexplore.copy import Copy, Wait
from pipexplore.dependency import depend
from pipexplore.microbatch import Batch
from pipexplore.skip.layout import SkipLayout
from pipexplore.skip.tracker import SkipTrackerThroughPortals, use_skip_tracker
from pipexplore.stream import AbstractStream, current_stream, use_device, use_stream
from pipexplore.worker import ExcInfo, InQueue, Task, spawn_workers

__all__ = ["Pipeline", "clock_cycles"]

#: Seconds between the caller's looks for an interrupt while it waits for the workers' results: a
#: Ctrl+C sent to the process may be taken by a worker thread, and Python raises it in the caller's
#: thread only when that thread runs Python code (a wait without a timeout would outlast the step).
INTERRUPT_POLL = 0.05


def clock_cycles(m: int, n: int) -> Iterable[list[tuple[int, int]]]:
    """The ``(micro-batch, partition)`` pairs of each clock tick, for ``m`` micro-batches and ``n`` partitions.

    ::

        k  (i,j) (i,j) (i,j)
        -  ----- ----- -----
        0  (0,0)
        1  (1,0) (0,1)
        2  (2,0) (1,1) (0,2)
        3        (2,1) (1,2)
        4              (2,2)
    """
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


def copy(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    batch[:] = Copy.apply(prev_stream, next_stream, *batch)
    batch[:] = tuple(x if x.is_floating_point() else x.detach() for x in batch)


def wait(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
         on_backward: Optional[Callable[[], None]] = None) -> None:
    batch[:] = Wait.apply(prev_stream, next_stream, on_backward, *batch)
    batch[:] = tuple(x if x.is_floating_point() else x.detach() for x in batch)


@contextmanager
def _stream_span(recorder: "_recording.Recorder", stage: int, device: torch.device, microbatch: int, phase: str,
                 stream: AbstractStream) -> Generator[None, None, None]:
    with use_stream(stream), recorder.span(stage, device, microbatch, phase):
        yield


def _open(recorder: "_recording.Recorder", stage: int, microbatch: int, device: torch.device) -> Callable[[], None]:
    return lambda: recorder.open_backward(stage, microbatch, device)


def _close(recorder: "_recording.Recorder", stage: int, microbatch: int, device: torch.device) -> Callable[[], None]:
    return lambda: recorder.close_backward(stage, microbatch, device)


class Pipeline:
    """Runs one mini-batch (as ``batches``) through ``partitions`` on ``devices``.

    It records into the ``record()`` block of the thread that makes it (none: nothing recorded),
    and stops between clock ticks when that thread's run is cancelled.

    ``rng_locks[j]`` (or ``None``) guards partition ``j``'s draws when another partition shares its
    device's generator: on a GPU its random operators take it while they draw, and its checkpointed
    forwards draw from streams of their own (see ``rng_guard.RNGGuard``).
    """

    def __init__(self, batches: list[Batch], partitions: Sequence[nn.Sequential], devices: Sequence[torch.device],
                 copy_streams: list[list[AbstractStream]], skip_layout: SkipLayout, checkpoint_stop: int,
                 rng_locks: Optional[Sequence[Optional[RNGGuard]]] = None) -> None:
        self.batches = batches
        self.partitions = partitions
        self.devices = devices
        self.copy_streams = copy_streams
        self.skip_layout = skip_layout
        self.checkpoint_stop = checkpoint_stop
        self.rng_locks = list(rng_locks) if rng_locks is not None else [None] * len(partitions)
        self.recorder = _recording.active_recorder()

    def run(self) -> None:
        """Run every (micro-batch, partition) task in the clock order's dependencies, but each as
        soon as they are met rather than a whole tick at a time: task ``(i, j)`` starts once
        ``(i, j-1)`` (its input) and ``(i-1, j)`` (its partition's previous micro-batch) are done
        and ``(i+1, j-1)`` has started (so that the autograd graph is the one the ticks build:
        micro-batch ``i``'s fork in partition ``j-1`` comes before its copy to partition ``j``).
        A partition waits for its own inputs, not for the slowest task of a tick.

        Each partition's worker starts its own tasks, under one lock: right after computing a
        task it takes the output back and, where its next micro-batch is ready, starts it and
        goes on with it (no hand-off through another thread); where what it did makes the next
        partition's task ready, it pokes that partition's worker, which starts that task itself
        while this one computes. This thread starts the first tasks and waits for the last, or
        for the first error (then nothing more starts, and the tasks in flight are waited for
        before it is raised)."""
        m, n = len(self.batches), len(self.partitions)
        self._skip_trackers = [SkipTrackerThroughPortals(self.skip_layout) for _ in range(m)]
        if self.recorder is not None and torch.is_grad_enabled() and not self.batches[0][0].requires_grad:
            self.recorder.watch_parameters(0, self.partitions[0])
        self._streams = [current_stream(d) for d in self.devices]
        self._started = [0] * n  # micro-batches each partition has started
        self._done = [0] * n  # micro-batches each partition has finished (in order)
        self._poked = [False] * n  # a poke waits in that partition's queue
        self._in_flight = 0
        self._remaining = m * n
        self._failed = self._ended = False
        self._grad_enabled = torch.is_grad_enabled()  # the workers build the graph in this mode too
        self._lock = threading.Lock()
        exc_info: Optional[ExcInfo] = None
        with spawn_workers(list(self.devices)) as (in_queues, results):
            self._in_queues, self._results = in_queues, results
            with self._lock:
                try:
                    for j in range(n):
                        self._start_next(j)
                except BaseException:
                    self._failed = True
                    exc_info = cast(ExcInfo, sys.exc_info())
                waiting = self._in_flight > 0
            try:
                while waiting:
                    try:  # (timed: an interrupt a worker thread took is raised here within INTERRUPT_POLL)
                        ok, payload = results.get(timeout=INTERRUPT_POLL)
                    except queue.Empty:
                        continue
                    if not ok:
                        exc_info = exc_info or cast(ExcInfo, payload)
                    elif payload is None:  # the last task is done, or the last in flight after an error
                        break
            except BaseException:  # interrupted: the workers start nothing more; they are joined on exit
                with self._lock:
                    self._failed = True
                raise
        if exc_info is not None:
            raise exc_info[1].with_traceback(exc_info[2])

    def _ready(self, j: int) -> bool:
        """Whether partition ``j``'s next task may start (under the lock)."""
        i, done, started = self._started[j], self._done, self._started
        return (i < len(self.batches) and done[j] == i and (j == 0 or done[j - 1] > i)
                and (j == 0 or i + 1 >= len(self.batches) or started[j - 1] > i + 1))

    def _start_next(self, j: int) -> None:
        """Start partition ``j``'s next task if it is ready (under the lock), and poke partition
        ``j + 1``'s worker if its task now is: what ``j`` did (finished a micro-batch, or forked
        one by starting the next) may be what it waited for."""
        if not self._failed and self._ready(j):
            check_cancelled()  # a cancelled run stops starting tasks; the workers are joined on exit
            i = self._started[j]
            self.fence(i, j, self._skip_trackers[i])
            self._start(i, j, self._streams, self._skip_trackers[i], self._in_queues[j])
            self._started[j] += 1
            self._in_flight += 1
        self._poke(j + 1)

    def _poke(self, j: int) -> None:
        """Wake partition ``j``'s worker to start its next task, if it is ready (under the lock)."""
        if j < len(self.partitions) and not self._poked[j] and self._ready(j):
            self._poked[j] = True
            self._in_queues[j].put(functools.partial(self._on_poke, j))

    def _on_poke(self, j: int) -> None:
        """In partition ``j``'s worker: start its next task (it then computes it)."""
        with self._lock:
            self._poked[j] = False
            self._guarded(lambda: self._start_next(j))
            self._end_if_over()

    def _then(self, task: Task, ok: bool, payload: Union[Batch, ExcInfo]) -> None:
        """In the worker that computed ``task``: take its output back and start what it makes ready."""
        with self._lock:
            self._in_flight -= 1
            if ok:
                i, j = task.key

                def finish() -> None:
                    self._finish(i, j, task, cast(Batch, payload), self._streams)
                    self._done[j] += 1
                    self._remaining -= 1
                    self._start_next(j)

                self._guarded(finish)
            else:
                self._fail(cast(ExcInfo, payload))
            self._end_if_over()

    def _end_if_over(self) -> None:
        """Tell the waiting thread the run is over: all done, or failed with nothing in flight (under the lock)."""
        if self._in_flight == 0 and (self._failed or self._remaining == 0) and not self._ended:
            self._ended = True
            self._results.put((True, None))

    def _guarded(self, work: Callable[[], None]) -> None:
        """Run ``work`` (under the lock, in a worker) unless the run has failed; its error fails the run."""
        if self._failed:
            return
        try:
            with torch.set_grad_enabled(self._grad_enabled):
                work()
        except BaseException:
            self._fail(cast(ExcInfo, sys.exc_info()))

    def _fail(self, exc_info: ExcInfo) -> None:
        """The run has failed (under the lock): nothing more starts, and the first error is the one raised."""
        if not self._failed:
            self._failed = True
            self._results.put((False, exc_info))  # type: ignore[arg-type]

    def fence(self, i: int, j: int, skip_tracker: SkipTrackerThroughPortals) -> None:
        """Before micro-batch ``i`` runs on partition ``j``: order backward across micro-batches and
        copy its input (and skips) to the partition."""
        batches, copy_streams = self.batches, self.copy_streams
        # Partition j runs backward on micro-batch i-1 only after micro-batch i (mirrored order).
        if i != 0:
            depend(batches[i - 1], batches[i])
        next_stream = copy_streams[j][i]
        for stash_partition, ns, name in self.skip_layout.copy_policy(j):
            with self._copy_span(stash_partition, j, i, next_stream):
                skip_tracker.copy(batches[i], copy_streams[stash_partition][i], next_stream, ns, name)
        if j != 0 and (self.devices[j - 1] != self.devices[j] or self.devices[j].type != "cpu"):
            # (Between two CPU partitions there is nothing to copy or order: no autograd node.)
            with self._copy_span(j - 1, j, i, next_stream):
                copy(batches[i], copy_streams[j - 1][i], next_stream)

    def _copy_span(self, prev_j: int, j: int, i: int, next_stream: AbstractStream) -> ContextManager[None]:
        """Record a copy (on the receiving device's copy stream) when devices differ."""
        if self.recorder is None or self.devices[prev_j] == self.devices[j]:
            return nullcontext()
        return _stream_span(self.recorder, j, self.devices[j], i, "copy", next_stream)

    def _start(self, i: int, j: int, streams: list[AbstractStream], skip_tracker: SkipTrackerThroughPortals,
               in_queue: InQueue) -> None:
        """Hand micro-batch ``i`` of partition ``j`` to its worker."""
        batch, recorder = self.batches[i], self.recorder
        if j != 0:
            # Its backward is where the gradient leaves stage j: the end of j's backward.
            closes = None if recorder is None else _close(recorder, j, i, self.devices[j])
            wait(batch, self.copy_streams[j][i], streams[j], closes)
        elif recorder is not None:
            batch[0] = _recording.mark_backward_end(recorder, batch[0], j, i)
        task = self._task(batch, i, j, streams[j], skip_tracker)
        task.key = (i, j)
        task.then = self._then
        in_queue.put(task)

    def _finish(self, i: int, j: int, task: Task, batch: Batch, streams: list[AbstractStream]) -> None:
        """Take micro-batch ``i``'s output of partition ``j`` back, and schedule its recomputation."""
        recorder = self.recorder
        if j != len(self.partitions) - 1:
            # Its backward runs once the gradient reached stage j and any recomputation is
            # done (the recompute node joined below runs first): j's backward starts there.
            opens = None if recorder is None else _open(recorder, j, i, self.devices[j])
            wait(batch, streams[j], self.copy_streams[j][i], opens)
        elif recorder is not None:
            batch[0] = _recording.mark_backward_start(recorder, batch[0], j, i)
        # Joined last, the recomputation runs first in backward, overlapping the gradient's copy.
        with use_device(self.devices[j]):
            task.finalize(batch)
        self.batches[i] = batch

    def _task(self, batch: Batch, i: int, j: int, stream: AbstractStream,
              skip_tracker: SkipTrackerThroughPortals) -> Task:
        partition = self.partitions[j]
        recorder, device = self.recorder, self.devices[j]

        def function(input: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
            with use_skip_tracker(skip_tracker):
                if recorder is None:
                    return partition(input)
                recomputing = is_recomputing()  # inside backward(): one thread per device
                with recorder.span(j, device, i, "recompute" if recomputing else "forward", serial=recomputing):
                    return partition(input)

        if i < self.checkpoint_stop:
            chk = Checkpointing(function, batch, self.rng_locks[j])
            return Task(stream, compute=chk.checkpoint, finalize=chk.recompute)
        guard = self.rng_locks[j]
        if guard is None:
            return Task(stream, compute=lambda: batch.call(function), finalize=None)

        def guarded() -> Batch:  # a drawing forward must not move the generator under another's checkpoint
            with guard.drawing():
                return batch.call(function)

        return Task(stream, compute=guarded, finalize=None)
