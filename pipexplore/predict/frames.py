"""Predicted timelines as frames: the timed actions of a step in the common timeline schema.

The simulator times a step either as the schedule's graph (a start and end per action) or with
the processor-sharing loop (:class:`~pipexplore.predict.sharing.Records`, row by row); both
become one frame here, with ``source='predicted'``, each row's ``lane`` (the worker that ran
it), a ``copy`` row before every forward that receives over a copy, and the activation bytes
each stage holds once an event is done (:func:`held_activations`, the ``memory`` column).
"""
from __future__ import annotations

from typing import Union

import numpy as np
import pandas as pd

from pipexplore.predict.dataflow import BACKWARD, FORWARD, INPUT_GRAD, KINDS, RECOMPUTE, ActionGraph
from pipexplore.predict.sharing import Records
from pipexplore.schedules import PHASES
from pipexplore.timeline.metrics import lexsort

__all__ = ["PHASE_NAMES", "KIND_PHASES", "FrozenRecords", "graph_frame", "records_frame", "timeline_frame",
           "held_activations"]

#: The timeline phase of each of the graph's kind letters: the schedule's, and ``optimizer``.
KIND_PHASES = {**PHASES, "O": "optimizer"}
#: Phase names by the graph's kind numbers, then ``copy``.
PHASE_NAMES = np.array([*(KIND_PHASES[k] for k in KINDS), "copy"], dtype=object)
_PHASE_INDEX = pd.Index(PHASE_NAMES)


class FrozenRecords(tuple):
    """Records a timeline's ``attrs`` carry (tuples of numbers and names: FSDP's placement, the
    experts' overlapped exchanges), shared by every frame and column taken from the timeline, not
    copied: pandas deep-copies a frame's attrs into each of them, and a search that read a mesh's
    timeline column by column spent seconds copying these. Nothing in them can change."""

    __slots__ = ()

    def __copy__(self) -> "FrozenRecords":
        return self

    def __deepcopy__(self, memo: dict) -> "FrozenRecords":
        return self


def graph_frame(graph: ActionGraph, times: tuple[np.ndarray, np.ndarray], copy: np.ndarray,
                stage_device: list[str], run: Union[int, str]) -> tuple[pd.DataFrame, np.ndarray]:
    """The timeline of a timed graph, with a copy row before every forward that receives over a
    copy; and each row's phase number (:data:`PHASE_NAMES`)."""
    start, end = times
    copied = np.flatnonzero(copy > 0)
    sent = end[graph.first[copied]]
    return timeline_frame(np.concatenate([graph.stage, graph.stage[copied]]),
                          np.concatenate([graph.micro, graph.micro[copied]]),
                          np.concatenate([graph.kind, np.full(len(copied), len(PHASE_NAMES) - 1)]),
                          np.concatenate([start, sent]), np.concatenate([end, sent + copy[copied]]),
                          np.concatenate([graph.lane, graph.lane[copied]]), stage_device, run)


def records_frame(graph: ActionGraph, records: Records, stage_device: list[str],
                  run: Union[int, str]) -> tuple[pd.DataFrame, np.ndarray]:
    """The timeline of the processor-sharing loop's records (rows that tie keep the order the loop
    emitted them), and each row's phase number."""
    action = records.action
    kind = np.where(records.copy, len(PHASE_NAMES) - 1, graph.kind[action])
    return timeline_frame(graph.stage[action], graph.micro[action], kind, records.start, records.end,
                          graph.lane[action], stage_device, run)


def timeline_frame(stage: np.ndarray, micro: np.ndarray, kind: np.ndarray, start: np.ndarray, end: np.ndarray,
                   lane: np.ndarray, stage_device: list[str], run: Union[int, str]) -> tuple[pd.DataFrame, np.ndarray]:
    """A predicted timeline from one array per column (``kind``: phase numbers), its rows sorted by
    start then stage, built array by array (at 65k actions a row-wise build would cost more than
    the timing itself); and each row's phase number in that order."""
    order = lexsort((stage, start))
    kind = kind[order]
    stage = stage[order]
    # Strings taken from an index of the few distinct ones (pandas checks each of an object array's).
    frame = pd.DataFrame({
        "run": run, "stage": stage, "device": pd.Index(stage_device).take(stage), "microbatch": micro[order],
        "phase": _PHASE_INDEX.take(kind), "start": start[order], "end": end[order], "source": "predicted",
        "lane": lane[order],
    }, copy=False)  # the arrays are this frame's own
    return frame, kind


def held_activations(frame: pd.DataFrame, kind: np.ndarray, costs: pd.DataFrame, fractions: np.ndarray,
                     stop: int) -> np.ndarray:
    """Activation bytes each stage holds after each event (``kind``: each row's phase number): a
    forward keeps its activations (only its input when checkpointed), a recompute brings them back,
    the backward (input-grad) frees them. Copies, weight-grads and optimizer steps change nothing."""
    act = costs["activation_bytes"].to_numpy()
    inp = costs["input_bytes"].to_numpy()
    stage = frame["stage"].to_numpy()
    micro = frame["microbatch"].to_numpy()
    share = fractions[np.maximum(micro, 0)]  # (an optimizer step's micro-batch, -1, holds nothing)
    checkpointed = micro < stop
    kept = np.where(checkpointed, inp[stage], act[stage])  # what a forward keeps
    freed = act[stage] + np.where(checkpointed, inp[stage], 0.0)  # what a backward (I) frees
    delta = np.select([kind == FORWARD, kind == RECOMPUTE, (kind == BACKWARD) | (kind == INPUT_GRAD)],
                      [kept, act[stage], -freed], 0.0) * share
    # Per stage, in the order events end: a running sum that starts again at each stage.
    order = lexsort((frame["end"].to_numpy(), stage))  # by stage, then end (then row)
    running = np.cumsum(delta[order])
    ordered = stage[order]
    first = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    running -= np.repeat(np.r_[0.0, running[first[1:] - 1]], np.diff(np.r_[first, len(order)]))
    held = np.empty(len(frame))
    held[order] = np.clip(running, 0.0, None)
    return held
