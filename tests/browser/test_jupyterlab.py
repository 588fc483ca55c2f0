"""The explorer in a real JupyterLab, driven by headless Chromium as a person would use it.

Starts JupyterLab on 127.0.0.1 in a 1,280-px window, opens a notebook, runs it, drags a split
handle with the mouse, checks the kernel's ``explorer.splits`` changed and the predicted timeline
was redrawn (its ``data-splits``), adds a split by double-click and removes one by Delete, moves a
focused handle with the keyboard, clicks "Run step" and waits for the runs table to grow, then
checks the page fits and no text overlaps. Saves a screenshot in ``test-output/``. At real sizes
(a Llama-3-70B shape of 84 layers planned on 64 H100s, and a strip of 1,000 layers) a handle is
grabbed by the middle of its box and dragged by mouse, the header's cards fit, and the redraw after
the release is timed (``test-output/strip-drag-*.json``, not asserted).
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import time

import playwright.sync_api as playwright_sync  # the test extra
import pytest
from lab import CHROMIUM, CHROMIUM_ARGS, LabError, accept_kernel_dialog, dismiss_news, jupyterlab, run_cell

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "test-output"

pytestmark = pytest.mark.browser
#: Threads the module's Chromium keeps (its event loop's pool that writes files, screenshots among
#: them: started as tests first need it, "asyncio_0", "asyncio_1", ...), left to the module by
#: conftest.py's check that a test leaves no thread of its own.
MODULE_THREADS = ("asyncio_",)

NOTEBOOK_CELLS = [
    "%load_ext pipexplore\n"
    "import torch\n"
    "from torch import nn\n"
    "torch.manual_seed(0)\n"
    "model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)])\n"
    "sample = torch.randn(64, 64)",
    "ex = %pipexplore model sample --chunks 4 --devices cpu,cpu --splits 2 --schedule 1f1b\n"
    "ex",
    "print('SPLITS', ex.splits, 'RUNS', len(ex.runs))",
    # The kernel refuses one plan (as it refuses a split it cannot run): the page must give it up.
    "_change = ex.state.change_plan\n"
    "def _refusing(change):\n"
    "    if list(change(ex.plan).splits) == [6]:\n"
    "        raise ValueError('split [6] refused for this test')\n"
    "    return _change(change)\n"
    "ex.state.change_plan = _refusing",
]


def _serving(tmp_path, notebooks: dict):
    """JupyterLab serving ``notebooks`` (name -> cells): yields its URL and token."""
    try:
        with jupyterlab(tmp_path, notebooks) as (url, token):
            yield url, token
    except LabError as error:
        pytest.fail(str(error))


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """One JupyterLab for the module's tests, serving each test's notebook (a kernel each)."""
    yield from _serving(tmp_path_factory.mktemp("lab"), {"explorer.ipynb": NOTEBOOK_CELLS,
                                                         "many.ipynb": MANY_LAYERS_CELLS,
                                                         "planned.ipynb": PLANNED_CELLS,
                                                         "llama.ipynb": LLAMA_CELLS,
                                                         "thousand.ipynb": THOUSAND_CELLS})


@pytest.fixture
def lab(lab_server):
    return lab_server


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """One Chromium (a profile of its own, a 1,280-px window) for the module's pages, refused by name
    where Debian's chromium is missing: each test opens a page of its own, and JupyterLab's scripts,
    fetched and compiled for the first page, come from the profile's caches for the next."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)")
    folder = tmp_path_factory.mktemp("chromium")
    with playwright_sync.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(folder / "profile"), executable_path=CHROMIUM,
                                                       headless=True, args=CHROMIUM_ARGS,
                                                       viewport={"width": 1280, "height": 1400})
        try:
            yield context
        finally:
            context.close()


def _output_text(page, index: int) -> str:
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea").inner_text()


def _run_all(page) -> None:
    """Run > Run All Cells, as a person would; again if the kernel was not ready to take it."""
    for _ in range(6):
        accept_kernel_dialog(page, playwright_sync.TimeoutError)
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        try:
            page.wait_for_function(
                "document.querySelectorAll('.jp-Notebook .jp-InputPrompt')[0].innerText.match(/\\[[0-9*]+\\]/)",
                timeout=20_000)
            return
        except playwright_sync.TimeoutError:
            continue
    raise AssertionError("the notebook's cells never started running")


