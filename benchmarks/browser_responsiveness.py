"""The explorer in JupyterLab + headless Chromium, timed as a person sees it.

Two notebooks: a 12-layer MLP profiled on 3 CPU stages, and a synthetic layer table of 1,000
layers × 64 stages × 256 micro-batches (``Explorer(..., layer_table=...)``, no profiling). For
each, run right after ``%load_ext pipexplore`` and again once its background warm-up is over: the
time from the explorer cell's Shift+Enter to the predicted timeline on screen (its
``.pipexplore-timeline[data-splits]``, set once the canvas is drawn), and, for 10 drags of
a split handle, the time from the page's ``pointerup`` to ``data-splits`` showing the new split,
both read on the page's clock (``performance.now()``); and the setup cell's own seconds (its
imports and ``%load_ext``). Then the quickstart as notebook 01 has it, its two cells one after the
other.

Goals (issue "The explorer page"): 12 layers on screen ≤ 2 s (profiling included), drag ≤ 50 ms;
1,000 × 64 × 256 on screen ≤ 3 s, drag ≤ 50 ms.

Needs Debian's chromium (/usr/bin/chromium) and playwright (the test extra).
"""
from __future__ import annotations

import json
import pathlib
import statistics
import sys
import tempfile
import time

from common import machine

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "browser"))
from lab import CHROMIUM, CHROMIUM_ARGS, accept_kernel_dialog, dismiss_news, jupyterlab, run_cell  # noqa: E402

SETUP = ("%load_ext pipexplore\n"
         "import numpy as np, pandas as pd, torch\n"
         "from torch import nn\n"
         "from pipexplore.widgets import Explorer\n"
         "torch.manual_seed(0)\n"
         "print('READY')")
# The same, once %load_ext's background warm-up (the widget modules and torch's optimizer imports,
# ~4 s on 2 cores) is over: what a person sees who runs the explorer's cell after writing it.
WARM_SETUP = SETUP.replace("print('READY')",
                           "import pipexplore.magics\npipexplore.magics.warm_up_thread.join()\nprint('READY')")

CASES = {
    "12 layers × 3 stages × 4 micro-batches (profiled)": (
        "model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(12)])\n"
        "sample = torch.randn(64, 256)\n"
        "ex = %pipexplore model sample --chunks 4 --devices cpu,cpu,cpu --splits 4,8\n"
        "ex"),
    "1,000 layers × 64 stages × 256 micro-batches (layer table)": (
        "n, stages = 1000, 64\n"
        "rng = np.random.default_rng(0)\n"
        "table = pd.DataFrame({'name': [str(k) for k in range(n)], 'type': 'Linear', 'param_bytes': 4096.0,\n"
        "    'output_bytes': 1e6, 'forward': rng.random(n) * 1e-3, 'backward': rng.random(n) * 2e-3,\n"
        "    'stash': '', 'pop': ''})\n"
        "ex = Explorer(nn.Sequential(*[nn.Identity() for _ in range(n)]), torch.zeros(256, 1), layer_table=table,\n"
        "              devices=['cpu'] * stages, chunks=256, splits=[15 * k + 10 for k in range(1, stages)])\n"
        "ex"),
}

# The quickstart as notebook 01 has it, read from the notebook (its setup cell imports no widget
# module: %load_ext's background warm-up does), its explorer's cell run right after: what Run All,
# or a person's quick Shift+Enters through the notebook, sees.
QUICKSTART_NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "01_quickstart.ipynb"


def quickstart_cells() -> tuple[str, str]:
    """Notebook 01's first two code cells: its setup (READY printed at its end) and its explorer."""
    cells = [cell for cell in json.loads(QUICKSTART_NOTEBOOK.read_text())["cells"] if cell["cell_type"] == "code"]
    setup, explorer = ("".join(cell["source"]) for cell in cells[:2])
    return setup + "\nprint('READY')", explorer


# In the page: when the pointer is released, and when the predicted timeline's data-splits changes.
WATCH = """
() => {
  window.__pipexploreLog = [];
  const timeline = document.querySelector('.pipexplore-timeline[data-splits]');
  new MutationObserver(() => window.__pipexploreLog.push(['shown', performance.now(), timeline.dataset.splits,
                                                           timeline.dataset.source]))
    .observe(timeline, {attributes: true, attributeFilter: ['data-splits', 'data-source']});
  document.addEventListener('pointerup', () => window.__pipexploreLog.push(['up', performance.now()]), true);
}
"""

SPLITS_SHOWN = "(document.querySelector('.pipexplore-timeline[data-splits]') || {dataset: {}}).dataset.splits || ''"


