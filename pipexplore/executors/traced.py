"""Traced models in this process: the stages of torch's split, each in a worker thread, under any schedule.

:func:`pipexplore.trace.split` cuts a model that is not an ``nn.Sequential`` into stage modules
(``pipe.split_gm``'s ``submod_k``). A stage may take several values (hidden states, masks,
positions) from several earlier stages and the model's inputs; the last stage also builds the
model's output as the model returns it (a Hugging Face ``ModelOutput`` too) and computes the loss.
Each value crosses between workers through a mailbox, detached at the boundary, and its gradient
comes back the same way (summed over its consumers). The actions and their order are those of the
schedule executor (:mod:`pipexplore.schedule`): ``F``, ``B``, ``R`` (recompute under
checkpointing), and ``I``/``W`` for zero-bubble; the timeline has the same schema.

Parameters the tracer replicates into several stages (tied weights such as GPT-2's ``wte`` and
``lm_head``) get the sum of their copies' gradients after each step, so the copies train as one.

Example::

    pipe = trace.split(copy.deepcopy(model), first_microbatch(batch, 4), ["transformer.h.2"])
    executor = TracedExecutor(pipe, devices=["cpu", "cpu"], chunks=4, schedule="1f1b",
                              loss_fn=lambda out, _: out.loss)
    executor.step(batch).loss
"""
from __future__ import annotations

import copy
import operator
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, fx, nn

from pipexplore import timeline as tl
from pipexplore import validate
from pipexplore.host import use_stage_threads
from pipexplore.checkpoint import restore_rng_states, save_rng_states
from pipexplore.executors.base import (LossFn, OptimizerFactory, RunResult, StepJob, make_optimizer, measure,
                                       result, synthetic_loss)
from pipexplore.devices import as_device
from pipexplore.microbatch import to_device
from pipexplore.models.inputs import call_inputs, first_microbatch, microbatches, model_output, sample_rows
from pipexplore.plan import Plan
from pipexplore.executors.sequential import PHASE, StepResult, _Aborted, _Mailbox
from pipexplore.schedules import SCHEDULES, interleaved_order, stage_orders, worker_devices
from pipexplore.stream import use_device

__all__ = ["NAME", "TracedExecutor", "run", "run_traced_step"]

NAME = "threads"


@dataclass
class _State:
    """What one stage keeps for one micro-batch between its forward and its backward."""

    leaves: dict[fx.Node, Any] = field(default_factory=dict)
    produced: dict[fx.Node, Any] = field(default_factory=dict)
    needs_grad: dict[fx.Node, bool] = field(default_factory=dict)
    loss: Optional[Tensor] = None
    rng: Any = None
    param_groups: Any = None


def _stage_index(node: fx.Node) -> Optional[int]:
    """The stage a root-graph node's value comes from (a stage call or a getitem of one), or None."""
    if node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]  # type: ignore[assignment]
    if node.op == "call_module" and str(node.target).startswith("submod_"):
        return int(str(node.target).rsplit("_", 1)[1])
    return None