_OVERLAPS = """
root => {
  // Every piece of text drawn in the explorer (SVG text of the strip, the HTML labels, the
  // timelines' titles, legend and buttons) as boxes; the pairs that overlap by more than a pixel each way.
  const boxes = [];
  for (const node of root.querySelectorAll('svg text, .widget-label, .pipexplore-card-label, .pipexplore-card-value, '
                                           + '.pipexplore-tl-title, .pipexplore-tl-key, .pipexplore-tl-button')) {
    if (!node.textContent.trim() || node.closest('.modebar')) continue;
    const style = getComputedStyle(node);
    if (style.display === 'none' || style.visibility === 'hidden' || style.opacity === '0') continue;
    const r = node.getBoundingClientRect();
    if (r.width < 1 || r.height < 1) continue;
    boxes.push({text: node.textContent.trim().slice(0, 40), l: r.left, r: r.right, t: r.top, b: r.bottom});
  }
  const overlaps = [];
  for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
    const a = boxes[i], b = boxes[j];
    if (Math.min(a.r, b.r) - Math.max(a.l, b.l) > 1 && Math.min(a.b, b.b) - Math.max(a.t, b.t) > 1)
      overlaps.push(a.text + ' / ' + b.text);
  }
  return overlaps;
}
"""


_OVERFLOWING = """
root => {
  // Elements of the explorer that reach past its right edge (a page wider than its window).
  const right = root.getBoundingClientRect().right + 1;
  return [...root.querySelectorAll('*')].filter(node => node.getBoundingClientRect().right > right
    && getComputedStyle(node).display !== 'none' && !node.closest('.pipexplore-runs'))
    .slice(0, 8).map(node => node.tagName + '.' + String(node.className.baseVal ?? node.className).slice(0, 60)
      + ' ' + Math.round(node.getBoundingClientRect().right - right) + 'px: ' + node.textContent.slice(0, 50));
}
"""


_TIMELINE_STATE = """
() => {
  const timeline = document.querySelector('.pipexplore-timeline');
  return JSON.stringify({timeline: timeline ? timeline.className + ' ' + JSON.stringify(timeline.dataset) : null,
                         canvases: timeline ? timeline.querySelectorAll('canvas').length : 0});
}
"""


