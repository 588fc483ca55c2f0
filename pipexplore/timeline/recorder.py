"""Recording a step: marks taken where the work runs, resolved into a timeline once, afterwards.

A ``record()`` block binds its recorder to the thread that opens it (a context variable): the
pipelines that thread runs record into it, with the worker threads they start (they inherit the
binding), and nothing that runs in other threads does (another explorer's run, a user's own
``GPipe``).
"""
from __future__ import annotations

import contextvars
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional, Union

import numpy as np
import pandas as pd
import torch

from pipexplore.timeline.schema import COLUMNS, COMPUTE_PHASES, empty_timeline

__all__ = [
    "Recorder", "record", "active_recorder", "thread_in_this_context", "ActionCounter", "counting_actions",
    "mark_backward_start", "mark_backward_end",
]

Mark = Union[int, "torch.cuda.Event"]

_active: contextvars.ContextVar[Optional["Recorder"]] = contextvars.ContextVar("pipexplore_recorder", default=None)


def active_recorder() -> Optional["Recorder"]:
    """The recorder of the enclosing ``record()`` block of this thread (or of the thread that
    started this worker), or ``None``: then nothing is recorded."""
    return _active.get()


def thread_in_this_context(target: Callable[..., Any], args: tuple[Any, ...] = (), *, name: str,
                           daemon: bool = True) -> threading.Thread:
    """A thread that runs ``target`` in a copy of the caller's context: a worker of a pipeline
    records into the recorder of the ``record()`` block that runs the pipeline, and into no other.

    Example::

        worker = thread_in_this_context(work, (queue,), name="pipexplore-worker0")
        worker.start()
    """
    context = contextvars.copy_context()
    return threading.Thread(target=context.run, args=(target, *args), name=name, daemon=daemon)


class ActionCounter:
    """Compute actions done per stage by every step recorded inside :func:`counting_actions`
    (forward, backward, recompute, I, W, the optimizer step; copies are not counted), readable from any thread while
    the steps run: what a progress display shows."""

    def __init__(self) -> None:
        self._done: dict[int, int] = {}
        self._lock = threading.Lock()

    def count(self, stage: int) -> None:
        with self._lock:
            self._done[stage] = self._done.get(stage, 0) + 1

    def done(self) -> dict[int, int]:
        """Actions done so far, per stage."""
        with self._lock:
            return dict(self._done)


_counter: contextvars.ContextVar[Optional[ActionCounter]] = contextvars.ContextVar("pipexplore_counter",
                                                                                  default=None)


@contextmanager
def counting_actions() -> Generator[ActionCounter, None, None]:
    """Count the actions of every step recorded in this block (in this thread and the workers
    its pipelines start), per stage.

    Example::

        with counting_actions() as counter:
            threading.Timer(0.5, lambda: print(counter.done())).start()
            run_step(model, sample, plan)       # {0: 14, 1: 12} half a second in
    """
    counter = ActionCounter()
    token = _counter.set(counter)
    try:
        yield counter
    finally:
        _counter.reset(token)


