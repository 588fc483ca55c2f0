"""pipexplore: see and tune pipeline parallelism in PyTorch.

The library: ``GPipe`` (torchgpipe-compatible), ``pipexplore.skip`` (skip connections across
partitions), ``record`` (measured timelines), ``profile`` (layer tables), ``pipexplore.balance``
(exact balancing) and ``simulate`` (predicted timelines for GPipe, 1F1B, interleaved, zero-bubble).
"""
from pipexplore import balance, timeline
from pipexplore.checkpoint import is_checkpointing, is_recomputing
from pipexplore.gpipe import BalanceError, GPipe
from pipexplore.profile import profile
from pipexplore.simulate import simulate
from pipexplore.splits import SplitError, balance_to_splits, splits_to_balance
from pipexplore.timeline import record

__version__ = "0.1.0"

__all__ = [
    "GPipe", "BalanceError", "SplitError", "is_checkpointing", "is_recomputing",
    "record", "profile", "simulate", "balance", "timeline", "balance_to_splits", "splits_to_balance",
    "__version__",
]