def test_drag_a_split_and_run_a_step_in_jupyterlab(lab, chromium):
    url, token = lab
    OUTPUT.mkdir(exist_ok=True)
    page = chromium.new_page()
    try:
        page.goto(f"{url}/lab/workspaces/pipexplore-test/tree/explorer.ipynb?reset&token={token}")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
        # Wait for the kernel, then run the notebook as a person would.
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
        _run_all(page)
        handle = page.wait_for_selector(".pipexplore-splitbar .handle", timeout=90_000)
        dismiss_news(page)
        page.wait_for_function("document.querySelector('.jp-Notebook').innerText.includes('SPLITS [2]')",
                               timeout=120_000)
        assert handle.get_attribute("aria-valuenow") == "2"
        # The predicted timeline says which split it shows once it has drawn it.
        page.wait_for_selector(".pipexplore-timeline[data-splits='2']", timeout=60_000)
        explorer = page.locator(".pipexplore-explorer")
        assert "no run yet" in explorer.locator(".pipexplore-timeline").inner_text()

        # Drag the handle to the boundary before layer 5: the page re-times the moved split and
        # draws it at once, then the kernel's picture of the same plan replaces it, the same step.
        page.wait_for_selector(".pipexplore-timeline[data-retime='ready']", timeout=60_000)
        page.evaluate(_WATCH_SOURCES)
        _drag_handle(page, handle, 5, steps=12)
        page.wait_for_selector(".pipexplore-splitbar .handle[aria-valuenow='5']", timeout=30_000)
        # The predicted timeline is redrawn for the new split.
        page.wait_for_selector(".pipexplore-timeline[data-splits='5'][data-source='kernel']", timeout=30_000)
        shown = [entry for entry in page.evaluate("window.__pipexploreSources") if entry[0] == "5"]
        assert [source for _, source, _, _ in shown][:2] == ["page", "kernel"], shown
        assert shown[0][2] == shown[1][2] and "step" in shown[0][2], shown  # the same figures in the title
        # (the memory panel dimmed while the page's picture is shown: it is the previous plan's)
        assert [stale for *_, stale in shown][:2] == [True, False], shown

        # A move the kernel refuses: the page's own picture of it gives way to the plan kept.
        page.evaluate(_WATCH_SOURCES)
        _drag_until(page, page.locator(".pipexplore-splitbar .handle[aria-valuenow='5']"), 6, 6,
                    "document.querySelector('.pipexplore-splitbar').innerText"
                    ".includes('split [6] refused for this test')")
        page.wait_for_selector(".pipexplore-timeline[data-splits='5'][data-source='kernel']", timeout=30_000)
        page.wait_for_selector(".pipexplore-splitbar .handle[aria-valuenow='5']", timeout=30_000)
        shown = page.evaluate("window.__pipexploreSources")
        assert shown[0][:2] == ["6", "page"] and shown[-1][:2] == ["5", "kernel"], shown

        # Hovering a layer shades its stage's lane in the timelines.
        page.locator(".pipexplore-splitbar .cell[data-layer='6']").hover()
        page.wait_for_selector(".pipexplore-timeline[data-highlight='1']", timeout=30_000)
        page.mouse.move(5, 5)
        page.wait_for_selector(".pipexplore-timeline[data-highlight='-1']", timeout=30_000)
        # Hovering a block of the predicted timeline tells what it is.
        canvas = page.locator(".pipexplore-timeline canvas").first
        canvas.scroll_into_view_if_needed()
        box = _box(canvas)
        tip = page.locator(".pipexplore-timeline .pipexplore-tl-tip")
        for k in range(1, 40):  # along the top lane (stage 0) until the pointer is over a block
            page.mouse.move(box["x"] + box["width"] * k / 40, box["y"] + 8)
            if tip.is_visible():
                break
        assert re.search(r"micro-batch \d+ · stage 0 · layers 0–4", tip.inner_text()), tip.inner_text()
        # The schedule grid, opened, lights the hovered block's action (a front-end link).
        page.mouse.move(5, 5)
        explorer.get_by_text("schedule: the actions each rank runs").click()
        page.wait_for_selector(".pipexplore-grid[data-rows='2']", timeout=30_000)
        canvas.scroll_into_view_if_needed()
        box = _box(canvas)
        for k in range(1, 40):
            page.mouse.move(box["x"] + box["width"] * k / 40, box["y"] + 8)
            if tip.is_visible():
                break
        phase, micro = re.search(r"(\w+) · micro-batch (\d+) · stage 0", tip.inner_text()).groups()
        action = f"0{dict(forward='F', backward='B', recompute='R')[phase]}{micro}"
        page.wait_for_selector(f".pipexplore-grid[data-hover='{action}'] td.hot[data-action='{action}']",
                               timeout=30_000)
        # Drag across the timelines to zoom into a time range; double-click to see the whole step.
        page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + 20)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.7, box["y"] + 20, steps=5)
        page.mouse.up()
        assert page.locator(".pipexplore-timeline .pipexplore-tl-button", has_text="whole step").is_visible()
        page.mouse.dblclick(box["x"] + box["width"] * 0.6, box["y"] + 20)
        assert not page.locator(".pipexplore-timeline .pipexplore-tl-button", has_text="whole step").is_visible()

        # The kernel's explorer has the new split.
        run_cell(page, 2)
        page.wait_for_function("document.querySelector('.jp-Notebook').innerText.includes('SPLITS [5]')",
                               timeout=60_000)

        # A third stage: double-click the boundary before layer 2; its devices follow.
        page.locator(".pipexplore-splitbar").scroll_into_view_if_needed()
        cell = _box(page.locator(".pipexplore-splitbar .cell[data-layer='2']"))
        page.mouse.dblclick(cell["x"] + 1, cell["y"] + cell["height"] / 2)
        page.wait_for_selector(".pipexplore-timeline[data-splits='2,5']", timeout=30_000)
        assert page.locator(".pipexplore-splitbar .handle").count() == 2
        page.wait_for_function("document.querySelector('.pipexplore-explorer').innerText.includes('3 stages: cpu "
                               "repeated')", timeout=30_000)

        # Keyboard: a focused handle keeps its focus across moves; Delete removes it.
        first = page.locator(".pipexplore-splitbar .handle[data-index='0']")
        first.focus()
        page.keyboard.press("ArrowRight")
        page.wait_for_selector(".pipexplore-timeline[data-splits='3,5']", timeout=30_000)
        page.keyboard.press("ArrowRight")
        page.wait_for_selector(".pipexplore-timeline[data-splits='4,5']", timeout=30_000)
        assert page.evaluate("document.activeElement.getAttribute('aria-valuenow')") == "4"
        page.keyboard.press("Delete")
        page.wait_for_selector(".pipexplore-timeline[data-splits='5']", timeout=30_000)
        assert page.locator(".pipexplore-splitbar .handle").count() == 1

        # Run a real step from the button; the runs table grows by one row.
        page.get_by_role("button", name="Run step").click()
        page.wait_for_selector(".pipexplore-runs table tbody tr", timeout=120_000)
        assert page.locator(".pipexplore-runs table tbody tr").count() == 1
        run_cell(page, 2)
        page.wait_for_function("document.querySelector('.jp-Notebook').innerText.includes('RUNS 1')",
                               timeout=60_000)
        page.wait_for_function("!document.querySelector('.pipexplore-timeline').innerText.includes('no run yet')",
                               timeout=30_000)
        # The run's activation memory, measured as autograd saved it, beside the prediction.
        page.wait_for_function("document.querySelector('.pipexplore-timeline').innerText"
                               ".includes('measured (dashed)')", timeout=30_000)
        # The residual mode draws the run's error per action; a cell's hover names it.
        explorer.locator(".widget-toggle-button", has_text="residuals").click()
        page.wait_for_selector(".pipexplore-residuals[data-rows]:not([data-rows='0'])", timeout=30_000)
        grid = _box(page.locator(".pipexplore-residuals canvas"))
        page.mouse.move(grid["x"] + grid["width"] * 0.6, grid["y"] + 15)
        tip = page.locator(".pipexplore-residuals .pipexplore-tl-tip")
        assert re.search(r"stage 0 · \w+ · micro-batch \d+: error [+-]", tip.inner_text()), tip.inner_text()
        explorer.locator(".widget-toggle-button", has_text="timelines").click()

        # The page fits a 1,280-px window and no text overlaps other text.
        overflowing = explorer.evaluate(_OVERFLOWING)
        assert overflowing == [], "\n".join(overflowing)
        overlapping = explorer.evaluate(_OVERLAPS)
        assert overlapping == [], "\n".join(overlapping)
        page.set_viewport_size({"width": 1280, "height": 2400})  # the whole explorer in one picture
        explorer.scroll_into_view_if_needed()
        explorer.screenshot(path=str(OUTPUT / "explorer.png"))
    except BaseException:
        page.screenshot(path=str(OUTPUT / "failure.png"), full_page=True)
        (OUTPUT / "failure.txt").write_text(page.locator("body").inner_text() + "\n\n"
                                            + page.evaluate(_TIMELINE_STATE))
        raise
    finally:
        page.close()


