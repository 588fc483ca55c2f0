"""A self-contained HTML report of an explorer: opens in a browser with no kernel and no network."""
from __future__ import annotations

import base64
import datetime
import html
import json
import pathlib
from typing import TYPE_CHECKING, Any, Union

from pipexplore.export.registry import KINDS
from pipexplore.samples import batch_size
from pipexplore.widgets.header import plan_difference, plan_text, short_plan_text
from pipexplore.widgets.timeline_figure import TimelineView
from pipexplore.widgets.residual_view import ResidualCanvas, residual_state
from pipexplore.widgets.runs_view import runs_html
from pipexplore.widgets.static import strip_svg
from pipexplore.widgets.style import style_tag
from pipexplore.widgets.timeline_canvas import TimelineCanvas

if TYPE_CHECKING:
    from pipexplore.widgets.state import ExplorerState

__all__ = ["report_html", "write_report"]

_COPY_SCRIPT = """
document.querySelectorAll('.pipexplore-copy').forEach(function (button) {
  button.addEventListener('click', function () {
    var text = document.getElementById(button.dataset.target).textContent;
    function done(ok) { button.textContent = ok ? 'Copied' : 'Select the text to copy'; }
    if (navigator.clipboard) { navigator.clipboard.writeText(text).then(function () { done(true); }, function () {
      done(false); }); } else { done(false); }
  });
});
"""

_REPORT_CSS = """
body { margin: 16px auto; max-width: 1240px; padding: 0 12px; }
.pipexplore-report h2 { font-size: 15px; margin: 18px 0 6px 0; }
.pipexplore-report pre { background: #f6f6f6; border: 1px solid #ddd; padding: 8px; overflow: auto; font-size: 12px; }
.pipexplore-report .pipexplore-copy { float: right; font-size: 12px; }
@media (prefers-color-scheme: dark) {
  body { background: #111; }
  .pipexplore-report { --px-fg: #e8e8e8; --px-fg2: #aaa; --px-bg2: #1f1f1f; --px-border: #444; }
  .pipexplore-report pre { background: #1a1a1a; border-color: #444; color: #ddd; }
  table.pipexplore-stages th { background: #111; }
}
"""


#: The canvas widgets a report draws, by the name its elements carry (``data-pipexplore-widget``).
_WIDGETS = {"timeline": TimelineCanvas, "residuals": ResidualCanvas}

# Each widget's module, run as a plain script (its ``export default`` made a return), renders
# into its element from the state beside it: the same drawing as in the notebook, with a model
# that only answers ``get`` (binary buffers travel as base64).
_LOADER = """
(function () {
  function revive(value) {
    if (value && typeof value === 'object') {
      if (typeof value.$b64 === 'string') {
        var text = atob(value.$b64), bytes = new Uint8Array(text.length);
        for (var i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
        return new DataView(bytes.buffer);
      }
      for (var key in value) value[key] = revive(value[key]);
    }
    return value;
  }
  document.querySelectorAll('[data-pipexplore-widget]').forEach(function (el) {
    var state = revive(JSON.parse(document.getElementById(el.id + '-state').textContent));
    var model = {get: function (key) { return state[key]; }, on: function () {}, set: function () {},
                 save_changes: function () {}};
    window.__pipexploreWidgets[el.dataset.pipexploreWidget].render({model: model, el: el});
  });
})();
"""


def _module_script(name: str, widget: Any) -> str:
    """A widget's ES module as a script that registers its ``render`` under ``name``."""
    source = str(widget._esm)  # the module's text (each widget class holds it as text)
    export = "export default { render };"
    if source.count(export) != 1:
        raise RuntimeError(f"{widget.__name__}'s module must end with {export!r} to be embedded in a report")
    body = source.replace(export, "return { render };")
    return (f"<script>window.__pipexploreWidgets = window.__pipexploreWidgets || {{}};\n"
            f"window.__pipexploreWidgets[{json.dumps(name)}] = (function () {{\n{body}\n}})();</script>")


