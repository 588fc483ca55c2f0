"""FSDP's actions in a pipelined step, placed where torch's pipelining runtime places them.

Torch's runtime lowers a schedule's compute actions for FSDP with its own passes:
``_add_unshard_reshard`` issues a stage's ``UNSHARD`` (the all-gather of its parameters, async)
before the compute that is the first of the next three stages the rank works on, and its
``RESHARD`` once the stage leaves that window; ``_add_reduce_grad`` issues a stage's
``REDUCE_GRAD`` (its gradients' reduce-scatter) right after its last backward-side action. Those
passes run here, on each worker's queue of the predicted step, so that the prediction gathers as
often as torch does (once a step for a rank of one to three stages; again after each eviction for
more) and waits where torch waits:

- an ``UNSHARD`` issued before the rank's first compute starts at the step's start; the gathers of
  one rank run one after another (one all-gather stream) and the stage's first use may not start
  before its gather is done (a release time: a later stage's gather hides behind its wait for its
  input);
- an ``UNSHARD`` issued later is hidden by the rank's compute between its issue and the stage's use;
  what it takes beyond that is added to the use;
- a rank's ``REDUCE_GRAD``s run one after another (one reduce-scatter stream), each once its stage's
  last backward is done, behind the compute the rank still has (the backwards of its other
  stages; its idle time is not counted): what outlasts the rank's compute stays in the updates.

:func:`fsdp_placement` gives what the simulator adds; the timeline's collective rows are drawn from
its :class:`Unshard` and :class:`ReduceGrad` records. :func:`placed_fsdp` places them in a step the
simulator costs (where the table costs ``unshard_seconds`` or ``reduce_grad_seconds``), and
:func:`placement_record` keeps them in its timeline's attrs. The explorer's page re-times a moved
split with the same arithmetic (``widgets/retime.js``), from the lowering (:func:`lowered_steps`) and
the per-layer seconds (:func:`fsdp_columns`) that :func:`pipexplore.predict.retime.retime_model` packs.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import pandas as pd

from pipexplore.predict.costs import stage_sums
from pipexplore.predict.dataflow import OPTIMIZER
from pipexplore.predict.frames import PHASE_NAMES

__all__ = ["lowered", "lowered_steps", "fsdp_placement", "FsdpPlacement", "Unshard", "ReduceGrad", "placed_fsdp",
           "placement_record", "fsdp_columns", "fsdp_lanes", "regathered", "COMPUTE", "UNSHARD", "REDUCE_GRAD"]

_COMPUTE = {"F": "FORWARD", "B": "FULL_BACKWARD", "I": "BACKWARD_INPUT", "W": "BACKWARD_WEIGHT"}


def lowered(queue: Sequence[tuple[int, str, int]], microbatches: int) -> list[tuple[int, str, int]]:
    """``queue`` (a worker's ``(stage, kind, micro-batch)``, compute kinds ``F``/``B``/``I``/``W``; others
    are left out) with the ``UNSHARD``, ``RESHARD`` and ``REDUCE_GRAD`` actions torch's own lowering
    adds (micro-batch ``-1``)."""
    return list(_lowered(tuple(queue), microbatches))


@functools.lru_cache(maxsize=512)
def _lowered(queue: tuple[tuple[int, str, int], ...], microbatches: int) -> tuple[tuple[int, str, int], ...]:
    """:func:`lowered`, kept for each queue and count of micro-batches: a search lowers the same
    worker's queue for every mesh of its pipeline's depth and micro-batches, and torch's lowering
    walks the whole queue for each stage it unshards."""
    from torch.distributed.pipelining.schedules import (_Action, _add_reduce_grad, _add_unshard_reshard,
                                                        _ComputationType)

    letter = {getattr(_ComputationType, name): kind for kind, name in _COMPUTE.items()}
    actions = [_Action(s, getattr(_ComputationType, _COMPUTE[k]), i) for s, k, i in queue if k in _COMPUTE]
    out = []
    for action in _add_reduce_grad(_add_unshard_reshard(actions), microbatches):  # type: ignore[arg-type]
        if action is None:
            continue
        kind = letter.get(action.computation_type, action.computation_type.name)
        micro = action.microbatch_index
        out.append((action.stage_index, kind, -1 if micro is None else int(micro)))
    return tuple(out)


class Unshard(NamedTuple):
    """A stage's ``UNSHARD``: on worker ``lane``, issued before action ``issued`` (a graph action
    number) and first used by action ``use``; ``at_start``: issued before the worker's first compute
    (timed from the step's start, ``release`` after it); else ``hidden``/``exposed`` seconds."""
    stage: int
    lane: int
    issued: int
    use: int
    seconds: float
    at_start: bool
    release: float
    exposed: float


class ReduceGrad(NamedTuple):
    """A stage's ``REDUCE_GRAD``: after action ``after`` (its last backward-side one) on worker
    ``lane``; ``hidden`` of its ``seconds`` behind the rank's compute after it."""
    stage: int
    lane: int
    after: int
    seconds: float
    hidden: float


class FsdpPlacement(NamedTuple):
    """What the simulator adds to a step's actions (arrays over the graph's actions): ``release``,
    the earliest start an action's gather allows (from the step's start); ``extra``, seconds a use
    waits for a gather issued mid-step; ``optimizer_less``, per stage, the seconds of its
    ``REDUCE_GRAD`` its rank's later compute hides (taken off its update); ``regathers``, the
    backward actions that gather their stage again with ``reshard_after_forward`` and the seconds
    each adds (:func:`placed_fsdp`)."""
    release: np.ndarray
    extra: np.ndarray
    optimizer_less: np.ndarray
    unshards: list[Unshard]
    reduces: list[ReduceGrad]
    regathers: list[tuple[int, float]]


#: The codes of :func:`lowered_steps`' steps: a compute action (its number), a stage's ``UNSHARD``, its ``REDUCE_GRAD``.
COMPUTE, UNSHARD, REDUCE_GRAD = 0, 1, 2


def lowered_steps(graph: Any, microbatches: int,
                  lanes: Sequence[int] | None = None) -> list[tuple[int, list[tuple[int, int]]]]:
    """Each worker's queue of ``graph`` as torch's lowering runs it (``lanes``: the workers lowered,
    default all): ``(worker, steps)``, a step ``(COMPUTE, action number)``, ``(UNSHARD, stage)`` or
    ``(REDUCE_GRAD, stage)`` (``RESHARD`` left out: it costs nothing here). What a split moves does
    not change them: the page's re-timing gets them once a plan shape (:mod:`pipexplore.predict.retime`)."""
    out = []
    starts = np.cumsum([0, *map(len, graph.queues)])
    for lane, queue in enumerate(graph.queues):
        if lanes is not None and lane not in lanes:
            continue
        number = {action: int(starts[lane]) + j for j, action in enumerate(queue)}
        steps: list[tuple[int, int]] = []
        for s, kind, i in _lowered(tuple(queue), microbatches):
            if kind == "UNSHARD":
                steps.append((UNSHARD, s))
            elif kind == "REDUCE_GRAD":
                steps.append((REDUCE_GRAD, s))
            elif kind in _COMPUTE:
                steps.append((COMPUTE, number[(s, kind, i)]))
        out.append((lane, steps))
    return out


def fsdp_placement(graph, took: np.ndarray, unshard: np.ndarray, reduce_grad: np.ndarray, microbatches: int,
                   lanes: Sequence[int] | None = None,
                   steps: Optional[list[tuple[int, list[tuple[int, int]]]]] = None) -> FsdpPlacement:
    """FSDP's ``UNSHARD``s and ``REDUCE_GRAD``s over ``graph`` (a
    :class:`~pipexplore.predict.dataflow.ActionGraph`) placed by torch's lowering of each worker's
    queue (``lanes``: the workers lowered, default all; ``steps``: :func:`lowered_steps` of them, if
    known), for ``took`` (each action's seconds), ``unshard`` (per stage, seconds of its all-gather)
    and ``reduce_grad`` (per stage, seconds of its reduce-scatter). The page's re-timing
    (``widgets/retime.js``, ``fsdpCosts``) does the same arithmetic in the same order."""
    n = len(graph)
    release, extra = np.zeros(n), np.zeros(n)
    less = np.zeros(len(unshard))
    unshards: list[Unshard] = []
    reduces: list[ReduceGrad] = []
    for lane, ops in (steps if steps is not None else lowered_steps(graph, microbatches, lanes)):
        computes = [value for code, value in ops if code == COMPUTE]
        # compute done before each
        clock = np.concatenate([[0.0], np.cumsum(took[np.asarray(computes, dtype=np.int64)])])
        total = float(clock[-1])
        stream = 0.0  # when the worker's all-gather stream is free, for gathers issued at the start
        scatter = 0.0  # when its reduce-scatter stream is, on the compute's clock (its idle time left out)
        seen_compute = 0  # compute actions before the current point
        pending: dict[int, tuple[int, float]] = {}  # stage -> (compute index it was issued before, done)
        for code, value in ops:
            if code == UNSHARD:
                s = value
                at_start = seen_compute == 0
                if at_start:
                    stream += float(unshard[s])
                pending[s] = (seen_compute, stream if at_start else float(unshard[s]))
            elif code == REDUCE_GRAD:  # on the reduce-scatter stream, one after another, behind the compute
                s = value
                exposed_before = max(0.0, scatter - total)
                scatter = max(scatter, float(clock[seen_compute])) + float(reduce_grad[s])
                hidden = float(reduce_grad[s]) - (max(0.0, scatter - total) - exposed_before)
                less[s] += hidden
                reduces.append(ReduceGrad(s, lane, computes[seen_compute - 1], float(reduce_grad[s]), hidden))
            else:
                use = value
                s = int(graph.stage[use])
                if s in pending:
                    issued, done = pending.pop(s)
                    if issued == 0:  # timed from the step's start: a release time
                        release[use] = max(release[use], done)
                        unshards.append(Unshard(s, lane, computes[0], use, float(unshard[s]), True, done, 0.0))
                    else:
                        between = float(clock[seen_compute] - clock[issued])
                        exposed = max(0.0, done - between)
                        extra[use] += exposed
                        unshards.append(Unshard(s, lane, computes[issued], use, done, False, 0.0, exposed))
                seen_compute += 1
    return FsdpPlacement(release, extra, less, unshards, reduces, [])


def fsdp_columns(table: pd.DataFrame) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per layer, the seconds of FSDP's gather once a step (``unshard_seconds``), its step-end
    reduce-scatter (``reduce_grad_seconds``) and a backward's gather again
    (``backward_gather_exposed``), zeros where the table has no such column; None where it costs none."""
    columns = [table[c].to_numpy(dtype=float) if c in table else None
               for c in ("unshard_seconds", "reduce_grad_seconds", "backward_gather_exposed")]
    if all(c is None or not c.any() for c in columns):
        return None
    unshard, reduce_grad, regather = (c if c is not None else np.zeros(len(table)) for c in columns)
    return unshard, reduce_grad, regather


def fsdp_lanes(graph: Any, executor: str) -> list[int]:
    """The workers whose queues torch lowers: all, but with autograd's executor the forward workers
    (its backward worker runs after every forward: the gathers are the forward workers')."""
    return [w for w, queue in enumerate(graph.queues) if executor != "autograd" or any(k == "F" for _, k, _ in queue)]


def placed_fsdp(graph: Any, costs: Any, table: pd.DataFrame, points: list[int], microbatches: int,
                executor: str) -> Optional[FsdpPlacement]:
    """Where the table costs FSDP's gathers once a step (``unshard_seconds``) or its step-end
    reduce-scatter (``reduce_grad_seconds``, inside ``optimizer``), place them as torch's lowering
    does (:mod:`pipexplore.predict.fsdp_actions`): ``costs`` get the release times, the exposed
    gathers and the updates less what their rank hides. None where the table costs neither."""
    columns = fsdp_columns(table)
    if columns is None:
        return None
    unshard, reduce_grad, regather = (stage_sums(c, points) for c in columns)
    placement = fsdp_placement(graph, costs.seconds, unshard, reduce_grad, microbatches, fsdp_lanes(graph, executor))
    none = len(graph)
    waits = graph.second == none
    costs.second_wait[waits] = np.maximum(costs.second_wait[waits], placement.release[waits])
    costs.seconds[:] += placement.extra + np.where(waits, 0.0, placement.release)  # (a use with a second input)
    steps = graph.kind == OPTIMIZER
    costs.seconds[steps] -= placement.optimizer_less[graph.stage[steps]]
    if regather.any():  # resharded after forward: a backward gathers again where a forward came since the last
        again = regathered(graph)
        costs.seconds[again] += regather[graph.stage[again]]
        placement.regathers.extend((int(n), float(regather[graph.stage[n]])) for n in again)
    return placement


def regathered(graph: Any) -> np.ndarray:
    """The backward actions (``B``, ``I``) that gather their stage again with ``reshard_after_forward``:
    those whose stage ran a forward since its last backward on their worker (torch's stage keeps
    a stage unsharded from one backward to the next, until the last)."""
    from pipexplore.predict.dataflow import BACKWARD, FORWARD, INPUT_GRAD

    again = []
    n = 0
    for queue in graph.queues:
        resharded: dict[int, bool] = {}
        for _ in queue:
            kind, stage = int(graph.kind[n]), int(graph.stage[n])
            if kind == FORWARD:
                resharded[stage] = True
            elif kind in (BACKWARD, INPUT_GRAD) and resharded.get(stage, True):
                again.append(n)
                resharded[stage] = False
            n += 1
    return np.asarray(again, dtype=np.int64)


def placement_record(graph: Any, placement: FsdpPlacement) -> tuple:
    """The placement's gathers and reduce-scatters as plain tuples a timeline's attrs can carry:
    ``("unshard", stage, (use stage, phase, micro-batch), seconds, release, exposed)``,
    ``("reduce_grad", stage, (after stage, phase, micro-batch), seconds, hidden)`` and
    ``("regather", stage, (stage, phase, micro-batch), seconds)``."""
    def action(n: int) -> tuple:
        return (int(graph.stage[n]), PHASE_NAMES[int(graph.kind[n])], int(graph.micro[n]))
    return tuple([("unshard", u.stage, action(u.use), u.seconds, u.release if u.at_start else None, u.exposed)
                  for u in placement.unshards]
                 + [("reduce_grad", r.stage, action(r.after), r.seconds, r.hidden) for r in placement.reduces]
                 + [("regather", int(graph.stage[n]), action(n), seconds) for n, seconds in placement.regathers])