def _box(element, timeout: float = 30.0) -> dict:
    """Where ``element`` (a handle or locator) is drawn, once it is: the strip is redrawn when the
    kernel's picture of a plan replaces the page's, and an element between two drawings has no box."""
    deadline = time.monotonic() + timeout
    while (box := element.bounding_box()) is None:
        assert time.monotonic() < deadline, f"{element} was not drawn within {timeout:.0f} s"
        time.sleep(0.05)
    return box


def _drag_handle(page, handle, layer: int, steps: int) -> None:
    """Press on a split handle, move it to the boundary before ``layer`` and release it."""
    box = _box(handle)
    target = _box(page.locator(f".pipexplore-splitbar .cell[data-layer='{layer}']"))
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(target["x"] + 2, box["y"] + box["height"] / 2, steps=steps)
    page.mouse.up()


def _drag_until(page, handle, layer: int, steps: int, shown: str, tries: int = 3, timeout: int = 20_000) -> None:
    """Drag ``handle`` to ``layer`` until the page shows what ``shown`` (a JavaScript expression)
    looks for, ``tries`` drags of ``timeout`` ms each. A run of the whole suite at 1.6× its usual
    time once waited 30 s for a refusal after one drag: on a loaded machine the strip may be redrawn
    between finding the handle and pressing it, so that the page never sees the drag, or the kernel
    may be slow; from here the two look the same, and the drag made again settles the first."""
    for attempt in range(tries):
        _drag_handle(page, handle, layer, steps)
        try:
            page.wait_for_function(shown, timeout=timeout)
            return
        except playwright_sync.TimeoutError:
            if attempt + 1 == tries:
                raise


# Each picture the predicted timeline shows: its splits, whose it is, the predicted panel's title, and
# whether a panel is dimmed as stale.
_WATCH_SOURCES = """
() => {
  window.__pipexploreSources = [];
  const timeline = document.querySelector('.pipexplore-timeline[data-splits]');
  const title = () => (timeline.querySelector('.pipexplore-tl-title') || {}).textContent || '';
  const stale = () => !!timeline.querySelector('.pipexplore-tl-stale');
  new MutationObserver(() => window.__pipexploreSources.push([timeline.dataset.splits, timeline.dataset.source,
                                                             title(), stale()]))
    .observe(timeline, {attributes: true, attributeFilter: ['data-source', 'data-splits']});
}
"""


MANY_LAYERS_CELLS = [
    "import numpy as np, pandas as pd, torch\n"
    "from torch import nn\n"
    "from pipexplore.widgets import Explorer\n"
    "n = 120\n"
    "table = pd.DataFrame({'name': [f'blocks.{k // 4}.{k % 4}' for k in range(n)], 'type': 'Linear',\n"
    "    'param_bytes': 4096.0,\n"
    "    'output_bytes': 1e3, 'forward': [1e-4] * n, 'backward': [2e-4] * n, 'stash': '', 'pop': ''})\n"
    "ex = Explorer(nn.Sequential(*[nn.Identity() for _ in range(n)]), torch.zeros(8, 1), layer_table=table,\n"
    "              devices=['cpu'] * 4, chunks=4, splits=[30, 60, 90], calibrate=False)\n"
    "ex",
]


