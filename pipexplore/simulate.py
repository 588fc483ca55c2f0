"""Predicted timelines: replay a schedule over profiled per-layer costs.

Each stage gets an ordered list of actions — ``F`` forward, ``B`` backward, ``R`` recompute
(checkpointing), ``I``/``W`` input- and weight-gradient (zero-bubble) — per micro-batch. Actions
run on *lanes*: a device is one lane for all its stages (the CPU's cores are shared by every CPU
stage), unless ``cpu_stages_overlap`` gives each CPU stage a lane of its own (layers that leave
the CPU free); the autograd-driven ``GPipe`` runs every CPU backward on the one thread that called
``backward()``, so there all CPU backward work shares one lane. An action
starts when its lane is free and its inputs have arrived (plus the copy between devices)::

    stage 0  F0 F1 F2 F3 ·  ·  ·  ·  ·  ·  B3 B2 B1 B0          gpipe
    stage 1     F0 F1 F2 F3 ·  ·  B3 B2 B1 B0

The result is a timeline in the common schema with ``source='predicted'``, and a ``memory``
column: the activation bytes the stage holds once the event is done.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd

from pipexplore.splits import check_splits
from pipexplore.timeline import COLUMNS

__all__ = ["SCHEDULES", "simulate", "stage_orders", "stage_costs"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
Action = tuple[str, int]  # (kind, micro-batch)
PHASES = {"F": "forward", "B": "backward", "R": "recompute", "I": "input_grad", "W": "weight_grad"}

# Seconds per byte between devices when the caller gives none (~20 GB/s GPU↔GPU, ~10 GB/s host↔GPU).
DEFAULT_COPY_COST = {"cuda-cuda": 1 / 20e9, "cpu-cuda": 1 / 10e9}


def _gpipe(stage: int, stages: int, m: int) -> list[Action]:
    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


def _one_f_one_b(stage: int, stages: int, m: int) -> list[Action]:
    warmup = min(stages - stage - 1, m)
    order: list[Action] = [("F", i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", k) for k in range(m - warmup, m)]
    return order


def _zero_bubble_h1(stage: int, stages: int, m: int) -> list[Action]:
    """ZB-H1: 1F1B with backward split in input-grad (I) and weight-grad (W).

    Stage ``s`` keeps up to ``s`` weight-grads pending: the last stages, which finish first,
    push their W's back so that the chain of I's towards stage 0 starts early, and the W's
    fill the drain's bubbles. Bubble per stage: (stages-1)·(F + I − W), against 1F1B's
    (stages-1)·(F + I + W).
    """
    warmup = min(stages - stage - 1, m)
    order: list[Action] = [("F", i) for i in range(warmup)]
    pending: list[int] = []
    for k in range(m):
        if warmup + k < m:
            order.append(("F", warmup + k))
        order.append(("I", k))
        pending.append(k)
        if len(pending) > stage:
            order.append(("W", pending.pop(0)))
    order += [("W", k) for k in pending]
    return order


def _interleaved(device: int, devices: int, v: int, m: int) -> list[tuple[int, str, int]]:
    """Megatron's interleaved 1F1B for one device: ``(stage, kind, micro-batch)`` in order.

    The device holds stages ``device, device + devices, …`` (``v`` of them).
    """
    total = m * v

    def step(t: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(t, devices * v)
        chunk = within // devices
        if not forward:
            chunk = v - 1 - chunk
        return chunk * devices + device, group * devices + t % devices

    warmup = min((devices - device - 1) * 2 + (v - 1) * devices, total)
    order = []
    for t in range(warmup):
        s, i = step(t, True)
        order.append((s, "F", i))
    for k in range(total - warmup):
        s, i = step(warmup + k, True)
        order.append((s, "F", i))
        s, i = step(k, False)
        order.append((s, "B", i))
    for k in range(total - warmup, total):
        s, i = step(k, False)
        order.append((s, "B", i))
    return order


def stage_orders(schedule: str, stages: int, m: int) -> list[list[Action]]:
    """Each stage's actions in the order its worker runs them (``interleaved``: see :func:`simulate`)."""
    build = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zero-bubble": _zero_bubble_h1}.get(schedule)
    if build is None:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    return [build(s, stages, m) for s in range(stages)]


