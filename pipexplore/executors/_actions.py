"""The core of the in-process executors: worker threads that run each stage's actions in schedule order.

The schedule executor (:mod:`pipexplore.executors.threads`, stages of an ``nn.Sequential``) and
the traced executor (:mod:`pipexplore.executors.traced`, stages cut by torch's tracer) are both an
:class:`ActionExecutor`. One worker thread per stage (one per device for ``interleaved``) runs its
stages' actions in the order :mod:`pipexplore.schedules` gives::

    F(i)  forward of micro-batch i: the stage's inputs are detached at the boundary
    R(i)  recompute (checkpointed micro-batches), right before their backward
    B(i)  backward: torch.autograd.backward on the stage's own graph
    I(i)  input-gradient only (zero-bubble)     W(i)  weight-gradient only (zero-bubble)
          (DualPipeV runs B for some micro-batches of a stage, I and W for the others)

What a stage takes and gives differs (one tensor and skip routes, or the many values of a traced
graph): a subclass writes ``_forward``, ``_call``, ``_receive_grads`` and ``_backward``. This
module owns the rest: the workers and their mailboxes (values copied to the receiver's device, on
a copy stream on CUDA), the spans of the timeline and the activation bytes each stage holds,
checkpointing (random states saved and replayed), the loss, and stopping. A worker that raises,
:meth:`ActionExecutor.abort`, a cancelled :class:`~pipexplore.cancel.CancelToken` or a
KeyboardInterrupt stops every worker after its current action; ``step`` joins them all before it
raises (the layer's error, :class:`~pipexplore.cancel.Cancelled` or the interrupt).
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from pipexplore import timeline as tl
from pipexplore import validate
from pipexplore.cancel import Cancelled, current_token
from pipexplore.checkpoint import checkpointed_draws, enable_checkpointing, enable_recomputing, replayed_draws
from pipexplore.host import use_stage_threads
from pipexplore.samples import to_device
from pipexplore.rng_guard import rng_locks
from pipexplore.timeline.saved import SavedBytes
from pipexplore.schedules import (SCHEDULES, check_schedule, checkpointed, csv_schedule, is_csv, is_multi_stage,
                                  stage_ranks, worker_devices, worker_orders)
from pipexplore.stream import new_stream, use_device, use_stream
from pipexplore.training import LossFn

__all__ = ["PHASE", "Action", "Aborted", "Mailbox", "StageState", "StepResult", "ActionExecutor", "check_options",
           "plan_workers", "join_workers"]

PHASE = {"F": "forward", "B": "backward", "R": "recompute", "I": "input_grad", "W": "weight_grad"}
#: One action of a worker: ``(stage, kind, micro-batch)``, kind one of ``PHASE``'s keys.
Action = tuple[int, str, int]
#: Seconds between a waiting worker's looks at the abort flag.
POLL = 0.05


class Aborted(Exception):
    """Another worker failed, or the step was aborted: this one stops waiting."""


class Mailbox:
    """One value handed from one worker to another, with the CUDA event that makes it ready."""

    def __init__(self, abort: threading.Event) -> None:
        self._ready = threading.Event()
        self._abort = abort
        self.value: Any = None
        self.event: Any = None

    def put(self, value: Any, event: Any = None) -> None:
        self.value, self.event = value, event
        self._ready.set()

    def get(self, device: torch.device) -> Any:
        while not self._ready.wait(POLL):
            if self._abort.is_set():
                raise Aborted()
        value, self.value = self.value, None
        if self.event is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(self.event)
            for tensor in _tensors(value):
                tensor.record_stream(stream)  # made on the copy stream, used on this one
        return value


@dataclass
class StepResult:
    """The losses of one step: per micro-batch, and their mean weighted by rows."""

    losses: list[float]
    loss: float


@dataclass
class StageState:
    """What one stage keeps for one micro-batch between its forward and its backward (subclasses add
    the values)."""

    rng: deque = field(default_factory=lambda: deque(maxlen=1))
    param_groups: Any = None
    #: Activation bytes held for backward: saved by autograd in forward and recompute (or, for
    #: a checkpointed forward, the inputs it keeps).
    held: int = 0


def check_options(schedule: str, checkpoint: str, chunks: Any, loss_reduction: str) -> int:
    """Refuse an unknown schedule (a name, or the path of a CSV file), checkpoint mode or loss
    reduction, or bad ``chunks``; the chunks."""
    validate.schedule(schedule, SCHEDULES, csv=True)
    validate.checkpoint(checkpoint)
    chunks = validate.chunks(chunks)
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction is 'mean' or 'sum', not {loss_reduction!r}")
    return chunks


def plan_workers(schedule: str, stages: int, devices: Sequence[torch.device], chunks: int
                 ) -> tuple[list[torch.device], list[list[Action]], int]:
    """Each stage's device, each worker's actions in order, and the stages per worker.

    One worker per stage, or for the multi-stage schedules (``interleaved``, ``looped-bfs``,
    ``interleaved-zero-bubble``: stages round-robin; ``zbv``, ``dualpipev``: two stages a device in
    a V) one per device, running :func:`pipexplore.schedules.worker_orders`. A CSV schedule: one
    worker per rank (``devices[r]`` for rank ``r``), its stages where the file puts them.

    Example::

        plan_workers("1f1b", 2, [cpu, cpu], 2)
        # ([cpu, cpu], [[(0, 'F', 0), (0, 'F', 1), (0, 'B', 0), (0, 'B', 1)], [(1, 'F', 0), ...]], 1)
    """
    if is_csv(schedule):
        file = csv_schedule(schedule).check_fits(stages=stages, microbatches=chunks)
        if len(devices) < file.ranks:
            raise ValueError(f"schedule {schedule} runs on {file.ranks} ranks: give a device for each, got "
                             f"{len(devices)}")
        return ([devices[r] for r in file.stage_ranks], file.orders(),
                check_schedule(schedule, file.ranks, chunks))
    if schedule == "interleaved":
        p = len(devices)
        stage_devices = validate.interleaved_devices(stages, list(devices), chunks)
        return stage_devices, worker_orders(schedule, stages, chunks, stages // p), stages // p
    if is_multi_stage(schedule):
        p = len(devices)
        if stages % p:
            raise ValueError(f"{schedule} spreads {stages} stages over {p} devices: the stage count must be a "
                             "multiple of the device count")
        v = check_schedule(schedule, p, chunks, stages // p)
        return [devices[r] for r in stage_ranks(schedule, stages, p)], worker_orders(schedule, stages, chunks, v), v
    validate.enough_devices(len(devices), stages)
    return list(devices[:stages]), worker_orders(schedule, stages, chunks), 1


class ActionExecutor:
    """Workers that run a pipeline's actions; subclasses say what a stage's forward and backward are.

    A subclass sets ``stage_devices``, ``worker_orders`` (:func:`plan_workers`), ``checkpoint`` and
    ``loss_fn`` (resolved: :meth:`pipexplore.training.Training.of`), calls :meth:`_place` with its
    stage modules, and in ``step`` sets ``_weights`` and ``_targets`` (one per micro-batch) before
    :meth:`_run_workers`.
    """

    #: Worker threads are named this and their number.
    worker_name = "pipexplore-worker"
    stage_devices: list[torch.device]
    worker_orders: list[list[Action]]
    stage_modules: list[nn.Module]
    checkpoint: str
    loss_fn: LossFn
    #: Set by ``step`` for each micro-batch: its loss's weight, its target.
    _weights: list[float]
    _targets: list[Any]

    def _place(self, stage_modules: Sequence[nn.Module]) -> None:
        """Keep the stages (on their devices): copy streams, random-generator locks, no step running."""
        self.stage_modules = list(stage_modules)
        self.copy_streams = [new_stream(d) for d in self.stage_devices]
        # Stages sharing a device share its random generator: a checkpointed forward and its
        # recomputation hold the device's lock so that they draw the same numbers.
        self.rng_locks = rng_locks(self.stage_modules, self.stage_devices)
        self._abort: Optional[threading.Event] = None
        self._aborted = False

    def stage_parameters(self) -> list[list[nn.Parameter]]:
        """Each stage's parameters, stage by stage (what each stage's optimizer steps)."""
        return [list(module.parameters()) for module in self.stage_modules]

    @property
    def worker_devices(self) -> list[torch.device]:
        """The device of each worker thread (one per stage; one per device for ``interleaved``)."""
        return worker_devices(self.worker_orders, self.stage_devices)

    def abort(self) -> None:
        """Stop the step in progress, from any thread: every worker stops after its current action,
        ``step`` joins them and raises :class:`~pipexplore.cancel.Cancelled`. No step: nothing happens.

        Example::

            threading.Timer(0.5, executor.abort).start()
            executor.step(x, target)        # raises Cancelled; no worker thread is left
        """
        abort = self._abort
        if abort is not None:
            self._aborted = True
            abort.set()

    # ---- one step -----------------------------------------------------------------------
    def _run_workers(self, microbatches: int) -> StepResult:
        """Run every worker's actions, each worker in its own thread, and join them all.

        The first error of a worker is raised here (noted with its stage, device and action), after
        every worker stopped; an abort or a cancelled token raises :class:`Cancelled`; a
        KeyboardInterrupt while waiting stops the workers, joins them and is raised.
        """
        m = microbatches
        self._stop = checkpointed(self.checkpoint, m)
        abort = threading.Event()
        self._abort, self._aborted = abort, False
        self._boxes: dict[Any, Mailbox] = {}
        self._boxes_lock = threading.Lock()
        self._states: dict[tuple[int, int], Any] = {}
        self._param_groups: dict[tuple[int, int], Any] = {}  # what I(i) leaves for W(i)
        self._held = [0] * len(self.stage_modules)  # activation bytes each stage holds (measured)
        self._losses: list[float] = [0.0] * m
        self._recorder = tl.active_recorder()
        errors: list[Any] = []

        def work(order: list[Action], device: torch.device, done: threading.Event) -> None:
            use_stage_threads()  # the host's cores shared among the stages (pipexplore.host)
            stage, kind, i = order[0]
            try:
                with use_device(device):
                    for stage, kind, i in order:
                        if abort.is_set():
                            raise Aborted()
                        self._act(stage, kind, i)
            except Aborted:
                pass
            except BaseException as exc:
                # The layer's own error, and where it ran: the stage, its device, the action.
                add_note(exc, f"(in stage {stage} on {self.stage_devices[stage]}: {PHASE[kind]} of micro-batch {i})")
                errors.append(sys.exc_info())
                abort.set()
            finally:
                done.set()

        workers = []
        for w, order in enumerate(o for o in self.worker_orders if o):
            done = threading.Event()
            workers.append((tl.thread_in_this_context(work, (order, self.stage_devices[order[0][0]], done),
                                                      name=f"{self.worker_name}{w}"), done))
        token = current_token()
        try:
            with token.on_cancel(self.abort) if token is not None else nullcontext():
                for thread, _ in workers:
                    thread.start()
                join_workers(workers, abort.set)  # a KeyboardInterrupt stops the workers, joins them, then raises
        except BaseException:  # interrupted before every worker started: stop and join those that did
            abort.set()
            join_workers([(t, done) for t, done in workers if t.ident is not None], abort.set)
            raise
        finally:
            self._abort = None
            self._boxes.clear()
            self._states.clear()
            self._param_groups.clear()
        if errors:
            raise errors[0][1].with_traceback(errors[0][2])
        if self._aborted:
            raise Cancelled("the step was aborted (executor.abort() or a cancelled run): every worker stopped and "
                            "was joined; parameter gradients are partial")
        return StepResult(list(self._losses), sum(loss * w for loss, w in zip(self._losses, self._weights)))

    def _act(self, stage: int, kind: str, i: int) -> None:
        if kind == "F":
            self._forward(stage, i)
        elif kind == "W":
            self._timed(stage, "W", i, lambda: self._weight_grad(stage, i))
        else:
            # Waiting for the gradients is not work: receive them before the spans start.
            received = self._receive_grads(stage, i)
            if i < self._stop:
                self._timed(stage, "R", i, lambda: self._run(stage, i, self._states[(stage, i)], recomputing=True))
            self._timed(stage, kind, i, lambda: self._backward(stage, i, received, split=kind == "I"))

    # ---- what subclasses write ------------------------------------------------------------
    def _forward(self, stage: int, i: int) -> None:
        """F(i): receive the stage's inputs, :meth:`_run` it (timed), send its outputs."""
        raise NotImplementedError

    def _call(self, stage: int, i: int, state: Any) -> None:
        """Call the stage on ``state``'s inputs and keep its outputs in ``state`` (the last stage: the loss too)."""
        raise NotImplementedError

    def _receive_grads(self, stage: int, i: int) -> Any:
        raise NotImplementedError

    def _backward(self, stage: int, i: int, received: Any, *, split: bool) -> None:
        raise NotImplementedError

    def _stage_scope(self, stage: int, i: int, state: Any, recomputing: bool) -> ContextManager[Any]:
        """A context the stage's forward runs in (the schedule executor's skip tracker)."""
        return nullcontext()

    def _kept_bytes(self, stage: int, state: Any) -> int:
        """Bytes a checkpointed forward keeps for its recomputation (its inputs)."""
        return 0

    # ---- mailboxes and spans ----------------------------------------------------------------
    def _box(self, key: Any) -> Mailbox:
        with self._boxes_lock:
            box = self._boxes.get(key)
            if box is None:
                box = self._boxes[key] = Mailbox(self._abort)  # type: ignore[arg-type]
            return box

    def _send(self, box: Mailbox, value: Any, from_stage: int, to_stage: int, i: int,
              wrap: Callable[[Any], Any] = lambda v: v) -> None:
        """Put ``value`` (detached, on ``to_stage``'s device) in ``box``, as ``wrap`` packs it.

        On CUDA the copy runs on a copy stream that first waits for the stream that produced
        the tensor; the receiver waits for the copy's event (a CPU receiver: the copy is done
        before the tensor is handed over). A value that is not a tensor is handed over as it is.
        """
        if not torch.is_tensor(value):
            box.put(wrap(value))
            return
        source, target = self.stage_devices[from_stage], self.stage_devices[to_stage]
        if source == target and source.type != "cuda":
            box.put(wrap(value.detach()))
            return
        if source.type != "cuda" and target.type != "cuda":
            box.put(wrap(value.detach().to(target)))
            return
        stream = self.copy_streams[to_stage] if target.type == "cuda" else self.copy_streams[from_stage]
        if source.type == "cuda":
            stream.wait_stream(torch.cuda.current_stream(source))  # type: ignore[union-attr]
        with use_stream(stream):
            done = self._span(to_stage, "copy", i) if source != target else None
            copy = value.detach().to(target, non_blocking=True)
            if source.type == "cuda":
                value.record_stream(stream)  # type: ignore[arg-type]
            if done is not None:
                done()
            event = torch.cuda.Event()
            event.record(stream)  # type: ignore[arg-type]
        if target.type != "cuda":
            event.synchronize()
            box.put(wrap(copy))
        else:
            box.put(wrap(copy), event)

    def _span(self, stage: int, phase: str, i: int) -> Optional[Callable[[], None]]:
        recorder = self._recorder
        if recorder is None:
            return None
        device = self.stage_devices[stage]
        start = recorder.mark(device)
        if phase == "copy":
            return lambda: recorder.add(stage, device, i, phase, start, recorder.mark(device))
        # Each stage's actions run on one worker, so its held bytes change on that thread only.
        return lambda: recorder.add(stage, device, i, phase, start, recorder.mark(device), memory=self._held[stage])

    def _timed(self, stage: int, kind: str, i: int, action: Callable[[], None]) -> None:
        done = self._span(stage, PHASE[kind], i)
        action()
        if done is not None:
            done()

    # ---- forward, loss, backward ------------------------------------------------------------
    def _run(self, stage: int, i: int, state: StageState, *, recomputing: bool) -> None:
        """The stage's forward (checkpointed: without autograd, where its draws start kept;
        recomputing: those draws replayed), counting the activation bytes it leaves for backward.
        A stage that shares its device's random generator with others draws one operator at a
        time under the device's lock (:class:`~pipexplore.rng_guard.RNGGuard`)."""
        checkpointed = i < self._stop
        device = self.stage_devices[stage]
        saved = SavedBytes(self.stage_modules[stage])
        guard = self.rng_locks[stage]
        with saved.hooks(), self._stage_scope(stage, i, state, recomputing):
            if not checkpointed:
                with guard.drawing() if guard is not None else contextlib.nullcontext():
                    self._call(stage, i, state)
            elif not recomputing:
                with checkpointed_draws(device, state.rng, guard), torch.no_grad(), enable_checkpointing():
                    self._call(stage, i, state)
            else:
                with replayed_draws(device, state.rng, guard), torch.enable_grad(), enable_recomputing():
                    self._call(stage, i, state)
        grown = self._kept_bytes(stage, state) if checkpointed and not recomputing else saved.total
        state.held += grown
        self._held[stage] += grown

    def _loss(self, stage: int, i: int, output: Any) -> Tensor:
        """The loss of micro-batch ``i`` on the model's output, noted, and weighted for backward."""
        loss = validate.loss_value(self.loss_fn(output, to_device(self._targets[i], self.stage_devices[stage])))
        self._losses[i] = float(loss.detach())
        return loss * self._weights[i]  # type: ignore[no-any-return]

    def _backward_pass(self, stage: int, i: int, state: StageState, pairs: list[tuple[Tensor, Optional[Tensor]]],
                       inputs: list[Tensor], *, split: bool) -> list[Optional[Tensor]]:
        """Back-propagate ``pairs`` (tensor, its gradient; None for a loss) to ``inputs``; their gradients.

        B (``split=False``): the whole backward. I (``split=True``): input gradients only, the weight
        gradients left to W through the saved parameter groups. With no input that needs a
        gradient, nothing upstream waits: I does all the work, W none.
        """
        if not split or not inputs:
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            return [x.grad for x in inputs]
        if not pairs:
            return [None] * len(inputs)
        from torch.distributed.pipelining._backward import stage_backward_input

        try:
            input_grads, state.param_groups = stage_backward_input(
                [t for t, _ in pairs], [g if g is not None else torch.ones_like(t) for t, g in pairs],
                inputs, self.stage_modules[stage].parameters())
        except Exception as exc:  # torch 2.13 wraps the layer's error in a RuntimeError; earlier ones raise it as is
            raise _own_error(exc, f"stage {stage}'s input-gradient action (I) of micro-batch {i}") from None
        return list(input_grads)

    def _backward_done(self, stage: int, i: int, state: StageState) -> None:
        """Free what the micro-batch held on this stage; W(i) keeps only the parameter groups."""
        self._held[stage] -= state.held
        state.held = 0
        del self._states[(stage, i)]
        if state.param_groups is not None:
            self._param_groups[(stage, i)] = state.param_groups

    def _weight_grad(self, stage: int, i: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward_weight

        groups = self._param_groups.pop((stage, i), None)
        if groups is not None:
            stage_backward_weight(self.stage_modules[stage].parameters(), groups)


def join_workers(workers: Sequence[tuple[threading.Thread, threading.Event]], stop: Callable[[], None]) -> None:
    """Wait until every worker (a thread and the event it sets last) is done, even when interrupts
    (Ctrl+C) arrive meanwhile: the first calls ``stop()``, the waiting goes on, it is raised after.

    It waits on the workers' own events, not in ``Thread.join()``: in Python 3.11 a join that an
    interrupt cuts short may mark a thread that still runs as stopped (its ``is_alive()`` False).
    And it waits ``POLL`` seconds at a time: Python raises an interrupt in the main thread when that
    thread next runs Python code, and a signal sent to the process (the terminal's Ctrl+C, Jupyter's
    "interrupt the kernel") may be taken by a worker thread, which does not wake a wait without a
    timeout: the step would run to its end first (every forward of a 32-micro-batch step, measured).
    """
    interrupt: Optional[BaseException] = None
    for thread, done in workers:
        while True:
            try:
                while not done.wait(POLL):
                    pass
                thread.join()
                break
            except BaseException as exc:  # KeyboardInterrupt: stop the workers and wait for them
                if interrupt is None:
                    stop()
                interrupt = interrupt or exc
    if interrupt is not None:
        raise interrupt


def _own_error(exc: BaseException, where: str) -> BaseException:
    """The layer's own error inside torch's "Failed to run stage backward" wrapper, noted with where it ran."""
    cause = exc.__cause__ if "Failed to run stage backward" in str(exc) and exc.__cause__ is not None else exc
    add_note(cause, f"(raised in {where}, by torch.distributed.pipelining's stage_backward_input)")
    return cause


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python 3.11+); on 3.10, whose tracebacks print no notes, the note
    ends the error's message instead (an error without a message is left as it is)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}",) + exc.args[1:]


def _tensors(value: Any) -> Iterator[Tensor]:
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
