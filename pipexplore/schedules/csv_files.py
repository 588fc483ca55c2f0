"""Pipeline schedules as CSV files, in torch's format: read, checked, written.

The format of ``torch.distributed.pipelining`` (``_PipelineScheduleRuntime._load_csv`` and
``_dump_csv``): no header, one row per rank (line 1 is rank 0), one cell per step, each cell an
action ``{stage}{F|I|B|W}{micro-batch}`` (``0F0`` forward, ``3I1`` input gradient, ``1W2`` weight
gradient, ``2B0`` a whole backward), an empty cell an idle step::

    0F0,0F1,,0B0,0B1          rank 0 holds stage 0
    ,1F0,1B0,1F1,1B1          rank 1 holds stage 1

``format="compute_comms"`` also takes torch's communication actions (``0SEND_F1``, ``1RECV_F0``,
``0SEND_B1``, ``1RECV_B0``, ``0UNSHARD``, ``0RESHARD``, ``0REDUCE_GRAD``) and has no idle cells,
as torch wants it; they are read and kept (:attr:`CsvSchedule.comms`), and the file handed to torch
as written, but pipexplore's simulator and in-process executors run the compute actions only. A
cell ``(1F3;2B1)OVERLAP_F_B`` (torch's overlapped pair) runs its actions one after the other.

:func:`load_csv` checks a file before anything runs, each refusal naming where: a cell it cannot
read (its line and column, 1-based, and its text); a stage on two ranks; an action twice; an
action that would wait forever, found by running the order (``F`` of stage s waits for ``F`` of
s−1; ``B`` or ``I`` for the stage's ``F`` and the next stage's ``B`` or ``I``; ``W`` for its
``I``), named by its rank and step (the step is the cell's column, from 1)::

    rank 1, step 7: 1B3 waits for 2B3, which no rank runs

and every micro-batch of every stage with one forward and one backward (``B``, or ``I`` and
``W``). :func:`to_csv_text` and :func:`write_csv` write per-rank orders (as
:func:`pipexplore.schedules.rank_orders` gives them) in the same format; torch's reader reads
them back (tests).

This module imports no other part of pipexplore (:mod:`pipexplore.schedules` imports it).
"""
from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

__all__ = [
    "CsvSchedule", "FORMATS", "COMPUTE", "COMMS", "load_csv", "parse_csv_text", "to_csv_text", "write_csv",
    "is_csv_path"
]

#: The formats torch reads (``compute_only``: compute actions and idle cells; ``compute_comms``:
#: every action written out); ``auto`` reads ``compute_comms`` where a cell holds a communication action.
FORMATS = ("compute_only", "compute_comms")
#: Compute action kinds: forward, input gradient, weight gradient, whole backward.
COMPUTE = ("F", "I", "W", "B")
#: torch's communication and sharding actions (``compute_comms`` only).
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")
_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
Action = tuple[int, str, int]  # (stage, kind, micro-batch)
Comm = tuple[int, str, Optional[int]]  # (stage, kind, micro-batch or None)


def is_csv_path(schedule: Any) -> bool:
    """Whether ``schedule`` names a CSV file (a string or path ending in ``.csv``)."""
    return isinstance(schedule, (str, os.PathLike)) and os.fspath(schedule).lower().endswith(".csv")


def _count(n: int, what: str) -> str:
    return f"{n} {what if n != 1 else what.removesuffix('es' if what.endswith('ches') else 's')}"


def _name(action: Sequence[Any]) -> str:
    stage, kind, micro = action
    return f"{stage}{kind}{'' if micro is None else micro}"


