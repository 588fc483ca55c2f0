"""The explorer page's stylesheet (light and dark JupyterLab themes, and standalone reports)."""
from __future__ import annotations

import pathlib

__all__ = ["PAGE_CSS", "style_tag"]

#: The rules of ``page.css``: header cards, control row, stage view, runs table, status.
PAGE_CSS = (pathlib.Path(__file__).parent / "page.css").read_text()


def style_tag() -> str:
    """``<style>`` with :data:`PAGE_CSS`, for an HTML widget or a page.

    Example::

        ipywidgets.HTML(style_tag())
    """
    return f"<style>{PAGE_CSS}</style>"
