"""Chrome trace JSON (Trace Event Format) of a timeline: loads in Perfetto and chrome://tracing."""
from __future__ import annotations

import json
from typing import Any, Optional

import pandas as pd

__all__ = ["to_chrome_trace"]


def to_chrome_trace(timeline: pd.DataFrame, path: Optional[str] = None) -> dict[str, Any]:
    """Trace Event Format JSON (loads in Perfetto and chrome://tracing).

    One process per device, one thread per lane (stage, and copies apart), complete ``"X"``
    events in microseconds, with metadata names. Written to ``path`` when given.
    """
    events: list[dict[str, Any]] = []
    devices = sorted(timeline["device"].unique(), key=str)
    pids = {d: k + 1 for k, d in enumerate(devices)}
    lanes: dict[tuple[str, str], int] = {}
    for row in timeline.itertuples(index=False):
        lane = f"stage {row.stage}" + (" copy" if row.phase in ("copy", "send", "recv") else "")
        tid = lanes.setdefault((row.device, lane), len(lanes) + 1)
        events.append({
            "name": f"{row.phase} {row.microbatch}" if row.microbatch >= 0 else str(row.phase), "cat": row.phase,
            "ph": "X",
            "ts": row.start * 1e6, "dur": max(0.0, row.end - row.start) * 1e6,
            "pid": pids[row.device], "tid": tid,
            "args": {"run": str(row.run), "stage": int(row.stage), "microbatch": int(row.microbatch),
                     "source": row.source},
        })
    for device, pid in pids.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": str(device)}})
    for (device, lane), tid in lanes.items():
        events.append({"name": "thread_name", "ph": "M", "pid": pids[device], "tid": tid, "args": {"name": lane}})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace
