"""Widgets: the Explorer, the split strip, the timelines and residuals (anywidgets, canvas), reports."""
from pipexplore.widgets.explorer import Explorer, explore
from pipexplore.widgets.splitbar import SplitBar

__all__ = ["Explorer", "explore", "SplitBar"]
