"""The experts' all-to-alls of one micro-batch hidden behind another's compute, where the schedule pairs them.

A plan's ``moe_overlap`` (off by default: every all-to-all exposed, as
:mod:`pipexplore.predict.mesh_costs` costs it) runs a forward and a backward of different
micro-batches on a rank as one pair, each one's all-to-alls (dispatch, combine) on a
communication stream under the other's compute. Which actions pair is the schedule's:

=================  ===========================================================================================
``1f1b``,          Megatron-Core's 1F1B all-to-all overlap (``--overlap-moe-expert-parallel-comm``, v0.14): one
``interleaved``    more warm-up forward than 1F1B (``megatron/core/pipeline_parallel/schedules.py``: "we schedule
                   one extra micro-batch forward step before the 1f1b stages ... to ensure the forward and
                   backward computations are independent in all 1f1b steps"), so each steady backward runs
                   with the forward that follows it: here each ``B`` pairs with the ``F`` right after it on
                   its rank (a ``B`` followed by another ``B``, or by nothing, runs alone)
``dualpipev``      DeepSeek's DualPipeV as torch's ``ScheduleDualPipeV`` lists it: its ``OVERLAP_F_B``
                   actions (a forward of one of the rank's stages, then a full backward of the other), run
                   overlapped by the function registered for them (``register_custom_function``), as
                   DeepSeek's DualPipe overlaps them: each ``F`` directly followed by a ``B`` on a rank, but
                   the last rank's first (torch runs that one alone, to shrink the bubble)
other schedules    no pairs: nothing hidden
=================  ===========================================================================================

The rule, per pair (stage sums: the pair's forward ``F`` and backward ``B``, each its compute ``c``
and its all-to-alls ``a`` at its micro-batch's rows, the ``ep_*`` columns of the rank's table)::

    F runs  c_F + max(0, a_F − c_B)        B runs  c_B + max(0, a_B − c_F)

Megatron-Core's ``TransformerLayerSchedulePlan.run`` (``megatron/core/models/common/
model_chunk_schedule_plan.py``) orders a pair's layer so: communication ``combine_bwd | dispatch_fwd
→ dispatch_bwd | combine_fwd`` beside computation ``attn_fwd | mlp_bwd → mlp_fwd | attn_bwd``: every
all-to-all of the one runs under compute of the other, never its own. Taken over the stage as a
whole (the layer table does not split a layer into attention and experts), an all-to-all is hidden
up to the other action's compute and only what exceeds it is exposed: a lower bound on what
Megatron's sub-layer slots expose. A recompute's all-to-alls stay exposed (Megatron: "exposed (not
overlapped) by design").
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd

from pipexplore.predict.costs import stage_sums
from pipexplore.predict.dataflow import BACKWARD, FORWARD, RECOMPUTE, ActionGraph
from pipexplore.predict.sharing import ActionCosts

__all__ = ["OVERLAP_SCHEDULES", "EXCHANGE_COLUMNS", "overlap_pairs", "hide_exchanges"]

#: The schedules whose forward and backward pair (the module docstring), and which comes first in a pair.
OVERLAP_SCHEDULES = {"1f1b": "B", "interleaved": "B", "dualpipev": "F"}
#: A rank table's seconds of the experts' all-to-alls inside each layer's ``forward_a`` … ``backward_b``
#: (:func:`pipexplore.predict.mesh_costs.mesh_layer_table`).
EXCHANGE_COLUMNS = ("ep_forward_a", "ep_forward_b", "ep_backward_a", "ep_backward_b")


def overlap_pairs(graph: ActionGraph, schedule: str) -> list[tuple[int, int]]:
    """The ``(forward, backward)`` action numbers of ``graph`` that ``schedule`` runs as a pair (the
    module docstring), on each worker that runs forwards (a rank; recomputes skipped over)."""
    first = OVERLAP_SCHEDULES.get(schedule)
    if first is None:
        return []
    ends = np.cumsum([0, *(len(q) for q in graph.queues)])
    ranks = [w for w in range(len(graph.queues)) if (graph.kind[ends[w]:ends[w + 1]] == FORWARD).any()]
    pairs: list[tuple[int, int]] = []
    for rank in ranks:
        numbers = [int(i) for i in range(ends[rank], ends[rank + 1]) if graph.kind[i] != RECOMPUTE]
        skip_first = schedule == "dualpipev" and rank == ranks[-1]
        i = 0
        while i + 1 < len(numbers):
            a, b = numbers[i], numbers[i + 1]
            lead, follow = (BACKWARD, FORWARD) if first == "B" else (FORWARD, BACKWARD)
            if graph.kind[a] == lead and graph.kind[b] == follow and (
                    graph.stage[a], graph.micro[a]) != (graph.stage[b], graph.micro[b]):
                if skip_first:
                    skip_first = False
                else:
                    pairs.append((b, a) if first == "B" else (a, b))
                    i += 2
                    continue
            i += 1
    return pairs


def hide_exchanges(graph: ActionGraph, costs: ActionCosts, table: pd.DataFrame, splits: Sequence[int],
                   rows: Sequence[float], schedule: str) -> tuple[ActionCosts, tuple]:
    """``costs`` with each pair's all-to-alls hidden behind the other's compute (the module
    docstring's rule), and a record of each paired action: ``(stage, phase, micro-batch, all-to-all
    seconds, exposed seconds, the partner's (stage, phase, micro-batch))``. ``rows``: each
    micro-batch's size as the table's costs are read (:meth:`~pipexplore.predict.simulator.Setup.layer_rows`);
    a table without :data:`EXCHANGE_COLUMNS` hides nothing."""
    pairs = overlap_pairs(graph, schedule)
    if not pairs or not all(column in table for column in EXCHANGE_COLUMNS):
        return costs, ()
    points = [0, *splits, len(table)]
    per_stage = {phase: (stage_sums(table[f"ep_{phase}_a"].to_numpy(dtype=float), points),
                         stage_sums(table[f"ep_{phase}_b"].to_numpy(dtype=float), points))
                 for phase in ("forward", "backward")}

    def exchange(action: int, phase: str) -> float:
        fixed, per_row = per_stage[phase]
        s = int(graph.stage[action])
        return float(fixed[s] + per_row[s] * rows[int(graph.micro[action])])

    seconds = np.asarray(costs.seconds, dtype=float).copy()
    records: list[Any] = []
    for f, b in pairs:
        a_f, a_b = exchange(f, "forward"), exchange(b, "backward")
        c_f, c_b = max(0.0, seconds[f] - a_f), max(0.0, seconds[b] - a_b)
        shown_f, shown_b = max(0.0, a_f - c_b), max(0.0, a_b - c_f)
        seconds[f], seconds[b] = c_f + shown_f, c_b + shown_b
        key_f = (int(graph.stage[f]), "forward", int(graph.micro[f]))
        key_b = (int(graph.stage[b]), "backward", int(graph.micro[b]))
        records += [(*key_f, a_f, shown_f, key_b), (*key_b, a_b, shown_b, key_f)]
    return costs._replace(seconds=seconds), tuple(records)
