"""The plan that fits: every combination of stages, chunks, schedule, checkpointing and virtual
stages, each split for the schedule's memory under a cap, predicted, ranked.

For each combination the split is the one whose slowest stage (forward + backward, + recompute
when checkpointing, at the micro-batch, by the plan's corrected per-layer costs, as
:func:`pipexplore.predict.sweep.plan_balanced_splits` times them) is fastest among those whose every stage's
training memory is within the cap (:func:`pipexplore.predict.split_search.capped_splits`, exact):
its parameters, gradients and optimizer state, and the activations the schedule holds there at
its peak (the stage's in-flight micro-batches, read from the schedule's own action order: GPipe
all ``m``, a 1F1B stage ``s`` of ``p`` holds ``p - s``, checkpointed micro-batches only their input
until recomputed). Then the plan is predicted (its timeline, and from it the real peak of every
stage, :func:`pipexplore.predict.memory.stage_memory`), and ``fits`` says whether every device
holds it within the cap. Where no split of a combination fits, its row has the split that
exceeds the cap least (``over_cap`` bytes).

A device that runs several stages (interleaved) holds all of them: the split gives each of its
stages an equal share of its cap (enough, not necessary); ``fits`` sums its stages' memory as the
predicted timeline holds it at once.

This module imports no plan: ``plan`` is any object with :class:`pipexplore.plan.Plan`'s methods.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import math
import multiprocessing
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np
import pandas as pd

from pipexplore import timeline as tl
from pipexplore.balance import join_first, optimal_splits
from pipexplore.devices import device_memory
from pipexplore.host import host_cores
from pipexplore.predict.costs import layer_times
from pipexplore.predict.dataflow import KINDS
from pipexplore.predict.memory import activation_peaks, optimizer_state_ratio, stage_memory
from pipexplore.predict.simulator import prepare_step
from pipexplore.predict.split_search import StageMemory, capped_splits, held_shares, least_over
from pipexplore.splits import first_runnable_layer
from pipexplore.validate import splits_exactly

__all__ = ["search", "SEARCH_COLUMNS", "layer_bytes", "ranked", "pareto_front"]

#: Actions (stages × chunks, summed over the combinations) from which a search runs in two processes.
_PARALLEL_ACTIONS = 200_000

#: The columns of :func:`search`: a sweep's (:data:`pipexplore.predict.sweep.SWEEP_COLUMNS`: the
#: predicted step in seconds, ``activation_bytes`` the largest stage's peak of activations held), with
#: ``virtual_stages`` (stages per device), ``peak_bytes`` the largest device's training memory (bytes:
#: parameters, gradients, optimizer state and activations at their peak; the stage table's
#: ``peak_bytes``), per stage and per device, how far the largest excess is over the cap
#: (``over_cap``, bytes; negative: room left), ``fits`` and ``pareto`` (no other plan is as fast and as
#: small, and better in one).
SEARCH_COLUMNS = ["rank", "stages", "splits", "chunks", "schedule", "checkpoint", "virtual_stages", "devices",
                  "predicted_step_time", "bubble", "throughput", "activation_bytes", "activation_bytes_per_stage",
                  "peak_bytes", "peak_bytes_per_stage", "peak_bytes_per_device", "over_cap", "fits", "pareto"]


def layer_bytes(table: pd.DataFrame, *, optimizer: Optional[Callable[[Any], Any]] = None,
                mixed_precision: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer of ``table``: the static bytes a stage holding it keeps (parameters, gradients,
    optimizer state, counted as :func:`pipexplore.predict.memory.stage_memory` counts a stage,
    layer by layer), what it saves for the backward of the whole batch (``saved_bytes``, else its
    output), and what a stage starting at it receives (the layer before's output; 0 for the first)."""
    n = len(table)

    def column(name: str) -> np.ndarray:
        return table[name].to_numpy(dtype=float) if name in table else np.zeros(n)

    params = column("param_bytes")
    grads = column("grad_bytes") if "grad_bytes" in table else params
    ratio = optimizer_state_ratio(optimizer)
    if mixed_precision:
        counts = column("params") if "params" in table else params / 2.0
        trained = counts * (grads / np.where(params > 0, params, 1.0))
        static = 2.0 * counts + 4.0 * trained + 4.0 * trained * (1.0 + ratio)
    else:
        static = params + grads * (1.0 + ratio)
    out = column("output_bytes")
    saved = column("saved_bytes") if "saved_bytes" in table else out
    return np.nan_to_num(static), np.nan_to_num(saved), np.r_[0.0, np.nan_to_num(out[:-1])]


