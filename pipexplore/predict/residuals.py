"""Residuals: each action of a measured step against its prediction, side by side."""
from __future__ import annotations

import pandas as pd

from pipexplore.predict.costs import PHASE_SOURCE

__all__ = ["residuals", "RESIDUAL_COLUMNS"]

RESIDUAL_COLUMNS = ["stage", "microbatch", "phase", "predicted_start", "predicted_end", "measured_start",
                    "measured_end", "predicted_seconds", "measured_seconds", "error"]


def residuals(predicted: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """One row per action (stage, micro-batch, phase) found in both timelines: its predicted and
    measured span, and ``error`` = predicted ÷ measured seconds − 1 (positive: predicted too long).

    Example::

        table = residuals(run.predicted, run.timeline)
        table.groupby(["stage", "phase"])["error"].median()
    """
    keys = ["stage", "microbatch", "phase"]

    def spans(frame: pd.DataFrame, prefix: str) -> pd.DataFrame:
        compute = frame[frame["phase"].isin(list(PHASE_SOURCE))]
        compute = compute.groupby(keys, as_index=False).agg(start=("start", "min"), end=("end", "max"))
        return compute.rename(columns={"start": f"{prefix}_start", "end": f"{prefix}_end"})

    both = spans(predicted, "predicted").merge(spans(measured, "measured"), on=keys)
    both["predicted_seconds"] = both["predicted_end"] - both["predicted_start"]
    both["measured_seconds"] = both["measured_end"] - both["measured_start"]
    both["error"] = both["predicted_seconds"] / both["measured_seconds"].where(both["measured_seconds"] > 0) - 1
    return both[RESIDUAL_COLUMNS].sort_values(["stage", "predicted_start"]).reset_index(drop=True)