@dataclass(frozen=True)
class CsvSchedule:
    """A schedule read from a CSV file (:func:`load_csv`), checked: every rank's actions in order.

    ``actions[r]``: rank ``r``'s compute actions ``(stage, kind, micro-batch)``, in order (a
    pipexplore worker's order); ``steps[r]``: each one's step (its cell's column, from 1);
    ``comms[r]``: the communication actions of a ``compute_comms`` file, ``(stage, kind,
    micro-batch or None, step)``; ``stage_ranks[s]``: the rank that holds stage ``s``.
    """

    path: str
    format: str
    text: str
    actions: tuple[tuple[Action, ...], ...]
    steps: tuple[tuple[int, ...], ...]
    comms: tuple[tuple[tuple[int, str, Optional[int], int], ...], ...]
    stage_ranks: tuple[int, ...]
    microbatches: int

    @property
    def ranks(self) -> int:
        return len(self.actions)

    @property
    def stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def split_backward(self) -> bool:
        """Whether some backward is split into input- and weight-gradient actions (``I``, ``W``)."""
        return any(kind == "I" for order in self.actions for _, kind, _ in order)

    @property
    def rank_stages(self) -> list[list[int]]:
        """The stages each rank holds, in ascending order."""
        return [sorted({s for s, _, _ in order}) for order in self.actions]

    def orders(self) -> list[list[Action]]:
        """Each rank's compute actions in order, as :func:`pipexplore.schedules.rank_orders` gives them."""
        return [list(order) for order in self.actions]

    def fits(self, *, stages: Optional[int] = None, microbatches: Optional[int] = None,
             ranks: Optional[int] = None) -> Optional[str]:
        """Why this schedule does not fit a plan of ``stages`` stages, ``microbatches`` micro-batches
        (chunks) on ``ranks`` ranks (each given), saying what was expected and what the file has; None if it fits.

        Example::

            load_csv("my.csv").fits(stages=3, microbatches=4)
            # "schedule my.csv does not fit the plan: expected 3 stages and 4 micro-batches (the plan's
            #  stages and chunks), got 4 stages and 8 micro-batches in the file"
        """
        wanted = [(stages, self.stages, "stages"), (microbatches, self.microbatches, "micro-batches"),
                  (ranks, self.ranks, "ranks")]
        wrong = [(w, have, what) for w, have, what in wanted if w is not None and w != have]
        if not wrong:
            return None
        mine = {"stages": "stages", "micro-batches": "chunks", "ranks": "devices"}
        expected = " and ".join(_count(w, what) for w, _, what in wrong)
        got = " and ".join(_count(have, what) for _, have, what in wrong)
        return (f"schedule {self.path} does not fit the plan: expected {expected} (the plan's "
                f"{' and '.join(mine[what] for _, _, what in wrong)}), got {got} in the file")

    def check_fits(self, **shape: Optional[int]) -> "CsvSchedule":
        """Raise :meth:`fits`'s refusal as a ValueError; this schedule where it fits."""
        refusal = self.fits(**shape)
        if refusal:
            raise ValueError(refusal)
        return self


def load_csv(path: Union[str, "os.PathLike[str]"], format: str = "compute_only") -> CsvSchedule:
    """Read and check a schedule in torch's CSV format (see the module docstring).

    ``format``: ``compute_only`` (torch's default), ``compute_comms`` (communication actions
    written out, kept but not simulated) or ``auto`` (``compute_comms`` where a cell holds one).

    Raises:
        ValueError: a cell it cannot read (line and column), or a schedule that cannot run (why, where).
        FileNotFoundError: no such file.

    Example::

        schedule = load_csv("my.csv")
        schedule.actions[0][:3]     # ((0, 'F', 0), (0, 'F', 1), (0, 'B', 0))
    """
    path = os.fspath(path)
    try:
        with open(path, newline="") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"schedule file {path!r} not found (a schedule is a name or the path of a "
                                "CSV file in torch's format)") from None
    return parse_csv_text(text, path, format)


def parse_csv_text(text: str, path: str = "<csv>", format: str = "compute_only") -> CsvSchedule:
    """:func:`load_csv` on the text of a file (``path`` names it in messages)."""
    if format not in (*FORMATS, "auto"):
        raise ValueError(f"format is one of {', '.join(FORMATS)} or 'auto', got {format!r}")
    rows = []
    reader = csv.reader(io.StringIO(text))
    for row in reader:
        rows.append((reader.line_num, row))
    if format == "auto":
        kinds = {match.group(2) for _, row in rows for cell in row if (match := _ACTION.fullmatch(cell.strip()))}
        format = "compute_comms" if kinds & set(COMMS) else "compute_only"
    try:
        return _check(path, format, text, [(line, _parse_row(line, row, format)) for line, row in rows])
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _parse_row(line: int, row: list[str], format: str) -> list[tuple[int, Union[Action, Comm]]]:
    """A row's actions, each with its step (the cell's column, from 1); an overlapped pair gives two."""
    cells: list[tuple[int, Union[Action, Comm]]] = []
    for column, raw in enumerate(row, start=1):
        cell = raw.strip()
        if not cell:
            if format == "compute_comms":
                raise ValueError(f"line {line}, column {column} is empty: torch's compute_comms format has no "
                                 "idle cells (each cell an action, in order)")
            continue
        overlap = _OVERLAP.fullmatch(cell)
        parts = [p.strip() for p in overlap.group(1).split(";") if p.strip()] if overlap else [cell]
        for part in parts:
            match = _ACTION.fullmatch(part)
            if match is None or (overlap and match.group(2) not in COMPUTE):
                raise ValueError(f"line {line}, column {column}: cannot read {cell!r} as an action: write "
                                 f"{{stage}}{{F|I|B|W}}{{micro-batch}}, such as 1B3"
                                 + (" (or a communication action such as 0SEND_F1)" if format == "compute_comms"
                                    else ", or leave the cell empty for an idle step"))
            stage, kind, micro = int(match.group(1)), match.group(2), match.group(3)
            if kind in COMMS and format == "compute_only":
                raise ValueError(f"line {line}, column {column}: {cell!r} is a communication action, which "
                                 "format 'compute_only' does not take: read the file with format='compute_comms' "
                                 "(every send and receive written out), or leave them out for torch to add")
            if kind in COMPUTE and not micro:
                raise ValueError(f"line {line}, column {column}: {cell!r} names no micro-batch: a compute action "
                                 f"is {{stage}}{{F|I|B|W}}{{micro-batch}}, such as {cell}0")
            cells.append((column, (stage, kind, int(micro) if micro else None)))
    return cells