@pytest.fixture
def many_layers_lab(lab_server):
    return lab_server


@contextlib.contextmanager
def _notebook_ran(lab_server, chromium, notebook: str, workspace: str, ready: str, failure: str):
    """A page of ``chromium`` with ``notebook`` open in JupyterLab and every cell run, once ``ready``
    (a selector) is drawn; a screenshot ``failure`` in test-output/ if the test fails."""
    url, token = lab_server
    OUTPUT.mkdir(exist_ok=True)
    page = chromium.new_page()
    try:
        page.goto(f"{url}/lab/workspaces/{workspace}/tree/{notebook}?reset&token={token}")
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
        _run_all(page)
        page.wait_for_selector(ready, timeout=90_000)
        dismiss_news(page)
        yield page
    except BaseException:
        page.screenshot(path=str(OUTPUT / failure), full_page=True)
        raise
    finally:
        page.close()


def test_a_strip_of_many_layers_zooms_with_a_brush_on_its_overview(many_layers_lab, chromium):
    with _notebook_ran(many_layers_lab, chromium, "many.ipynb", "pipexplore-zoom",
                       ".pipexplore-splitbar .overview .brush", "failure-zoom.png") as page:
        cells = ".pipexplore-splitbar .cell"
        assert page.locator(cells).count() == 120  # the whole strip
        # The model's blocks (blocks.N: 4 layers each) are bracketed; a click closes one into a cell.
        page.locator(".pipexplore-splitbar .group-hit[data-block='blocks.5']").click()
        page.wait_for_function(f"document.querySelectorAll('{cells}').length === 117", timeout=10_000)
        assert page.locator(".pipexplore-splitbar .cell.block[data-block='blocks.5']").count() == 1
        page.locator(".pipexplore-splitbar .group-hit[data-block='blocks.5']").click()
        page.wait_for_function(f"document.querySelectorAll('{cells}').length === 120", timeout=10_000)
        assert page.locator(".pipexplore-splitbar .handle").count() == 3  # clicks add no split
        # Drag across the overview from layer 20 to layer 50: the strip shows those in detail.
        overview = _box(page.locator(".pipexplore-splitbar .overview-stage").first)
        last = _box(page.locator(".pipexplore-splitbar .overview-stage").last)
        left, width = overview["x"], last["x"] + last["width"] - overview["x"]
        y = overview["y"] + overview["height"] / 2
        page.mouse.move(left + width * 20 / 120, y)
        page.mouse.down()
        page.mouse.move(left + width * 50 / 120, y, steps=8)
        page.mouse.up()
        page.wait_for_function(f"document.querySelectorAll('{cells}').length <= 32", timeout=10_000)
        brush = page.locator(".pipexplore-splitbar .brush")
        assert (brush.get_attribute("data-first"), brush.get_attribute("data-end")) == ("20", "50")
        # Only the split inside the detail has a handle, and it can be grabbed.
        assert [h.get_attribute("aria-valuenow") for h in page.locator(".pipexplore-splitbar .handle").all()] \
            == ["30"]
        # Drag the brush to pan by 10 layers, then double-click the overview: every layer again.
        box = _box(brush)
        page.mouse.move(box["x"] + box["width"] / 2, y)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] / 2 + width * 10 / 120, y, steps=6)
        page.mouse.up()
        assert (brush.get_attribute("data-first"), brush.get_attribute("data-end")) == ("30", "60")
        page.mouse.dblclick(left + width * 0.9, y)
        page.wait_for_function(f"document.querySelectorAll('{cells}').length === 120", timeout=10_000)
        assert page.locator(".pipexplore-splitbar .handle").count() == 3  # no split was added


PLANNED_CELLS = [
    "import torch\n"
    "from torch import nn\n"
    "from pipexplore import explore\n"
    "with torch.device('meta'):\n"
    "    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(32)])\n"
    "    sample = torch.empty(64, 1024)\n"
    "ex = explore(model, sample, devices=['H100'] * 16, gpus_per_node=8, chunks=16, schedule='1f1b')\n"
    "ex",
    "from pipexplore.widgets.front import front_panel\n"
    "plans = ex.search(stages=[8, 16], chunks=[16, 32], schedules=['gpipe', '1f1b'], checkpoint=['never'])\n"
    "front_panel(ex, plans)",
    "print('PLAN', ex.plan.num_stages, ex.plan.chunks, ex.plan.schedule)",
]


def test_a_plan_on_two_planned_nodes_reads_as_planned_with_its_node_boundary(lab_server, chromium):
    """Sixteen stages on two planned nodes of eight H100s: one split is the node boundary (marked
    and named in the strip), Run step is off, the header and the measured timeline say planned,
    and no text overlaps."""
    with _notebook_ran(lab_server, chromium, "planned.ipynb", "pipexplore-planned", ".pipexplore-splitbar .handle",
                       "failure-planned.png") as page:
        assert page.locator(".pipexplore-splitbar .handle").count() == 15
        boundary = page.locator(".pipexplore-splitbar .handle.node")
        assert boundary.count() == 1 and boundary.locator(".node-label").text_content() == "node 1"
        assert "stage 8 begins" in boundary.get_attribute("aria-label")
        run = page.locator(".jupyter-widgets button", has_text="Run step")
        assert run.is_disabled()
        header = page.locator(".pipexplore-header").inner_text()
        assert "predicted step (planned)" in header and "16 × H100 on 2 nodes are not here" in header
        explorer = page.locator(".pipexplore-explorer").first
        assert explorer.evaluate(_OVERLAPS) == []
        page.screenshot(path=str(OUTPUT / "planned.png"), full_page=True)
        # The search's front: a click on a plan's point applies it.
        point = page.locator(".pipexplore-front-chart circle.plan").last
        point.scroll_into_view_if_needed()
        rank = point.get_attribute("data-rank")
        point.click()
        page.wait_for_selector(f".pipexplore-front-chart[data-picked='{rank}']", timeout=30_000)
        page.wait_for_function(f"document.querySelector('.jp-Notebook').innerText.includes('applied #{rank}:')",
                               timeout=30_000)
        applied = re.search(rf"applied #{rank}: (\d+) stages, (\d+) chunks, ([\w-]+)",
                            page.locator(".jp-Notebook").inner_text()).groups()
        assert applied != ("16", "16", "1f1b")  # (the slowest plan: not the one the explorer had)
        run_cell(page, 2)  # the kernel's explorer has the plan of the point
        page.wait_for_function(f"document.querySelector('.jp-Notebook').innerText.includes('PLAN {' '.join(applied)}')",
                               timeout=30_000)


def test_the_html_report_opens_in_a_browser_without_kernel_or_network(tmp_path, chromium):
    """``Explorer.to_html`` writes one page; Chromium opens it from disk with every network request
    refused, and the embedded canvas widgets draw its timeline and residuals."""
    import torch
    from torch import nn

    from pipexplore.widgets import explore

    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
    ex = explore(model, torch.randn(16, 16), devices=["cpu", "cpu", "cpu"], splits=[2, 4], chunks=4, calibrate=False)
    ex.run()
    path = ex.to_html(tmp_path / "report.html")
    requests, errors = [], []
    page = chromium.new_page()  # (requests for anything but the file are refused here)
    try:
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                   else (requests.append(route.request.url), route.abort()))
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(path.resolve().as_uri())
        page.wait_for_selector(".pipexplore-timeline[data-splits='2,4'][data-blocks] canvas", timeout=30_000)
        blocks = page.locator(".pipexplore-timeline").get_attribute("data-blocks")
        assert int(blocks) == len(ex.plan.predicted) + len(ex.timeline("measured"))
        assert page.locator(".pipexplore-timeline canvas").count() == 4  # predicted, measured, memory, axis
        page.wait_for_selector(".pipexplore-residuals[data-rows='9'] canvas", timeout=30_000)  # 3 stages × F/B/R
        assert page.locator(".pipexplore-strip .cell").count() == 6
        assert page.locator(".pipexplore-runs table tbody tr").count() == 1
        assert "GPipe(model, balance=[2, 2, 2]" in page.locator("#pipexplore-code-gpipe").inner_text()
        assert requests == [] and errors == []
    finally:
        page.close()


# ---- the strip at real sizes, by mouse ------------------------------------------------------------

# A Llama-3-70B shape (84 layers: embedding, 80 blocks, norm, head, loss) built on the meta device and
# planned on 64 H100s in a mesh, as notebooks/06_plan_a_cluster.ipynb builds it: its splits are node
# boundaries (labelled over the handle), and FSDP's actions are re-timed in the page, as for any plan.
LLAMA_CELLS = [
    "import torch\n"
    "from transformers import LlamaConfig, LlamaForCausalLM\n"
    "import pipexplore\n"
    "config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,\n"
    "                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)\n"
    "with torch.device('meta'):\n"
    "    model = LlamaForCausalLM(config).to(torch.bfloat16)\n"
    "    ids = torch.randint(0, config.vocab_size, (32, 4096))\n"
    "ex = pipexplore.explore(model, ids, devices=['H100'] * 64, mesh={'tp': 8, 'pp': 4, 'dp': 2},\n"
    "                        data_parallel='fsdp')\n"
    "ex",
    "print('SPLITS', ex.splits)",
]