def _measure(page, explorer_cell: str, drags: int) -> tuple[float, float, list[float], list[float]]:
    """Seconds of the setup cell (its imports and ``%load_ext``, to its READY), to the explorer on
    screen from its cell's start, and per drag from mouse-up to the new predicted timeline
    drawn (the page's re-timing where it has one) and to the kernel's picture of it."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
    accept_kernel_dialog(page, PlaywrightTimeout)
    setup_start = time.perf_counter()
    run_cell(page, 0)
    # READY in the setup cell's output (its source says it too), so that the explorer's cell does
    # not wait behind the setup cell's imports.
    page.wait_for_function("[...document.querySelectorAll('.jp-OutputArea-output')]"
                           ".some(e => e.innerText.includes('READY'))", timeout=120_000)
    start = time.perf_counter()
    setup = start - setup_start
    run_cell(page, 1)
    try:
        page.wait_for_selector(".pipexplore-timeline[data-splits]", timeout=300_000)
    except PlaywrightTimeout:
        raise RuntimeError("the explorer did not appear; the notebook shows:\n"
                           + page.locator(".jp-Notebook").inner_text()[-2000:]) from None
    on_screen = time.perf_counter() - start
    dismiss_news(page)
    page.evaluate(WATCH)
    times, kernel_times = [], []
    for k in range(drags):
        handles = page.locator(".pipexplore-splitbar .handle")
        index = (7 * k) % handles.count()
        handle = handles.nth(index)
        value = int(handle.get_attribute("aria-valuenow"))
        upper = int(handles.nth(index + 1).get_attribute("aria-valuenow")) if index + 1 < handles.count() else None
        layers = page.locator(".pipexplore-splitbar .cell").count()
        to = value + 1 if value + 1 < (upper or layers) else value - 1
        before = page.evaluate(SPLITS_SHOWN)
        page.locator(".pipexplore-splitbar").scroll_into_view_if_needed()
        # Move the handle by the distance between the two layer boundaries, wherever it was grabbed.
        here = page.locator(f".pipexplore-splitbar .cell[data-layer='{value}']").bounding_box()
        there = page.locator(f".pipexplore-splitbar .cell[data-layer='{to}']").bounding_box()
        box = handle.bounding_box()
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        page.mouse.move(x, y)
        page.mouse.down()
        page.mouse.move(x + there["x"] - here["x"], y, steps=6)
        page.evaluate("window.__pipexploreLog = []")
        page.mouse.up()
        page.wait_for_function(f"({SPLITS_SHOWN}) !== {before!r}", timeout=60_000)
        log = page.evaluate("window.__pipexploreLog")
        if not any(event == "shown" for event, *_ in log):
            raise RuntimeError(f"log {log}; before {before!r}; now {page.evaluate(SPLITS_SHOWN)!r}; timelines "
                               f"{page.locator('.pipexplore-timeline').count()}")
        now = page.evaluate(SPLITS_SHOWN)
        # The kernel's picture of the same plan (the page's own re-timing comes first, where it can).
        page.wait_for_selector(f".pipexplore-timeline[data-splits='{now}'][data-source='kernel']", timeout=60_000)
        log = page.evaluate("window.__pipexploreLog")
        up = next(t for event, t, *_ in log if event == "up")
        shown = next(t for event, t, *_ in log if event == "shown" and t >= up)
        kernel = next(t for event, t, splits, source in (e for e in log if e[0] == "shown")
                      if t >= up and splits == now and source == "kernel")
        times.append((shown - up) / 1e3)
        kernel_times.append((kernel - up) / 1e3)
    return setup, on_screen, times, kernel_times


def main() -> None:
    from playwright.sync_api import sync_playwright

    print(f"machine: {machine()}; Chromium headless, 1,280 × 1,400 px")
    runs = [(name, cell, setup, when) for name, cell in CASES.items()
            for setup, when in ((SETUP, "right after %load_ext"), (WARM_SETUP, "after its warm-up"))]
    quickstart_setup, quickstart_explorer = quickstart_cells()
    runs.append(("the quickstart (notebook 01's first two cells)", quickstart_explorer, quickstart_setup,
                 "right after its setup cell"))
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        notebooks = {f"case{k}.ipynb": [setup, cell] for k, (_, cell, setup, _) in enumerate(runs)}
        with jupyterlab(root, notebooks) as (url, token), sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                for k, (name, cell, _, when) in enumerate(runs):
                    page = browser.new_page(viewport={"width": 1280, "height": 1400})
                    page.goto(f"{url}/lab/workspaces/bench{k}/tree/case{k}.ipynb?reset&token={token}")
                    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
                    setup, on_screen, drags, kernel = _measure(page, cell, drags=10)
                    print(f"{name}, {when}: setup cell {setup:.2f} s, on screen {on_screen:.2f} s; drag → new "
                          f"predicted timeline: median {statistics.median(drags) * 1e3:.0f} ms, max "
                          f"{max(drags) * 1e3:.0f} ms; → the kernel's picture of it: median "
                          f"{statistics.median(kernel) * 1e3:.0f} ms, max {max(kernel) * 1e3:.0f} ms "
                          f"({len(drags)} drags)")
                    page.close()
            finally:
                browser.close()


if __name__ == "__main__":
    main()