def stage_costs(layer_table: pd.DataFrame, splits: Sequence[int]) -> pd.DataFrame:
    """Per-stage sums of a layer table: ``forward``, ``backward``, ``param_bytes``,
    ``activation_bytes`` (outputs of its layers) and ``input_bytes`` (what it receives)."""
    n = len(layer_table)
    points = [0, *check_splits(splits, n), n]
    forward = layer_table["forward"].to_numpy(dtype=float)
    backward = layer_table["backward"].to_numpy(dtype=float)
    out_bytes = layer_table["output_bytes"].to_numpy(dtype=float) if "output_bytes" in layer_table else np.zeros(n)
    params = layer_table["param_bytes"].to_numpy(dtype=float) if "param_bytes" in layer_table else np.zeros(n)
    rows = []
    for s, (a, b) in enumerate(zip(points, points[1:])):
        rows.append({
            "stage": s, "first_layer": a, "last_layer": b - 1, "layers": b - a,
            "forward": forward[a:b].sum(), "backward": backward[a:b].sum(),
            "param_bytes": params[a:b].sum(), "activation_bytes": out_bytes[a:b].sum(),
            "input_bytes": out_bytes[a - 1] if a > 0 else 0.0,
        })
    return pd.DataFrame(rows)


def _copy_seconds(copy_cost: Optional[float], a: str, b: str, nbytes: float) -> float:
    if a == b:
        return 0.0
    if copy_cost is not None:
        return nbytes * copy_cost
    kinds = "-".join(sorted(d.split(":")[0] for d in (a, b)))
    return nbytes * DEFAULT_COPY_COST.get(kinds, 0.0)