# A strip of 1,000 narrow cells (under a pixel each in a 1,280-px window), re-timed in the page.
THOUSAND_CELLS = [
    "import torch, pipexplore\n"
    "from torch import nn\n"
    "torch.manual_seed(0)\n"
    "model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(1000)])\n"
    "ex = pipexplore.explore(model, torch.randn(8, 4), devices=['cpu'] * 4, chunks=4, calibrate=False)\n"
    "ex",
    "print('SPLITS', ex.splits)",
]

# Times from the release of a dragged handle (performance.now, ms): the predicted timeline's new
# picture (its data-splits), the strip drawn again, and the first frame after the timeline's picture.
_MEASURE_RELEASE = """
() => {
  const m = window.__pipexploreRelease = {};
  const timeline = document.querySelector('.pipexplore-timeline');
  const strip = document.querySelector('.pipexplore-splitbar svg');
  const before = timeline.dataset.splits;
  new MutationObserver(() => {
    if (m.up !== undefined && m.timeline === undefined && timeline.dataset.splits !== before) {
      m.timeline = performance.now();
      m.source = timeline.dataset.source;  // who drew it: the page (re-timed there) or the kernel
    }
  }).observe(timeline, {attributes: true, attributeFilter: ['data-splits']});
  new MutationObserver(() => { if (m.up !== undefined && m.strip === undefined) m.strip = performance.now(); })
    .observe(strip.querySelector('.part-handles') || strip, {childList: true});
  document.addEventListener('pointerup', () => {
    m.up = performance.now();
    const frame = () => requestAnimationFrame(() => {
      if (m.timeline === undefined) return frame();
      setTimeout(() => { m.painted = performance.now(); }, 0);
    });
    frame();
  }, {capture: true, once: true});
}
"""

# What is drawn at the middle of a handle's box (the handle itself, if it is to be grabbed there).
_AT_HANDLE_CENTRE = """
handle => {
  const r = handle.getBoundingClientRect();
  const hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
  return {handle: hit && hit.closest('.handle') === handle,
          tag: hit ? hit.tagName + '.' + hit.getAttribute('class') : null,
          width: (handle.querySelector('.hit') || handle).getBoundingClientRect().width};
}
"""

# Header cards whose content is wider than the card (a list running off it).
_CARDS_OVERFLOWING = """
root => [...root.querySelectorAll('.pipexplore-card')].filter(card => {
  const box = card.getBoundingClientRect();
  return card.scrollWidth > card.clientWidth
    || [...card.querySelectorAll('*')].some(node => node.getBoundingClientRect().right > box.right + 0.5);
}).map(card => card.scrollWidth + ' > ' + card.clientWidth + ': ' + card.innerText.replace(/\\s+/g, ' '))
"""


def _drag_by_mouse(page, index: int, layer: int, name: str) -> dict:
    """Press the middle of split handle ``index`` (asserting the handle is what is drawn there), move the
    mouse to the left edge of layer ``layer``'s cell, check that only the handle moved meanwhile (the
    cells are not drawn again), release; the new split (the handle's value once drawn again) and the
    times of the redraw after the release (ms), also written to test-output/strip-drag-<name>.json."""
    handle = page.locator(f".pipexplore-splitbar .handle[data-index='{index}']")
    handle.scroll_into_view_if_needed()
    at = handle.evaluate(_AT_HANDLE_CENTRE)
    assert at["handle"], f"the middle of the handle is {at['tag']}, not the handle"
    assert at["width"] >= 10, at  # a hit area wide enough to grab, however narrow the cells
    before = handle.get_attribute("aria-valuenow")
    box, target = _box(handle), _box(page.locator(f".pipexplore-splitbar .cell[data-layer='{layer}']"))
    page.evaluate(_MEASURE_RELEASE)
    page.evaluate("window.__pipexploreCell = document.querySelector('.pipexplore-splitbar .cell')")
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] / 2, y)
    page.mouse.down()
    page.mouse.move(target["x"] + 0.25, y, steps=12)
    moving = page.evaluate("""index => {
      const handle = document.querySelector(`.pipexplore-splitbar .handle[data-index="${index}"]`);
      return {cells: document.querySelector('.pipexplore-splitbar .cell') === window.__pipexploreCell,
              moved: handle.getAttribute('transform'), value: handle.getAttribute('aria-valuenow')};
    }""", index)
    page.mouse.up()
    assert moving["cells"] and moving["moved"] and moving["value"] != before, moving
    page.wait_for_function("(m => m.timeline !== undefined && m.strip !== undefined && m.painted !== undefined)"
                           "(window.__pipexploreRelease)", timeout=60_000)
    release = page.evaluate("window.__pipexploreRelease")
    times = {key: round(release[key] - release["up"], 1) for key in ("timeline", "strip", "painted")}
    times["drawn_by"] = release.get("source")
    split = int(page.locator(f".pipexplore-splitbar .handle[data-index='{index}']").get_attribute("aria-valuenow"))
    assert split == int(moving["value"]), (split, moving)
    cells = page.locator(".pipexplore-splitbar .cell").count()
    (OUTPUT / f"strip-drag-{name}.json").write_text(json.dumps({"cells": cells, "ms_after_release": times}) + "\n")
    print(f"{name}: {cells} cells, ms after the release of a dragged handle: {times}")
    return {"split": split, "ms": times, "source": release.get("source")}