class TracedExecutor:
    """Runs training steps of a traced model's stages with an explicit pipeline schedule, in this process.

    Args:
        pipe: what :func:`pipexplore.trace.split` returns (a ``torch.distributed.pipelining`` Pipe).
        devices: one per stage (one per device for ``interleaved``, stages round-robin); default CPU.
        chunks: micro-batches per step; the batch must divide evenly (traced graphs have fixed shapes).
        schedule: ``gpipe``, ``1f1b``, ``interleaved`` or ``zero-bubble`` (ZB-H1).
        checkpoint: ``always``, ``except_last`` or ``never``: checkpointed micro-batches keep only
            their stage inputs and run forward again (same random numbers) before backward.
        loss_fn: ``loss_fn(output, target)`` on the output as the model returns it; default: the
            mean of the squared floating outputs.
        loss_reduction: ``'mean'`` (the micro-batch losses averaged, so gradients equal one step on
            the whole batch with a mean loss) or ``'sum'``.

    Example::

        executor = TracedExecutor(pipe, devices=["cpu"] * pipe.num_stages, chunks=4, schedule="1f1b")
        result = executor.step({"input_ids": ids, "labels": ids})   # parameter .grad as one plain step
    """

    def __init__(self, pipe: Any, *, devices: Optional[Sequence[Any]] = None, chunks: int = 1,
                 schedule: str = "1f1b", checkpoint: str = "never", loss_fn: Optional[LossFn] = None,
                 loss_reduction: str = "mean") -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if checkpoint not in ("always", "except_last", "never"):
            raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never', got {checkpoint!r}")
        if isinstance(chunks, bool) or int(chunks) != chunks or chunks < 1:
            raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction is 'mean' or 'sum', not {loss_reduction!r}")
        stages = int(pipe.num_stages)
        device_list = [as_device(d) for d in devices] if devices else [torch.device("cpu")] * stages
        if schedule == "interleaved":
            p = len(device_list)
            self.stage_devices = validate.interleaved_devices(stages, device_list, chunks)
            self.worker_orders = [list(interleaved_order(d, p, stages // p, chunks)) for d in range(p)]
        else:
            if len(device_list) < stages:
                raise ValueError(f"{stages} stages need {stages} devices, got {len(device_list)} "
                                 f"({', '.join(map(str, device_list))}): give one device per stage")
            self.stage_devices = device_list[:stages]
            self.worker_orders = [[(s, kind, i) for kind, i in order]
                                  for s, order in enumerate(stage_orders(schedule, stages, chunks))]
        self.chunks, self.schedule, self.checkpoint = int(chunks), schedule, checkpoint
        self.loss_fn = loss_fn or synthetic_loss
        self.loss_reduction = loss_reduction
        self.output_spec = getattr(pipe, "output_spec", None)
        self.stage_modules: list[nn.Module] = []
        for s in range(stages):
            module = pipe.get_stage_module(s).to(self.stage_devices[s])
            if isinstance(module, fx.GraphModule):
                from torch.distributed.pipelining._IR import _modify_graph_op_device

                _modify_graph_op_device(module, self.stage_devices[s])  # devices burned into the graph by tracing
            self.stage_modules.append(module)
        self._read_graph(pipe.split_gm.graph, stages)
        self.replicated = [[(int(name.rsplit("_", 1)[1]), qualname) for name, qualname in mapping.items()]
                           for mapping in getattr(pipe, "replicated_params", [])]
        shared = {d for d in self.stage_devices if self.stage_devices.count(d) > 1}
        locks: dict[torch.device, threading.Lock] = {}
        # Stages sharing a device share its random generator: checkpointed forwards and their
        # recomputations hold the device's lock so that they draw the same numbers.
        self.rng_locks = [locks.setdefault(d, threading.Lock()) if d in shared else None for d in self.stage_devices]

    def _read_graph(self, graph: fx.Graph, stages: int) -> None:
        """Which values each stage takes, produces, sends and receives, from the split's root graph."""
        self.input_nodes = [n for n in graph.nodes if n.op == "placeholder"]
        calls = {_stage_index(n): n for n in graph.nodes if n.op == "call_module"}
        self.stage_args: list[tuple[Any, ...]] = []
        for s in range(stages):
            node = calls[s]
            if node.kwargs:
                raise ValueError(f"stage {s} of the split takes keyword arguments {list(node.kwargs)}; the traced "
                                 "executor passes positional values only")
            self.stage_args.append(tuple(node.args))
        output = next(n for n in graph.nodes if n.op == "output")
        self.output_arg = output.args[0]
        last = stages - 1
        # received[s]: values of other stages that stage s uses (the output counts as the last stage's).
        self.received: list[list[fx.Node]] = [[] for _ in range(stages)]
        for s in range(stages):
            used = _nodes_in(self.stage_args[s])
            if s == last:
                used += _nodes_in(self.output_arg)
            for node in used:
                source = _stage_index(node)
                if source is not None and source != s and node not in self.received[s]:
                    self.received[s].append(node)
        # produced[s]: values of stage s used anywhere; sent[s]: those with their consuming stages.
        self.produced: list[list[fx.Node]] = [[] for _ in range(stages)]
        self.sent: list[dict[fx.Node, list[int]]] = [{} for _ in range(stages)]
        for s in range(stages):
            for node in self.received[s]:
                self.sent[_stage_index(node)].setdefault(node, []).append(s)  # type: ignore[index]
        for s in range(stages):
            for node in [*_nodes_in(self.stage_args), *_nodes_in(self.output_arg)]:
                if _stage_index(node) == s and node not in self.produced[s]:
                    self.produced[s].append(node)

    # ---- parameters -------------------------------------------------------------------
    @property
    def worker_devices(self) -> list[torch.device]:
        """The device of each worker thread (one per stage; one per device for ``interleaved``)."""
        return worker_devices(self.worker_orders, self.stage_devices)

    def parameters(self) -> list[nn.Parameter]:
        """Every stage's parameters (a tied weight once per stage that holds a copy)."""
        return [p for module in self.stage_modules for p in module.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(stage.FQN, parameter)``: the FQN as in the model (``1.lm_head.weight``)."""
        return [(f"{s}.{name}", p) for s, module in enumerate(self.stage_modules)
                for name, p in module.named_parameters()]

    def _replicated_params(self) -> list[list[nn.Parameter]]:
        return [[operator.attrgetter(qualname)(self.stage_modules[s]) for s, qualname in group]
                for group in self.replicated]

    # ---- one step -----------------------------------------------------------------------
    def step(self, sample: Any, target: Any = None) -> StepResult:
        """Forward and backward of every micro-batch of ``sample`` as the schedule orders them.

        ``sample``: a tensor, a tuple of positional inputs or a dict of keyword inputs. Parameter
        gradients accumulate into ``.grad`` as one ``backward()`` of a plain step would; no
        optimizer step is taken.
        """
        parts = microbatches(sample, self.chunks)
        self._inputs = [self._bind(part) for part in parts]
        m = self.chunks
        rows = sample_rows(sample)
        self._targets = list(target.chunk(m)) if torch.is_tensor(target) and target.dim() > 0 and \
            target.size(0) == rows else [target] * m
        self._weights = [1.0 / m if self.loss_reduction == "mean" else 1.0] * m
        self._stop = {"always": m, "except_last": m - 1, "never": 0}[self.checkpoint]
        self._abort = threading.Event()
        self._boxes: dict[Any, _Mailbox] = {}
        self._boxes_lock = threading.Lock()
        self._states: dict[tuple[int, int], _State] = {}
        self._losses: list[float] = [0.0] * m
        self._recorder = tl.active_recorder()
        replicated = self._replicated_params()
        before = [[None if p.grad is None else p.grad.clone() for p in group] for group in replicated]
        errors: list[Any] = []

        def work(order: list[tuple[int, str, int]], device: torch.device) -> None:
            use_stage_threads()  # the host's cores shared among the stages (pipexplore.host)
            try:
                with use_device(device):
                    for stage, kind, i in order:
                        self._act(stage, kind, i)
            except _Aborted:
                pass
            except BaseException:
                errors.append(sys.exc_info())
                self._abort.set()

        threads = [tl.thread_in_this_context(work, (order, self.stage_devices[order[0][0]]),
                                             name=f"pipexplore-traced{w}")
                   for w, order in enumerate(self.worker_orders) if order]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._boxes.clear()
        self._states.clear()
        if errors:
            raise errors[0][1].with_traceback(errors[0][2])
        self._sum_replicated_grads(replicated, before)
        return StepResult(list(self._losses), sum(loss * w for loss, w in zip(self._losses, self._weights)))

    def _bind(self, part: Any) -> dict[str, Any]:
        """The model's inputs of one micro-batch, by the split's placeholder names."""
        args, kwargs = call_inputs(part)
        names = [str(n.target) for n in self.input_nodes]
        if len(args) > len(names):
            raise TypeError(f"the traced model takes {len(names)} inputs ({', '.join(names)}), got {len(args)} "
                            "positional ones")
        bound = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names:
                raise TypeError(f"the traced model was traced without input {key!r} (its inputs: "
                                f"{', '.join(names)}); give the same inputs as when it was traced")
            bound[key] = value
        for node in self.input_nodes:
            if str(node.target) not in bound:
                if not node.args:
                    raise TypeError(f"input {node.target!r} of the traced model is missing: give the same inputs as "
                                    "when it was traced")
                bound[str(node.target)] = node.args[0]
        return bound

    def _sum_replicated_grads(self, groups: list[list[nn.Parameter]], before: list[list[Optional[Tensor]]]) -> None:
        """Each copy of a replicated parameter gets the step's gradient of all copies together."""
        for params, old in zip(groups, before):
            deltas = [(p.grad - (o if o is not None else 0)) if p.grad is not None else None
                      for p, o in zip(params, old)]
            if all(d is None for d in deltas):
                continue
            for p, o in zip(params, old):
                total = sum(d.to(p.device) for d in deltas if d is not None)
                p.grad = total if o is None else o + total

    # ---- mailboxes --------------------------------------------------------------------
    def _box(self, key: Any) -> _Mailbox:
        with self._boxes_lock:
            box = self._boxes.get(key)
            if box is None:
                box = self._boxes[key] = _Mailbox(self._abort)
            return box

    def _moved(self, value: Any, from_stage: int, to_stage: int, i: int) -> Any:
        """``value`` detached and on ``to_stage``'s device (a ``copy`` span when the device changes)."""
        if not torch.is_tensor(value):
            return value
        value = value.detach()
        source, target = self.stage_devices[from_stage], self.stage_devices[to_stage]
        if source == target:
            return value
        done = self._span(to_stage, "copy", i)
        value = value.to(target)
        if done is not None:
            done()
        return value

    def _span(self, stage: int, phase: str, i: int) -> Optional[Callable[[], None]]:
        recorder = self._recorder
        if recorder is None:
            return None
        device = self.stage_devices[stage]
        start = recorder.mark(device)
        return lambda: recorder.add(stage, device, i, phase, start, recorder.mark(device))

    def _timed(self, stage: int, kind: str, i: int, action: Callable[[], None]) -> None:
        done = self._span(stage, PHASE[kind], i)
        action()
        if done is not None:
            done()

    # ---- actions ------------------------------------------------------------------------
    def _act(self, stage: int, kind: str, i: int) -> None:
        if kind == "F":
            self._forward(stage, i)
        elif kind == "W":
            self._timed(stage, "W", i, lambda: self._weight_grad(stage, i))
        else:
            received = self._receive_grads(stage, i)  # waiting is not work: before the spans
            if i < self._stop:
                self._timed(stage, "R", i, lambda: self._run(stage, i, recomputing=True))
            self._timed(stage, kind, i, lambda: self._backward(stage, i, received, split=kind == "I"))

    def _forward(self, stage: int, i: int) -> None:
        device = self.stage_devices[stage]
        state = self._states.setdefault((stage, i), _State())
        for node in self.received[stage]:
            value, needs_grad = self._box(("act", node, stage, i)).get(device)
            state.leaves[node] = value.requires_grad_(needs_grad) if torch.is_tensor(value) else value
        self._timed(stage, "F", i, lambda: self._run(stage, i, recomputing=False))
        checkpointed = i < self._stop
        for node, consumers in self.sent[stage].items():
            value = state.produced[node]
            # A checkpointed forward ran without autograd: whether a value needs a gradient shows only
            # in the recomputation, so every floating value asks for one.
            needs_grad = torch.is_tensor(value) and (value.is_floating_point() if checkpointed else value.requires_grad)
            state.needs_grad[node] = needs_grad
            for consumer in consumers:
                self._box(("act", node, consumer, i)).put((self._moved(value, stage, consumer, i), needs_grad))
        if checkpointed:
            state.produced, state.loss = {}, None  # recomputed before backward

    def _value(self, stage: int, i: int, state: _State, arg: Any, outputs: Optional[dict[fx.Node, Any]] = None) -> Any:
        def resolve(node: fx.Node) -> Any:
            if node.op == "placeholder":
                return to_device(self._inputs[i][str(node.target)], self.stage_devices[stage])
            if node in state.leaves:
                return state.leaves[node]
            if outputs is not None and node in outputs:
                return outputs[node]
            raise KeyError(f"stage {stage} has no value for {node.name}")

        return fx.node.map_arg(arg, resolve)

    def _run(self, stage: int, i: int, *, recomputing: bool) -> None:
        """The stage's forward (and, on the last stage, the model's output and the loss)."""
        state = self._states[(stage, i)]
        checkpointed = i < self._stop
        device = self.stage_devices[stage]
        lock = self.rng_locks[stage] if checkpointed else None
        if lock is not None:
            lock.acquire()
        try:
            if not checkpointed:
                self._call(stage, i, state)
            elif not recomputing:
                state.rng = []
                save_rng_states(device, state.rng)  # type: ignore[arg-type]
                with torch.no_grad():
                    self._call(stage, i, state)
            else:
                with restore_rng_states(device, state.rng), torch.enable_grad():  # type: ignore[arg-type]
                    self._call(stage, i, state)
        finally:
            if lock is not None:
                lock.release()

    def _call(self, stage: int, i: int, state: _State) -> None:
        args = self._value(stage, i, state, self.stage_args[stage])
        output = self.stage_modules[stage](*args)
        produced = {}
        for node in self.produced[stage]:
            produced[node] = output[node.args[1]] if node.op == "call_function" else output
        state.produced = produced
        if stage < len(self.stage_modules) - 1:
            return
        flat = self._value(stage, i, state, self.output_arg, produced)
        model_output = self._model_output(flat)
        loss = self.loss_fn(model_output, to_device(self._targets[i], self.stage_devices[stage]))
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                            f"{tuple(loss.shape) if torch.is_tensor(loss) else ''}")
        self._losses[i] = float(loss.detach())
        state.loss = loss * self._weights[i]

    def _model_output(self, flat: Any) -> Any:
        """The output as the model returns it, rebuilt from the split's flat outputs."""
        return model_output(flat, self.output_spec)

    def _receive_grads(self, stage: int, i: int) -> dict[fx.Node, Optional[Tensor]]:
        """For each value this stage sent, the sum of its consumers' gradients (None: none needed)."""
        device = self.stage_devices[stage]
        state = self._states[(stage, i)]
        grads: dict[fx.Node, Optional[Tensor]] = {}
        for node, consumers in self.sent[stage].items():
            if not state.needs_grad.get(node):
                continue
            parts = [self._box(("grad", node, consumer, i)).get(device) for consumer in consumers]
            parts = [g for g in parts if g is not None]
            grads[node] = sum(parts[1:], parts[0]) if parts else None
        return grads

    def _backward(self, stage: int, i: int, received: dict[fx.Node, Optional[Tensor]], *, split: bool) -> None:
        """B (``split=False``): the whole backward. I (``split=True``): input gradients only, the
        weight gradients left to W."""
        state = self._states[(stage, i)]
        pairs: list[tuple[Tensor, Optional[Tensor]]] = []
        if state.loss is not None:
            pairs.append((state.loss, None))
        for node, grad in received.items():
            value = state.produced.get(node)
            if grad is not None and torch.is_tensor(value) and value.requires_grad:
                pairs.append((value, grad))
        inputs = [leaf for leaf in state.leaves.values() if torch.is_tensor(leaf) and leaf.requires_grad]
        if not split or not inputs:  # with no input that needs a gradient, I does all the work, W none
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            input_grads = [leaf.grad for leaf in inputs]
        else:
            from torch.distributed.pipelining._backward import stage_backward_input

            if pairs:
                grads, state.param_groups = stage_backward_input(
                    [t for t, _ in pairs], [g if g is not None else torch.ones_like(t) for t, g in pairs],
                    inputs, self.stage_modules[stage].parameters())
                input_grads = list(grads)
            else:
                input_grads = [None] * len(inputs)
        by_leaf = {id(leaf): g for leaf, g in zip(inputs, input_grads)}
        for node, leaf in state.leaves.items():
            if torch.is_tensor(leaf) and leaf.requires_grad:
                source: int = _stage_index(node)  # type: ignore[assignment]
                self._box(("grad", node, stage, i)).put(self._moved(by_leaf.get(id(leaf)), stage, source, i))
        if split and inputs and pairs:
            state.leaves, state.produced, state.loss = {}, {}, None  # W needs only the parameter groups
        else:
            del self._states[(stage, i)]

    def _weight_grad(self, stage: int, i: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward_weight

        state = self._states.pop((stage, i), None)
        if state is not None and state.param_groups is not None:
            stage_backward_weight(self.stage_modules[stage].parameters(), state.param_groups)


def _nodes_in(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, lambda n: found.append(n) or n)
    return found


def run_traced_step(model: nn.Module, sample: Any, plan: Plan, *, target: Any = None, loss_fn: Optional[LossFn] = None,
                    optimizer: Optional[OptimizerFactory] = None, warmup: int = 1, run: Any = 0, repeats: int = 3,
                    return_grads: bool = False) -> RunResult:
    """Train a traced copy of ``model`` in this process as ``plan`` says: ``warmup`` steps, then
    ``repeats`` measured ones (the median step is kept).

    The model is split at the plan's candidate names (``plan.layer_table['name']``) by
    :func:`pipexplore.trace.split` on the plan's first micro-batch, and the stages run in worker
    threads with the plan's schedule, devices and checkpointing (:class:`TracedExecutor`).
    ``sample`` is a tensor, a tuple of positional inputs or a dict of keyword inputs;
    ``loss_fn(output, target)`` gets the output as the model returns it. With ``return_grads``,
    ``result.metrics['grads']`` holds the last step's gradients by ``'stage.FQN'``, taken before
    the optimizer step.

    Example::

        result = run_traced_step(gpt2, {"input_ids": ids, "labels": ids}, plan, loss_fn=lambda out, _: out.loss)
        result.loss, result.timeline
    """
    from pipexplore.models.trace import split

    if plan.executor == "autograd":
        raise ValueError(f"the autograd executor (the GPipe module) takes an nn.Sequential, not "
                         f"{type(model).__name__}: choose executor='threads' (traced stages in this process) or "
                         "'processes'")
    if plan.schedule == "async-backends":
        raise ValueError(f"schedule 'async-backends' serves nn.Sequential stages, not the traced stages of "
                         f"{type(model).__name__}: choose gpipe, 1f1b, interleaved or zero-bubble")
    names = [str(n) for n in plan.layer_table["name"]]
    pipe = split(copy.deepcopy(model), first_microbatch(sample, plan.chunks), [names[s] for s in plan.splits])
    executor = TracedExecutor(pipe, devices=list(plan.devices[: plan.num_devices]), chunks=plan.chunks,
                              schedule=plan.schedule, checkpoint=plan.checkpoint, loss_fn=loss_fn or synthetic_loss)
    opt = make_optimizer(optimizer, executor.parameters())
    grads: dict[str, Tensor] = {}

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = executor.step(sample, target).loss
        if return_grads:
            grads.clear()
            grads.update({name: p.grad.detach().cpu().clone() for name, p in executor.named_parameters()
                          if p.grad is not None})
        opt.step()
        return loss

    timeline, loss = measure(step, warmup, run, repeats, executor.worker_devices)
    measured = result(plan, timeline, loss, sample, {str(d) for d in executor.stage_devices}, executor.parameters())
    if return_grads:
        measured.metrics["grads"] = dict(grads)
    return measured


def run(job: StepJob) -> RunResult:
    """The executor protocol (:mod:`pipexplore.executors`): :func:`run_traced_step` of ``job``."""
    return run_traced_step(job.model, job.sample, job.plan, target=job.target, loss_fn=job.loss_fn,
                           optimizer=job.optimizer, warmup=job.warmup, run=job.run, repeats=job.repeats)
