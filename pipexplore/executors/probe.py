"""What an executor itself costs per action, measured on layers that cost next to nothing."""
from __future__ import annotations

import copy
import math
import time
import warnings
from collections import Counter
from typing import Any, Callable, Optional, cast

import numpy as np
import pandas as pd
import torch
from torch import nn

from pipexplore import background
from pipexplore.host import host_cores
from pipexplore.predict.costs import (PHASE_SOURCE, Corrections, handoff_gaps, layer_seconds, microbatch_rows,
                                      stage_seconds)
from pipexplore.timeline import step_time
from pipexplore.executors.base import StepJob
from pipexplore.plan import Plan
from pipexplore.schedules import is_csv, splits_backward
from pipexplore.skip.skippable import Skippable
from pipexplore.training import OptimizerFactory, Training

__all__ = ["probe", "probe_kind", "runs_as_script", "needs_probe", "with_probed_costs", "loaded_transfer",
           "busy_seconds", "busy_table", "BusyLayer", "action_overheads", "fitted_transfer", "PROBE_DEVICES",
           "PROBE_CHUNKS", "LOADED_SECONDS", "co_run_shares", "CO_RUN_SECONDS", "CO_RUN_LIMIT"]

#: The probe runs at most this many devices' stages and micro-batches: what an action costs the
#: executor does not grow with their number, and a 64-stage × 256-micro-batch plan would
#: otherwise spend a minute on layers that do nothing.
PROBE_DEVICES = 8
PROBE_CHUNKS = 8
#: The loaded probe's busy actions last between these CPU seconds (the plan's own per micro-batch
#: and stage, bounded: the probe stays a fraction of a second).
LOADED_SECONDS = (2e-4, 5e-3)


