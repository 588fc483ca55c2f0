"""The ``threads`` executor: the schedule executor, a training step of an ``nn.Sequential`` with an explicit schedule in one process.

Each worker thread (one per stage; one per device for the multi-stage schedules) runs its stages'
actions in schedule order: ``F``, ``B``, ``R`` (recompute) and ``I``/``W`` for the zero-bubble ones, as
:mod:`pipexplore.executors._actions` (the core it shares with the traced executor) runs them.
A stage takes one tensor and gives one; activations and gradients pass between workers through
mailboxes, copied to the receiving device (on a copy stream on CUDA). A skip route that crosses
stages is an extra stage output (stash side) and input (pop side); its gradient is sent back the
same way. Unlike one ``backward()`` call, backward work of different stages overlaps, on CPU too.

Example::

    executor = ScheduleExecutor(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=8,
                                schedule="1f1b", loss_fn=nn.functional.mse_loss)
    result = executor.step(x, target)      # losses per micro-batch; parameter .grad accumulated

``executor.abort()`` (from another thread), a cancelled :class:`~pipexplore.cancel.CancelToken`
or a KeyboardInterrupt stops every worker after its current action and joins them before
``step`` returns (raising :class:`~pipexplore.cancel.Cancelled` or the interrupt).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ContextManager, Optional, Sequence, cast

import torch
from torch import Tensor, nn

from pipexplore import validate
from pipexplore.devices import as_device
from pipexplore.executors.base import RunResult, StepJob, train_and_measure
from pipexplore.executors._actions import PHASE, ActionExecutor, StageState, StepResult, check_options, plan_workers
from pipexplore.gpipe import split_module, verify_balance, verify_module
from pipexplore.microbatch import Batch, check, scatter
from pipexplore.samples import batch_size, to_device
from pipexplore.timeline.saved import tensor_bytes
from pipexplore.skip.layout import inspect_skip_layout
from pipexplore.skip.namespace import Namespace
from pipexplore.skip.skippable import verify_skippables
from pipexplore.skip.tracker import SkipTracker, use_skip_tracker
from pipexplore.training import LossFn, Training

__all__ = ["NAME", "run", "ScheduleExecutor", "StepResult", "PHASE"]

Key = tuple[Namespace, str]


@dataclass
class _State(StageState):
    """What one stage keeps for one micro-batch between its forward and its backward."""

    leaf: Any = None
    outputs: list[Tensor] = field(default_factory=list)
    incoming: dict[Key, Tensor] = field(default_factory=dict)
    outgoing: dict[Key, Tensor] = field(default_factory=dict)


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
            self.executor._send(self.executor._skip_box(self.microbatch, ns, name), tensor,
                                self.stage, route[1], self.microbatch)

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        route = self.executor.skip_layout.by_ns_name.get((ns, name))
        if route is None or route[0] == route[1]:
            return super().load(batch, ns, name)
        if (ns, name) not in self.state.incoming:
            value = self.executor._skip_box(self.microbatch, ns, name).get(self.executor.stage_devices[self.stage])
            self.state.incoming[(ns, name)] = value.requires_grad_(value.is_floating_point())
        return self.state.incoming[(ns, name)]


class ScheduleExecutor(ActionExecutor):
    """Runs training steps of a partitioned ``nn.Sequential`` with an explicit pipeline schedule.

    Args:
        module: the ``nn.Sequential`` (its layers are moved to the stages' devices).
        balance: layers per stage. For the multi-stage schedules, ``len(balance)`` stages are spread
            over ``len(devices)`` devices (``virtual_stages`` = stages / devices): round-robin, or in
            a V for ``zbv`` and ``dualpipev`` (device ``d`` holds stages ``d`` and ``2p − 1 − d``).
        devices: one per stage (one per device for the multi-stage schedules); default CPU for each.
        chunks: micro-batches per step.
        schedule: one of :data:`pipexplore.schedules.SCHEDULES`: ``gpipe``, ``1f1b``, ``interleaved``,
            ``zero-bubble`` (ZB-H1), ``looped-bfs``, ``interleaved-zero-bubble``, ``zbv``, ``dualpipev``;
            or the path of a CSV file in torch's format (one worker a rank, ``devices[r]`` for rank
            ``r``; its stages and micro-batches must be ``len(balance)`` and ``chunks``).
        checkpoint: ``always``, ``except_last`` or ``never``.
        loss_fn: ``loss_fn(output, target)``; default: :func:`pipexplore.training.synthetic_loss` (the
            mean of the squared outputs).
        loss_reduction: ``'mean'`` (micro-batch losses weighted by their rows, so the gradients
            equal one step on the whole batch with a mean loss) or ``'sum'``.
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int], *, devices: Optional[Sequence[Any]] = None,
                 chunks: int = 1, schedule: str = "1f1b", checkpoint: str = "never",
                 loss_fn: Optional[LossFn] = None, loss_reduction: str = "mean") -> None:
        chunks = check_options(schedule, checkpoint, chunks, loss_reduction)
        self.loss_fn = Training.of(loss_fn).loss_fn
        verify_module(module)
        balance = verify_balance(module, balance)
        verify_skippables(module)
        stages = len(balance)
        device_list = [as_device(d) for d in validate.devices(devices)] if devices is not None else (
            [torch.device("cpu")] * stages)
        self.stage_devices, self.worker_orders, self.virtual_stages = plan_workers(schedule, stages, device_list,
                                                                                   chunks)
        self.partitions = split_module(module, balance, self.stage_devices)
        self.balance, self.chunks, self.schedule, self.checkpoint = balance, chunks, schedule, checkpoint
        self.loss_reduction = loss_reduction
        self.skip_layout = inspect_skip_layout(self.partitions)
        self._place(self.partitions)

    def parameters(self) -> list[nn.Parameter]:
        return [p for partition in self.partitions for p in partition.parameters()]

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
        return self._run_workers(m)

    def _skip_box(self, i: int, ns: Namespace, name: str, grad: bool = False) -> Any:
        return self._box(("skip-grad" if grad else "skip", i, ns, name))

    # ---- actions ------------------------------------------------------------------------
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
            self._send(self._box(("act", stage + 1, i)), state.outputs[0], stage, stage + 1, i)
        if i < self._stop:
            state.outputs = []  # checkpointed: recomputed before backward

    def _stage_scope(self, stage: int, i: int, state: _State, recomputing: bool) -> ContextManager[Any]:
        return use_skip_tracker(_StageSkipTracker(self, stage, i, state, recomputing))

    def _kept_bytes(self, stage: int, state: _State) -> int:
        # A checkpointed forward keeps only its input (stage 0's is the caller's batch: not counted).
        return tensor_bytes(state.leaf) if stage else 0

    def _call(self, stage: int, i: int, state: _State) -> None:
        output = self.partitions[stage](state.leaf)
        if stage < len(self.partitions) - 1:
            if not torch.is_tensor(output):
                raise TypeError("the schedule executor passes one tensor between stages; stage "
                                f"{stage} returned {type(output).__name__}")
            state.outputs = [output]
        else:
            state.outputs = [self._loss(stage, i, output)]

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

    def _backward(self, stage: int, i: int, received: tuple[Optional[Tensor], dict[Key, Tensor]], *,
                  split: bool) -> None:
        """B (``split=False``): the whole backward. I (``split=True``): input gradients only, the
        weight gradients left to W."""
        state = self._states[(stage, i)]
        output_grad, skip_grads = received
        tensors, grads = list(state.outputs), [output_grad]
        for key, tensor in state.outgoing.items():
            tensors.append(tensor)
            grads.append(skip_grads[key])
        pairs = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
        inputs = ([state.leaf] if torch.is_tensor(state.leaf) and state.leaf.requires_grad else []) + list(
            state.incoming.values())
        input_grads = self._backward_pass(stage, i, state, pairs, inputs, split=split)
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
        self._backward_done(stage, i, state)


def _leaf(x: Any) -> Any:
    if torch.is_tensor(x):
        return x.detach().requires_grad_(x.is_floating_point())
    return tuple(_leaf(t) for t in x)


NAME = "threads"


def run(job: StepJob) -> RunResult:
    """One step of the plan's schedule through :class:`ScheduleExecutor`; measure."""
    plan = job.plan
    model = cast(nn.Sequential, copy.deepcopy(job.model))  # cast: executor_for sends only an nn.Sequential here
    executor = ScheduleExecutor(model, plan.balance, devices=list(plan.devices[: plan.num_devices]),
                                chunks=plan.chunks, schedule=plan.schedule, checkpoint=plan.checkpoint,
                                loss_fn=job.training.loss_fn)
    return train_and_measure(executor, plan, job.sample, job.training, warmup=job.warmup, run=job.run,
                             repeats=job.repeats)