def _layer_time(plan: Any) -> np.ndarray:
    """Each layer's forward + backward (+ recompute) at the plan's micro-batch, as
    :func:`pipexplore.predict.sweep.plan_balanced_splits` weighs it (:func:`~pipexplore.predict.costs.layer_times`),
    unknown costs as zero."""
    return np.nan_to_num(layer_times(plan))


def _device_activations(frame: pd.DataFrame, stage_device: Sequence[str], stages: int) -> dict[str, float]:
    """Each device's peak of the activations its stages hold at once (the timeline's ``memory``,
    per stage after each event, summed over the device's stages in the order events end)."""
    stage = frame["stage"].to_numpy()
    held = frame["memory"].to_numpy(dtype=float)
    end = frame["end"].to_numpy(dtype=float)
    order = np.lexsort((end, stage))  # as held_activations ran its sums
    stage, held, end = stage[order], held[order], end[order]
    first = np.r_[True, stage[1:] != stage[:-1]]
    delta = np.where(first, held, held - np.r_[0.0, held[:-1]])
    names = list(dict.fromkeys(stage_device))
    device = np.array([names.index(stage_device[s]) for s in range(stages)])[stage]
    order = np.lexsort((delta, end, device))  # frees before allocations at the same moment
    device, delta = device[order], delta[order]
    running = np.cumsum(delta)
    starts = np.flatnonzero(np.r_[True, device[1:] != device[:-1]])
    running -= np.repeat(np.r_[0.0, running[starts[1:] - 1]], np.diff(np.r_[starts, len(running)]))
    peaks = np.zeros(len(names))
    np.maximum.at(peaks, device, running)
    return dict(zip(names, peaks.tolist()))


def _even_splits(layers: int, stages: int) -> list[int]:
    return [round(k * layers / stages) for k in range(1, stages)]


