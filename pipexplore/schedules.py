"""Every schedule's order of actions: what each stage's (or device's) worker runs, and when.

The vocabulary the predictor and the executors share: :mod:`pipexplore.predict.simulator` times
these orders, :mod:`pipexplore.executors.sequential` and :mod:`pipexplore.executors.traced` run
them. An action is a kind letter and a micro-batch: ``F`` forward, ``B`` backward, ``R`` recompute
(checkpointing), ``I``/``W`` input- and weight-gradient (zero-bubble). For two stages and four
micro-batches::

    gpipe   stage 0  F0 F1 F2 F3 B3 B2 B1 B0        1f1b   stage 0  F0 F1 B0 F2 B1 F3 B2 B3
            stage 1  F0 F1 F2 F3 B3 B2 B1 B0               stage 1  F0 B0 F1 B1 F2 B2 F3 B3

:func:`actions` gives every schedule's order per rank in torch's notation (``"0F0"``, ``"3I1"``:
stage, kind, micro-batch), as ``torch.distributed.pipelining`` runs it, and refuses what torch
refuses (:func:`check`). Besides the four above: ``looped-bfs``, ``interleaved-zero-bubble``
(ZB1P over several stages per rank), ``zbv`` (ZB-V: two stages per rank in a V, rank ``r``
holding stages ``r`` and ``2p − 1 − r``) and ``dualpipev`` (DeepSeek's DualPipeV, same V; its
overlapped F;B pairs listed forward then backward, which is how torch runs them without a custom
overlap function). :func:`worker_orders` is what the simulator and the in-process executors run:
the same orders, except that our ``gpipe`` runs its backward last micro-batch first (as one
``backward()`` over all micro-batches does), where torch's ``ScheduleGPipe`` runs micro-batch 0 first.

A schedule may also be the path of a CSV file in torch's format (``"my.csv"``: one row per rank,
one cell per step, ``{stage}{F|I|B|W}{micro-batch}``; :mod:`pipexplore.schedule_csv`), wherever a
name is taken: the file says each rank's order and which stages it holds, read and checked once
per modification (:func:`csv_schedule`). Ask :func:`is_multi_stage`, :func:`splits_backward` and
:func:`is_csv` rather than ``schedule in MULTI_STAGE``: they answer for files too.
:func:`schedule_csv_text` writes any schedule's orders in that format.

This module imports no other part of pipexplore but :mod:`pipexplore.schedule_orders` (the
orders of torch's multi-stage schedules, ported) and :mod:`pipexplore.schedule_csv` (files).
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from pipexplore.schedule_csv import CsvSchedule, is_csv_path, load_csv, to_csv_text, write_csv
from pipexplore.schedule_orders import MULTI_STAGE_ORDERS, rounds

__all__ = ["SCHEDULES", "MULTI_STAGE", "V_SHAPED", "SPLIT_BACKWARD", "TORCH_CLASSES", "PHASES", "Action",
           "actions", "rank_orders", "worker_orders", "refusal", "check", "stage_ranks", "ranks_of", "stage_orders",
           "interleaved_order", "worker_devices", "gpipe_order", "one_f_one_b_order", "zero_bubble_h1_order",
           "is_csv", "csv_schedule", "load_csv", "schedule_version", "known_schedule", "is_multi_stage",
           "splits_backward", "is_v_shaped", "checkpointed", "schedule_csv_text", "CsvSchedule", "to_csv_text", "write_csv"]

#: The schedules the simulator and the executors run.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "looped-bfs", "interleaved-zero-bubble", "zbv",
             "dualpipev")
#: Schedules whose ranks (devices) each hold several stages (``virtual_stages`` of them).
MULTI_STAGE = ("interleaved", "looped-bfs", "interleaved-zero-bubble", "zbv", "dualpipev")
#: Schedules laid out in a V: rank ``r`` of ``p`` holds stages ``r`` and ``2p − 1 − r``.
V_SHAPED = ("zbv", "dualpipev")
#: Schedules that split backwards into input-gradient (I) and weight-gradient (W) actions.
SPLIT_BACKWARD = ("zero-bubble", "interleaved-zero-bubble", "zbv", "dualpipev")
#: ``torch.distributed.pipelining``'s class for each schedule (ZB-H1 is its interleaved
#: zero-bubble schedule with one stage per rank).
TORCH_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                 "zero-bubble": "ScheduleInterleavedZeroBubble", "looped-bfs": "ScheduleLoopedBFS",
                 "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                 "dualpipev": "ScheduleDualPipeV"}
Action = tuple[str, int]  # (kind, micro-batch)
#: Each action kind's phase name in a timeline.
PHASES = {"F": "forward", "B": "backward", "R": "recompute", "I": "input_grad", "W": "weight_grad"}
_LOADED: dict[str, tuple[tuple[int, ...], CsvSchedule]] = {}  # CSV files read: by path, with schedule_version


def is_csv(schedule: Any) -> bool:
    """Whether ``schedule`` is the path of a CSV file (ends in ``.csv``) rather than a name."""
    return is_csv_path(schedule)


def _stat(schedule: Any) -> tuple[int, ...]:
    try:
        stat = os.stat(os.fspath(schedule))
    except FileNotFoundError:
        raise FileNotFoundError(f"schedule file {os.fspath(schedule)!r} not found (a schedule is one of "
                                f"{', '.join(SCHEDULES)}, or the path of a CSV file in torch's format)") from None
    return stat.st_mtime_ns, stat.st_size, stat.st_ctime_ns, stat.st_ino


def csv_schedule(schedule: Any) -> CsvSchedule:
    """The schedule a CSV file holds, read and checked (:func:`pipexplore.schedule_csv.load_csv`,
    ``format='auto'``) once per path and modification: an edited file is read again.

    Example::

        csv_schedule("my.csv").stage_ranks    # (0, 1, 1, 0)
    """
    key = os.path.abspath(os.fspath(schedule))
    version = _stat(schedule)
    cached = _LOADED.get(key)
    if cached is not None and cached[0] == version:
        return cached[1]
    loaded = load_csv(schedule, format="auto")
    _LOADED[key] = (version, loaded)
    return loaded


def schedule_version(schedule: Any) -> Optional[tuple[int, ...]]:
    """What changes when a schedule's orders may have: a CSV file's modification and change times,
    size and inode (an edit of the same size within one timestamp tick still changes the change
    time or, saved by replacing the file, the inode); None for a name."""
    return _stat(schedule) if is_csv(schedule) else None


def _unknown(schedule: Any) -> str:
    return (f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}, or give the path of a .csv file "
            "(a schedule in torch's CSV format)")


def known_schedule(schedule: Any) -> str:
    """``schedule`` as a name or a CSV path (a string); an unknown one refused, listing the known ones."""
    if is_csv(schedule):
        return os.fspath(schedule)
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ValueError(_unknown(schedule))
    return schedule


def is_multi_stage(schedule: Any) -> bool:
    """Whether ranks hold several stages each (:data:`MULTI_STAGE`, or a CSV file where some rank does):
    the workers are the ranks, not the stages."""
    if is_csv(schedule):
        return any(len(stages) > 1 for stages in csv_schedule(schedule).rank_stages)
    return schedule in MULTI_STAGE


def splits_backward(schedule: Any) -> bool:
    """Whether backwards are split into I and W (:data:`SPLIT_BACKWARD`, or a CSV file with an ``I``)."""
    if is_csv(schedule):
        return csv_schedule(schedule).split_backward
    return schedule in SPLIT_BACKWARD


def is_v_shaped(schedule: Any) -> bool:
    """Whether the stages lie in a V (:data:`V_SHAPED`; a CSV file says its own layout: False)."""
    return not is_csv(schedule) and schedule in V_SHAPED


def checkpointed(checkpoint: str, microbatches: int) -> int:
    """How many micro-batches recompute their forward before their backward (``0 … n-1``):
    all for ``always``, all but the last for ``except_last``, none for ``never``."""
    return {"always": microbatches, "except_last": microbatches - 1, "never": 0}[checkpoint]


def gpipe_order(stage: int, stages: int, m: int) -> list[Action]:
    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]


def one_f_one_b_order(stage: int, stages: int, m: int) -> list[Action]:
    warmup = min(stages - stage - 1, m)
    order: list[Action] = [("F", i) for i in range(warmup)]
    for k in range(m - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", k) for k in range(m - warmup, m)]
    return order


def zero_bubble_h1_order(stage: int, stages: int, m: int) -> list[Action]:
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


def interleaved_order(device: int, devices: int, v: int, m: int) -> list[tuple[int, str, int]]:
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
    """Each stage's actions in the order its worker runs them (``interleaved`` runs per device: :func:`interleaved_order`)."""
    build = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order, "zero-bubble": zero_bubble_h1_order}.get(schedule)
    if build is None:
        if is_csv(schedule) or schedule in SCHEDULES:
            raise ValueError(f"{schedule} is ordered per rank, not per stage: see worker_orders")
        raise ValueError(_unknown(schedule))
    return [build(s, stages, m) for s in range(stages)]