class _NoUpdate:
    """An optimizer that only clears gradients: the probe times the executor's actions, not an
    update, and a first ``torch.optim`` optimizer costs ~1 s (it imports ``torch._dynamo``), which
    the explorer's first picture need not wait for."""

    def __init__(self, parameters: Any) -> None:
        self.parameters = list(parameters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters:
            p.grad = None

    def step(self) -> None:
        pass


def probe(plan: Plan, repeats: int = 3) -> tuple[dict[str, float], float, float]:
    """Run ``plan``'s executor, schedule, devices and chunks (at most :data:`PROBE_DEVICES` devices'
    stages and :data:`PROBE_CHUNKS` micro-batches) on one ``Linear(1, 1)`` per stage
    and measure ``(overhead, gap, transfer)``: per phase the median seconds of an action's span
    (what the executor records around a layer that does nothing: its bookkeeping, autograd
    set-up, recording; ``"all"``: over every phase), the median seconds a worker spends between
    actions whose inputs are there (dispatch), and from an action's end to the start of the one
    on another stage that waited for it (the hand-over).

    The phases differ: on 2 CPU stages of the threads executor a forward's span costs it ~0.1 ms,
    a backward's ~0.23 ms (gpipe), zero-bubble's weight-gradient pass ~0.44 ms.

    ``processes`` runs in the warm pool of rank processes, on every device of the plan (so the
    pool the plan's first run takes is the one the probe started): what an action costs torch's
    pipelining runtime there, and a hand-over is a send and receive over gloo between processes
    (on 2 CPU ranks here ~0.2 ms a forward's span, ~0.3 ms a backward's and a hand-over, 5 s to
    start the pool the first time, 0.1 s once it is warm); where its ranks outnumber this host's
    cores, the hand-over is :func:`loaded_transfer`'s. Async backends are not probed:
    ``({}, 0.0, 0.0)``.

    Example::

        overhead, gap, transfer = probe(plan)      # overhead["forward"], overhead["all"]
    """
    background.wait()  # nothing is timed beside pipexplore's background imports
    from pipexplore.executors import autograd, processes, threads

    module = {"threads": threads, "autograd": autograd, "processes": processes}.get(plan.executor)
    if module is None or plan.schedule == "async-backends":
        return {}, 0.0, 0.0
    # processes: all of the plan's ranks, the pool its first run takes
    devices, stages, chunks = _probe_shape(plan, all_devices=module is processes)
    tiny = nn.Sequential(*[nn.Linear(1, 1) for _ in range(stages)])
    _, measured = _probe_step(module, plan, tiny, _layer_table(stages, forward=0.0, backward=0.0), devices, chunks,
                              repeats)
    overhead = action_overheads(measured, plan.schedule)
    gap, transfer = handoff_gaps(measured)
    gap, transfer = float(gap or 0.0), float(transfer or 0.0)
    if _loaded(plan):
        transfer = loaded_transfer(plan, overhead, gap, transfer, stages, chunks, repeats)
    return overhead, gap, transfer


def action_overheads(measured: pd.DataFrame, schedule: str,
                     layer: Optional[dict[str, float]] = None) -> dict[str, float]:
    """What the executor costs an action in a probe's ``measured`` step: per phase the median seconds
    of an action's span beyond its layer's (``layer``: a busy layer's seconds per phase; nothing
    where not given; never below 0), ``"all"`` over every phase. Under a ``schedule`` that splits
    the backward, the first stage's W is left out: it does nothing (its I ran the whole backward)."""
    compute = measured[measured["phase"].isin(list(PHASE_SOURCE))]
    if splits_backward(schedule):
        compute = compute[~((compute["stage"] == 0) & (compute["phase"] == "weight_grad"))]
    seconds = compute["phase"].map(layer or {}).fillna(0.0)
    beyond = (compute["end"] - compute["start"] - seconds).clip(lower=0.0)
    overhead = {str(phase): float(values.median()) for phase, values in beyond.groupby(compute["phase"])}
    overhead["all"] = float(beyond.median()) if len(beyond) else 0.0
    return overhead


def fitted_transfer(busy_plan: Plan, overhead: dict[str, float], gap: float, transfer: float,
                    measured: pd.DataFrame) -> float:
    """The hand-over with which the simulator gives ``busy_plan`` (a probe's plan of busy stages) the
    step of ``measured`` (:meth:`Corrections.step_fitted`, the fit a run's learning makes), its
    executor's other costs ``overhead`` and ``gap``; never less than ``transfer``, the measured median."""
    executor = busy_plan.predict_executor
    probed = Corrections().with_executor_costs(executor, overhead, gap, transfer)
    fitted = probed.step_fitted(executor, lambda c: busy_plan.with_options(corrections=c).predict(), measured)
    return max(transfer, fitted.transfer(executor))


def _probe_shape(plan: Plan, all_devices: bool = False) -> tuple[tuple[Any, ...], int, int]:
    """The devices, stages and micro-batches a probe of ``plan`` runs: at most :data:`PROBE_DEVICES`
    devices (``all_devices``: every one, a mesh's every rank: as many processes share the cores as
    its run starts) with the plan's stages a device, at most :data:`PROBE_CHUNKS` micro-batches (or
    as many as the schedule needs)."""
    per_device = plan.num_stages // plan.num_devices
    count = plan.mesh_or_pipeline.size if all_devices else min(plan.num_devices, PROBE_DEVICES)
    devices = tuple(plan.devices[:count])
    stages = len(devices) * per_device
    chunks = min(plan.chunks, max(PROBE_CHUNKS, len(devices)))
    if count > plan.num_devices:  # a mesh's ranks as one pipeline: as many micro-batches as its stages
        chunks = max(chunks, stages)
    if plan.schedule in ("interleaved", "interleaved-zero-bubble"):  # a multiple of the devices, as they need
        chunks -= chunks % len(devices)
    if plan.schedule == "dualpipev":  # at least as many micro-batches as stages
        chunks = max(chunks, stages)
    if is_csv(plan.schedule):  # a schedule file runs only the stages, ranks and micro-batches it names
        devices, stages, chunks = tuple(plan.devices[:plan.num_devices]), plan.num_stages, plan.chunks
    return devices, stages, chunks


def _layer_table(stages: int, **columns: Any) -> pd.DataFrame:
    """A probe's profile: one layer a stage, ``columns`` beside its name and bytes."""
    return pd.DataFrame({"name": [str(k) for k in range(stages)], **columns, "output_bytes": 0.0,
                         "param_bytes": 8.0})


def _probe_step(module: Any, plan: Plan, layers: nn.Sequential, table: pd.DataFrame, devices: Any, chunks: int,
                repeats: int) -> tuple[Plan, pd.DataFrame]:
    """Run ``plan``'s schedule on ``layers`` (one a stage, ``table`` their profile) through the
    executor ``module`` on ``devices``, ``chunks`` micro-batches of a row: the probe's plan and the
    measured step's timeline."""
    probe_plan = Plan(table, splits=tuple(range(1, len(layers))), devices=tuple(devices), chunks=chunks,
                      checkpoint=plan.checkpoint, schedule=plan.schedule, virtual_stages=plan.virtual_stages,
                      executor=plan.executor, batch=chunks)
    # cast: _NoUpdate is no torch.optim.Optimizer, but has all the executors call of one (zero_grad, step)
    training = Training.of(optimizer=cast(OptimizerFactory, _NoUpdate))
    measured = module.run(StepJob(layers, torch.randn(chunks, 1), probe_plan, training, warmup=1,
                                  repeats=repeats)).timeline
    return probe_plan, measured


def runs_as_script(plan: Plan) -> bool:
    """Whether ``plan``'s runs are the exported ``torchrun`` script's ranks forked here and its costs
    are probed through that script (``pipexplore.runs.script_probe``): a mesh of this machine's CPUs
    run by processes, of pipeline and data parallelism only (the probe's stages hold no layer to
    shard across tensor, context or expert ranks: those meshes take the processes probe)."""
    mesh = plan.mesh
    return (mesh is not None and not plan.planned and plan.executor == "processes" and plan.device_type == "cpu"
            and mesh.tp == mesh.cp == mesh.ep == mesh.etp == 1 and not is_csv(plan.schedule))


def _loaded(plan: Plan) -> bool:
    """Whether the processes probe's hand-over is the loaded one (:func:`loaded_transfer`): processes
    whose ranks, a mesh's every one, outnumber this host's cores."""
    return (plan.predict_executor == "processes" and plan.mesh_or_pipeline.size > host_cores()
            and not is_csv(plan.schedule))


def probe_kind(plan: Plan) -> tuple[str, str]:
    """What a probe of ``plan`` stands for: its executor, and how it is probed — ``"script fsdp"``
    (its data parallelism named: the exported script's ranks, :func:`runs_as_script`), ``"loaded"``
    (:func:`loaded_transfer`'s hand-over) or ``"idle"``. A plan of another kind needs a probe of its
    own; one of the same kind takes the last one's figures."""
    executor = plan.predict_executor
    if runs_as_script(plan):
        return executor, f"script {plan.data_parallel}"
    return executor, "loaded" if _loaded(plan) else "idle"


def needs_probe(plan: Plan, probed: set) -> bool:
    """Whether ``plan``'s executor costs are to be probed: its executor never was, or it is a
    processes plan of a :func:`probe_kind` not in ``probed`` whose hand-over no run has taught.
    Plans for catalogue devices and async backends never are."""
    executor = plan.predict_executor
    if plan.schedule == "async-backends" or plan.planned:
        return False
    if executor not in plan.corrections.overheads:
        return True
    return probe_kind(plan) not in probed and not plan.corrections.counts.get(executor)


def with_probed_costs(plan: Plan, probed: set,
                      measure: Optional[Callable[[Plan], tuple[dict[str, float], float, float]]] = None) -> Plan:
    """``plan`` with its executor's own costs as :func:`probe` (or ``measure``: a probe of the same
    figures, such as the exported script's) measures them, its kind added to ``probed``; what a run
    of the executor taught (gap, hand-over) wins over the probe. Rank processes that cannot start
    here: a warning, and the plan predicted without them (not tried again for this kind: the first
    run will say why)."""
    executor = plan.predict_executor
    try:
        overhead, gap, transfer = (measure or probe)(plan)
    except Exception as error:
        if plan.executor != "processes":
            raise
        warnings.warn(f"the processes executor's own costs were not probed, so the prediction leaves them "
                      f"out until a run teaches them: {error}", RuntimeWarning, stacklevel=3)
        overhead, gap, transfer = {}, 0.0, None
    probed.add(probe_kind(plan))
    if plan.corrections.counts.get(executor):  # what a real run taught wins
        gap = plan.corrections.gaps.get(executor, gap)
        transfer = plan.corrections.transfers.get(executor, transfer)
    return plan.with_options(corrections=plan.corrections.with_executor_costs(executor, overhead, gap, transfer))


def _spin(seconds: float) -> None:
    """Keep this thread computing for ``seconds`` of its own CPU time (as a layer's arithmetic
    does: where it shares a core, it takes longer)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Spin(torch.autograd.Function):
    """The identity, costing ``forward`` CPU seconds forward and ``backward`` seconds backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: float, backward: float) -> torch.Tensor:
        ctx.backward = backward
        _spin(forward)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _spin(ctx.backward)
        return grad, None, None