def search(plan: Any, *, memory_cap: Optional[float] = None, stages: Sequence[int] = (), chunks: Sequence[int] = (),
           schedules: Sequence[str] = (), checkpoint: Sequence[str] = (), virtual_stages: Sequence[int] = (),
           devices_for: Optional[Callable[[int], Sequence[str]]] = None,
           optimizer: Optional[Callable[[Any], Any]] = None, mixed_precision: bool = False,
           workers: Optional[int] = None) -> pd.DataFrame:
    """Every combination, each with the fastest split that fits ``memory_cap`` bytes a device,
    predicted; fitting plans first, each group ranked by predicted step time.

    Empty choices keep the plan's own value. ``memory_cap``: bytes of training memory a device
    may hold (parameters, gradients, ``optimizer`` state, activations; ``mixed_precision`` as
    :func:`pipexplore.predict.memory.stage_memory` counts it); None: each device's own memory
    (a planned device's from the catalogue, a GPU's total), no cap where unknown (CPU).
    ``devices_for(n)``: the devices for ``n`` devices (default: the plan's, round-robin).
    Combinations a schedule cannot run (the plan or the simulator refuses them) are left out and
    named in ``table.attrs['left_out']``; ``table.attrs['memory_cap']`` is the cap.

    Columns: :data:`SEARCH_COLUMNS`.

    Raises:
        ValueError: nothing fits (the message names the plan that comes closest and by how many
            bytes it is over), or no combination can run at all.

    Example::

        table = search(plan, memory_cap=80e9, stages=[8, 16], chunks=[32, 64],
                       schedules=["gpipe", "1f1b"], checkpoint=["never", "always"])
        best = table.iloc[0]
    """
    if memory_cap is not None and (isinstance(memory_cap, bool) or not isinstance(memory_cap, (int, float))
                                   or not memory_cap > 0):
        raise ValueError(f"memory_cap must be a number of bytes > 0 (or None: each device's memory), got {memory_cap!r}")
    table = plan.layer_table
    batch = plan.step_batch
    own = list(plan.devices) or ["cpu"]
    devices_for = devices_for or (lambda k: [own[d % len(own)] for d in range(k)])
    static, act, inp = layer_bytes(table, optimizer=optimizer, mixed_precision=mixed_precision)
    jobs, left_out, seen = [], [], set()
    for n, m, schedule, mode, v in itertools.product(stages or [plan.num_stages], chunks or [plan.chunks],
                                                     schedules or [plan.schedule], checkpoint or [plan.checkpoint],
                                                     virtual_stages or [plan.virtual_stages]):
        name = f"{n} stages, {m} chunks, {schedule}, checkpoint {mode}, virtual_stages {v}"
        if n < 1 or n > plan.num_layers:
            left_out.append(f"{name}: {n} stages for {plan.num_layers} layers")
            continue
        if (batch and not splits_exactly(int(batch), m)) or schedule == "async-backends":
            left_out.append(f"{name}: " + ("not simulated" if schedule == "async-backends"
                                           else f"{batch} rows do not split into {m} chunks exactly"))
            continue
        executor = plan.executor if not (plan.executor == "autograd" and schedule != "gpipe") else "threads"
        try:
            candidate = plan.with_options(chunks=m, schedule=schedule, checkpoint=mode, executor=executor,
                                          virtual_stages=v, splits=tuple(_even_splits(plan.num_layers, n)),
                                          devices=tuple(devices_for(n)))
            count = candidate.num_devices
            if (n, m, schedule, mode, count) in seen:
                continue  # virtual_stages that this schedule does not use
            seen.add((n, m, schedule, mode, count))
            if schedule == "interleaved" and (n % v or m % count):
                raise ValueError(f"interleaved needs stages divisible by {v} and chunks by its {count} devices")
            candidate = candidate.with_options(devices=tuple(devices_for(count)))
        except ValueError as exc:  # the plan refuses it (a SplitError is one too)
            left_out.append(f"{name}: {exc}")
            continue
        caps = {d: float(memory_cap) if memory_cap is not None else _capacity(d) for d in candidate.stage_devices}
        jobs.append((name, candidate, caps))
    context = _Context(static, act, inp, optimizer, mixed_precision, batch)
    rows = []
    for job, outcome in zip(jobs, _run(jobs, context, workers)):
        if isinstance(outcome, str):
            left_out.append(f"{job[0]}: {outcome}")
        else:
            rows.append(_with_memory(outcome, job, context))
    result = pd.DataFrame(rows, columns=SEARCH_COLUMNS[1:])
    if result.empty:
        raise ValueError("no combination can run: " + "; ".join(left_out[:5])
                         + (f" (and {len(left_out) - 5} more)" if len(left_out) > 5 else ""))
    result["pareto"] = pareto_front(result["predicted_step_time"].to_numpy(), result["peak_bytes"].to_numpy())
    if not result["fits"].any():
        closest = result.loc[result["over_cap"].idxmin()]
        raise ValueError(f"no plan fits memory_cap {_gib(memory_cap) if memory_cap else 'of the devices'}: the "
                         f"closest is {_describe(closest)}, {_gib(closest['peak_bytes'])} at its peak, "
                         f"{closest['over_cap']:,.0f} bytes ({_gib(closest['over_cap'])}) over")
    return ranked(result, left_out, memory_cap)


