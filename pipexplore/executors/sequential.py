"""The schedule executor: a training step with an explicit schedule, in one process.

Each worker thread (one per stage; one per device for ``interleaved``) runs its actions in
schedule order::

    F(i)  forward of micro-batch i: the stage's input is detached at the boundary
    R(i)  recompute (checkpointed micro-batches), right before their backward
    B(i)  backward: torch.autograd.backward on the stage's own graph
    I(i)  input-gradient only (zero-bubble)     W(i)  weight-gradient only (zero-bubble)

Activations and gradients pass between workers through mailboxes, copied to the receiving
device (on a copy stream on CUDA). A skip route that crosses stages is an extra stage output
(stash side) and input (pop side); its gradient is sent back the same way. Unlike one
``backward()`` call, backward work of different stages overlaps, on CPU too.

Example::

    executor = ScheduleExecutor(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=8,
                                schedule="1f1b", loss_fn=nn.functional.mse_loss)
    result = executor.step(x, target)      # losses per micro-batch; parameter .grad accumulated

``executor.abort()`` (from another thread), a cancelled :class:`~pipexplore.cancel.CancelToken`
or a KeyboardInterrupt stops every worker after its current action and joins them before
``step`` returns (raising :class:`~pipexplore.cancel.Cancelled` or the interrupt).
"""
from __future__ import annotations

import sys
import threading
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from pipexplore import timeline as tl
from pipexplore import validate
from pipexplore.host import use_stage_threads
from pipexplore.cancel import Cancelled, current_token
from pipexplore.checkpoint import (enable_checkpointing, enable_recomputing, restore_rng_states, rng_locks,
                                   save_rng_states)
from pipexplore.devices import as_device
from pipexplore.gpipe import split_module, verify_balance, verify_module
from pipexplore.saved import SavedBytes, tensor_bytes
from pipexplore.microbatch import Batch, batch_size, check, scatter, to_device
from pipexplore.executors.base import synthetic_loss
from pipexplore.schedules import SCHEDULES, interleaved_order, stage_orders, worker_devices
from pipexplore.skip.layout import inspect_skip_layout
from pipexplore.skip.namespace import Namespace
from pipexplore.skip.skippable import verify_skippables
from pipexplore.skip.tracker import SkipTracker, use_skip_tracker
from pipexplore.stream import new_stream, use_device, use_stream
from pipexplore.worker import join_all

__all__ = ["ScheduleExecutor", "StepResult"]

PHASE = {"F": "forward", "B": "backward", "R": "recompute", "I": "input_grad", "W": "weight_grad"}
Key = tuple[Namespace, str]


class _Aborted(Exception):
    """Another worker failed: this one stops waiting."""


class _Mailbox:
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
        while not self._ready.wait(0.05):
            if self._abort.is_set():
                raise _Aborted()
        value, self.value = self.value, None
        if self.event is not None:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(self.event)
            value.record_stream(stream)  # made on the copy stream, used on this one
        return value


@dataclass
class StepResult:
    """The losses of one step: per micro-batch, and their mean weighted by rows."""

    losses: list[float]
    loss: float


@dataclass
class _State:
    """What one stage keeps for one micro-batch between its forward and its backward."""

    leaf: Any = None
    outputs: list[Tensor] = field(default_factory=list)
    incoming: dict[Key, Tensor] = field(default_factory=dict)
    outgoing: dict[Key, Tensor] = field(default_factory=dict)
    rng: deque = field(default_factory=lambda: deque(maxlen=1))
    param_groups: Any = None
    #: Activation bytes held for backward: saved by autograd in forward and recompute (or, for
    #: a checkpointed forward, the input it keeps).
    held: int = 0