def worker_devices(worker_orders: Sequence[Sequence[tuple[int, str, int]]], stage_devices: Sequence[Any]) -> list[Any]:
    """The device each worker runs on, from its ``(stage, kind, micro-batch)`` order: the device of
    its first stage (an interleaved worker's stages all share one). Workers with nothing to do are
    left out."""
    return [stage_devices[order[0][0]] for order in worker_orders if order]


def _name(schedule: str) -> str:
    return f"{schedule} (torch's {TORCH_CLASSES[schedule]})"


def check(schedule: str, ranks: int, microbatches: int, stages_per_rank: Optional[int] = None) -> int:
    """Refuse what torch's class for ``schedule`` refuses, with its reason; the stages per rank.

    A CSV file is refused where its ranks or micro-batches are not these (``stages_per_rank`` is
    the file's: the most stages a rank holds is returned).

    ``stages_per_rank`` defaults to 1 for the one-stage-per-rank schedules, 2 for the others.
    1F1B needs micro-batches ≥ stages; ZB-V and DualPipeV exactly two stages per rank, and
    DualPipeV micro-batches ≥ its stages (2 × ranks); the interleaved schedules (and ZB-H1, torch's
    interleaved zero-bubble class) micro-batches that their rounds (``max(1, m // ranks)``) divide.

    Example::

        check("dualpipev", 4, 6)   # ValueError: ... needs at least as many micro-batches as stages ...
    """
    if is_csv(schedule):
        return max(map(len, csv_schedule(schedule).check_fits(ranks=ranks, microbatches=microbatches).rank_stages))
    if schedule not in SCHEDULES:
        raise ValueError(_unknown(schedule))
    for value, what in ((ranks, "ranks"), (microbatches, "micro-batches")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{schedule} needs a whole number of {what} from 1, got {value!r}")
    v = stages_per_rank if stages_per_rank is not None else (2 if schedule in MULTI_STAGE else 1)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"stages per rank (virtual_stages) is a whole number from 1, got {v!r}")
    if schedule not in MULTI_STAGE and v != 1:
        raise ValueError(f"{_name(schedule)} runs one stage per rank, not {v}")
    stages, m = ranks * v, microbatches
    if schedule in V_SHAPED and v != 2:
        raise ValueError(f"{_name(schedule)} needs exactly two stages per rank (virtual_stages=2), got {v}: torch "
                         f"lays them out in a V, rank r holding stages r and 2·ranks − 1 − r")
    if schedule == "1f1b" and m < stages:
        raise ValueError(f"torch's Schedule1F1B needs at least as many micro-batches as stages: chunks {m} < "
                         f"{stages} stages")
    if schedule == "dualpipev" and m < stages:
        raise ValueError(f"{_name(schedule)} needs at least as many micro-batches as stages (2 × {ranks} ranks): "
                         f"chunks {m} < {stages}")
    if schedule in ("interleaved", "interleaved-zero-bubble", "zero-bubble"):
        number, _ = rounds(ranks, m)
        if m % number:
            raise ValueError(f"{_name(schedule)} needs the micro-batches to be a multiple of its rounds "
                             f"(max(1, chunks // ranks) = {number} rounds over {ranks} ranks): chunks {m} is not; "
                             f"choose a multiple of {ranks}, or fewer than {2 * ranks} chunks")
    return v


