"""Models that are not ``nn.Sequential``: candidate split points, their costs, and splits.

Candidate split points at any depth (:mod:`~pipexplore.models.trace.candidates`), each profiled where
it runs in the model (:mod:`~pipexplore.models.trace.profile_candidates`), and splits through
``torch.distributed.pipelining.pipeline`` (:mod:`~pipexplore.models.trace.split`; pipexplore does not
trace itself), on one export of the model with every candidate marked
(:mod:`~pipexplore.models.trace.markers`), kept for the session (:mod:`~pipexplore.models.trace.pipes`).
The modules import one another in that order, never back::

    candidates  <-  markers  <-  split  <-  pipes  <-  profile_candidates

Example::

    table = trace.candidates(model, {"input_ids": ids})   # one row per block, in execution order
    pipe = trace.split(model, {"input_ids": ids[:2]}, ["transformer.h.2"])
    trace.skip_routes_of(pipe)                            # values that jump over stages
"""
from pipexplore.models.trace.candidates import GRANULARITIES, TraceError, candidate_modules
from pipexplore.models.trace.profile_candidates import candidates, candidates_in_rows
from pipexplore.models.trace.split import (
    MULTI_STAGE,
    SCHEDULE_CLASSES,
    run_generated_code,
    skip_routes_of,
    split,
    split_marked,
)
from pipexplore.models.trace.stage_inputs import inputs_past_first_stage

__all__ = [
    "TraceError", "GRANULARITIES", "candidate_modules", "candidates", "candidates_in_rows",
    "inputs_past_first_stage", "split", "split_marked", "run_generated_code", "skip_routes_of", "SCHEDULE_CLASSES",
    "MULTI_STAGE"
]

