"""CodeView: exported code (or a trace) in a box with a Copy button (an anywidget)."""
from __future__ import annotations

import anywidget
import traitlets

__all__ = ["CodeView", "SHOWN_CHARACTERS"]

#: Longer texts (a Chrome trace) are shown cut; Copy still copies all of them.
SHOWN_CHARACTERS = 20_000

_ESM = """
function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "pipexplore-codeview";
  const bar = document.createElement("div");
  bar.className = "pipexplore-codeview-bar";
  const title = document.createElement("span");
  const button = document.createElement("button");
  button.className = "pipexplore-copy jupyter-button";
  button.type = "button";
  button.textContent = "Copy";
  const pre = document.createElement("pre");
  pre.className = "pipexplore-code";
  bar.append(title, button);
  root.append(bar, pre);
  el.appendChild(root);

  function fallbackCopy(text) {
    const area = document.createElement("textarea");
    area.value = text;
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    const ok = document.execCommand("copy");
    area.remove();
    return ok;
  }
  button.addEventListener("click", async () => {
    const text = model.get("code");
    let ok = false;
    try {
      await navigator.clipboard.writeText(text);
      ok = true;
    } catch (error) {
      ok = fallbackCopy(text);
    }
    button.textContent = ok ? "Copied" : "Copy failed: select the text";
    model.set("copies", model.get("copies") + 1);
    model.save_changes();
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
  function draw() {
    const code = model.get("code");
    const shown = model.get("shown");
    root.style.display = code ? "" : "none";
    title.textContent = model.get("title");
    pre.textContent = code.length > shown
      ? code.slice(0, shown) + `\\n… (${code.length - shown} more characters: Copy takes them all)`
      : code;
  }
  model.on("change:code", draw);
  model.on("change:title", draw);
  draw();
}
export default { render };
"""

_CSS = """
.pipexplore-codeview { border: 1px solid var(--jp-border-color2, #d0d0d0); border-radius: 4px; margin-top: 4px; }
.pipexplore-codeview-bar { display: flex; justify-content: space-between; align-items: center; padding: 2px 6px;
  font-size: 12px; color: var(--jp-ui-font-color2, #616161); background: var(--jp-layout-color2, #f3f3f3); }
.pipexplore-codeview .pipexplore-code { margin: 0; padding: 6px 8px; max-height: 320px; overflow: auto;
  font-size: 12px; color: var(--jp-content-font-color1, #1f1f1f); background: var(--jp-layout-color1, #fff); }
"""


class CodeView(anywidget.AnyWidget):
    """``code`` shown under ``title`` with a Copy button (the browser's clipboard); hidden while empty.

    Example::

        view = CodeView(code=explorer.export("gpipe"), title="GPipe")
        view                  # Copy puts the code on the clipboard; view.copies counts the clicks
    """

    _esm = _ESM
    _css = _CSS

    code = traitlets.Unicode("").tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)
    shown = traitlets.Int(SHOWN_CHARACTERS).tag(sync=True)
    copies = traitlets.Int(0).tag(sync=True)
