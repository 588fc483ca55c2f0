"""The schedules by name: what each is, which torch class runs it, what torch refuses, where its stages go.

Ask :func:`is_multi_stage`, :func:`splits_backward` and :func:`is_csv` rather than ``schedule in MULTI_STAGE``:
they answer for CSV files too (read and checked once per modification: :func:`csv_schedule`).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from pipexplore.schedules.csv_files import CsvSchedule, is_csv_path, load_csv
from pipexplore.schedules.torch_orders import rounds

__all__ = [
    "SCHEDULES", "MULTI_STAGE", "V_SHAPED", "SPLIT_BACKWARD", "TORCH_CLASSES", "PHASES", "Action", "check_schedule",
    "stage_ranks", "ranks_of", "is_csv", "csv_schedule", "schedule_version", "known_schedule", "is_multi_stage",
    "splits_backward", "is_v_shaped", "checkpointed"
]

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
    """The schedule a CSV file holds, read and checked (:func:`pipexplore.schedules.csv_files.load_csv`,
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


def _name(schedule: str) -> str:
    return f"{schedule} (torch's {TORCH_CLASSES[schedule]})"


def check_schedule(schedule: str, ranks: int, microbatches: int, stages_per_rank: Optional[int] = None) -> int:
    """Refuse what torch's class for ``schedule`` refuses, with its reason; the stages per rank.

    A CSV file is refused where its ranks or micro-batches are not these (``stages_per_rank`` is
    the file's: the most stages a rank holds is returned).

    ``stages_per_rank`` defaults to 1 for the one-stage-per-rank schedules, 2 for the others.
    1F1B needs micro-batches ≥ stages; ZB-V and DualPipeV exactly two stages per rank, and
    DualPipeV micro-batches ≥ its stages (2 × ranks); the interleaved schedules (and ZB-H1, torch's
    interleaved zero-bubble class) micro-batches that their rounds (``max(1, m // ranks)``) divide.

    Example::

        check_schedule("dualpipev", 4, 6)   # ValueError: ... needs at least as many micro-batches as stages ...
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
