"""Traced models in this process: the stages of torch's split, each in a worker thread, under any schedule.

:func:`pipexplore.models.trace.split` cuts a model that is not an ``nn.Sequential`` into stage modules
(``pipe.split_gm``'s ``submod_k``). A stage may take several values (hidden states, masks,
positions) from several earlier stages and the model's inputs; the last stage also builds the
model's output as the model returns it (a Hugging Face ``ModelOutput`` too) and computes the loss.
Each value crosses between workers through a mailbox, detached at the boundary, and its gradient
comes back the same way (summed over its consumers). The workers, their actions (``F``, ``B``,
``R`` under checkpointing, ``I``/``W`` for zero-bubble), the timeline's spans, abort and cancel are
those of the schedule executor: the core both share, :mod:`pipexplore.executors._actions`.

Parameters the tracer replicates into several stages (tied weights such as GPT-2's ``wte`` and
``lm_head``) get the sum of their copies' gradients after each step, so the copies train as one.

Example::

    pipe = trace.split(copy.deepcopy(model), first_microbatch(batch, 4), ["transformer.h.2"])
    executor = TracedExecutor(pipe, devices=["cpu", "cpu"], chunks=4, schedule="1f1b",
                              loss_fn=lambda out, _: out.loss)
    executor.step(batch).loss

``executor.abort()``, a cancelled :class:`~pipexplore.cancel.CancelToken` or a KeyboardInterrupt
stops every worker after its current action; ``step`` joins them all and raises
:class:`~pipexplore.cancel.Cancelled` (or the interrupt).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, cast

import torch
from torch import Tensor, fx, nn

from pipexplore.cancel import check_cancelled
from pipexplore.executors._actions import ActionExecutor, StageState, StepResult, check_options, plan_workers
from pipexplore.executors.base import RunResult, StepJob, train_and_measure
from pipexplore.devices import as_device
from pipexplore.samples import to_device
from pipexplore.models.inputs import call_inputs, first_microbatch, microbatches, model_output, sample_rows
from pipexplore.plan import Plan
from pipexplore.timeline.saved import tensor_bytes
from pipexplore.schedules import SCHEDULES, is_multi_stage
from pipexplore.training import LossFn, OptimizerFactory, Training

__all__ = ["NAME", "TracedExecutor", "run", "run_traced_step"]

NAME = "threads"


@dataclass
class _State(StageState):
    """What one stage keeps for one micro-batch between its forward and its backward."""

    leaves: dict[fx.Node, Any] = field(default_factory=dict)
    produced: dict[fx.Node, Any] = field(default_factory=dict)
    needs_grad: dict[fx.Node, bool] = field(default_factory=dict)
    loss: Optional[Tensor] = None


def _stage_index(node: fx.Node) -> Optional[int]:
    """The stage a root-graph node's value comes from (a stage call or a getitem of one), or None."""
    if node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]  # type: ignore[assignment]
    if node.op == "call_module" and str(node.target).startswith("submod_"):
        return int(str(node.target).rsplit("_", 1)[1])
    return None