def _encode(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$b64": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _widget_html(name: str, key: str, state: dict[str, Any], attributes: str = "") -> str:
    """An element the loader renders widget ``name`` into, with its state beside it as JSON."""
    data = json.dumps(_encode(state), allow_nan=False).replace("</", "<\\/")
    return (f"<div id='{key}' data-pipexplore-widget='{name}'{attributes}></div>"
            f"<script type='application/json' id='{key}-state'>{data}</script>")


def _code_block(title: str, code: str, key: str) -> str:
    return (f"<h2>{html.escape(title)}</h2><div><button class='pipexplore-copy' type='button' data-target='{key}'>"
            f"Copy</button><pre id='{key}'>{html.escape(code)}</pre></div>")


def report_html(state: "ExplorerState", strip_view: str = "time") -> str:
    """The explorer's report as one HTML page (from its state; the strip's cells sized by ``strip_view``): header, strip (SVG), stage view, predicted and
    measured timelines with the memory panel and the residuals of the shown run (drawn by the
    notebook's own canvas widgets, their JavaScript embedded), the runs table and the exported code.

    Example::

        pathlib.Path("report.html").write_text(report_html(explorer.state))
    """
    from pipexplore.predict.residuals import residuals
    from pipexplore.widgets.panels.stages import layer_cells, skip_arcs, stage_totals, stages_html
    from pipexplore.widgets.panels.status import header_of

    plan = state.plan
    result = state.log.shown_result()
    view = TimelineView(plan.predicted, result.timeline if result is not None else None,
                        batch_size(state.sample), widget=False, memory_cap=state.memory_cap)
    view.show(splits=plan.splits, predicted_title=short_plan_text(plan),
              measured_title=(f"run {state.log.run_number(result)} · {short_plan_text(result.plan)}"
                              if result is not None else ""),
              measured_warning=plan_difference(state.plan, result.plan) if result is not None else "")
    splits = ",".join(map(str, plan.splits))
    scripts = "".join(_module_script(name, widget) for name, widget in _WIDGETS.items())
    widget_css = "".join(dict.fromkeys(str(widget._css) for widget in _WIDGETS.values()))  # shared once
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>pipexplore report · {html.escape(plan_text(plan))}</title>",
        style_tag(), f"<style>{_REPORT_CSS}{widget_css}</style>", scripts,
        "</head><body>",
        "<div class='pipexplore-report'>", header_of(state),
        f"<div class='pipexplore-note'>written {datetime.datetime.now().isoformat(timespec='seconds')}</div>",
        "<h2>split</h2>",
        strip_svg(layer_cells(state.layer_table), list(plan.splits), skip_arcs(plan), strip_view,
                  stage_totals(plan, strip_view)),
        stages_html(state),
        "<h2>timelines</h2>",
        _widget_html("timeline", "pipexplore-timeline-figure", {"scene": view.figure.scene, "highlight": -1},
                     f" class='pipexplore-timeline' data-splits='{splits}'"),
    ]
    if result is not None:
        grid = residual_state(residuals(result.predicted, result.timeline), f"run {state.log.run_number(result)}")
        parts += ["<h2>residuals</h2>", _widget_html("residuals", "pipexplore-residuals-figure", {"grid": grid})]
    runs = state.runs
    parts += ["<h2>runs</h2>", runs_html(runs, shown_run=state.log.run_number(result), uuid="pipexplore-report-runs")]
    for kind in (KINDS[name] for name in ("gpipe", "pipelining", "torchrun")):
        if state.traced and not kind.traced:
            continue
        try:
            code = state.export(kind.name)
        except Exception as exc:  # a kind this model cannot export: say why instead
            code = f"# {type(exc).__name__}: {exc}"
        title = kind.title.format(ranks=plan.mesh_or_pipeline.size, shown="")
        parts.append(_code_block(f"export: {title}", code, f"pipexplore-code-{kind.name}"))
    parts += ["</div>", f"<script>{_COPY_SCRIPT}{_LOADER}</script>", "</body></html>"]
    return "".join(parts)


def write_report(state: "ExplorerState", path: Union[str, pathlib.Path], strip_view: str = "time") -> pathlib.Path:
    """Write :func:`report_html` to ``path`` (its folder must exist); returns the path.

    Example::

        write_report(explorer.state, "report.html")
    """
    target = pathlib.Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(f"to_html path {str(path)!r}: its folder {str(target.parent)!r} does not exist; "
                                "create it first or choose another path")
    target.write_text(report_html(state, strip_view), encoding="utf-8")
    return target