class Recorder:
    """Collects marks during a step; resolves them into :attr:`timeline` once, afterwards.

    On CUDA a mark is a ``torch.cuda.Event(enable_timing=True)`` recorded on the current stream
    (the stream doing the work); on the CPU it is ``time.perf_counter_ns()``. Nothing is
    synchronised during the step: events are read after it, against one origin per device.
    """

    def __init__(self, run: Any = 0) -> None:
        self.run = run
        self._spans: list[tuple[int, torch.device, int, str, Mark, Mark, bool, Optional[float]]] = []
        self._open: dict[tuple[int, int], tuple[torch.device, Mark]] = {}
        self._latest_open: dict[int, int] = {}
        self._touched: dict[tuple[int, int], Mark] = {}
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        self._origin_ns = 0
        self._cuda_origins: dict[int, tuple["torch.cuda.Event", int]] = {}
        self.timeline: pd.DataFrame = empty_timeline()
        self.peak_memory: dict[str, float] = {}
        self._counter = _counter.get()

    # -- during the step ------------------------------------------------------------------
    def mark(self, device: torch.device) -> Mark:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter_ns()

    def add(self, stage: int, device: torch.device, microbatch: int, phase: str, start: Mark, end: Mark,
            serial: bool = False, memory: Optional[float] = None) -> None:
        """Add a span. ``serial``: it ran inside one ``backward()`` call, which runs a device's
        backward work on one thread, so other serial spans nested in it were not its own work.
        ``memory``: the activation bytes the stage holds once the span is done, where known."""
        self._spans.append((stage, device, microbatch, phase, start, end, serial, memory))
        if self._counter is not None and phase in COMPUTE_PHASES:
            self._counter.count(stage)

    @contextmanager
    def span(self, stage: int, device: torch.device, microbatch: int, phase: str,
             serial: bool = False) -> Generator[None, None, None]:
        start = self.mark(device)
        yield
        self.add(stage, device, microbatch, phase, start, self.mark(device), serial)

    def open_backward(self, stage: int, microbatch: int, device: torch.device) -> None:
        with self._lock:
            self._open[(stage, microbatch)] = (device, self.mark(device))
            self._latest_open[stage] = microbatch

    def touch_backward(self, stage: int, device: torch.device) -> None:
        """Note backward work of ``stage`` now: the open span of its latest micro-batch ends no earlier."""
        with self._lock:
            microbatch = self._latest_open.get(stage)
            if microbatch is not None and (stage, microbatch) in self._open:
                self._touched[(stage, microbatch)] = self.mark(device)

    def watch_parameters(self, stage: int, module: torch.nn.Module) -> None:
        """End ``stage``'s backward spans at its parameters' last gradient accumulation.

        For a stage whose input needs no gradient (the first), nothing marks the end of its
        backward; its weights' gradients are the last thing it computes. Hooks go at the end
        of the ``record()`` block.
        """
        # Backward reaches the earliest layer last: watching its parameters is enough, and a
        # mark per parameter (an event each on CUDA) would cost the step more than it tells.
        for layer in module.modules():
            params = [p for p in layer.parameters(recurse=False) if p.requires_grad]
            if not params:
                continue
            for param in params:
                device = param.device
                self._handles.append(param.register_post_accumulate_grad_hook(
                    lambda _p, device=device: self.touch_backward(stage, device)))
            break

    def close_backward(self, stage: int, microbatch: int, device: torch.device) -> None:
        end = self.mark(device)
        with self._lock:
            opened = self._open.pop((stage, microbatch), None)
        if opened is not None:
            self.add(stage, device, microbatch, "backward", opened[1], end, serial=True)

    # -- around the step ------------------------------------------------------------------
    def start(self) -> None:
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)
                torch.cuda.reset_peak_memory_stats(index)
        self._origin_ns = time.perf_counter_ns()
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                event = torch.cuda.Event(enable_timing=True)
                event.record(torch.cuda.current_stream(index))
                self._cuda_origins[index] = (event, time.perf_counter_ns())

    def finish(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for key, end in self._touched.items():
            opened = self._open.pop(key, None)
            if opened is not None:
                self.add(key[0], opened[0], key[1], "backward", opened[1], end, serial=True)
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)
                self.peak_memory[f"cuda:{index}"] = float(torch.cuda.max_memory_allocated(index))
        rows = []
        for stage, device, microbatch, phase, start, end, serial, memory in self._spans:
            rows.append((self.run, stage, str(device), microbatch, phase,
                         self._seconds(device, start), self._seconds(device, end), "measured", serial,
                         np.nan if memory is None else float(memory)))
        rows.sort(key=lambda r: (r[5], r[1]))
        frame = (pd.DataFrame(rows, columns=COLUMNS + ["serial", "memory"]) if rows
                 else empty_timeline().assign(serial=False, memory=np.nan))
        if frame["memory"].isna().all():
            frame = frame.drop(columns="memory")  # the executor did not measure it
        frame = _serial_backward_spans(frame).drop(columns="serial")
        frame.attrs["peak_memory"] = dict(self.peak_memory)
        self.timeline = frame

    def _seconds(self, device: torch.device, mark: Mark) -> float:
        if isinstance(mark, int):
            return (mark - self._origin_ns) / 1e9
        origin, origin_ns = self._cuda_origins[device.index]
        return (origin_ns - self._origin_ns) / 1e9 + origin.elapsed_time(mark) / 1e3