def stage_ranks(schedule: str, stages: int, ranks: int) -> list[int]:
    """The rank (device) of each stage: stage ``s`` on rank ``s`` (one stage per rank), on
    ``s % ranks`` (looped and interleaved schedules), in a V for ``zbv`` and ``dualpipev``
    (rank ``r`` holds ``r`` and ``2·ranks − 1 − r``), or where a CSV file puts it (refused where
    the file has other stages or ranks).

    Example::

        stage_ranks("zbv", 4, 2)           # [0, 1, 1, 0]
        stage_ranks("interleaved", 4, 2)   # [0, 1, 0, 1]
    """
    if is_csv(schedule):
        return list(csv_schedule(schedule).check_fits(stages=stages, ranks=ranks).stage_ranks)
    if schedule in V_SHAPED:
        return [s if s < ranks else 2 * ranks - 1 - s for s in range(stages)]
    return [s % ranks for s in range(stages)]


def ranks_of(schedule: str, stages: int, stages_per_rank: int) -> int:
    """How many ranks (devices) ``stages`` stages take: ``stages / stages_per_rank`` for the
    multi-stage schedules (refused where it does not divide), a CSV file's ranks, else one per stage."""
    if is_csv(schedule):
        return csv_schedule(schedule).check_fits(stages=stages).ranks
    if schedule not in MULTI_STAGE:
        return stages
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"virtual_stages (stages per device) is a whole number from 1, got {stages_per_rank!r}")
    if stages % stages_per_rank:
        raise ValueError(f"{schedule} needs the stage count ({stages}) to be a multiple of virtual_stages "
                         f"({stages_per_rank}), the stages on each device")
    return stages // stages_per_rank