def simulate(layer_table: pd.DataFrame, splits: Sequence[int], *, chunks: int, schedule: str = "gpipe",
             checkpoint: str = "except_last", devices: Optional[Sequence[str]] = None,
             copy_cost: Optional[float] = None, virtual_stages: int = 2, executor: Optional[str] = None,
             cpu_stages_overlap: bool = False, per_microbatch: bool = False, action_overhead: float = 0.0,
             run: Union[int, str] = "predicted") -> pd.DataFrame:
    """Predict the timeline of one training step.

    Args:
        layer_table: per-layer costs (``forward``, ``backward`` seconds for the whole mini-batch;
            ``output_bytes``), as :func:`pipexplore.profile` gives.
        splits: layers that begin a stage.
        chunks: micro-batches; each costs ``1/chunks`` of the profiled mini-batch, unless
            ``per_microbatch`` says the table was profiled on one micro-batch (more accurate
            where small batches run less efficiently, as GEMMs on a CPU do).
        schedule: ``gpipe``, ``1f1b``, ``interleaved`` (``virtual_stages`` stages per device:
            stage ``s`` on device ``s % (stages / virtual_stages)``) or ``zero-bubble`` (ZB-H1).
        checkpoint: ``always``, ``except_last`` or ``never``: checkpointed micro-batches
            recompute their forward right before their backward.
        devices: one per stage (``interleaved``: one per device); default ``'cpu'`` for each.
        copy_cost: seconds per byte between different devices (default by device kinds).
        executor: ``autograd`` (the ``GPipe`` module: CPU backward runs on one thread) or
            ``threads`` (the schedule executor: each stage's backward in its own worker).
            Default: ``autograd`` for ``gpipe``, ``threads`` for the others.
        action_overhead: seconds every compute action costs beyond its layers (the executor's own
            work: scheduling, Python, autograd bookkeeping), e.g. as measured by an earlier run.
        cpu_stages_overlap: whether CPU stages run in parallel (a lane each). By default the CPU
            is one device whose cores every stage shares, as it is for compute-bound layers
            profiled on all cores; set it for layers that leave the CPU free (sleeps, I/O,
            waits on other machines) or stages pinned to cores of their own.

    Example::

        table = pipexplore.profile(model, sample)
        predicted = simulate(table, [4, 8], chunks=8, schedule="1f1b")
        bubble_fraction(predicted)
    """
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    if checkpoint not in ("always", "except_last", "never"):
        raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never', got {checkpoint!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    executor = executor or ("autograd" if schedule == "gpipe" else "threads")
    if executor not in ("autograd", "threads"):
        raise ValueError(f"unknown executor {executor!r}: 'autograd' or 'threads'")
    if executor == "autograd" and schedule != "gpipe":
        raise ValueError(f"the autograd executor (GPipe) runs only the gpipe schedule, not {schedule!r}")

    costs = stage_costs(layer_table, splits)
    S, m = len(costs), chunks
    stop = {"always": m, "except_last": m - 1, "never": 0}[checkpoint]

    if schedule == "interleaved":
        if virtual_stages < 1 or S % virtual_stages:
            raise ValueError(f"interleaved needs the stage count ({S}) to be a multiple of virtual_stages "
                             f"({virtual_stages})")
        p = S // virtual_stages
        if m % p:
            raise ValueError(f"interleaved needs chunks ({m}) to be a multiple of the device count ({p})")
        device_names = list(devices) if devices is not None else ["cpu"] * p
        if len(device_names) != p:
            raise ValueError(f"interleaved with {S} stages and virtual_stages={virtual_stages} needs {p} devices, "
                             f"got {len(device_names)}")
        stage_device = [device_names[s % p] for s in range(S)]
        lane_queues = [[(s, k, i) for s, k, i in _interleaved(d, p, virtual_stages, m)] for d in range(p)]
        lanes_of_queue = [f"device{d}" for d in range(p)]
    else:
        stage_device = list(devices) if devices is not None else ["cpu"] * S
        if len(stage_device) != S:
            raise ValueError(f"{S} stages need {S} devices, got {len(stage_device)}")
        orders = stage_orders(schedule, S, m)
        lane_queues, lanes_of_queue = [], []
        for s, order in enumerate(orders):
            lane = f"cpu-stage{s}" if cpu_stages_overlap and stage_device[s] == "cpu" else stage_device[s]
            if executor == "autograd" and not stage_device[s].startswith("cuda"):
                lane_queues.append([(s, k, i) for k, i in order if k == "F"])
                lanes_of_queue.append(lane)
            else:
                lane_queues.append([(s, k, i) for k, i in order])
                lanes_of_queue.append(lane)
        if executor == "autograd":
            # One backward() call: CPU stages' backward on one thread, micro-batch-major, last first.
            cpu_backward = [(s, "B", i) for i in reversed(range(m)) for s in reversed(range(S))
                            if not stage_device[s].startswith("cuda")]
            if cpu_backward:
                lane_queues.append(cpu_backward)
                lanes_of_queue.append("cpu-autograd" if cpu_stages_overlap else "cpu")

    # Expand recompute (before B or I of checkpointed micro-batches).
    expanded = []
    for queue in lane_queues:
        out = []
        for s, kind, i in queue:
            if kind in ("B", "I") and i < stop:
                out.append((s, "R", i))
            out.append((s, kind, i))
        expanded.append(out)
    lane_queues = expanded

    scale = 1 if per_microbatch else m
    fwd = costs["forward"].to_numpy() / scale
    bwd = costs["backward"].to_numpy() / scale
    if action_overhead < 0:
        raise ValueError(f"action_overhead must be non-negative, got {action_overhead}")
    duration = {"F": fwd + action_overhead, "R": fwd + action_overhead, "B": bwd + action_overhead,
                "I": bwd / 2 + action_overhead, "W": bwd / 2 + action_overhead}
    edge_bytes = [float(layer_table["output_bytes"].iloc[b]) / scale if "output_bytes" in layer_table else 0.0
                  for b in costs["last_layer"]]
    copy_in = [_copy_seconds(copy_cost, stage_device[s - 1], stage_device[s], edge_bytes[s - 1]) if s else 0.0
               for s in range(S)]
    copy_back = [_copy_seconds(copy_cost, stage_device[s + 1], stage_device[s], edge_bytes[s]) if s < S - 1 else 0.0
                 for s in range(S)]

    end: dict[tuple[int, str, int], float] = {}
    rows: list[tuple] = []
    lane_free: dict[str, float] = {}
    heads = [0] * len(lane_queues)
    remaining = sum(len(q) for q in lane_queues)
    grad_kind = "I" if schedule == "zero-bubble" else "B"

    def ready(s: int, kind: str, i: int) -> Optional[float]:
        if kind == "F":
            if s == 0:
                return 0.0
            t = end.get((s - 1, "F", i))
            return None if t is None else t + copy_in[s]
        if kind in ("B", "I", "R"):
            own = end.get((s, "F", i))
            if own is None:
                return None
            if s == S - 1:
                return own
            t = end.get((s + 1, grad_kind, i))
            return None if t is None else max(own, t + copy_back[s])
        # W
        return end.get((s, "I", i))

    while remaining:
        best = None
        for q, queue in enumerate(lane_queues):
            if heads[q] >= len(queue):
                continue
            s, kind, i = queue[heads[q]]
            if kind in ("B", "I") and i < stop and (s, "R", i) not in end:
                continue
            t = ready(s, kind, i)
            if t is None:
                continue
            start = max(t, lane_free.get(lanes_of_queue[q], 0.0))
            if best is None or start < best[0]:
                best = (start, q)
        if best is None:
            raise RuntimeError(f"schedule {schedule!r} deadlocked: no stage can run its next action")
        start, q = best
        s, kind, i = lane_queues[q][heads[q]]
        heads[q] += 1
        remaining -= 1
        finish = start + float(duration[kind][s])
        end[(s, kind, i)] = finish
        lane_free[lanes_of_queue[q]] = finish
        rows.append((run, s, stage_device[s], i, PHASES[kind], start, finish, "predicted"))
        if kind == "F" and s and copy_in[s] > 0:
            done = end[(s - 1, "F", i)]
            rows.append((run, s, stage_device[s], i, "copy", done, done + copy_in[s], "predicted"))

    frame = pd.DataFrame(rows, columns=COLUMNS).sort_values(["start", "stage"], kind="stable").reset_index(drop=True)
    frame["memory"] = _activation_memory(frame, costs, scale, stop)
    frame.attrs["peak_memory"] = {}
    return frame