def _serial_backward_spans(frame: pd.DataFrame) -> pd.DataFrame:
    """Trim autograd-driven backward spans to the work they did.

    One ``backward()`` call runs each device's backward work on one thread, one node at a
    time, so a backward span (gradient in → gradient out) can hold other stages' work and its
    own recomputation. The work of a span starts where the last span nested inside it ends.
    """
    serial = frame["serial"].astype(bool)
    if not serial.any():
        return frame
    for _, group in frame[serial].groupby("device"):
        starts, ends = group["start"].to_numpy(), group["end"].to_numpy()
        is_backward = (group["phase"] == "backward").to_numpy()
        for k, index in enumerate(group.index):
            if not is_backward[k]:
                continue
            inside = (starts >= starts[k]) & (ends <= ends[k])
            inside[k] = False
            if inside.any():
                frame.at[index, "start"] = max(starts[k], float(ends[inside].max()))
    return frame


@contextmanager
def record(run: Any = 0) -> Generator[Recorder, None, None]:
    """Record every pipelined ``(stage, micro-batch, phase)`` that this thread runs in the block.

    The recorder is this thread's (and its pipelines' worker threads'): blocks in several
    threads at once each record their own work only. Within one thread blocks do not nest.

    Example::

        with pipexplore.record() as rec:
            loss = pipe(x).sum()
            loss.backward()
        rec.timeline            # a DataFrame, one row per event
    """
    if _active.get() is not None:
        raise RuntimeError("pipexplore.record() blocks cannot be nested: this thread is already recording "
                           "(close the outer block first, or record in another thread)")
    recorder = Recorder(run)
    token = _active.set(recorder)
    try:
        recorder.start()
        yield recorder
    finally:
        try:
            _active.reset(token)
        except ValueError:  # closed from another context than it was opened in
            _active.set(None)
        recorder.finish()


class _BackwardMark(torch.autograd.Function):
    """Identity; its backward opens or closes a stage's backward span."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, recorder: Recorder, stage: int, microbatch: int,  # type: ignore[override]
                opens: bool) -> torch.Tensor:
        ctx.recorder, ctx.stage, ctx.microbatch, ctx.opens = recorder, stage, microbatch, opens
        ctx.device = input.device
        return input.view_as(input)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if ctx.opens:
            ctx.recorder.open_backward(ctx.stage, ctx.microbatch, ctx.device)
        else:
            ctx.recorder.close_backward(ctx.stage, ctx.microbatch, ctx.device)
        return grad, None, None, None, None


def mark_backward_end(recorder: Recorder, input: torch.Tensor, stage: int, microbatch: int) -> torch.Tensor:
    """At a stage's input: its backward ends when the gradient reaches here.

    An input that needs no gradient (the first stage's) gets no mark: there the span ends at
    the stage's last gradient accumulation (:meth:`Recorder.watch_parameters`).
    """
    if not torch.is_grad_enabled() or not input.requires_grad:
        return input
    return _BackwardMark.apply(input, recorder, stage, microbatch, False)  # type: ignore[no-any-return]


def mark_backward_start(recorder: Recorder, output: torch.Tensor, stage: int, microbatch: int) -> torch.Tensor:
    """At a stage's output: its backward starts when the gradient arrives here."""
    if not torch.is_grad_enabled() or not output.requires_grad:
        return output
    return _BackwardMark.apply(output, recorder, stage, microbatch, True)  # type: ignore[no-any-return]