class TracedExecutor(ActionExecutor):
    """Runs training steps of a traced model's stages with an explicit pipeline schedule, in this process.

    Args:
        pipe: what :func:`pipexplore.models.trace.split` returns (a ``torch.distributed.pipelining`` Pipe).
        devices: one per stage (one per device for the multi-stage schedules: see
            :func:`pipexplore.executors._actions.plan_workers`); default CPU.
        chunks: micro-batches per step; the batch must divide evenly (traced graphs have fixed shapes).
        schedule: one of :data:`pipexplore.schedules.SCHEDULES` (``zero-bubble`` is ZB-H1), or the
            path of a CSV file in torch's format (its ranks' orders; ``devices``: one a rank).
        checkpoint: ``always``, ``except_last`` or ``never``: checkpointed micro-batches keep only
            their stage inputs and run forward again (same random numbers) before backward.
        loss_fn: ``loss_fn(output, target)`` on the output as the model returns it; default:
            :func:`pipexplore.training.synthetic_loss` (the mean square of the floating outputs).
        loss_reduction: ``'mean'`` (the micro-batch losses averaged, so gradients equal one step on
            the whole batch with a mean loss) or ``'sum'``.

    Example::

        executor = TracedExecutor(pipe, devices=["cpu"] * pipe.num_stages, chunks=4, schedule="1f1b")
        result = executor.step({"input_ids": ids, "labels": ids})   # parameter .grad as one plain step
    """

    worker_name = "pipexplore-traced"

    def __init__(self, pipe: Any, *, devices: Optional[Sequence[Any]] = None, chunks: int = 1,
                 schedule: str = "1f1b", checkpoint: str = "never", loss_fn: Optional[LossFn] = None,
                 loss_reduction: str = "mean") -> None:
        chunks = check_options(schedule, checkpoint, chunks, loss_reduction)
        stages = int(pipe.num_stages)
        device_list = [as_device(d) for d in devices] if devices else [torch.device("cpu")] * stages
        if not is_multi_stage(schedule) and len(device_list) < stages:
            raise ValueError(f"{stages} stages need {stages} devices, got {len(device_list)} "
                             f"({', '.join(map(str, device_list))}): give one device per stage")
        self.stage_devices, self.worker_orders, self.virtual_stages = plan_workers(schedule, stages, device_list,
                                                                                   chunks)
        self.chunks, self.schedule, self.checkpoint = chunks, schedule, checkpoint
        self.loss_fn = Training.of(loss_fn).loss_fn
        self.loss_reduction = loss_reduction
        self.output_spec = getattr(pipe, "output_spec", None)
        modules = []
        for s in range(stages):
            module = pipe.get_stage_module(s).to(self.stage_devices[s])
            if isinstance(module, fx.GraphModule):
                from torch.distributed.pipelining._IR import _modify_graph_op_device

                _modify_graph_op_device(module, self.stage_devices[s])  # devices burned into the graph by tracing
            modules.append(module)
        self._place(modules)
        self._read_graph(pipe.split_gm.graph, stages)
        self.replicated = [[(int(name.rsplit("_", 1)[1]), qualname) for name, qualname in mapping.items()]
                           for mapping in getattr(pipe, "replicated_params", [])]

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
        replicated = self._replicated_params()
        before = [[None if p.grad is None else p.grad.clone() for p in group] for group in replicated]
        outcome = self._run_workers(m)
        self._sum_replicated_grads(replicated, before)
        return outcome

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
                # cast: some delta is a tensor (were all None, the group was skipped), so the sum is one
                total = cast(Tensor, sum(d.to(p.device) for d in deltas if d is not None))
                p.grad = total if o is None else o + total

    # ---- actions ------------------------------------------------------------------------
    def _forward(self, stage: int, i: int) -> None:
        device = self.stage_devices[stage]
        state = self._states.setdefault((stage, i), _State())
        for node in self.received[stage]:
            value, needs_grad = self._box(("act", node, stage, i)).get(device)
            state.leaves[node] = value.requires_grad_(needs_grad) if torch.is_tensor(value) else value
        self._timed(stage, "F", i, lambda: self._run(stage, i, state, recomputing=False))
        checkpointed = i < self._stop
        for node, consumers in self.sent[stage].items():
            value = state.produced[node]
            # A checkpointed forward ran without autograd: whether a value needs a gradient shows only
            # in the recomputation, so every floating value asks for one.
            needs_grad = torch.is_tensor(value) and (value.is_floating_point() if checkpointed else value.requires_grad)
            state.needs_grad[node] = needs_grad

            def wrap(copy: Any, needs_grad: bool = needs_grad) -> tuple[Any, bool]:
                return copy, needs_grad

            for consumer in consumers:
                self._send(self._box(("act", node, consumer, i)), value, stage, consumer, i, wrap)
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

    def _kept_bytes(self, stage: int, state: _State) -> int:
        return tensor_bytes([v for v in state.leaves.values() if torch.is_tensor(v)])

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
        state.loss = self._loss(stage, i, model_output)

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
        input_grads = self._backward_pass(stage, i, state, pairs, inputs, split=split)
        by_leaf = {id(leaf): g for leaf, g in zip(inputs, input_grads)}
        for node, leaf in state.leaves.items():
            if torch.is_tensor(leaf) and leaf.requires_grad:
                source: int = _stage_index(node)  # type: ignore[assignment]
                self._send(self._box(("grad", node, stage, i)), by_leaf.get(id(leaf)), stage, source, i)
        self._backward_done(stage, i, state)