class _StageSkipTracker(SkipTracker):
    """Skips within a stage pass as they are; crossing ones go through the executor's mailboxes."""

    def __init__(self, executor: "ScheduleExecutor", stage: int, microbatch: int, state: _State,
                 recomputing: bool) -> None:
        super().__init__()
        self.executor, self.stage, self.microbatch = executor, stage, microbatch
        self.state, self.recomputing = state, recomputing

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        route = self.executor.skip_layout.by_ns_name.get((ns, name))
        if route is None or route[0] == route[1] or tensor is None:
            super().save(batch, ns, name, tensor)
            return
        self.state.outgoing[(ns, name)] = tensor
        if not self.recomputing:
            self.executor._send(self.executor._skip_box(self.microbatch, ns, name), tensor.detach(),
                                self.stage, route[1], self.microbatch)

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        route = self.executor.skip_layout.by_ns_name.get((ns, name))
        if route is None or route[0] == route[1]:
            return super().load(batch, ns, name)
        if (ns, name) not in self.state.incoming:
            value = self.executor._skip_box(self.microbatch, ns, name).get(self.executor.stage_devices[self.stage])
            self.state.incoming[(ns, name)] = value.requires_grad_(value.is_floating_point())
        return self.state.incoming[(ns, name)]


class ScheduleExecutor:
    """Runs training steps of a partitioned ``nn.Sequential`` with an explicit pipeline schedule.

    Args:
        module: the ``nn.Sequential`` (its layers are moved to the stages' devices).
        balance: layers per stage. For ``interleaved``, ``len(balance)`` stages are spread over
            ``len(devices)`` devices round-robin (``virtual_stages`` = stages / devices).
        devices: one per stage (one per device for interleaved); default CPU for each.
        chunks: micro-batches per step.
        schedule: ``gpipe``, ``1f1b``, ``interleaved`` or ``zero-bubble`` (ZB-H1).
        checkpoint: ``always``, ``except_last`` or ``never``.
        loss_fn: ``loss_fn(output, target)``; default: the mean of the squared outputs.
        loss_reduction: ``'mean'`` (micro-batch losses weighted by their rows, so the gradients
            equal one step on the whole batch with a mean loss) or ``'sum'``.
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int], *, devices: Optional[Sequence[Any]] = None,
                 chunks: int = 1, schedule: str = "1f1b", checkpoint: str = "never",
                 loss_fn: Optional[Callable[[Any, Any], Tensor]] = None, loss_reduction: str = "mean") -> None:
        validate.schedule(schedule, SCHEDULES)
        validate.checkpoint(checkpoint)
        chunks = validate.chunks(chunks)
        validate.optional_callable(loss_fn, "loss_fn", "loss_fn(output, target)")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction is 'mean' or 'sum', not {loss_reduction!r}")
        verify_module(module)
        balance = verify_balance(module, balance)
        verify_skippables(module)
        stages = len(balance)
        device_list = [as_device(d) for d in validate.devices(devices)] if devices is not None else (
            [torch.device("cpu")] * stages)
        if schedule == "interleaved":
            p = len(device_list)
            self.stage_devices = validate.interleaved_devices(stages, device_list, chunks)
            self.virtual_stages = stages // p
            self.worker_orders = [list(interleaved_order(d, p, self.virtual_stages, chunks)) for d in range(p)]
        else:
            validate.enough_devices(len(device_list), stages)
            self.virtual_stages = 1
            self.stage_devices = device_list[:stages]
            self.worker_orders = [[(s, k, i) for k, i in order] for s, order in
                                  enumerate(stage_orders(schedule, stages, chunks))]
        self.partitions = split_module(module, balance, self.stage_devices)
        self.balance, self.chunks, self.schedule, self.checkpoint = balance, chunks, schedule, checkpoint
        self.loss_fn = loss_fn
        self.loss_reduction = loss_reduction
        self.skip_layout = inspect_skip_layout(self.partitions)
        self.copy_streams = [new_stream(d) for d in self.stage_devices]
        self.rng_locks = rng_locks(self.partitions, self.stage_devices)
        self._abort: Optional[threading.Event] = None
        self._aborted = False

    @property
    def worker_devices(self) -> list[torch.device]:
        """The device of each worker thread (one per stage; one per device for ``interleaved``)."""
        return worker_devices(self.worker_orders, self.stage_devices)

    def parameters(self) -> list[nn.Parameter]:
        return [p for partition in self.partitions for p in partition.parameters()]

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
    def step(self, input: Any, target: Any = None) -> StepResult:
        """Run forward and backward for every micro-batch as the schedule orders them.

        Parameter gradients accumulate into ``.grad`` as one ``backward()`` of a plain step would;
        no optimizer step is taken. A batch that ``chunks`` cannot split into exactly ``chunks``
        micro-batches is refused (see :func:`pipexplore.validate.chunks_for_batch`).
        """
        check(input)
        validate.sample(input, "input")
        validate.chunks_for_batch(self.chunks, batch_size(input))
        validate.target(target, batch_size(input))
        self._inputs = [b.tensor_or_tensors for b in scatter(input, self.chunks)]
        m = len(self._inputs)
        rows = [batch_size(x) for x in self._inputs]
        self._weights = [r / sum(rows) if self.loss_reduction == "mean" else 1.0 for r in rows]
        self._targets = list(target.chunk(m)) if torch.is_tensor(target) else [target] * m
        self._stop = {"always": m, "except_last": m - 1, "never": 0}[self.checkpoint]
        abort = threading.Event()
        self._abort, self._aborted = abort, False
        self._boxes: dict[Any, _Mailbox] = {}
        self._boxes_lock = threading.Lock()
        self._states: dict[tuple[int, int], _State] = {}
        self._held = [0] * len(self.partitions)  # activation bytes each stage holds (measured)
        self._losses: list[float] = [0.0] * m
        self._recorder = tl.active_recorder()
        errors: list[Any] = []

        def work(order: list[tuple[int, str, int]], device: torch.device) -> None:
            use_stage_threads()  # the host's cores shared among the stages (pipexplore.host)
            stage, kind, i = order[0]
            try:
                with use_device(device):
                    for stage, kind, i in order:
                        if abort.is_set():
                            raise _Aborted()
                        self._act(stage, kind, i)
            except _Aborted:
                pass
            except BaseException as exc:
                # The layer's own error, and where it ran: the stage, its device, the action.
                exc.add_note(f"(in stage {stage} on {self.stage_devices[stage]}: {PHASE[kind]} of micro-batch {i})")
                errors.append(sys.exc_info())
                abort.set()

        threads = [tl.thread_in_this_context(work, (order, self.stage_devices[order[0][0]]),
                                             name=f"pipexplore-worker{w}")
                   for w, order in enumerate(self.worker_orders)]
        token = current_token()
        try:
            with token.on_cancel(self.abort) if token is not None else nullcontext():
                for t in threads:
                    t.start()
                join_all(threads, abort.set)  # a KeyboardInterrupt stops the workers, joins them, then raises
        except BaseException:  # interrupted before every worker started: stop and join those that did
            abort.set()
            join_all([t for t in threads if t.ident is not None], abort.set)
            raise
        finally:
            self._abort = None
            self._boxes.clear()
            self._states.clear()
        if errors:
            raise errors[0][1].with_traceback(errors[0][2])
        if self._aborted:
            raise Cancelled("the step was aborted (executor.abort() or a cancelled run): every worker stopped and "
                            "was joined; parameter gradients are partial")
        weighted = sum(loss * w for loss, w in zip(self._losses, self._weights))
        return StepResult(list(self._losses), weighted)

    # ---- mailboxes --------------------------------------------------------------------
    def _box(self, key: Any) -> _Mailbox:
        with self._boxes_lock:
            box = self._boxes.get(key)
            if box is None:
                box = self._boxes[key] = _Mailbox(self._abort)
            return box

    def _skip_box(self, i: int, ns: Namespace, name: str, grad: bool = False) -> _Mailbox:
        return self._box(("skip-grad" if grad else "skip", i, ns, name))

    def _send(self, box: _Mailbox, tensor: Tensor, from_stage: int, to_stage: int, i: int) -> None:
        """Copy ``tensor`` to ``to_stage``'s device and put it in ``box``.

        On CUDA the copy runs on a copy stream that first waits for the stream that produced
        the tensor; the receiver waits for the copy's event (a CPU receiver: the copy is done
        before the tensor is handed over).
        """
        source, target = self.stage_devices[from_stage], self.stage_devices[to_stage]
        if source == target and source.type != "cuda":
            box.put(tensor.detach())
            return
        if source.type != "cuda" and target.type != "cuda":
            box.put(tensor.detach().to(target))
            return
        stream = self.copy_streams[to_stage] if target.type == "cuda" else self.copy_streams[from_stage]
        if source.type == "cuda":
            stream.wait_stream(torch.cuda.current_stream(source))  # type: ignore[union-attr]
        with use_stream(stream):
            done = self._span(to_stage, "copy", i) if source != target else None
            copy = tensor.detach().to(target, non_blocking=True)
            if source.type == "cuda":
                tensor.record_stream(stream)  # type: ignore[arg-type]
            if done is not None:
                done()
            event = torch.cuda.Event()
            event.record(stream)  # type: ignore[arg-type]
        if target.type != "cuda":
            event.synchronize()
            box.put(copy)
        else:
            box.put(copy, event)

    def _span(self, stage: int, phase: str, i: int) -> Optional[Callable[[], None]]:
        recorder = self._recorder
        if recorder is None:
            return None
        device = self.stage_devices[stage]
        start = recorder.mark(device)
        if phase == "copy":
            return lambda: recorder.add(stage, device, i, phase, start, recorder.mark(device))
        # Each stage's actions run on one worker, so its held bytes change on that thread only.
        return lambda: recorder.add(stage, device, i, phase, start, recorder.mark(device),
                                    memory=self._held[stage])

    # ---- actions ------------------------------------------------------------------------
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

    def _receive_grads(self, stage: int, i: int) -> tuple[Optional[Tensor], dict[Key, Tensor]]:
        """The gradient of the stage's output (None for the loss), and of each skip it stashed
        for a later stage."""
        device = self.stage_devices[stage]
        last = stage == len(self.partitions) - 1
        output_grad = None if last else self._box(("grad", stage, i)).get(device)
        skip_grads = {key: self._skip_box(i, key[0], key[1], grad=True).get(device)
                      for key, (stash_stage, pop_stage) in self.skip_layout.by_ns_name.items()
                      if stash_stage == stage and pop_stage != stage}
        return output_grad, skip_grads

    def _timed(self, stage: int, kind: str, i: int, action: Callable[[], None]) -> None:
        done = self._span(stage, PHASE[kind], i)
        action()
        if done is not None:
            done()

    def _forward(self, stage: int, i: int) -> None:
        device = self.stage_devices[stage]
        if stage == 0:
            x = to_device(self._inputs[i], device)
        else:
            x = self._box(("act", stage, i)).get(device)
        state = self._states.setdefault((stage, i), _State())
        state.leaf = x if stage == 0 else _leaf(x)
        self._timed(stage, "F", i, lambda: self._run(stage, i, state, recomputing=False))
        if stage + 1 < len(self.partitions):
            output = state.outputs[0]
            self._send(self._box(("act", stage + 1, i)), output, stage, stage + 1, i)
        if i < self._stop:
            state.outputs = []  # checkpointed: recomputed before backward

    def _run(self, stage: int, i: int, state: _State, *, recomputing: bool) -> None:
        saved = SavedBytes(self.partitions[stage])
        with saved.hooks():
            self._run_saving(stage, i, state, recomputing=recomputing)
        checkpointed_forward = i < self._stop and not recomputing
        # A checkpointed forward keeps only its input (stage 0's is the caller's batch: not counted).
        grown = (tensor_bytes(state.leaf) if stage else 0) if checkpointed_forward else saved.total
        state.held += grown
        self._held[stage] += grown

    def _release(self, stage: int, state: _State) -> None:
        self._held[stage] -= state.held
        state.held = 0

    def _run_saving(self, stage: int, i: int, state: _State, *, recomputing: bool) -> None:
        checkpointed = i < self._stop
        tracker = _StageSkipTracker(self, stage, i, state, recomputing)
        lock = self.rng_locks[stage] if checkpointed else None
        if lock is not None:
            lock.acquire()
        try:
            device = self.stage_devices[stage]
            with use_skip_tracker(tracker):
                if not checkpointed:
                    outputs = self._call(stage, i, state.leaf)
                elif not recomputing:
                    save_rng_states(device, state.rng)
                    with torch.no_grad(), enable_checkpointing():
                        outputs = self._call(stage, i, state.leaf)
                else:
                    with restore_rng_states(device, state.rng), torch.enable_grad(), enable_recomputing():
                        outputs = self._call(stage, i, state.leaf)
        finally:
            if lock is not None:
                lock.release()
        state.outputs = outputs

    def _call(self, stage: int, i: int, leaf: Any) -> list[Tensor]:
        output = self.partitions[stage](leaf)
        if stage < len(self.partitions) - 1:
            if not torch.is_tensor(output):
                raise TypeError("the schedule executor passes one tensor between stages; stage "
                                f"{stage} returned {type(output).__name__}")
            return [output]
        loss_fn = self.loss_fn or synthetic_loss
        loss = validate.loss_value(loss_fn(output, to_device(self._targets[i], self.stage_devices[stage])))
        self._losses[i] = float(loss.detach())
        return [loss * self._weights[i]]

    def _backward(self, stage: int, i: int, received: tuple[Optional[Tensor], dict[Key, Tensor]], *,
                  split: bool) -> None:
        """B (``split=False``): the whole backward. I (``split=True``): input gradients only, the
        weight gradients left to W through the saved parameter groups."""
        state = self._states[(stage, i)]
        output_grad, skip_grads = received
        tensors, grads = list(state.outputs), [output_grad]
        for key, tensor in state.outgoing.items():
            tensors.append(tensor)
            grads.append(skip_grads[key])
        pairs = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
        inputs = ([state.leaf] if torch.is_tensor(state.leaf) and state.leaf.requires_grad else []) + list(
            state.incoming.values())
        # With no input that needs a gradient, nothing upstream waits: I does all the work, W none.
        weights_too = not split or not inputs
        if weights_too:
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            input_grads = [x.grad for x in inputs]
        else:
            from torch.distributed.pipelining._backward import stage_backward_input

            if pairs:
                try:
                    input_grads, state.param_groups = stage_backward_input(
                        [t for t, _ in pairs], [g if g is not None else torch.ones_like(t) for t, g in pairs],
                        inputs, self.partitions[stage].parameters())
                except RuntimeError as exc:
                    raise _own_error(exc, f"stage {stage}'s input-gradient action (I) of micro-batch {i}") from None
                input_grads = list(input_grads)
            else:
                input_grads = [None] * len(inputs)
        grads_by_input = dict(zip(map(id, inputs), input_grads))
        if stage > 0:
            g = grads_by_input.get(id(state.leaf))
            self._send(self._box(("grad", stage - 1, i)), g if g is not None else torch.zeros_like(state.leaf),
                       stage, stage - 1, i)
        for (ns, name), leaf in state.incoming.items():
            stash_stage = self.skip_layout.by_ns_name[(ns, name)][0]
            g = grads_by_input.get(id(leaf))
            self._send(self._skip_box(i, ns, name, grad=True), g if g is not None else torch.zeros_like(leaf),
                       stage, stash_stage, i)
        if split:
            state.outputs, state.outgoing, state.incoming, state.leaf = [], {}, {}, None  # W pops it
            self._release(stage, state)
        else:
            self._release(stage, self._states.pop((stage, i)))

    def _weight_grad(self, stage: int, i: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward_weight

        state = self._states.pop((stage, i))
        if state.param_groups is not None:
            stage_backward_weight(self.partitions[stage].parameters(), state.param_groups)


def _own_error(exc: BaseException, where: str) -> BaseException:
    """The layer's own error inside torch's "Failed to run stage backward" wrapper, noted with where it ran."""
    cause = exc.__cause__ if "Failed to run stage backward" in str(exc) and exc.__cause__ is not None else exc
    cause.add_note(f"(raised in {where}, by torch.distributed.pipelining's stage_backward_input)")
    return cause


def _leaf(x: Any) -> Any:
    if torch.is_tensor(x):
        return x.detach().requires_grad_(x.is_floating_point())
    return tuple(_leaf(t) for t in x)


