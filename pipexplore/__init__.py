"""pipexplore: see and tune pipeline parallelism in PyTorch.

The explorer (``explore``, ``Explorer``, ``%load_ext pipexplore``) and the library under it: ``GPipe``
(torchgpipe-compatible), ``pipexplore.skip`` (skip connections across partitions), ``profile_model``
(the layer table of any model, on devices here or planned from the catalogue; ``profile`` for an
``nn.Sequential``), ``Plan`` (splits, devices, schedule: what is predicted and exported),
``simulate`` (predicted timelines for GPipe, 1F1B, interleaved, zero-bubble), ``record`` (measured
timelines), ``pipexplore.balance`` (exact balancing) and ``ScheduleExecutor`` (any schedule, in
this process).

The names are imported on first use (PEP 562): ``import pipexplore`` costs nothing beyond this
file, and a process that needs one module (a torchrun rank importing
``pipexplore.runs.record``) imports that module and what it imports, not the whole library. No
module of the package needs the others imported first: nothing here runs at import but the
definitions below.
"""
import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:  # the names as type checkers and editors see them; imported on first use below
    from pipexplore import balance, timeline
    from pipexplore.checkpoint import is_checkpointing, is_recomputing
    from pipexplore.executors.threads import ScheduleExecutor
    from pipexplore.gpipe import BalanceError, GPipe
    from pipexplore.models.flatten import FlattenError, flatten
    from pipexplore.models.profile import profile_model
    from pipexplore.plan import Plan
    from pipexplore.predict.simulator import simulate
    from pipexplore.profiling.sequential import backward_split, profile
    from pipexplore.splits import SplitError, balance_to_splits, splits_to_balance
    from pipexplore.timeline import record
    from pipexplore.widgets.explorer import Explorer, explore

__version__ = "0.1.0"

#: Each public name, by the module it is imported from on first use (a name that is the module's
#: own, ``balance`` and ``timeline``, is that module).
_LAZY = {
    "balance": "pipexplore.balance",
    "timeline": "pipexplore.timeline",
    "is_checkpointing": "pipexplore.checkpoint", "is_recomputing": "pipexplore.checkpoint",
    "ScheduleExecutor": "pipexplore.executors.threads",
    "BalanceError": "pipexplore.gpipe", "GPipe": "pipexplore.gpipe",
    "FlattenError": "pipexplore.models.flatten", "flatten": "pipexplore.models.flatten",
    "profile_model": "pipexplore.models.profile",
    "Plan": "pipexplore.plan",
    "simulate": "pipexplore.predict.simulator",
    "backward_split": "pipexplore.profiling.sequential", "profile": "pipexplore.profiling.sequential",
    "SplitError": "pipexplore.splits", "balance_to_splits": "pipexplore.splits",
    "splits_to_balance": "pipexplore.splits",
    "record": "pipexplore.timeline",
    "explore": "pipexplore.widgets.explorer", "Explorer": "pipexplore.widgets.explorer",  # ipywidgets
}


def __getattr__(name: str) -> _typing.Any:
    """A public name, imported on its first use; or a subpackage (``pipexplore.schedules``), which
    the package's eager import used to leave bound."""
    if name in _LAZY:
        module = _importlib.import_module(_LAZY[name])
        value = module if _LAZY[name] == f"{__name__}.{name}" else getattr(module, name)
        globals()[name] = value  # the next use finds it without this function
        return value
    if not name.startswith("_"):
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":  # the submodule is there but one of its imports is not
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
