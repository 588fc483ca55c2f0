"""Widgets: the Explorer, the split strip (anywidget) and timeline figures (plotly)."""
from pipexplore.widgets.explorer import Explorer, explore
from pipexplore.widgets.splitbar import SplitBar

__all__ = ["Explorer", "explore", "SplitBar"]
