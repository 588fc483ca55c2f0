"""pipexplore: see and tune pipeline parallelism in PyTorch.

The explorer (``explore``, ``Explorer``, ``%load_ext pipexplore``) and the library under it: ``GPipe``
(torchgpipe-compatible), ``pipexplore.skip`` (skip connections across partitions), ``profile_model``
(the layer table of any model, on devices here or planned from the catalogue; ``profile`` for an
``nn.Sequential``), ``Plan`` (splits, devices, schedule: what is predicted and exported),
``simulate`` (predicted timelines for GPipe, 1F1B, interleaved, zero-bubble), ``record`` (measured
timelines), ``pipexplore.balance`` (exact balancing) and ``ScheduleExecutor`` (any schedule, in
this process).
"""
from pipexplore import balance, timeline
from pipexplore.checkpoint import is_checkpointing, is_recomputing
from pipexplore.executors.threads import ScheduleExecutor
from pipexplore.gpipe import BalanceError, GPipe
from pipexplore.models.flatten import FlattenError, flatten
from pipexplore.models.profile import profile_model
from pipexplore.plan import Plan
from pipexplore.profiling.sequential import backward_split, profile
from pipexplore.predict.simulator import simulate
from pipexplore.splits import SplitError, balance_to_splits, splits_to_balance
from pipexplore.timeline import record

__version__ = "0.1.0"


def __getattr__(name: str):  # the widgets import ipywidgets only when asked for
    if name in ("explore", "Explorer"):
        from pipexplore.widgets import explorer

        return getattr(explorer, name)
    raise AttributeError(f"module 'pipexplore' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:  # type: ignore[no-untyped-def]
    """``%load_ext pipexplore``: registers the ``%pipexplore`` magic."""
    from pipexplore.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython) -> None:  # type: ignore[no-untyped-def]
    from pipexplore.magics import unload_ipython_extension as unload

    unload(ipython)


__all__ = [
    "GPipe", "BalanceError", "SplitError", "is_checkpointing", "is_recomputing",
    "record", "profile", "profile_model", "Plan", "backward_split", "simulate", "balance", "timeline",
    "balance_to_splits", "splits_to_balance",
    "ScheduleExecutor", "flatten", "FlattenError",
    "explore", "Explorer", "load_ipython_extension", "unload_ipython_extension", "__version__",
]
