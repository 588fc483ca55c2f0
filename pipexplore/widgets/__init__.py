"""Widgets: the Explorer, the split strip and the timelines (anywidget, canvas), reports (plotly)."""
from pipexplore.widgets.explorer import Explorer, explore
from pipexplore.widgets.splitbar import SplitBar

__all__ = ["Explorer", "explore", "SplitBar"]
