"""Costs in, predicted timelines out: the cost model, the simulator, re-timing (profiles: pipexplore.profiling)."""
