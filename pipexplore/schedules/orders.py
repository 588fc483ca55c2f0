"""Every schedule's order of actions: what each stage's (or device's) worker runs, and when.

The vocabulary the predictor and the executors share: :mod:`pipexplore.predict.simulator` times
these orders, :mod:`pipexplore.executors.threads` and :mod:`pipexplore.executors.traced` run
them. An action is a kind letter and a micro-batch: ``F`` forward, ``B`` backward, ``R`` recompute
(checkpointing), ``I``/``W`` input- and weight-gradient (zero-bubble). For two stages and four
micro-batches::

    gpipe   stage 0  F0 F1 F2 F3 B3 B2 B1 B0        1f1b   stage 0  F0 F1 B0 F2 B1 F3 B2 B3
            stage 1  F0 F1 F2 F3 B3 B2 B1 B0               stage 1  F0 B0 F1 B1 F2 B2 F3 B3

:func:`actions` gives every schedule's order per rank in torch's notation (``"0F0"``, ``"3I1"``:
stage, kind, micro-batch), as ``torch.distributed.pipelining`` runs it, and refuses what torch
refuses (:func:`check_schedule`). Besides the four above: ``looped-bfs``, ``interleaved-zero-bubble``
(ZB1P over several stages per rank), ``zbv`` (ZB-V: two stages per rank in a V, rank ``r``
holding stages ``r`` and ``2p − 1 − r``) and ``dualpipev`` (DeepSeek's DualPipeV, same V; its
overlapped F;B pairs listed forward then backward, which is how torch runs them without a custom
overlap function). :func:`worker_orders` is what the simulator and the in-process executors run:
the same orders, except that our ``gpipe`` runs its backward last micro-batch first (as one
``backward()`` over all micro-batches does), where torch's ``ScheduleGPipe`` runs micro-batch 0 first.

A schedule may also be the path of a CSV file in torch's format (``"my.csv"``: one row per rank,
one cell per step, ``{stage}{F|I|B|W}{micro-batch}``; :mod:`pipexplore.schedules.csv_files`), wherever a
name is taken: the file says each rank's order and which stages it holds, read and checked once
per modification (:func:`csv_schedule`). Ask :func:`is_multi_stage`, :func:`splits_backward` and
:func:`is_csv` rather than ``schedule in MULTI_STAGE``: they answer for files too.
:func:`schedule_csv_text` writes any schedule's orders in that format.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from pipexplore.schedules.csv_files import to_csv_text
from pipexplore.schedules.names import SCHEDULES, Action, _unknown, check_schedule, csv_schedule, is_csv, ranks_of
from pipexplore.schedules.torch_orders import MULTI_STAGE_ORDERS

__all__ = [
    "actions", "rank_orders", "worker_orders", "refusal", "stage_orders", "interleaved_order", "worker_devices",
    "gpipe_order", "one_f_one_b_order", "zero_bubble_h1_order", "schedule_csv_text"
]


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


def rank_orders(schedule: str, ranks: int, microbatches: int,
                stages_per_rank: Optional[int] = None) -> list[list[tuple[int, str, int]]]:
    """Each rank's compute actions ``(stage, kind, micro-batch)`` in the order torch's class runs
    them (refused as torch refuses: :func:`check_schedule`); a CSV file's, as written. :func:`actions` writes
    them in torch's notation."""
    v = check_schedule(schedule, ranks, microbatches, stages_per_rank)
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
    refuses is refused with its reason (:func:`check_schedule`); an unknown schedule lists the known ones.

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
    """The schedule's orders in torch's CSV format (:func:`pipexplore.schedules.csv_files.to_csv_text`): one
    row per rank, what :func:`worker_orders` gives (what the simulator times and the threads run;
    torch's own order for every schedule but ``gpipe``, whose backwards run last micro-batch first).
    Read back (``schedule="file.csv"``), it predicts the same timeline.

    Example::

        schedule_csv_text("1f1b", 2, 2)    # '0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n'
    """
    return to_csv_text(worker_orders(schedule, stages, microbatches, stages_per_rank))