def ranked(result: pd.DataFrame, left_out: list[str], memory_cap: Optional[float]) -> pd.DataFrame:
    """``result``'s rows ranked: those that fit first, each group by predicted step then peak
    memory, numbered from 1 (``rank``); ``attrs``: ``left_out`` and ``memory_cap``."""
    result = result.sort_values(["fits", "predicted_step_time", "peak_bytes"], ascending=[False, True, True],
                                kind="stable").reset_index(drop=True)
    result.insert(0, "rank", range(1, len(result) + 1))
    result.attrs["left_out"] = left_out
    result.attrs["memory_cap"] = memory_cap
    return result


class _Context(NamedTuple):
    """What every combination's row needs: per layer bytes, the optimizer, the batch."""

    static: np.ndarray
    act: np.ndarray
    inp: np.ndarray
    optimizer: Any
    mixed_precision: bool
    batch: Any


def _row(job: tuple[str, Any, dict[str, float]], context: _Context, times: dict) -> Union[str, dict[str, Any]]:
    """One combination: its split under the cap, its prediction and its memory (or why the
    simulator refuses it)."""
    _, candidate, device_cap = job
    try:
        setup = prepare_step(candidate.layer_table, list(candidate.splits), **candidate.simulate_options())
    except ValueError as exc:  # a schedule's constraint
        return str(exc)
    n = candidate.num_stages
    static, act, inp, _, _, batch = context
    graph = setup.graph
    shares = held_shares(graph.stage, np.asarray(KINDS)[graph.kind], graph.micro, setup.fractions, setup.stop, n)
    stage_device = list(candidate.stage_devices)
    per_device = {d: stage_device.count(d) for d in device_cap}
    # Layers a later stage cannot begin at (a traced model's in processes) join the first: one row,
    # which receives what the first layer does.
    first = first_runnable_layer(candidate.layer_table, candidate.executor, n)
    memory = StageMemory(join_first(static, first), join_first(act, first), inp[np.r_[0, first:len(inp)]]
                         if first > 1 else inp, shares, [device_cap[d] / per_device[d] for d in stage_device])
    key = (candidate.chunks, candidate.run_checkpoint != "never", candidate.predict_executor, first)
    if key not in times:
        times[key] = join_first(_layer_time(candidate), first)
    if (key, n) not in times:  # the time-balanced split, shared by the schedules
        times[(key, n)] = optimal_splits(times[key], n) if n > 1 else []
    splits = capped_splits(times[key], memory, times[(key, n)])
    if splits is None:
        splits, _ = least_over(times[key], memory, balanced=times[(key, n)])
    planned = candidate.with_splits([point + first - 1 for point in splits])
    predicted = planned.predict()
    step = tl.step_time(predicted)
    peaks = np.asarray(activation_peaks(predicted, n))
    return {
        "stages": n, "splits": list(planned.splits), "chunks": candidate.chunks, "schedule": candidate.schedule,
        "checkpoint": candidate.checkpoint, "virtual_stages": n // candidate.num_devices,
        "devices": ",".join(candidate.devices[: candidate.num_devices]), "predicted_step_time": step,
        "bubble": tl.bubble_fraction(predicted, by=tl.bubble_by(candidate.schedule)),
        "throughput": (batch / step) if batch and step > 0 else math.nan,
        "peak_activations": peaks.tolist(),
        "device_activations": (dict(zip(stage_device, peaks.tolist())) if len(set(stage_device)) == n
                               else _device_activations(predicted, stage_device, n)),
    }


