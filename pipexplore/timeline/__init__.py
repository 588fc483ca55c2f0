"""Timelines: what a pipeline did, one row per event, as a DataFrame; metrics and Chrome traces from it.

The same schema (:mod:`~pipexplore.timeline.schema`) whatever made the timeline: CUDA events or the
host clock (:mod:`~pipexplore.timeline.recorder`), other processes, the simulator. Every view and
metric (:mod:`~pipexplore.timeline.metrics`) works on all of them; :func:`to_chrome_trace` writes one
for Perfetto.

Example::

    with pipexplore.record() as rec:
        pipe(x).sum().backward()
    step_time(rec.timeline), bubble_fraction(rec.timeline)
"""
from pipexplore.timeline.chrome import to_chrome_trace
from pipexplore.timeline.metrics import (
                                         activation_memory,
                                         bubble_by,
                                         bubble_fraction,
                                         busy_time,
                                         copy_overlap,
                                         step_time,
                                         throughput,
)
from pipexplore.timeline.recorder import (
                                         ActionCounter,
                                         Recorder,
                                         active_recorder,
                                         counting_actions,
                                         record,
                                         thread_in_this_context,
)
from pipexplore.timeline.saved import SavedBytes, tensor_bytes
from pipexplore.timeline.schema import COLUMNS, COMPUTE_PHASES, OPTIMIZER_MICROBATCH, empty_timeline

__all__ = [
    "COLUMNS", "COMPUTE_PHASES", "OPTIMIZER_MICROBATCH", "empty_timeline", "Recorder", "record", "active_recorder",
    "thread_in_this_context", "ActionCounter", "counting_actions", "step_time", "busy_time", "bubble_fraction",
    "bubble_by", "throughput", "copy_overlap", "activation_memory", "to_chrome_trace", "SavedBytes", "tensor_bytes"
]

