"""Predicted timelines: replay a schedule over per-layer costs, with stages sharing devices.

Each stage gets an ordered list of actions — ``F`` forward, ``B`` backward, ``R`` recompute
(checkpointing), ``I``/``W`` input- and weight-gradient (zero-bubble) — per micro-batch, then
``O``, its optimizer step (where the table costs one), run by
a *worker* as the executor has them: one per stage (one per device for interleaved), and for the
autograd-driven ``GPipe`` the backward of each device on one more (autograd's engine thread). An
action starts when its worker is free and its inputs have arrived (plus the copy between
devices); while it runs it keeps a share of its device busy (the host's cores for every CPU
stage, or its GPU), and actions whose shares add up to more than the whole device run slower in
proportion (processor sharing)::

    stage 0  F0 F1 F2 F3 ·  ·  ·  ·  ·  ·  B3 B2 B1 B0          gpipe
    stage 1     F0 F1 F2 F3 ·  ·  B3 B2 B1 B0

Where no device is ever asked for more than all of it at once (a device per stage, stages that
leave the host free), the step is the longest path of the schedule's dependency graph, which is
cached per shape and timed level by level (:mod:`pipexplore.predict.dataflow`); otherwise an event loop
runs the processor sharing (:mod:`pipexplore.predict.sharing`). Both give the same timeline where
both apply (tests). Both are compiled (``pipexplore/predict/_sharing.c``, built at install) and also
written in Python: the reference the compiled ones equal bit for bit (tests), and what runs where
no compiler was found.

The result is a timeline in the common schema with ``source='predicted'``, a ``memory``
column (the activation bytes the stage holds once the event is done) and a ``lane`` column: the
worker that runs the action (what a measured timeline's hand-offs are read against, see
:func:`pipexplore.predict.costs.handoff_gaps`).

Why one module: :func:`simulate` and :func:`prepare_step` are one computation, the second the part
that a moved split does not change (what the page re-times a drag with); the costs, the graph, the
processor sharing and FSDP's placement live in modules of their own.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import pandas as pd

from pipexplore.devices import is_planned, link_seconds_per_byte
from pipexplore.host import host_cores
from pipexplore.predict.dataflow import (BACKWARD, FORWARD, INPUT_GRAD, KINDS, OPTIMIZER_MICRO, WEIGHT_GRAD,
                                         ActionGraph, oversubscribed)
from pipexplore.predict.costs import (Corrections, fresh_gradient_seconds, has_fit, microbatch_rows, stage_seconds,
                                      stage_shares, stage_sums)
from pipexplore.predict.fsdp_actions import placed_fsdp, placement_record
from pipexplore.predict.frames import (KIND_PHASES, PHASE_NAMES, FrozenRecords, graph_frame, held_activations,
                                      records_frame)
from pipexplore.predict.moe_overlap import hide_exchanges
from pipexplore.predict.sharing import ActionCosts, loop_layout, may_oversubscribe, processor_sharing
from pipexplore.schedules import (SCHEDULES, check_schedule, checkpointed, csv_schedule, is_csv, is_multi_stage,
                                  known_schedule, rank_orders, schedule_version, splits_backward, stage_orders,
                                  stage_ranks, worker_devices, worker_orders)
from pipexplore.splits import check_splits
from pipexplore.validate import interleaved_devices, valid_chunks

try:  # the compiled loops; where they were not built (or ``_sharing`` is set to None), the Python ones run
    from pipexplore.predict import _sharing
except ImportError:  # pragma: no cover - depends on the install
    _sharing = None  # type: ignore[assignment]  # mypy types an imported module as never None

__all__ = ["SCHEDULES", "COSTED", "PHASE_NAMES", "simulate", "prepare_step", "Setup", "loop_layout",
           "stage_orders", "stage_costs", "schedule_graph", "host_cores", "worker_devices"]

#: What a prediction costs per stage, by kind letter: the cost phase (:func:`pipexplore.predict.costs.layer_seconds`)
#: and the phase whose learnt corrections apply. The graph's kinds (``O``: the stage's optimizer
#: step, the table's ``optimizer`` column summed over its layers), then ``C``: the forward of a
#: checkpointed micro-batch (no autograd), corrected as the forward (runs teach the forward from both).
COSTED = {**{kind: (KIND_PHASES[kind], KIND_PHASES[kind]) for kind in KINDS}, "C": ("checkpointed", "forward")}

# Seconds per byte between devices when the caller gives none (~20 GB/s GPU↔GPU, ~10 GB/s host↔GPU).
DEFAULT_COPY_COST = {"cuda-cuda": 1 / 20e9, "cpu-cuda": 1 / 10e9}


@functools.lru_cache(maxsize=16)
def schedule_graph(schedule: str, stages: int, m: int, *, executor: str, checkpointed: int, virtual_stages: int = 2,
                   resources: Optional[tuple[str, ...]] = None, optimizer: bool = False,
                   version: Optional[tuple[int, ...]] = None) -> ActionGraph:
    """The actions of one step, per worker in the order it runs them, and what each waits for.

    ``checkpointed``: micro-batches ``0 … checkpointed-1`` recompute their forward right before their
    backward. ``resources``: what each stage's device shares (the autograd executor runs the
    backward of each on one worker). ``optimizer``: the step ends with one optimizer step per stage
    (``O``, after the stage's last backward-side action), as the executors run them: in
    ``processes`` each rank steps its own stages' at the end of its worker's queue; the in-process
    executors (``threads``, ``autograd``) step them one after another, in stage order, on one more
    worker (the caller's thread, once the workers are done). Depends on the schedule's shape only,
    so it is cached: moving a split re-times the same graph. ``version``: a CSV schedule's
    :func:`~pipexplore.schedules.schedule_version`, so that an edited file is graphed anew.
    """
    S = stages
    lane_queues = [list(queue) for queue in _worker_queues(schedule, S, m, executor, virtual_stages, resources,
                                                                 version)]
    if checkpointed:  # recompute right before the backward (or I) of checkpointed micro-batches
        lane_queues = [[a for s, kind, i in queue
                        for a in ([(s, "R", i)] if kind in ("B", "I") and i < checkpointed else []) + [(s, kind, i)]]
                       for queue in lane_queues]
    if optimizer:
        steps = [(s, "O", OPTIMIZER_MICRO) for s in range(S)]
        if executor == "processes":  # each rank steps its stages' optimizers once its schedule is done
            for queue in lane_queues:
                held = {s for s, _, _ in queue}
                queue += [step for step in steps if step[0] in held]
        else:  # the caller's thread, once the workers are done: stage after stage
            lane_queues.append(steps)
    return ActionGraph.build(lane_queues, S, "I" if splits_backward(schedule) else "B")


@functools.lru_cache(maxsize=64)
def _worker_queues(schedule: str, S: int, m: int, executor: str, virtual_stages: int,
                   resources: Optional[tuple[str, ...]],
                   version: Optional[tuple[int, ...]] = None) -> tuple[tuple[tuple[int, str, int], ...], ...]:
    """Each worker's (stage, kind, micro-batch) before recompute and optimizer steps: a worker per
    rank (:mod:`pipexplore.schedules`), and for ``autograd`` the backward of each device on one
    more. Cached apart from :func:`schedule_graph` (its checkpointed variants share it), by the
    same ``version``. ``processes`` runs torch's own orders (GPipe's backwards first micro-batch
    first, where the in-process executors run them last first)."""
    if executor == "processes" and schedule == "gpipe":
        orders = rank_orders(schedule, S, m)
    else:
        orders = worker_orders(schedule, S, m, virtual_stages if is_multi_stage(schedule) else 1)
    lane_queues = [[(s, k, i) for s, k, i in order if executor != "autograd" or k == "F"] for order in orders]
    if executor == "autograd":
        # One backward() call: autograd's engine runs the backward of each device on one thread
        # (the caller's for the CPU), micro-batch-major, last first.
        resources = resources or ("host",) * S
        for device in dict.fromkeys(resources):
            lane_queues.append([(s, "B", i) for i in reversed(range(m)) for s in reversed(range(S))
                                if resources[s] == device])
    return tuple(tuple(queue) for queue in lane_queues)


def stage_costs(layer_table: pd.DataFrame, splits: Sequence[int]) -> pd.DataFrame:
    """Per-stage sums of a layer table: ``forward``, ``backward``, ``param_bytes``,
    ``activation_bytes`` (what its layers keep for backward: ``saved_bytes`` where profiled,
    else their outputs) and ``input_bytes`` (what it receives), for the table's whole batch."""
    n = len(layer_table)
    points = [0, *check_splits(splits, n), n]
    forward = layer_table["forward"].to_numpy(dtype=float)
    backward = layer_table["backward"].to_numpy(dtype=float)
    out_bytes = layer_table["output_bytes"].to_numpy(dtype=float) if "output_bytes" in layer_table else np.zeros(n)
    kept = layer_table["saved_bytes"].to_numpy(dtype=float) if "saved_bytes" in layer_table else out_bytes
    params = layer_table["param_bytes"].to_numpy(dtype=float) if "param_bytes" in layer_table else np.zeros(n)
    first, end = np.asarray(points[:-1]), np.asarray(points[1:])
    return pd.DataFrame({
        "stage": np.arange(len(first)), "first_layer": first, "last_layer": end - 1, "layers": end - first,
        "forward": stage_sums(forward, points), "backward": stage_sums(backward, points),
        "param_bytes": stage_sums(params, points), "activation_bytes": stage_sums(kept, points),
        "input_bytes": np.where(first > 0, out_bytes[np.maximum(first - 1, 0)], 0.0),
    })


def _copy_rate(copy_cost: Optional[float], a: str, b: str, gpus_per_node: int = 8) -> float:
    """Seconds per byte from device ``a`` to ``b`` (none on the same device): ``copy_cost`` where
    given, else the catalogue's link between two planned devices (inside a node of
    ``gpus_per_node`` or across nodes), else a default by device kinds."""
    if a == b:
        return 0.0
    if copy_cost is not None:
        return copy_cost
    if is_planned(a) and is_planned(b):
        return link_seconds_per_byte(a, b, gpus_per_node)
    kinds = "-".join(sorted(d.split(":")[0] for d in (a, b)))
    return DEFAULT_COPY_COST.get(kinds, 0.0)


def _is_host(device: str) -> bool:
    return not device.startswith("cuda") and not is_planned(device)


def _resource(device: str) -> str:
    """What a stage's work shares: the host's cores for every CPU device, else the GPU (or the
    planned device) itself."""
    return "host" if _is_host(device) else device


def simulate(layer_table: pd.DataFrame, splits: Sequence[int], *, chunks: int, schedule: str = "gpipe",
             checkpoint: str = "except_last", devices: Optional[Sequence[str]] = None,
             copy_cost: Optional[float] = None, virtual_stages: int = 2, executor: Optional[str] = None,
             cpu_stages_overlap: bool = False, per_microbatch: bool = False, action_overhead: float = 0.0,
             batch: Optional[int] = None, corrections: Optional[Corrections] = None,
             run: Union[int, str] = "predicted", gpus_per_node: int = 8, replicas: int = 1,
             moe_overlap: bool = False) -> pd.DataFrame:
    """Predict the timeline of one training step.

    Args:
        layer_table: per-layer costs, as :func:`pipexplore.profile` gives: ``t(n) = a + b·n`` per
            phase in the rows ``n`` of a micro-batch, and the share of its device each phase
            keeps busy (``share_forward``, ``share_backward``; 1 where the table does not say).
            A table of whole-batch seconds only (``forward``, ``backward``) is taken as
            proportional to the rows. Where it has an ``optimizer`` column (seconds of the
            optimizer's step over each layer's parameters, as ``profile`` times it), the step
            ends with each stage's update (phase ``optimizer``, micro-batch -1) after its last
            backward-side action: on the caller's thread in stage order for the in-process
            executors, on each rank for ``processes``; without one, no update is predicted.
            An update is its stage's work in the bubble (:mod:`pipexplore.timeline`).
        splits: layers that begin a stage.
        chunks: micro-batches. Their rows are the batch's split as ``torch.chunk`` makes it (refused
            where it makes fewer: more chunks than rows, or chunks that do not split them exactly).
        schedule: ``gpipe``, ``1f1b``, ``zero-bubble`` (ZB-H1), or with ``virtual_stages`` stages
            per device ``interleaved``, ``looped-bfs``, ``interleaved-zero-bubble`` (stage ``s`` on
            device ``s % (stages / virtual_stages)``), ``zbv``, ``dualpipev`` (two a device, in a V);
            or the path of a CSV file in torch's format (its ranks' orders and stages, one device
            a rank; refused where it schedules other stages or micro-batches).
        checkpoint: ``always``, ``except_last`` or ``never``: checkpointed micro-batches
            recompute their forward right before their backward.
        devices: one per stage (multi-stage schedules and CSV files: one per device, i.e. rank);
            default ``'cpu'`` for each.
            Every CPU device is the same host: its stages share its cores.
        copy_cost: seconds per byte between different devices (default by device kinds; between
            planned devices, the catalogue's links: see :func:`pipexplore.devices.link_seconds_per_byte`).
        gpus_per_node: planned devices per node (``'H100:0'`` … ``'H100:7'`` share node 0's links).
        executor: ``autograd`` (the ``GPipe`` module: one ``backward()`` call), ``threads`` (the
            schedule executor: a worker per stage) or ``processes`` (a process per stage).
            Default: ``autograd`` for ``gpipe``, ``threads`` for the others.
        batch: rows of the mini-batch (default: the profiled sample's, ``table.attrs['batch']``).
        corrections: what earlier runs taught (:class:`pipexplore.predict.costs.Corrections`): a factor
            per layer and phase, and the executor's time between actions.
        action_overhead: seconds added to every compute action (a what-if).
        per_microbatch: the table's seconds are already per micro-batch (a table without rows: no
            fit, no ``batch``; refused for the others, whose seconds follow from the rows).
        cpu_stages_overlap: CPU stages never slow each other (layers that leave the CPU free:
            sleeps, I/O, waits on other machines), whatever the table says of their shares.
        replicas: copies of each stage that run its actions at the same time on the same host
            (a mesh's data-parallel replicas, ranks of this machine): each action asks for that
            many times its share of the host's cores, and each rank of ``processes`` for its own.
        moe_overlap: the schedule's paired forward and backward of different micro-batches hide
            each other's experts' all-to-alls (the table's ``ep_*`` columns), as Megatron-Core's 1F1B
            overlap and DualPipeV run them (:mod:`pipexplore.predict.moe_overlap`); the timeline's
            ``attrs['moe_overlap']`` records each paired action's all-to-alls and what of them is exposed.

    Example::

        table = pipexplore.profile(model, sample, microbatch_rows=[16, 64])
        predicted = simulate(table, [4, 8], chunks=8, schedule="1f1b")
        bubble_fraction(predicted)
    """
    setup = prepare_step(layer_table, splits, chunks=chunks, schedule=schedule, checkpoint=checkpoint, devices=devices,
                   copy_cost=copy_cost, virtual_stages=virtual_stages, executor=executor,
                   cpu_stages_overlap=cpu_stages_overlap, per_microbatch=per_microbatch,
                   action_overhead=action_overhead, batch=batch, corrections=corrections,
                   gpus_per_node=gpus_per_node, replicas=replicas)
    layer_table, graph, costs = setup.layer_table, setup.graph, setup.costs
    splits, stage_device, resource, executor = setup.splits, setup.stage_device, setup.resource, setup.executor
    sizes, distinct, fractions = setup.sizes, setup.distinct, setup.fractions
    S = len(costs)
    split_backward = splits_backward(schedule)

    # Seconds, and the share of its device, of every (kind, stage, micro-batch).
    learnt = executor
    seconds: dict[tuple[str, float], np.ndarray] = {}
    demand: dict[tuple[str, float], np.ndarray] = {}
    extra = setup.extra
    for kind, (phase, corrected_as) in COSTED.items():
        if kind == "C" and not setup.stop:
            continue  # no checkpointed micro-batch
        scale = corrections.scale(learnt, corrected_as) if corrections is not None else None
        for rows in distinct:
            size = setup.layer_rows(rows)
            seconds[(kind, rows)] = stage_seconds(layer_table, splits, size, phase, scale) + extra[kind]
            if split_backward and kind in ("I", "W"):
                # The first stage's input is the user's data, which needs no gradient: its I runs the
                # whole backward (weights too) and its W has nothing left to do, as the executors do.
                whole_scale = corrections.scale(learnt, "backward") if corrections is not None else None
                whole = stage_seconds(layer_table, splits, size, "backward", whole_scale)[0]
                seconds[(kind, rows)][0] = whole + extra[kind] if kind == "I" else 0.0
            wanted = np.clip(stage_shares(layer_table, splits, size, phase, default=1.0), 0.0, 1.0)
            demand[(kind, rows)] = np.minimum(wanted, setup.share_cap) * setup.replicas
    # A step's first backward of each stage allocates the parameters' gradients; the later ones
    # accumulate into them, as the profile's backward is timed: ``fresh_grads`` seconds once a step.
    fresh = stage_sums(fresh_gradient_seconds(layer_table, corrections.scale(learnt, "backward")
                                              if corrections is not None else None), [0, *splits, len(layer_table)])
    last_layers = costs["last_layer"].to_numpy()
    out_bytes = layer_table["output_bytes"].to_numpy(dtype=float) if "output_bytes" in layer_table else None
    edge_bytes = [float(out_bytes[b]) if out_bytes is not None else 0.0 for b in last_layers]

    # The copy over each stage boundary, per micro-batch.
    edge_copy = (np.array([setup.copy_rates[b] * edge_bytes[b] for b in range(S - 1)]).reshape(S - 1, 1)
                 * np.asarray(fractions).reshape(1, len(sizes)))
    size_index = np.searchsorted(distinct, sizes)
    action_costs = _action_costs(graph, seconds, demand, size_index, edge_copy, setup.handoff, setup.stop,
                                 fresh, split_backward)
    overlapped: tuple = ()
    if moe_overlap:
        action_costs, overlapped = hide_exchanges(graph, action_costs, layer_table, splits,
                                                  [setup.layer_rows(r) for r in sizes], schedule)
    placement = placed_fsdp(graph, action_costs, layer_table, [0, *splits, len(layer_table)], len(sizes), executor)
    gap = setup.gap
    times = None
    # (A graph whose levels hold one action each, e.g. autograd's one backward thread for all CPU
    # stages, is timed as fast by the loop, which a crowded host needs anyway; and where the
    # workers of several stages could ask for more of a device than all of it, the compiled loop
    # is faster than timing the graph to find out: both give the same timeline where both apply.)
    most_levels = max(2000, len(graph) // 4)
    crowding, stages_crowd = may_oversubscribe(graph, action_costs.share, resource)
    if (not stages_crowd or _sharing is None) and graph.longest_queue <= most_levels and graph.depth <= most_levels:
        times = _longest_path(graph, action_costs, resource, gap, crowding)
    if times is not None:
        frame, kinds = graph_frame(graph, times, action_costs.copy, stage_device, run)
    else:
        records = processor_sharing(graph, action_costs, gap, resource, compiled=_sharing is not None)
        frame, kinds = records_frame(graph, records, stage_device, run)
    frame["memory"] = held_activations(frame, kinds, costs, np.asarray(fractions), setup.stop)
    # one micro-batch's part of it (the largest's), per stage: pipexplore.predict.memory.microbatch_activations
    frame.attrs["microbatch_activation_bytes"] = (costs["activation_bytes"].to_numpy(dtype=float)
                                                  * max(fractions)).tolist()
    frame.attrs["peak_memory"] = {}
    if placement is not None:
        frame.attrs["fsdp"] = FrozenRecords(placement_record(graph, placement))
    if overlapped:
        frame.attrs["moe_overlap"] = FrozenRecords(overlapped)
    if any(is_planned(d) for d in stage_device):
        frame.attrs["gpus_per_node"] = gpus_per_node  # which planned devices share a node (the page draws it)
    return frame


class Setup(NamedTuple):
    """What a step's prediction needs that a moved split does not change (the stage count
    stays): the graph, micro-batch sizes, devices and what corrections and the executor add."""

    layer_table: pd.DataFrame
    splits: list[int]
    costs: pd.DataFrame  # stage_costs of these splits
    graph: ActionGraph
    executor: str
    sizes: list[float]  # rows of each micro-batch
    distinct: list[float]  # the distinct sizes, ascending
    fractions: list[float]  # each micro-batch's fraction of the table's bytes
    stop: int  # micro-batches 0 … stop-1 are checkpointed
    stage_device: list[str]
    resource: list[str]
    share_cap: np.ndarray  # per stage: the most of its device an action may ask for
    extra: dict[str, float]  # per kind letter (and "C"): seconds an action's span holds beyond its layers
    gap: float  # seconds a worker spends between actions
    handoff: float  # seconds from an action's end to the start of the one on another stage it feeds
    copy_rates: list[float]  # seconds per byte over each stage boundary
    fit: bool
    batch: Optional[int]
    replicas: Union[np.ndarray, float] = 1.0  # per stage: copies of its actions at once on its device (host meshes)

    def layer_rows(self, rows: float) -> float:
        """The size a layer table's costs are read at for a micro-batch of ``rows`` rows (a table
        without a fit or a batch of its own holds whole-batch seconds: the fraction)."""
        return rows if self.fit or self.layer_table.attrs.get("batch") or not self.batch else rows / self.batch


def prepare_step(layer_table: pd.DataFrame, splits: Sequence[int], *, chunks: int, schedule: str = "gpipe",
                 checkpoint: str = "except_last", devices: Optional[Sequence[str]] = None,
                 copy_cost: Optional[float] = None, virtual_stages: int = 2, executor: Optional[str] = None,
                 cpu_stages_overlap: bool = False, per_microbatch: bool = False, action_overhead: float = 0.0,
                 batch: Optional[int] = None, corrections: Optional[Corrections] = None,
                 gpus_per_node: int = 8, replicas: int = 1) -> Setup:
    """:func:`simulate`'s arguments checked, and what they fix for every split of the same stage
    count (what :mod:`pipexplore.predict.retime` hands a page to re-time a drag with)."""
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks!r}")
    if checkpoint not in ("always", "except_last", "never"):
        raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never', got {checkpoint!r}")
    schedule = known_schedule(schedule)
    executor = executor or ("autograd" if schedule == "gpipe" else "threads")
    if executor not in ("autograd", "threads", "processes"):
        raise ValueError(f"unknown executor {executor!r}: 'autograd', 'threads' or 'processes'")
    if executor == "autograd" and schedule != "gpipe":
        raise ValueError(f"the autograd executor (GPipe) runs only the gpipe schedule, not {schedule!r}")
    if action_overhead < 0:
        raise ValueError(f"action_overhead must be non-negative, got {action_overhead}")

    if set(layer_table.attrs) - {"batch"}:
        # pandas deep-copies a frame's attrs into every column it hands out, and the costs below
        # read columns some hundred times: keep only what they use (the profiled batch).
        layer_table = layer_table.copy(deep=False)
        layer_table.attrs = {k: v for k, v in layer_table.attrs.items() if k == "batch"}
    costs = stage_costs(layer_table, splits)
    splits = [int(b) for b in costs["first_layer"].iloc[1:]]
    S = len(costs)
    fit = has_fit(layer_table)
    own_batch = layer_table.attrs.get("batch")
    if per_microbatch and (fit or batch is not None or own_batch is not None):
        raise ValueError(_per_microbatch_refusal(fit, batch, own_batch))
    given, batch = batch is not None, batch if batch is not None else own_batch
    if fit or batch is not None:
        sizes = [float(r) for r in microbatch_rows(int(batch), chunks)] if batch else [1.0] * chunks
        if len(sizes) != chunks:
            raise ValueError(_chunks_refusal(chunks, int(batch), len(sizes), int(sizes[0]), given))
    else:
        sizes = [1.0 if per_microbatch else 1.0 / chunks] * chunks
    m = len(sizes)
    # Bytes of the table are for its own batch (fractions: the profiled sample's rows, else the
    # batch given), unless given per micro-batch.
    fractions = [1.0 if per_microbatch else (r / (own_batch or batch) if batch else r) for r in sizes]
    stop = checkpointed(checkpoint, m)

    if is_csv(schedule):  # the file's ranks, each stage on the rank that runs it
        file = csv_schedule(schedule).check_fits(stages=S, microbatches=m)
        device_names = list(devices) if devices is not None else ["cpu"] * file.ranks
        if len(device_names) != file.ranks:
            raise ValueError(f"schedule {schedule} runs on {file.ranks} ranks: give {file.ranks} devices, one a "
                             f"rank, got {len(device_names)}")
        stage_device = [str(device_names[r]) for r in file.stage_ranks]
    elif is_multi_stage(schedule):
        if virtual_stages < 1 or S % virtual_stages:
            raise ValueError(f"{schedule} needs the stage count ({S}) to be a multiple of virtual_stages "
                             f"({virtual_stages})")
        p = S // virtual_stages
        device_names = list(devices) if devices is not None else ["cpu"] * p
        if len(device_names) != p:
            raise ValueError(f"{schedule} with {S} stages and virtual_stages={virtual_stages} needs {p} devices, "
                             f"got {len(device_names)}")
        if schedule == "interleaved":
            stage_device = interleaved_devices(S, device_names, m)
        else:  # torch's constraints (two stages a rank for the V schedules, …), then its layout
            check_schedule(schedule, p, m, virtual_stages)
            stage_device = [str(device_names[r]) for r in stage_ranks(schedule, S, p)]
    else:
        stage_device = [str(d) for d in devices] if devices is not None else ["cpu"] * S
        if len(stage_device) != S:
            raise ValueError(f"{S} stages need {S} devices, got {len(stage_device)}")
    resource = [_resource(d) for d in stage_device]
    # A table that says what each layer's optimizer step costs (``optimizer``) ends the step with one
    # per stage; one that does not (older tables, tables written by hand) predicts none, as before.
    graph = schedule_graph(schedule, S, m, executor=executor, checkpointed=stop, virtual_stages=virtual_stages,
                           resources=tuple(resource) if executor == "autograd" else None,
                           optimizer="optimizer" in layer_table, version=schedule_version(schedule))

    host = np.array([_is_host(d) for d in stage_device])
    cores = host_cores()
    if isinstance(replicas, bool) or not isinstance(replicas, (int, np.integer)) or replicas < 1:
        raise ValueError(f"replicas must be a whole number ≥ 1, got {replicas!r}")
    rank_share = max(1, cores // (S * replicas)) / cores
    share_cap = np.ones(S)
    if executor == "processes":
        # A process per stage: no GIL between them, and each keeps at most its own intra-op
        # threads busy (the host's cores shared among the ranks, as the workers set them).
        share_cap = np.where(host, rank_share, share_cap)
    if cpu_stages_overlap:
        share_cap = np.where(host, 0.0, share_cap)
    # Every action's span also holds the executor's own bookkeeping (a what-if, and as probed per
    # phase; "C", a checkpointed forward, as a forward). Not an optimizer step: the executors time
    # optimizer.step() alone, outside their actions.
    extra = {kind: 0.0 if kind == "O" else action_overhead + (
        corrections.overhead(executor, corrected_as) if corrections is not None else 0.0)
        for kind, (_, corrected_as) in COSTED.items()}
    return Setup(layer_table, splits, costs, graph, executor, sizes, sorted(set(sizes)), fractions, stop, stage_device,
                 resource, share_cap, extra, corrections.gap(executor) if corrections is not None else 0.0,
                 corrections.transfer(executor) if corrections is not None else 0.0,
                 [_copy_rate(copy_cost, stage_device[b], stage_device[b + 1], gpus_per_node) for b in range(S - 1)],
                 fit, batch,
                 np.where(host, float(replicas), 1.0))


def _chunks_refusal(chunks: int, batch: int, made: int, rows: int, given: bool) -> str:
    """Why ``chunks`` micro-batches cannot be predicted from ``batch`` rows (``torch.chunk`` makes
    ``made`` of up to ``rows`` rows), and what to do; ``given``: the batch is simulate's argument."""
    where = f"batch={batch}" if given else f"the profile's batch of {batch} rows (the sample it was profiled on)"
    choose = f"choose chunks among {', '.join(map(str, valid_chunks(batch, chunks)))}"
    if chunks > batch:
        remedy = (f"or a batch of at least {chunks} rows" if given else
                  f"or profile a sample of at least {chunks} rows (more rows, or fewer chunks)")
        return (f"chunks={chunks} asks for more micro-batches than {where} has rows: every micro-batch needs "
                f"a row, so torch.chunk makes {made} micro-batches and the prediction would time {made}, not "
                f"{chunks}; {choose}, {remedy}")
    remedy = (f"or a batch that splits into {chunks}" if given else
              f"or profile a sample whose rows split into {chunks} (e.g. {chunks * rows} rows)")
    return (f"chunks={chunks} cannot split {where} into {chunks} micro-batches: torch.chunk makes {made} "
            f"micro-batches of up to {rows} rows; {choose}, {remedy}")


def _per_microbatch_refusal(fit: bool, batch: Optional[int], own_batch: Optional[int]) -> str:
    """Why ``per_microbatch=True`` would be ignored: the table's seconds follow from the rows."""
    if fit:
        return (f"per_microbatch=True is for a table of seconds without rows, but this table's costs are a line "
                f"in the rows (forward_a + forward_b·rows, as profile gives them), read at each micro-batch's "
                f"rows: leave per_microbatch out, and give batch= the mini-batch's rows where it is not the "
                f"profiled sample's ({own_batch})")
    if own_batch is not None:
        return (f"per_microbatch=True contradicts the table: its seconds are for its batch of {own_batch} rows "
                f"(table.attrs['batch']) and each micro-batch's follow from its rows; leave per_microbatch out, "
                f"or drop attrs['batch'] if the seconds are each micro-batch's")
    return (f"per_microbatch=True contradicts batch={batch}: with a batch the table's seconds are the batch's, "
            f"and each micro-batch's follow from its rows; leave one of them out")


def _action_costs(graph: ActionGraph, seconds: dict, demand: dict, size_index: np.ndarray, edge_copy: np.ndarray,
                  handoff: float, stop: int = 0, fresh: Optional[np.ndarray] = None,
                  split_backward: bool = False) -> ActionCosts:
    """``seconds``/``demand`` per (kind letter, rows) and stage; ``("C", rows)``: the forward of a
    checkpointed micro-batch (``micro < stop``). ``fresh``: per stage, the seconds its first
    backward of the step (micro-batch 0) adds by allocating the parameters' gradients: to its
    weight-gradient action where the backward is split (the first stage's input-gradient action,
    which does its weights too)."""
    by_size = sorted({rows for _, rows in seconds})
    stage, micro, kind = graph.stage, graph.micro, graph.kind
    size = size_index[np.maximum(micro, 0)]  # (an optimizer step's micro-batch is -1: its cost has no rows)
    took = np.array([[seconds[(k, rows)] for rows in by_size] for k in KINDS])[kind, size, stage]
    asked = np.array([[demand[(k, rows)] for rows in by_size] for k in KINDS])[kind, size, stage]
    if stop and ("C", by_size[0]) in seconds:
        checkpointed = (kind == FORWARD) & (micro < stop)
        at = (size[checkpointed], stage[checkpointed])
        took[checkpointed] = np.array([seconds[("C", rows)] for rows in by_size])[at]
        asked[checkpointed] = np.array([demand[("C", rows)] for rows in by_size])[at]
    if fresh is not None and fresh.any():
        weights = WEIGHT_GRAD if split_backward else BACKWARD
        first = (micro == 0) & (((kind == weights) & ((stage > 0) | (not split_backward)))
                                | ((kind == INPUT_GRAD) & (stage == 0)))
        took = took + np.where(first, fresh[stage], 0.0)
    n = len(graph)
    copy = np.zeros(n)
    received = (kind == FORWARD) & (stage > 0)
    copy[received] = edge_copy[stage[received] - 1, micro[received]]
    first_wait = np.where(received, copy + handoff, 0.0)
    second_wait = np.zeros(n)
    gradient = graph.second < n
    second_wait[gradient] = edge_copy[stage[gradient], micro[gradient]] + handoff
    return ActionCosts(took, asked, copy, first_wait, second_wait)


def _longest_path(graph: ActionGraph, costs: ActionCosts, resource: list[str], gap: float,
                  crowding: bool = True) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """Start and end of every action of ``graph`` when no device is ever asked for more than all
    of it, else ``None`` (the processor-sharing loop must run). ``crowding=False``: the caller
    knows no device can be (:func:`~pipexplore.predict.sharing.may_oversubscribe`), so the timed
    graph is not checked."""
    start, end = graph.times(costs.seconds, costs.first_wait, costs.second_wait, gap)
    resource_id = np.unique(np.asarray(resource), return_inverse=True)[1]
    if crowding and oversubscribed(graph, resource_id, costs.share, start, end):
        return None
    return start, end