def _check(path: str, format: str, text: str, rows: list[tuple[int, list[tuple[int, Any]]]]) -> CsvSchedule:
    """The schedule of parsed rows, refused (ValueError) where it cannot run."""
    if not rows:
        raise ValueError("the file has no rows: write one row per rank, one cell per step")
    orders = [[a for _, a in cells if a[1] in COMPUTE] for _, cells in rows]
    steps = [[c for c, a in cells if a[1] in COMPUTE] for _, cells in rows]
    comms = tuple(tuple((*a, c) for c, a in cells if a[1] in COMMS) for _, cells in rows)
    for rank, ((line, _), order) in enumerate(zip(rows, orders)):
        if not order:
            raise ValueError(f"rank {rank} (line {line}) runs no compute action: every rank holds at least one stage")
    where: dict[Action, tuple[int, int]] = {}  # action -> (rank, index in its order)
    home: dict[int, tuple[int, Action, int]] = {}
    for rank, order in enumerate(orders):
        for k, action in enumerate(order):
            if action in where:
                r, j = where[action]
                raise ValueError(f"{_name(action)} appears twice, at rank {r}, step {steps[r][j]} and rank {rank}, "
                                 f"step {steps[rank][k]}: each action runs exactly once")
            where[action] = (rank, k)
            stage = action[0]
            if stage in home and home[stage][0] != rank:
                r, first, step = home[stage]
                raise ValueError(f"stage {stage} sits on rank {r} ({_name(first)} at step {step}) and on rank {rank} "
                                 f"({_name(action)} at step {steps[rank][k]}): each stage runs on exactly one rank")
            home.setdefault(stage, (rank, action, steps[rank][k]))
    stages = max(home) + 1
    missing = [s for s in range(stages) if s not in home]
    if missing:
        raise ValueError(f"stage {missing[0]} appears on no rank: stages are numbered from 0 with none missing "
                         f"(found {', '.join(map(str, sorted(home)))})")
    for rank, sent in enumerate(comms):
        for stage, kind, micro, step in sent:
            if home.get(stage, (rank,))[0] != rank or stage >= stages:
                held = f"rank {home[stage][0]} holds it" if stage in home else f"the stages are 0 … {stages - 1}"
                raise ValueError(f"rank {rank}, step {step}: {_name((stage, kind, micro))} names stage {stage}, "
                                 f"but {held}: a rank's communication actions are its own stages'")
    microbatches = max(i for order in orders for _, _, i in order) + 1
    _backward_once(steps, where)  # before running the order: a W beside a B would only "wait for I"
    _run(orders, steps, where, stages)
    _complete(orders, steps, where, stages, microbatches)
    return CsvSchedule(path, format, text, tuple(map(tuple, orders)), tuple(map(tuple, steps)), comms,
                       tuple(home[s][0] for s in range(stages)), microbatches)


def _needs(action: Action, stages: int) -> list[tuple[Action, ...]]:
    """What ``action`` waits for: one of each tuple's actions (the next stage's B or I)."""
    s, kind, i = action
    if kind == "F":
        return [((s - 1, "F", i),)] if s > 0 else []
    if kind == "W":
        return [((s, "I", i),)]
    return [((s, "F", i),)] + ([((s + 1, "B", i), (s + 1, "I", i))] if s < stages - 1 else [])