def _activation_memory(frame: pd.DataFrame, costs: pd.DataFrame, scale: int, stop: int) -> np.ndarray:
    """Activation bytes each stage holds after each event: a forward keeps its activations (only
    its input when checkpointed), a recompute brings them back, the backward (input-grad) frees
    them. Copies and weight-grads change nothing."""
    act = costs["activation_bytes"].to_numpy() / scale
    inp = costs["input_bytes"].to_numpy() / scale
    stage = frame["stage"].to_numpy()
    phase = frame["phase"].to_numpy()
    checkpointed = frame["microbatch"].to_numpy() < stop
    delta = np.zeros(len(frame))
    forward = phase == "forward"
    delta[forward] = np.where(checkpointed[forward], inp[stage[forward]], act[stage[forward]])
    recompute = phase == "recompute"
    delta[recompute] = act[stage[recompute]]
    frees = (phase == "backward") | (phase == "input_grad")
    delta[frees] = -(act[stage[frees]] + np.where(checkpointed[frees], inp[stage[frees]], 0.0))
    order = np.lexsort((frame["end"].to_numpy(), stage))
    held = np.empty(len(frame))
    running = pd.Series(delta[order]).groupby(stage[order]).cumsum().to_numpy()
    held[order] = np.clip(running, 0.0, None)
    return held
