"""Split points and balances: two ways to say where a model is cut.

``splits`` are the sorted indices of the layers that begin a new stage; ``balance`` counts the
layers per stage::

    layers:   0 1 | 2 3 4
    splits  = [2]
    balance = [2, 3]
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["SplitError", "balance_to_splits", "splits_to_balance", "check_splits", "first_runnable_layer",
           "shared_parameters"]


class SplitError(ValueError):
    """Split points that do not cut the model (out of range, unsorted, repeated)."""


def check_splits(splits: Sequence[int], num_layers: int) -> list[int]:
    """Validate split points for a model of ``num_layers`` layers; returns them as a list of ints."""
    out: list[int] = []
    for point in splits:
        if isinstance(point, bool) or int(point) != point:
            raise SplitError(f"split point {point!r} is not a layer index")
        point = int(point)
        if point <= 0:
            raise SplitError(f"split point {point} must be at least 1: a stage needs at least one layer "
                             "before it (layer 0 always begins stage 0)")
        if point >= num_layers:
            raise SplitError(f"split point {point} is past the last layer ({num_layers - 1}): "
                             f"split points lie between 1 and {num_layers - 1}")
        if out and point == out[-1]:
            raise SplitError(f"split point {point} is repeated: every stage needs at least one layer")
        if out and point < out[-1]:
            raise SplitError(f"split points must be sorted: {point} comes after {out[-1]}")
        out.append(point)
    return out


def splits_to_balance(splits: Sequence[int], num_layers: int) -> list[int]:
    """``[2]`` for 5 layers → ``[2, 3]``."""
    points = [0, *check_splits(splits, num_layers), num_layers]
    return [b - a for a, b in zip(points, points[1:])]


def balance_to_splits(balance: Sequence[int]) -> list[int]:
    """``[2, 3]`` → ``[2]``."""
    if any(int(b) <= 0 for b in balance):
        raise SplitError(f"balance {list(balance)} has an empty stage: every stage needs at least one layer")
    splits, total = [], 0
    for b in list(balance)[:-1]:
        total += int(b)
        splits.append(total)
    return splits


def first_runnable_layer(table: Any, executor: str, stages: int) -> int:
    """The first layer a second stage of ``table`` (a layer table) may begin at, for ``stages``
    stages run by ``executor``: in processes (here, or the exported script under torchrun) torch
    feeds the model's inputs to the first stage only, so a traced model's candidates that read
    them stay in it (``table.attrs["first_split"]``, measured where its stages are traced:
    :func:`pipexplore.models.trace.stage_inputs.first_runnable_split`). 1 for every other executor, for
    tables that do not say, and where too few layers follow for ``stages`` stages (the run then
    refuses, naming the inputs: a Hugging Face model's ``labels`` read by its last block).

    Example::

        table.attrs["first_split"] = 3
        first_runnable_layer(table, "processes", 2)   # 3: the second stage begins at layer 3 or later
        first_runnable_layer(table, "threads", 2)     # 1: this process delivers every input to every stage
    """
    first = int(table.attrs.get("first_split", 1)) if executor == "processes" else 1
    return first if first > 1 and len(table) - first >= stages - 1 else 1


def shared_parameters(layer_table: Any, splits: Sequence[int]) -> dict[str, list[int]]:
    """Parameters used by blocks of more than one stage (tied weights), with those stages, as the
    layer table's ``shared`` column names them (a table without it: none known)."""
    if "shared" not in layer_table:
        return {}
    stage_of = [sum(1 for s in splits if s <= k) for k in range(len(layer_table))]
    users: dict[str, set[int]] = {}
    for k, names in enumerate(layer_table["shared"]):
        for name in filter(None, str(names).split(",")):
            users.setdefault(name, set()).add(stage_of[k])
    return {name: sorted(st) for name, st in users.items() if len(st) > 1}
