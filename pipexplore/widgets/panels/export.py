"""Export: the current split as code that runs as-is, a Chrome trace of the shown run, or the page
as one HTML file."""
from __future__ import annotations

import json
from typing import Any, Callable

import ipywidgets as W

from pipexplore import timeline as tl
from pipexplore.widgets.codeview import CodeView
from pipexplore.widgets.panels.controls import FieldMessages
from pipexplore.widgets.state import ExplorerState

__all__ = ["ExportPanel", "KINDS"]

#: What the export menu offers: (label, kind).
KINDS = [("GPipe", "gpipe"), ("torch pipelining", "pipelining"), ("torchrun script", "torchrun"),
         ("schedule CSV (torch)", "schedule-csv"), ("Megatron-LM arguments", "megatron"),
         ("torchtitan command", "torchtitan"),
         ("Chrome trace", "chrome-trace"), ("HTML report", "html")]


class ExportPanel:
    """The export menu and button, and the code shown with a copy button. ``write_html(path)``
    writes the page's report (the view knows how)."""

    def __init__(self, state: ExplorerState, fields: FieldMessages, write_html: Callable[[str], Any]) -> None:
        self.state, self.fields, self.write_html = state, fields, write_html
        self.w_export_kind = W.Dropdown(options=[k for k in KINDS if not (state.traced and k[1] == "gpipe")],
                                        layout=W.Layout(width="170px"))
        self.w_export = W.Button(description="Export", icon="code", layout=W.Layout(width="100px"))
        self.w_code = CodeView()
        self.w_export.on_click(self._on_export)
        self.tools = W.HBox([self.w_export_kind, self.w_export, fields["export"]])
        self.tools.add_class("pipexplore-controls")

    def _on_export(self, _: Any) -> None:
        state, kind = self.state, self.w_export_kind.value
        try:
            if kind == "chrome-trace":
                result = state.log.shown_result()
                frame = result.timeline if result is not None else state.plan.predicted
                what = f"run {state.log.run_number(result)}" if result is not None else "the predicted step"
                self.show_code(json.dumps(tl.to_chrome_trace(frame), indent=1),
                               f"Chrome trace of {what}: save as .json, open in ui.perfetto.dev or chrome://tracing")
            elif kind == "html":
                path = self.write_html("pipexplore-report.html")
                self.show_code(str(path), "HTML report written (one file, opens with no kernel):")
                state.say(f"wrote {path}")
            else:
                titles = {"gpipe": "GPipe", "pipelining": "torch.distributed.pipelining",
                          "torchrun": "a script for torchrun --standalone --nproc-per-node "
                                      f"{state.plan.mesh_or_pipeline.size}",
                          "schedule-csv": "the schedule in torch's CSV format: save as .csv, then schedule='that.csv'",
                          "megatron": "Megatron-LM's arguments: append them to pretrain_gpt.py's command line",
                          "torchtitan": "torchtitan's trainer with the plan's mesh and split: run it on each node"}
                self.show_code(state.export(kind), titles[kind])
            self.fields.set("export", "")
        except Exception as exc:
            self.show_code("", "")
            self.fields.set("export", f"{type(exc).__name__}: {exc}")

    def show_code(self, code: str, title: str = "") -> None:
        self.w_code.title = title
        self.w_code.code = code