def _with_memory(row: dict[str, Any], job: tuple[str, Any, dict[str, float]], context: _Context) -> dict[str, Any]:
    """A predicted row with its training memory per stage and device, and whether it fits
    (:func:`pipexplore.predict.memory.stage_memory`, in this process: an optimizer it does not
    know is probed with a step of torch)."""
    _, candidate, device_cap = job
    peaks = np.asarray(row.pop("peak_activations"))
    activations = row.pop("device_activations")
    held = stage_memory(candidate.layer_table, row["splits"], peak_activations=peaks, optimizer=context.optimizer,
                        mixed_precision=context.mixed_precision)
    totals = held["peak_bytes"].to_numpy()
    fixed = totals - peaks
    stage_device = list(candidate.stage_devices)
    device_peak = {d: float(sum(fixed[s] for s in range(len(stage_device)) if stage_device[s] == d) + activations[d])
                   for d in device_cap}
    over = max(device_peak[d] - device_cap[d] for d in device_cap)
    return {**row, "activation_bytes": float(peaks.max()), "activation_bytes_per_stage": [float(v) for v in peaks],
            "peak_bytes": max(device_peak.values()), "peak_bytes_per_stage": [float(v) for v in totals],
            "peak_bytes_per_device": list(device_peak.values()),
            "over_cap": over if math.isfinite(over) else -math.inf, "fits": bool(over <= 0)}


#: The combinations handed to worker processes (set before they fork, read by them).
_JOBS: list = []


def _run(jobs: list, context: _Context, workers: Optional[int]) -> list[Union[str, dict[str, Any]]]:
    """Each job's row (or refusal), in the jobs' order; in ``workers`` forked processes where
    more than one is asked for (None: two where the host has them and the work is large)."""
    with _collector_paused():
        return _rows(jobs, context, workers)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while plans are predicted (in forked workers too).

    Predicting a plan builds a graph of up to ~100k actions from as many small tuples, none of them
    in a reference cycle; each allocation burst starts a collection, and a full one walks every
    object of the process (torch, pandas: about a million), which took a fifth to a third of a
    search's time. Reference counting frees what the predictions leave; the collector's state is
    put back after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _rows(jobs: list, context: _Context, workers: Optional[int]) -> list[Union[str, dict[str, Any]]]:
    actions = sum(job[1].num_stages * job[1].chunks for job in jobs)
    if workers is None:
        workers = min(2, host_cores()) if actions >= _PARALLEL_ACTIONS else 1
    workers = max(1, min(int(workers), len(jobs)))
    if workers == 1 or "fork" not in multiprocessing.get_all_start_methods() \
            or threading.current_thread() is not threading.main_thread():
        times: dict = {}  # layer times per (chunks, recompute, executor), and their balanced splits
        return [_row(job, context, times) for job in jobs]
    global _JOBS
    _JOBS = [(job, context) for job in jobs]
    # The largest first, one at a time, so that the workers end together.
    order = sorted(range(len(jobs)), key=lambda k: -jobs[k][1].num_stages * jobs[k][1].chunks)
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            done = dict(pool.imap_unordered(_job, order, chunksize=1))
    finally:
        _JOBS = []
    return [done[k] for k in range(len(jobs))]


def _job(index: int) -> tuple[int, Union[str, dict[str, Any]]]:
    job, context = _JOBS[index]
    return index, _row(job, context, _TIMES)


_TIMES: dict = {}  # a worker's layer times and balanced splits


def _capacity(device: str) -> float:
    memory = device_memory(device)
    return memory if math.isfinite(memory) else math.inf


def pareto_front(step: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """Whether no other row is at least as fast and as small, and better in one."""
    no_worse = (step[None, :] <= step[:, None]) & (peak[None, :] <= peak[:, None])
    better = (step[None, :] < step[:, None]) | (peak[None, :] < peak[:, None])
    return ~np.any(no_worse & better, axis=1)


def _gib(value: Optional[float]) -> str:
    """Bytes as text: ``'1.50 GiB'``, ``'3.2 MiB'``."""
    if value is None or not math.isfinite(value):
        return "no cap"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} bytes"


def _describe(row: pd.Series) -> str:
    virtual = f", {row['virtual_stages']} stages a device" if row["virtual_stages"] > 1 else ""
    return (f"{row['stages']} stages (splits {list(row['splits'])}), {row['chunks']} chunks, {row['schedule']}, "
            f"checkpoint {row['checkpoint']}{virtual}")
