"""pipexplore: see and tune pipeline parallelism in PyTorch."""
from pipexplore.checkpoint import is_checkpointing, is_recomputing
from pipexplore.gpipe import GPipe, BalanceError

__version__ = "0.1.0"

__all__ = ["GPipe", "BalanceError", "is_checkpointing", "is_recomputing", "__version__"]
