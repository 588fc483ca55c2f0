"""Multi-process steps: one process per rank, running ``torch.distributed.pipelining`` schedules.

The ranks are the workers of a warm pool (:mod:`pipexplore.executors.pool`): started once with a clean
entry point (a user's script is never re-run in them), they meet on a free loopback port (gloo
on CPUs, NCCL on GPUs) and stay up between runs on the same devices, so a rerun pays no process
start-up; start-up is reported apart (``metrics['startup_seconds']``). Each run ships the model's
stages, ``loss_fn``, ``optimizer`` and batch by value with ``cloudpickle`` (notebook classes,
lambdas and closures included); a traced model is split here (its early check) and the split is
sent to the ranks (:mod:`pipexplore.models.trace.sent`), each of which builds its stages from it
with the model's weights, and keeps it while the pool is warm (a rerun copies the rank's kept pipe:
:mod:`pipexplore.models.trace.pipes`). Where the split cannot be sent, each rank splits the model by
torch's tracer itself (a new split of a model it exported: its kept export);
``metrics['traced_ranks']`` counts the ranks that traced, ``metrics['exported_ranks']`` those of
them that exported the model.
Each rank builds its stage(s) with ``PipelineStage`` and runs
the torch schedule for the plan (a CSV schedule: torch's ``_PipelineScheduleRuntime`` loading
the file, ``_load_csv``, which adds the sends and receives); it times each stage's ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` on the host clock, which all processes
on one machine share, then steps each of its stages' optimizers (one per stage) and times that
too (phase ``optimizer``, micro-batch -1), and sends its events back. A rank that raises, dies or hangs fails the run
with a :class:`DistributedRunError` naming it; every process is reaped and the pool rebuilt. So
does a cancelled run (:class:`~pipexplore.cancel.Cancelled`, within a poll of the ranks) and a
KeyboardInterrupt. The loss reported is the first step's (at the model's weights), as in every
executor; the measured step's is in ``measured_losses``.

Example::

    result = run_processes(model, sample, plan)       # plan.executor == "processes"
    result.timeline                                   # every rank's events, one schema
"""
from __future__ import annotations

import io
import math
import numbers
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch import nn

from pipexplore.cancel import check_cancelled, current_token
from pipexplore.samples import to_device
from pipexplore.host import StealMeter
from pipexplore.models.inputs import call_inputs, first_microbatch, sample_rows
from pipexplore.plan import Plan
from pipexplore.executors.forkserver import installed_modules
from pipexplore.executors.tied import (own_parameters, stage_shared_parameters, sum_tied_grads, tied_groups,
                                       tied_parameters)
from pipexplore.executors.pool import (DistributedRunError, ensure_picklable, pack_job, preload_modules, shutdown_pool,
                                       warm_pool)
from pipexplore.timeline import COLUMNS
from pipexplore.models.trace import MULTI_STAGE, SCHEDULE_CLASSES, sent
from pipexplore.schedules import check_schedule, csv_schedule, is_csv, stage_ranks
from pipexplore.training import LossFn, OptimizerFactory, Training

__all__ = ["run_processes", "default_timeout", "shutdown_pool", "DistributedRunError", "SCHEDULE_CLASSES"]


#: The default timeout is this many predicted steps, and never less than ``MIN_TIMEOUT`` seconds.
TIMEOUT_STEPS = 20
MIN_TIMEOUT = 30.0


def default_timeout(plan: Plan, warmup: int = 1) -> float:
    """Seconds a run of ``warmup`` + 1 steps of ``plan`` may take in processes, start-up apart.

    ``max(30 s, 20 × (warmup + 1) × the predicted step)``; process start-up is bounded on its own
    (:data:`pipexplore.executors.pool.STARTUP_TIMEOUT`).

    Example::

        default_timeout(plan)            # 30.0 for a step predicted at 10 ms
    """
    from pipexplore.timeline import step_time

    predicted = step_time(plan.predicted)
    if not math.isfinite(predicted):
        return MIN_TIMEOUT
    return max(MIN_TIMEOUT, TIMEOUT_STEPS * (warmup + 1) * predicted)