def _nodes_in(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []

    def keep(n: fx.Node) -> fx.Node:
        found.append(n)
        return n

    fx.node.map_arg(value, keep)
    return found


def run_traced_step(model: nn.Module, sample: Any, plan: Plan, *, target: Any = None, loss_fn: Optional[LossFn] = None,
                    optimizer: Optional[OptimizerFactory] = None, warmup: int = 1, run: Any = 0, repeats: int = 3,
                    return_grads: bool = False) -> RunResult:
    """Train a traced copy of ``model`` in this process as ``plan`` says: ``warmup`` steps, then
    ``repeats`` measured ones (the median step is kept).

    The model is split at the plan's candidate names (``plan.layer_table['name']``) by
    :func:`pipexplore.models.trace.split` on the plan's first micro-batch — once per split of a model of
    this shape in the session (:func:`pipexplore.models.trace.pipes.traced_pipe`: a rerun gets a
    copy of the kept pipe with the model's weights as they are) — and the stages run in worker
    threads with the plan's schedule, devices and checkpointing (:class:`TracedExecutor`).
    ``sample`` is a tensor, a tuple of positional inputs or a dict of keyword inputs;
    ``loss_fn(output, target)`` gets the output as the model returns it (the loss, ``optimizer`` and
    ``target`` resolved here: :meth:`pipexplore.training.Training.of`). With ``return_grads``,
    ``result.metrics['grads']`` holds the last step's gradients by ``'stage.FQN'``, taken before
    the optimizer step.

    Example::

        result = run_traced_step(gpt2, {"input_ids": ids, "labels": ids}, plan, loss_fn=lambda out, _: out.loss)
        result.loss, result.timeline
    """
    from pipexplore.models.trace.pipes import traced_pipe

    training = Training.of(loss_fn, optimizer, target)
    if plan.executor == "autograd":
        raise ValueError(f"the autograd executor (the GPipe module) takes an nn.Sequential, not "
                         f"{type(model).__name__}: choose executor='threads' (traced stages in this process) or "
                         "'processes'")
    if plan.schedule == "async-backends":
        raise ValueError(f"schedule 'async-backends' serves nn.Sequential stages, not the traced stages of "
                         f"{type(model).__name__}: choose one of {', '.join(SCHEDULES)}")
    names = [str(n) for n in plan.layer_table["name"]]
    pipe = traced_pipe(model, first_microbatch(sample, plan.chunks), [names[s] for s in plan.splits])
    check_cancelled()  # tracing takes a while: a run cancelled meanwhile starts no step
    executor = TracedExecutor(pipe, devices=list(plan.devices[: plan.num_devices]), chunks=plan.chunks,
                              schedule=plan.schedule, checkpoint=plan.checkpoint, loss_fn=training.loss_fn)
    grads: dict[str, Tensor] = {}

    def keep_grads() -> None:
        grads.clear()
        grads.update({name: p.grad.detach().cpu().clone() for name, p in executor.named_parameters()
                      if p.grad is not None})

    measured = train_and_measure(executor, plan, sample, training, warmup=warmup, run=run, repeats=repeats,
                                 after_backward=keep_grads if return_grads else None)
    if return_grads:
        measured.metrics["grads"] = dict(grads)
    return measured


def run(job: StepJob) -> RunResult:
    """The executor protocol (:mod:`pipexplore.executors`): :func:`run_traced_step` of ``job``."""
    return run_traced_step(job.model, job.sample, job.plan, **job.training.keywords(), warmup=job.warmup, run=job.run,
                           repeats=job.repeats)
