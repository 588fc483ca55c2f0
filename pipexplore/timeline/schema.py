"""The timeline's schema: one row per event, whatever made it (CUDA events, the host clock, other
processes, the simulator):

=============  ===================================================================
``run``        a label of the step (``record(run=...)``)
``stage``      the partition (pipeline stage) that did the work
``device``     where it ran (``'cpu'``, ``'cuda:0'``)
``microbatch`` the micro-batch index (``-1`` for an ``optimizer`` step: it belongs to none)
``phase``      ``forward``, ``backward``, ``recompute``, ``copy``, ``optimizer`` (each stage's
               update; also ``input_grad``, ``weight_grad``, ``send``, ``recv``, and ``collective``
               for a mesh's collectives, on their own lane: the device ``'<device> · collectives'``)
``start``      seconds from the step's origin
``end``        seconds from the step's origin
``source``     ``measured`` or ``predicted``
``memory``     optional: activation bytes the stage holds after the event (predicted; measured
               by the schedule executor from the tensors autograd saves)
=============  ===================================================================

Peak memory per device, where the device reports it, is in ``timeline.attrs['peak_memory']``.
"""
from __future__ import annotations

import pandas as pd

__all__ = ["COLUMNS", "COMPUTE_PHASES", "OPTIMIZER_MICROBATCH", "empty_timeline"]

COLUMNS = ["run", "stage", "device", "microbatch", "phase", "start", "end", "source"]
#: A stage's work (busy time, the bubble, actions counted); not copies, sends, receives.
COMPUTE_PHASES = ("forward", "backward", "recompute", "input_grad", "weight_grad", "optimizer")
OPTIMIZER_MICROBATCH = -1  # an ``optimizer`` event's micro-batch: it belongs to none


def empty_timeline() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="float64" if c in ("start", "end") else "object") for c in COLUMNS})
