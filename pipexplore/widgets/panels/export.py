"""Export: the current split as code that runs as-is, a Chrome trace of the shown run, or the page
as one HTML file: every kind of :data:`pipexplore.export.registry.KINDS`."""
from __future__ import annotations

from typing import Any, Callable

import ipywidgets as W

from pipexplore.export.registry import KINDS
from pipexplore.widgets.codeview import CodeView
from pipexplore.widgets.panels.controls import FieldMessages
from pipexplore.widgets.state import ExplorerState

__all__ = ["ExportPanel"]


class ExportPanel:
    """The export menu and button, and the code shown with a copy button. ``write_html(path)``
    writes the page's report (the view knows how)."""

    def __init__(self, state: ExplorerState, fields: FieldMessages, write_html: Callable[[str], Any]) -> None:
        self.state, self.fields, self.write_html = state, fields, write_html
        offered = [(kind.label, kind.name) for kind in KINDS.values() if kind.traced or not state.traced]
        self.w_export_kind = W.Dropdown(options=offered, layout=W.Layout(width="170px"))
        self.w_export = W.Button(description="Export", icon="code", layout=W.Layout(width="100px"))
        self.w_code = CodeView()
        self.w_export.on_click(self._on_export)
        self.tools = W.HBox([self.w_export_kind, self.w_export, fields["export"]])
        self.tools.add_class("pipexplore-controls")

    def _on_export(self, _: Any) -> None:
        state, kind = self.state, KINDS[self.w_export_kind.value]
        try:
            result = state.log.shown_result()
            title = kind.title.format(ranks=state.plan.mesh_or_pipeline.size,
                                      shown=f"run {state.log.run_number(result)}" if result is not None
                                      else "the predicted step")
            if kind.shown:
                self.show_code(state.export(kind.name), title)
            else:  # the report: a file (the view writes it, as the page shows it)
                path = self.write_html(f"pipexplore-report{kind.suffix}")
                self.show_code(str(path), title)
                state.say(f"wrote {path}")
            self.fields.set("export", "")
        except Exception as exc:
            self.show_code("", "")
            self.fields.set("export", f"{type(exc).__name__}: {exc}")

    def show_code(self, code: str, title: str = "") -> None:
        self.w_code.title = title
        self.w_code.code = code