def _wait_for_kernel_splits(page, cell: int, splits: list) -> None:
    """Run notebook cell ``cell`` (``print('SPLITS', ex.splits)``) again until the kernel's splits are ``splits``."""
    run_cell(page, cell)
    page.wait_for_function(f"document.querySelectorAll('.jp-Notebook .jp-Cell')[{cell}].innerText"
                           f".includes('SPLITS {splits}')", timeout=60_000)


def test_a_handle_is_dragged_by_mouse_on_a_planned_llama_of_84_layers(lab_server, chromium):
    """84 layers planned on 64 H100s (FSDP): the middle of a split handle, a node boundary whose label is
    drawn over it, is the handle; a drag by mouse moves the split in the kernel and the predicted
    timeline is redrawn for it, first by the page (which re-times FSDP's gathers and reduce-scatters
    itself), then by the kernel; the header's cards (lists of per-stage figures) fit."""
    with _notebook_ran(lab_server, chromium, "llama.ipynb", "pipexplore-llama",
                       ".pipexplore-timeline[data-retime='ready']", "failure-llama.png") as page:
        explorer = page.locator(".pipexplore-explorer").first
        assert page.locator(".pipexplore-splitbar .cell").count() == 84
        assert explorer.evaluate(_CARDS_OVERFLOWING) == []
        first = [int(s) for s in page.locator(".pipexplore-timeline").get_attribute("data-splits").split(",")]
        assert page.locator(".pipexplore-splitbar .handle.node[data-index='0'] .node-label").count() == 1
        moved = _drag_by_mouse(page, 0, first[0] + 6, "llama-84")
        assert moved["split"] == first[0] + 6
        assert moved["source"] == "page", moved  # re-timed in the page, not left to the kernel
        splits = [moved["split"], *first[1:]]
        page.wait_for_selector(f".pipexplore-timeline[data-splits='{','.join(map(str, splits))}']", timeout=30_000)
        _wait_for_kernel_splits(page, 1, splits)
        page.wait_for_selector(".pipexplore-timeline[data-source='kernel']", timeout=30_000)  # its scene replaced it
        assert explorer.evaluate(_CARDS_OVERFLOWING) == []
        assert explorer.evaluate(_OVERLAPS) == []


def test_a_handle_is_dragged_by_mouse_on_a_strip_of_1000_layers(lab_server, chromium):
    """1,000 cells narrower than a pixel: a handle keeps a hit area of 10 px or more, and a drag by
    mouse snaps to a layer boundary, commits a valid split and the page's timeline redraws it."""
    with _notebook_ran(lab_server, chromium, "thousand.ipynb", "pipexplore-thousand",
                       ".pipexplore-timeline[data-retime='ready']", "failure-thousand.png") as page:
        explorer = page.locator(".pipexplore-explorer").first
        assert page.locator(".pipexplore-splitbar .cell").count() == 1000
        assert explorer.evaluate(_CARDS_OVERFLOWING) == []
        first = [int(s) for s in page.locator(".pipexplore-timeline").get_attribute("data-splits").split(",")]
        moved = _drag_by_mouse(page, 0, first[0] + 50, "layers-1000")
        assert abs(moved["split"] - (first[0] + 50)) <= 2, (moved, first)  # the boundary nearest the pointer
        splits = [moved["split"], *first[1:]]
        page.wait_for_selector(f".pipexplore-timeline[data-splits='{','.join(map(str, splits))}']", timeout=30_000)
        _wait_for_kernel_splits(page, 1, splits)
        assert page.locator(".pipexplore-splitbar .cell[data-stage='1']").count() == splits[1] - splits[0]