def _run(orders: list[list[Action]], steps: list[list[int]], where: dict[Action, tuple[int, int]],
         stages: int) -> None:
    """Run every rank's order, each action once its inputs ran; refuse the first one stuck, and why."""
    done: set[Action] = set()
    at = [0] * len(orders)
    splits = {s for order in orders for s, kind, _ in order if kind == "I"}

    def waiting_for(action: Action) -> Optional[Action]:
        for choices in _needs(action, stages):
            if not any(c in done for c in choices):
                present = [c for c in choices if c in where]
                if present:
                    return present[0]
                return (choices[-1] if len(choices) > 1 and choices[-1][0] in splits else choices[0])
        return None

    moved = True
    while moved:
        moved = False
        for rank, order in enumerate(orders):
            while at[rank] < len(order) and waiting_for(order[at[rank]]) is None:
                done.add(order[at[rank]])
                at[rank] += 1
                moved = True
    stuck = [(steps[r][at[r]], r) for r in range(len(orders)) if at[r] < len(orders[r])]
    if not stuck:
        return
    step, rank = min(stuck)
    first = orders[rank][at[rank]]
    wanted = waiting_for(first)
    words = [f"rank {rank}, step {step}: {_name(first)} waits for {_name(wanted)}"]  # type: ignore[arg-type]
    seen = {first}
    action: Optional[Action] = wanted
    while action is not None:
        if action not in where:
            words.append("which no rank runs")
            break
        r, k = where[action]
        head = orders[r][at[r]]
        if head != action:  # behind another stuck action on its rank
            if head == first:
                words.append(f"which rank {r} runs only at step {steps[r][k]}, after it")
                break
            words.append(f"which rank {r} runs only at step {steps[r][k]}, after {_name(head)}"
                         + ("" if head in seen else f" (step {steps[r][at[r]]})"))
            if head in seen:
                break
            action = head
        seen.add(action)
        nxt = waiting_for(action)
        if nxt == first:
            words.append("which waits for it")
            break
        words.append(f"which waits for {_name(nxt)}")  # type: ignore[arg-type]
        action = None if nxt in seen else nxt
    dead = words[-1] != "which no rank runs"
    raise ValueError(", ".join(words) + (": a deadlock, no rank can go on" if dead else ""))


def _at(action: Action, steps: list[list[int]], where: dict[Action, tuple[int, int]]) -> str:
    r, k = where[action]
    return f"rank {r}, step {steps[r][k]}"


def _backward_once(steps: list[list[int]], where: dict[Action, tuple[int, int]]) -> None:
    """No micro-batch's backward runs both whole (B) and split (I or W) on one stage."""
    for s, kind, i in sorted(where, key=lambda a: (a[0], a[2])):
        if kind != "B":
            continue
        other = next((a for a in ((s, "I", i), (s, "W", i)) if a in where), None)
        if other is not None:
            b = (s, "B", i)
            raise ValueError(f"stage {s} runs micro-batch {i}'s backward twice, as {_name(b)} "
                             f"({_at(b, steps, where)}) and {_name(other)} ({_at(other, steps, where)}): a backward is "
                             "one B, or one I and one W")


def _complete(orders: list[list[Action]], steps: list[list[int]], where: dict[Action, tuple[int, int]],
              stages: int, microbatches: int) -> None:
    """Every stage runs each micro-batch's forward once and its backward once (B, or I and W)."""
    for s in range(stages):
        for i in range(microbatches):
            f, b, inp, w = ((s, kind, i) for kind in ("F", "B", "I", "W"))
            if f not in where:
                raise ValueError(f"stage {s} has no forward of micro-batch {i} ({_name(f)}): every stage runs "
                                 f"each micro-batch (0 … {microbatches - 1}) once forward and once backward")
            if b not in where and inp not in where:
                raise ValueError(f"stage {s} has no backward of micro-batch {i}: give it {_name(b)}, or {_name(inp)} "
                                 f"and {_name(w)}")
            if inp in where and w not in where:
                raise ValueError(f"stage {s} has {_name(inp)} ({_at(inp, steps, where)}) but no {_name(w)}: an "
                                 "input-gradient action (I) needs its weight-gradient action (W)")


def to_csv_text(rank_orders: Iterable[Iterable[Any]]) -> str:
    """Per-rank orders in torch's CSV format: one row per rank, one cell per action.

    An action is ``(stage, kind, micro-batch)`` (as :func:`pipexplore.schedules.rank_orders` gives
    them; micro-batch None for torch's ``UNSHARD``-like actions) or already a cell (``'0F1'``).

    Example::

        to_csv_text([[(0, "F", 0), (0, "B", 0)], [(1, "F", 0), (1, "B", 0)]])   # '0F0,0B0\\n1F0,1B0\\n'
    """
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for order in rank_orders:
        writer.writerow([a if isinstance(a, str) else _name(a) for a in order])
    return buffer.getvalue()


def write_csv(rank_orders: Iterable[Iterable[Any]], path: Union[str, "os.PathLike[str]"]) -> str:
    """Write :func:`to_csv_text` of ``rank_orders`` to ``path``; the path written."""
    path = os.fspath(path)
    with open(path, "w", newline="") as handle:
        handle.write(to_csv_text(rank_orders))
    return path

