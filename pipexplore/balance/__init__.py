"""Balance: choose the contiguous partition whose slowest (or largest) stage is smallest, exactly.

Among the partitions that reach that optimum the others are evened out (least sum of squared
stage costs), so identical layers split evenly. ``blockpartition.solve`` is torchgpipe's name
for the same cut of a plain sequence.

Example::

    from pipexplore.balance import balance_by_time
    balance = balance_by_time(4, model, sample, timeout=1.0)
    pipe = GPipe(model, balance, chunks=8)
"""
from __future__ import annotations

from pipexplore.balance import blockpartition
from pipexplore.balance.optimal import balance_cost, check_partitions, join_first, largest_stage, optimal_splits
from pipexplore.balance.profile import balance_by_size, balance_by_time, layerwise_sandbox, sandbox

__all__ = ["balance_cost", "balance_by_time", "balance_by_size", "optimal_splits", "join_first", "largest_stage",
           "check_partitions", "blockpartition", "layerwise_sandbox", "sandbox"]
