"""Widgets: the Explorer (a facade over :class:`~pipexplore.widgets.state.ExplorerState` and its
view), the split strip, the timelines and residuals (anywidgets, canvas), reports.

Importing this package imports no widget library: ``Explorer``, ``explore`` and ``SplitBar`` load
theirs when first asked for, so the state and the pure functions run without them.
"""
from typing import Any

__all__ = ["Explorer", "explore", "SplitBar"]


def __getattr__(name: str) -> Any:
    if name in ("Explorer", "explore"):
        from pipexplore.widgets import explorer

        return getattr(explorer, name)
    if name == "SplitBar":
        from pipexplore.widgets.splitbar import SplitBar

        return SplitBar
    raise AttributeError(f"module 'pipexplore.widgets' has no attribute {name!r}")