def rank_orders(schedule: str, ranks: int, microbatches: int,
                stages_per_rank: Optional[int] = None) -> list[list[tuple[int, str, int]]]:
    """Each rank's compute actions ``(stage, kind, micro-batch)`` in the order torch's class runs
    them (refused as torch refuses: :func:`check`); a CSV file's, as written. :func:`actions` writes
    them in torch's notation."""
    v = check(schedule, ranks, microbatches, stages_per_rank)
    m = microbatches
    if is_csv(schedule):
        return csv_schedule(schedule).orders()
    if schedule == "gpipe":  # torch's ScheduleGPipe: the backwards in micro-batch order
        return [[(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(ranks)]
    if schedule in ("1f1b", "zero-bubble"):
        return worker_orders(schedule, ranks, m)
    return [MULTI_STAGE_ORDERS[schedule](r, ranks, v, m) for r in range(ranks)]


def actions(schedule: str, ranks: int, microbatches: int, stages_per_rank: Optional[int] = None) -> list[list[str]]:
    """Per rank, its compute actions in torch's notation (``{stage}{F|B|I|W}{micro-batch}``), in
    the order ``torch.distributed.pipelining`` runs them (equal, rank by rank, to the compute
    actions of torch's ``_schedule_visualizer.get_schedule_ops``: tests).

    ``stages_per_rank`` (the plan's ``virtual_stages``): 1 for ``gpipe``, ``1f1b`` and
    ``zero-bubble``; any for ``interleaved``, ``looped-bfs`` and ``interleaved-zero-bubble``
    (default 2); exactly 2 for ``zbv`` and ``dualpipev``. DualPipeV's overlapped ``F;B`` pairs are
    listed as the forward, then the backward: torch runs them one after the other unless a
    custom function overlaps them (``register_custom_function(OVERLAP_F_B, ...)``). What torch
    refuses is refused with its reason (:func:`check`); an unknown schedule lists the known ones.

    Example::

        actions("zbv", 2, 2)
        # [['0F0', '0F1', '3F0', '3I0', '3W0', '3F1', '3I1', '3W1', '0I0', '0W0', '0I1', '0W1'],
        #  ['1F0', '2F0', '1F1', '2F1', '2I0', '2W0', '1I0', '1W0', '2I1', '2W1', '1I1', '1W1']]
    """
    return [[f"{s}{kind}{i}" for s, kind, i in order]
            for order in rank_orders(schedule, ranks, microbatches, stages_per_rank)]


def worker_orders(schedule: str, stages: int, microbatches: int,
                  stages_per_rank: int = 1) -> list[list[tuple[int, str, int]]]:
    """What the simulator and the in-process executors run: each worker's ``(stage, kind,
    micro-batch)`` in order, one worker per rank (per stage for ``gpipe``, ``1f1b`` and
    ``zero-bubble``; ``stages / stages_per_rank`` ranks for the others).

    Equal to :func:`rank_orders` (torch's), except ``gpipe``'s backward, last micro-batch first as
    one ``backward()`` over the micro-batches runs it. The one-stage schedules and ``interleaved``
    keep their own, looser checks (e.g. 1F1B with fewer micro-batches than stages runs here); the
    others are refused as torch refuses them. A CSV file: its ranks' orders, refused where its
    stages or micro-batches are not these (``stages_per_rank`` is the file's to say).
    """
    if is_csv(schedule):
        return csv_schedule(schedule).check_fits(stages=stages, microbatches=microbatches).orders()
    if schedule in ("gpipe", "1f1b", "zero-bubble"):
        return [[(s, kind, i) for kind, i in order] for s, order in enumerate(stage_orders(schedule, stages,
                                                                                           microbatches))]
    ranks = ranks_of(schedule, stages, stages_per_rank)
    if schedule == "interleaved":
        return [interleaved_order(d, ranks, stages_per_rank, microbatches) for d in range(ranks)]
    return rank_orders(schedule, ranks, microbatches, stages_per_rank)


def refusal(schedule: str, stages: int, microbatches: int, stages_per_rank: int = 1) -> Optional[str]:
    """Why :func:`worker_orders` refuses these stages and micro-batches (torch's reason), or None."""
    try:
        worker_orders(schedule, stages, microbatches, stages_per_rank)
    except (ValueError, FileNotFoundError) as exc:
        return str(exc)
    return None


def schedule_csv_text(schedule: str, stages: int, microbatches: int, stages_per_rank: int = 1) -> str:
    """The schedule's orders in torch's CSV format (:func:`pipexplore.schedule_csv.to_csv_text`): one
    row per rank, what :func:`worker_orders` gives (what the simulator times and the threads run;
    torch's own order for every schedule but ``gpipe``, whose backwards run last micro-batch first).
    Read back (``schedule="file.csv"``), it predicts the same timeline.

    Example::

        schedule_csv_text("1f1b", 2, 2)    # '0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n'
    """
    return to_csv_text(worker_orders(schedule, stages, microbatches, stages_per_rank))
