"""Costs in, predicted timelines out: profiling, the cost model, the simulator, re-timing (no threads, no processes)."""