class BusyLayer(nn.Module):
    """A ``Linear(1, 1)`` whose forward and backward each keep a core busy for a set time: a
    stage of the loaded probe (its parameter makes every stage's backward run, the first's too).
    ``tensors``: the parameter tensors it holds (``Linear(1, 1)``s one after another, two each;
    at least the one), for probes whose runtime works tensor by tensor (FSDP2, an optimizer)."""

    def __init__(self, forward: float, backward: float, tensors: int = 2) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 1)
        self.more = nn.ModuleList([nn.Linear(1, 1) for _ in range(max(0, int(tensors) // 2 - 1))])
        self.seconds = (float(forward), float(backward))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        for linear in self.more:
            x = linear(x)
        return _Spin.apply(x, *self.seconds)


def busy_seconds(plan: Plan) -> tuple[float, float]:
    """The seconds a busy stage's forward and backward compute a micro-batch: the median over the
    plan's stages of its own, within :data:`LOADED_SECONDS`."""
    batch = plan.step_batch
    rows = microbatch_rows(int(batch), plan.chunks)[0] if batch else 1.0 / plan.chunks
    low, high = LOADED_SECONDS
    forward, backward = (float(np.clip(np.median(stage_seconds(plan.layer_table, list(plan.splits), rows, phase)),
                                       low, high)) for phase in ("forward", "backward"))
    return forward, backward


def busy_table(stages: int, chunks: int, seconds: tuple[float, float]) -> pd.DataFrame:
    """The profile of ``stages`` busy layers (one a stage) computing ``seconds`` a micro-batch, each
    asking for a core of its own, over ``chunks`` micro-batches of a row."""
    table = _layer_table(stages, forward=seconds[0] * chunks, backward=seconds[1] * chunks, share_forward=1.0,
                         share_backward=1.0)
    table.attrs.update(batch=chunks, device="cpu", threads=1)
    return table


def loaded_transfer(plan: Plan, overhead: dict[str, float], gap: float, transfer: float, stages: int, chunks: int,
                    repeats: int = 3) -> float:
    """The processes executor's hand-over where the plan's ranks (a mesh's every rank) outnumber this
    host's cores: the idle probe's median hand-over (a few tenths of a millisecond) is what a rank
    costs when a core is free to take it; when every core computes another rank's action, a rank
    woken by a send or receive waits for the OS scheduler to give it one (~1–2 ms on a 2-core Linux
    host, measured: a 4-rank step 40 % longer than its actions and median hand-overs predict). Here
    the plan's schedule runs on stages that compute as long as the plan's own actions (per
    micro-batch, the median over its stages, within :data:`LOADED_SECONDS`; ``stages`` and
    ``chunks`` as the idle probe ran them: a mesh's every rank a stage, :func:`_probe_shape`), and
    the hand-over is the one that makes the simulator reproduce the measured step
    (:meth:`Corrections.step_fitted`, the same fit a real run's learning makes). ``transfer`` (the
    idle one) where the step says nothing more."""
    from pipexplore.executors import processes

    devices = plan.devices[:plan.mesh_or_pipeline.size]
    seconds = busy_seconds(plan)
    busy = nn.Sequential(*[BusyLayer(*seconds) for _ in range(stages)])
    table = busy_table(stages, chunks, seconds)
    busy_plan, measured = _probe_step(processes, plan, busy, table, devices, chunks, repeats)
    return fitted_transfer(busy_plan, overhead, gap, transfer, measured)


#: The co-run probe runs only where its steps stay this short (the representative layer's profiled
#: forward and backward, on every stage and micro-batch, over the warm-up and timed steps).
CO_RUN_SECONDS = 0.4
#: How far the co-run probe may move the table's shares, either way.
CO_RUN_LIMIT = 4.0


def _co_run_size(step: float, per_stage: int, repeats: int) -> tuple[int, int]:
    """The co-run probe's layers a stage and timed steps within :data:`CO_RUN_SECONDS`, for a step of
    ``step`` seconds with one layer a stage (each step run once to warm up, and once more to start
    the workers): the plan's ``per_stage`` and ``repeats`` where they fit, else fewer layers a stage
    (what co-running costs each action does not depend on how many follow it), then fewer steps (at
    least 2); ``(0, 0)`` where not even that fits (or the layer costs nothing)."""
    if not step > 0:
        return 0, 0
    fits = int(CO_RUN_SECONDS // (step * (2 + repeats)))
    if fits >= 1:
        return min(per_stage, fits), repeats
    steps = int(CO_RUN_SECONDS // step) - 2
    return (1, steps) if steps >= 2 else (0, 0)


def co_run_shares(plan: Plan, model: nn.Module, sample: Any, repeats: int = 5) -> Optional[pd.DataFrame]:
    """``plan``'s layer table with the shares of the host its CPU stages ask for as the ``threads``
    executor shows them, or ``None`` where nothing is to be learnt (another executor or device, one
    CPU stage, a table without shares, or a probe that would run too long).

    The profile times each layer alone and beside a twin thread; stages of one process that share
    the host's cores also take turns in the interpreter between their operators, and on small
    layers that costs more than any twin shows: two CPU stages of ``Linear(256)`` + GELU on 16 rows
    ran each co-running action ~2× its profile where the twins measured 0.7–1.2×, so a first run
    was predicted 20–35 % short. Here the plan's schedule and executor run on copies of the model's
    most common kind of layer (as many a stage as the plan's stages hold, fewer where the probe would
    outlast :data:`CO_RUN_SECONDS`: :func:`_co_run_size`; on at most :data:`PROBE_DEVICES` devices and
    :data:`PROBE_CHUNKS` micro-batches of the plan's rows), and the shares are scaled
    (all layers alike, within ×:data:`CO_RUN_LIMIT`) so that the simulator reproduces the measured
    step, as :meth:`Corrections.step_fitted` fits a hand-over."""
    from pipexplore.executors import threads

    table = plan.layer_table
    on_host = all(str(d).split(":")[0] == "cpu" for d in plan.devices[:plan.num_devices])
    if not isinstance(model, nn.Sequential):
        return None
    if (plan.executor != "threads" or plan.planned or not on_host or plan.num_devices < 2 or is_csv(plan.schedule)
            or len(model) != len(table) or "share_forward" not in table or not plan.step_batch
            or any(isinstance(m, Skippable) for m in model.modules())):  # (copies of a stash would clash)
        return None
    rows = microbatch_rows(int(plan.step_batch), plan.chunks)[0]
    kinds = list(zip(table["type"], table["param_bytes"])) if "type" in table else [(0, 0)] * len(table)
    counts = Counter(kinds)
    index = max(range(len(kinds)), key=lambda i: (counts[kinds[i]], -i))  # the commonest kind's first layer
    devices, stages, chunks = _probe_shape(plan)
    seconds = float(layer_seconds(table, rows, "forward")[index] + layer_seconds(table, rows, "backward")[index])
    per_stage, repeats = _co_run_size(seconds * stages * chunks, max(1, round(len(table) / plan.num_stages)), repeats)
    if not per_stage:
        return None
    first = sample if isinstance(sample, torch.Tensor) else None
    if first is None or first.shape[0] < rows:
        return None
    with torch.no_grad():
        x = first[:rows].detach()
        for layer in list(model)[:index]:
            x = layer(x)
        layer = model[index]
        out = layer(x) if isinstance(x, torch.Tensor) else None
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype:
        return None  # a kind whose output cannot feed its own copy: nothing to chain
    layers = nn.Sequential(*[copy.deepcopy(layer) for _ in range(stages * per_stage)])
    probe_table = table.iloc[[index] * (stages * per_stage)].reset_index(drop=True)
    probe_table.attrs.update(table.attrs, batch=rows * chunks)
    probe_plan = Plan(probe_table, splits=tuple(range(per_stage, stages * per_stage, per_stage)), devices=devices,
                      chunks=chunks, checkpoint=plan.checkpoint, schedule=plan.schedule,
                      virtual_stages=plan.virtual_stages, executor=plan.executor, batch=rows * chunks,
                      corrections=plan.corrections)
    training = Training.of(optimizer=cast(OptimizerFactory, _NoUpdate))
    batch = x.repeat(chunks, *[1] * (x.dim() - 1))
    measured = threads.run(StepJob(layers, batch, probe_plan, training, warmup=1, repeats=repeats)).timeline
    target = step_time(measured)

    def scaled(frame: pd.DataFrame, factor: float) -> pd.DataFrame:
        out = frame.copy()
        out.attrs.update(frame.attrs)
        for column in ("share_forward", "share_backward"):
            if column in out:
                out[column] = np.clip(out[column].to_numpy(dtype=float) * factor, 0.0, 1.0)
        return out

    def step(factor: float) -> float:
        return step_time(probe_plan.with_options(layer_table=scaled(probe_table, factor)).predict())

    # The factor nearest 1 that gives the measured step (below where the stages' shares add up to
    # less than the host, the step does not tell them apart): up from 1 where the run was slower
    # than predicted, down where it was faster, within the limits.
    factor = 1.0
    base = step(1.0)
    if target > 0 and abs(base - target) > 1e-3 * target:
        up = base < target
        lo, hi = (1.0, CO_RUN_LIMIT) if up else (1.0 / CO_RUN_LIMIT, 1.0)
        if up and step(hi) <= target:
            factor = hi
        elif not up and step(lo) >= target:
            factor = lo
        else:
            for _ in range(16):  # the step never shortens as the shares grow (to ~1e-5 of the factor)
                middle = math.sqrt(lo * hi)
                if (step(middle) < target) if up else (step(middle) <= target):
                    lo = middle
                else:
                    hi = middle
            factor = hi if up else lo
    out = scaled(table, factor)
    out.attrs["co_run_factor"] = factor
    return out