def check_timeout(timeout: Any) -> Optional[float]:
    """``timeout`` as float seconds (None stays None), or a clear error naming it."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__} {timeout!r}")
    if not (math.isfinite(timeout) and timeout > 0):  # type: ignore[operator]  # (typeshed's Real has no __gt__)
        raise ValueError(f"timeout must be a positive, finite number of seconds (or None for the default derived "
                         f"from the predicted step), not {timeout!r}")
    return float(timeout)


def _timed(stage: Any, spans: list, name: str, phase_of: Callable[..., str]) -> None:
    original = getattr(stage, name)

    def timed(chunk: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = original(chunk, *args, **kwargs)
        if stage.device.type == "cuda":
            torch.cuda.synchronize(stage.device)
        spans.append((stage.stage_index, str(stage.device), chunk, phase_of(*args, **kwargs), start,
                      time.perf_counter()))
        return out

    setattr(stage, name, timed)


def _no_self_warmup(stage: Any, rank: int) -> None:
    """torch warms a stage's links up by sending to its neighbours' ranks (2.13: traced stages;
    2.11: every stage), its own too where the neighbour shares it (a V schedule's middle stages):
    gloo cannot send to itself. The warm-up leaves those out (torch passes such values within the
    rank anyway); a torch without the warm-up is left as it is."""
    original = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if original is not None:
        stage._get_init_p2p_neighbors_ops = lambda: [op for op in original() if op.peer != rank]


def _rank_step(rank: int, world: int, job: dict[str, Any]) -> bytes:
    """One rank of a run (in a pool worker): build its stages, run ``warmup`` + ``repeats`` steps,
    return the measured steps' events and losses."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules

    device = torch.device(job["devices"][rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    stages: list = []
    traced_here = exported_here = 0
    if job.get("traced") is not None:
        # A traced model: every rank builds its own stages from the split the caller made and sent
        # (or, where it could not be sent, traces the same split itself); a rank of the warm pool
        # keeps the pipe (traced_pipes), so a rerun of the split copies it.
        from pipexplore.models.trace import pipes as traced_pipes

        traced = job["traced"]
        if traced.get("split") is not None:  # the caller's split, sent: kept as this rank's (unless kept)
            def received() -> Any:
                try:
                    return sent.loads(traced["split"])
                except Exception:  # (a split this rank cannot rebuild: it traces the model itself below)
                    return None

            traced_pipes.keep_traced(traced["model"], traced["mb_args"], traced["split_points"], received,
                                     mb_kwargs=traced["mb_kwargs"])
        before, exported_before = traced_pipes.traces, traced_pipes.exports
        pipe = traced_pipes.traced_pipe(traced["model"], traced["mb_args"], traced["split_points"],
                                        mb_kwargs=traced["mb_kwargs"], owned=True)  # the rank's own copy
        traced_here, exported_here = traced_pipes.traces - before, traced_pipes.exports - exported_before
        num_stages = pipe.num_stages
        layout = job.get("layout") or [s % world for s in range(num_stages)]
        indices = [s for s in range(num_stages) if layout[s] == rank]
        # parameters several stages hold (a tied embedding and head): summed after every backward
        tied = tied_groups(tied_parameters(pipe), rank_of=layout.__getitem__, rank=rank)
        for s in indices:
            stage = pipe.build_stage(s, device)
            if {s - 1, s + 1} & set(indices):
                _no_self_warmup(stage, rank)
            stages.append(stage)
    else:
        num_stages = job["num_stages"]
        indices = sorted(job["stages"])
        tied = tied_groups(job["tied"], rank_of=job["layout"].__getitem__, rank=rank)  # parameters stages share
        for s in indices:
            module = job["stages"][s].to(device)
            stages.append(PipelineStage(module, s, num_stages, device))
            if {s - 1, s + 1} & set(indices):
                _no_self_warmup(stages[-1], rank)
    params = own_parameters([list(stage.submod.parameters()) for stage in stages])  # each stepped once
    spans: list = []
    for stage in stages:
        _timed(stage, spans, "forward_one_chunk", lambda *a, **k: "forward")
        _timed(stage, spans, "backward_one_chunk",
               lambda *a, full_backward=True, **k: "backward" if full_backward else "input_grad")
        _timed(stage, spans, "backward_weight_one_chunk", lambda *a, **k: "weight_grad")
    name = job["schedule_class"]
    loss_fn = job["loss_fn"]
    if job.get("traced") is not None:
        # The loss sees the output as the unsplit model returns it (a ModelOutput: out.logits, out["logits"]).
        from pipexplore.models.inputs import model_output

        user_loss, spec = loss_fn, getattr(pipe, "output_spec", None)
        loss_fn = lambda output, target: user_loss(model_output(output, spec), target)  # noqa: E731
    schedule = getattr(schedules, name)(stages if name in MULTI_STAGE else stages[0], n_microbatches=job["chunks"],
                                        loss_fn=loss_fn)
    if job.get("schedule_csv") is not None:  # a _PipelineScheduleRuntime: every rank's order from the file
        _load_schedule_csv(schedule, **job["schedule_csv"])
    # One optimizer per stage (as the in-process executors have them): this rank steps its own once
    # its schedule is done, each timed as the stage's "optimizer" event.
    optimizers = [job["optimizer"](stage_params) if stage_params else None for stage_params in params]
    has_first, has_last = 0 in indices, num_stages - 1 in indices
    # The model's inputs as it takes them (positional and keyword); torch's schedule cuts each into
    # micro-batches and feeds the first stage.
    args = tuple(to_device(a, device) for a in job["args"]) if has_first else ()
    inputs = {k: to_device(v, device) for k, v in job["kwargs"].items()} if has_first else {}
    target = job["target"].to(device) if torch.is_tensor(job["target"]) else job["target"]
    losses: list = []
    first_losses: list[float] = []
    measured_spans: list[list] = []
    measured_losses: list[list[float]] = []
    grads = None
    last = job["warmup"] + job.get("repeats", 1) - 1
    for step in range(last + 1):
        for optimizer in optimizers:
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
        spans.clear()
        losses = []
        dist.barrier()
        kwargs: dict[str, Any] = {}
        if has_last:
            kwargs.update(target=target, losses=losses)
        schedule.step(*args, **inputs, **kwargs)
        sum_tied_grads(tied, {s: stage.submod for s, stage in zip(indices, stages)})
        if step == 0:  # at the model's weights, before any optimizer step: the loss the run reports
            first_losses = [float(loss.detach()) for loss in losses]
        if job["return_grads"] and step == last:
            grads = {f"{s}.{n}": p.grad.detach().cpu() for s, st in zip(indices, stages)
                     for n, p in st.submod.named_parameters() if p.grad is not None}
        for s, optimizer in zip(indices, optimizers):  # the step ends at the last update
            start = time.perf_counter()
            if optimizer is not None:
                optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            spans.append((s, str(device), -1, "optimizer", start, time.perf_counter()))
        if step >= job["warmup"]:  # a measured step: its events and its micro-batches' losses
            measured_spans.append(list(spans))
            measured_losses.append([float(loss.detach()) for loss in losses])
    dist.barrier()  # every rank done before the next run may start sending
    # Plain bytes: tensors sent as such would be shared-memory handles that die with this process.
    buffer = io.BytesIO()
    torch.save({"steps": measured_spans, "losses": measured_losses, "first_losses": first_losses, "grads": grads,
                "traced": traced_here, "exported": exported_here}, buffer)
    return buffer.getvalue()


def _load_schedule_csv(schedule: Any, text: str, format: str) -> None:
    """Have torch's runtime load a CSV schedule (its ``_load_csv`` reads a file: the text is written
    to a temporary one), which checks it and lowers it to sends and receives."""
    import os
    import tempfile

    handle, path = tempfile.mkstemp(suffix=".csv", prefix="pipexplore-schedule-")
    try:
        with os.fdopen(handle, "w", newline="") as file:
            file.write(text)
        schedule._load_csv(path, format=format)
    finally:
        os.unlink(path)


def _check_traced_split(model: nn.Module, mb_args: Any, mb_kwargs: dict[str, Any], points: list[str]) -> Any:
    """Trace here first, so that a model that cannot be traced, or whose later stages read the
    model's inputs themselves, fails fast and clearly, before any process starts. Once per split
    of a model of this shape in the session (:func:`pipexplore.models.trace.pipes.traced_graph`:
    another split, other input shapes, or a model whose modules, parameters, buffers or config
    changed is traced anew; a split that failed is never kept). Returns the split (its weights on
    the meta device), which the ranks are sent."""
    from pipexplore.models.trace.stage_inputs import inputs_past_first_stage, outputs_before_last_stage
    from pipexplore.models.trace.pipes import traced_graph

    graph = traced_graph(model, mb_args, points, mb_kwargs=mb_kwargs)
    early = outputs_before_last_stage(graph)
    if early:
        raise ValueError(f"{type(model).__name__} returns values that stages before the last make "
                         f"({', '.join(early)}), and torch's pipelining gives loss_fn the last stage's outputs "
                         "only, so the loss would differ from the model's: run in this process "
                         "(executor='threads'), whose loss sees the whole output")
    late = inputs_past_first_stage(graph)
    if late:
        listed = ", ".join(f"{name!r} (stage {stage})" for name, stage in late.items())
        raise ValueError(f"torch's pipelining feeds the model's inputs to the first stage only, but later stages "
                         f"read {listed}: run in this process (executor='threads'), or leave such inputs out of the "
                         f"sample (e.g. compute the loss in loss_fn from the logits, with the labels as its target)")
    return graph


#: Each kept split pickled once for the ranks (a rerun of it sends the same bytes); gone with the split.
_SENT: "weakref.WeakKeyDictionary[Any, Optional[bytes]]" = weakref.WeakKeyDictionary()


def _sendable(skeleton: Any) -> Optional[bytes]:
    """``skeleton`` (the kept split :func:`_check_traced_split` returns) pickled for the ranks,
    once while it is kept (:func:`pipexplore.models.trace.sent.dumps`; None: it cannot be sent)."""
    if skeleton not in _SENT:
        _SENT[skeleton] = sent.dumps(skeleton)
    return _SENT[skeleton]


def _mean(losses: list[float]) -> float:
    """The step's loss from its micro-batches' (equal sizes: torch's schedules split evenly)."""
    return sum(losses) / len(losses) if losses else float("nan")


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if torch.is_tensor(value) else value


def _pack(job: dict[str, Any], model: nn.Module) -> bytes:
    """One rank's job as bytes; if it cannot be pickled, a TypeError naming the model's culprit."""
    try:
        return pack_job(_rank_step, {"job": job})
    except Exception:
        ensure_picklable({"model": model})
        raise


def _check_one_gpu_a_rank(devices: list[str]) -> None:
    """Refuse ranks that share a GPU: NCCL will not put two ranks on one device ("Duplicate GPU
    detected") and gloo sends no CUDA tensors between processes (measured on an H100)."""
    seen: dict[torch.device, int] = {}
    for rank, name in enumerate(devices):
        device = torch.device(name)
        if device.type != "cuda":
            continue
        device = torch.device("cuda", device.index or 0)
        if device in seen:
            raise ValueError(f"the processes executor runs one rank a GPU, but ranks {seen[device]} and {rank} are "
                             f"both on {device} (NCCL refuses two ranks on one GPU, and gloo sends no GPU tensors "
                             f"between processes): give each rank a GPU of its own, or run the plan with the "
                             f"threads or autograd executor, whose stages may share one")
        seen[device] = rank


def run_processes(model: nn.Module, sample: Any, plan: Plan, *, target: Any = None,
                  loss_fn: Optional[LossFn] = None, optimizer: Optional[OptimizerFactory] = None, run: Any = 0,
                  warmup: int = 1, repeats: int = 1, timeout: Optional[float] = None,
                  return_grads: bool = False) -> Any:
    """Run ``warmup`` + ``repeats`` steps of ``plan`` in one process per device; keep the measured
    step of median time (as the in-process executors do).

    Returns a :class:`pipexplore.executors.step.RunResult` whose timeline holds every rank's events
    (``device`` is the rank's device, ``stage`` the pipeline stage), whose ``loss`` is the first
    step's and ``measured_losses`` the measured steps' (``metrics['losses']``: the kept step's, per
    micro-batch).
    ``metrics['startup_seconds']`` is the process start-up this run paid (0 when the warm pool was
    reused) and ``metrics['worker_pids']`` the ranks' process ids. With ``return_grads`` the parameter
    gradients of the last step are in ``metrics['grads']`` (by ``'stage.param'``).

    ``sample`` is one tensor for an ``nn.Sequential``; a traced model takes it as it takes its
    inputs (a tensor, a tuple of positional inputs or a dict of keyword inputs such as
    ``input_ids`` and ``labels``), cut into micro-batches by torch's schedule.
    The model's stages, ``loss_fn(output, target)``, ``optimizer(parameters)`` (resolved here,
    once: :meth:`pipexplore.training.Training.of`; without ``target``, torch's schedules get
    :meth:`~pipexplore.training.Training.schedule_target`) and the batch are sent by value with
    cloudpickle, so classes, lambdas and closures defined in a notebook or ``__main__`` work;
    something that cannot be pickled is named in a TypeError before any process starts.
    ``timeout`` bounds the steps in seconds (default :func:`default_timeout`); start-up is bounded
    apart. A rank that raises, dies or hangs raises :class:`DistributedRunError` naming it, and
    every process is reaped (so are they on KeyboardInterrupt, and when the run is cancelled:
    :class:`~pipexplore.cancel.Cancelled`, see :func:`pipexplore.cancel.cancel_scope`).

    Example::

        plan = Plan(pipexplore.profile(model, x), (4,), ("cpu", "cpu"), chunks=4, executor="processes")
        result = run_processes(model, x, plan, target=y, loss_fn=lambda out, y: ((out - y) ** 2).mean())
        result.loss, result.metrics["startup_seconds"]
    """
    import pandas as pd

    from pipexplore.executors.base import result as _result

    training = Training.of(loss_fn, optimizer, target)
    timeout = check_timeout(timeout)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats is the number of measured steps, a whole number from 1, got {repeats!r}")
    csv_file = csv_schedule(plan.schedule) if is_csv(plan.schedule) else None
    if csv_file is None and plan.schedule not in SCHEDULE_CLASSES:
        raise ValueError(f"the processes executor runs {', '.join(SCHEDULE_CLASSES)} or a CSV schedule file; not "
                         f"{plan.schedule!r}")
    traced = not isinstance(model, nn.Sequential)
    crossing = [r for r in plan.skip_routes if r.crosses]
    if crossing and not traced:
        raise ValueError("skip routes that cross stages cannot run in separate processes; move the split points "
                         "so that every stash and its pop share a stage, or trace the model")
    if not traced and not torch.is_tensor(sample):
        raise TypeError(f"the processes executor takes one tensor as the sample of an nn.Sequential, got "
                        f"{type(sample).__name__}")
    args, kwargs = call_inputs(sample)
    rows = sample_rows(sample)
    # What torch's class refuses, refused here with its reason (e.g. 1F1B with fewer micro-batches
    # than stages, DualPipeV with fewer than its stages, ZB-V with other than two stages a rank); a CSV
    # file that does not schedule the plan's ranks and micro-batches.
    check_schedule(plan.schedule, plan.num_devices, plan.chunks, plan.num_stages // plan.num_devices)
    if rows % plan.chunks:
        raise ValueError(f"torch pipelining splits the batch evenly: {rows} rows do not divide into "
                         f"{plan.chunks} chunks")
    target = training.schedule_target(rows)  # torch's schedules want a target for the loss
    # (the model is checked when it is packed)
    ensure_picklable({"loss_fn": training.loss_fn, "optimizer": training.optimizer, "target": target})
    world = plan.num_devices
    devices = list(plan.devices[:world])
    _check_one_gpu_a_rank(devices)
    layout = stage_ranks(plan.schedule, plan.num_stages, world)  # each stage's rank (a V for zbv, dualpipev; a file's)
    job = {
        "devices": devices, "chunks": plan.chunks,
        "schedule_class": "_PipelineScheduleRuntime" if csv_file else SCHEDULE_CLASSES[plan.schedule],
        "schedule_csv": {"text": csv_file.text, "format": csv_file.format} if csv_file else None,
        "loss_fn": training.loss_fn, "optimizer": training.optimizer,
        "args": tuple(_cpu(a) for a in args), "kwargs": {k: _cpu(v) for k, v in kwargs.items()},
        "target": target.detach().cpu() if torch.is_tensor(target) else target, "warmup": warmup,
        "repeats": repeats, "return_grads": return_grads, "traced": None, "layout": layout,
    }
    if traced:  # split by torch's tracer in every rank, at the plan's candidate blocks
        names = [str(n) for n in plan.layer_table["name"]]
        mb_args, mb_kwargs = call_inputs(first_microbatch(sample, plan.chunks))
        skeleton = _check_traced_split(model, mb_args, mb_kwargs, [names[s] for s in plan.splits])
        job["traced"] = {"model": model, "mb_args": tuple(_cpu(a) for a in mb_args),
                         "mb_kwargs": {k: _cpu(v) for k, v in mb_kwargs.items()},
                         "split_points": [names[s] for s in plan.splits],
                         "split": _sendable(skeleton)}  # (None: each rank traces the model itself)
        payloads = [_pack(job, model)] * world
    else:
        layers = list(model.named_children())  # stages keep the model's layer names; pickling copies them
        points = [0, *plan.splits, len(layers)]
        stages = [nn.Sequential(OrderedDict(layers[a:b])) for a, b in zip(points, points[1:])]
        job["num_stages"], job["tied"] = len(stages), stage_shared_parameters(stages)
        payloads = [_pack({**job, "stages": {s: stages[s] for s in range(len(stages)) if layout[s] == rank}}, model)
                    for rank in range(world)]
    if timeout is None:
        timeout = default_timeout(plan, warmup + repeats - 1)
    token = current_token()
    check_cancelled()  # tracing and pickling take a while: a run cancelled meanwhile starts no rank
    preload_modules(installed_modules(model), token)  # e.g. transformers' modules: imported once, not per rank
    with warm_pool(world, devices) as (pool, startup_seconds):
        meter = StealMeter()  # the ranks' steps are timed in their processes: the host's steal while they ran
        replies = pool.run(payloads, timeout, cancel=token)
        stolen = meter.share()
        pids = list(pool.pids)
        check_cancelled()  # cancelled as the replies came: not recorded, and no rank is left running
    outputs = [torch.load(io.BytesIO(reply), weights_only=False) for reply in replies]

    steps = []  # each measured step: (its time, its timeline, its micro-batches' losses)
    for k in range(repeats):
        records = [(run, stage, device, chunk, phase, start, end, "measured")
                for payload in outputs for stage, device, chunk, phase, start, end in payload["steps"][k]]
        frame = pd.DataFrame(records, columns=COLUMNS)
        if len(frame):  # every rank's clock is the host's (one machine): one origin for the step
            origin = frame["start"].min()
            frame["start"] -= origin
            frame["end"] -= origin
        frame = frame.sort_values(["start", "stage"]).reset_index(drop=True)
        step_losses = [loss for payload in outputs for loss in payload["losses"][k]]
        steps.append((float(frame["end"].max()) if len(frame) else 0.0, frame, step_losses))
    _, frame, losses = sorted(steps, key=lambda step: step[0])[len(steps) // 2]
    frame.attrs["peak_memory"] = {}
    frame.attrs["startup_seconds"] = startup_seconds
    frame.attrs["host_steal"] = stolen
    first = [loss for payload in outputs for loss in payload["first_losses"]]
    result = _result(plan, frame, _mean(first), sample, set(devices),
                     measured_losses=[_mean(step_losses) for _, _, step_losses in steps])
    if return_grads:
        result.metrics["grads"] = {k: v for payload in outputs for k, v in (payload["grads"] or {}).items()}
    result.metrics["losses"] = losses
    result.metrics["startup_seconds"] = startup_seconds
    result.metrics["traced_ranks"] = sum(1 for payload in outputs if payload.get("traced"))  # traced, not copied
    result.metrics["exported_ranks"] = sum(1 for payload in outputs if payload.get("exported"))  # of those, exported
    result.metrics["worker_pids"] = pids
    return result
