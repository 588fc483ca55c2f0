"""The explorer in a real JupyterLab, driven by headless Chromium as a person would use it.

Starts JupyterLab on 127.0.0.1, opens a notebook, runs it, drags a split handle with the mouse,
checks the kernel's ``explorer.splits`` changed and the predicted timeline re-rendered, clicks
"Run step" and waits for the runs table to grow. Saves a screenshot in ``test-output/``.
"""
from __future__ import annotations

import json
import re
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = pathlib.Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "test-output"

pytestmark = pytest.mark.browser

playwright_sync = pytest.importorskip("playwright.sync_api")

NOTEBOOK_CELLS = [
    "%load_ext pipexplore\n"
    "import torch\n"
    "from torch import nn\n"
    "torch.manual_seed(0)\n"
    "model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)])\n"
    "sample = torch.randn(64, 64)",
    "ex = %pipexplore model sample --chunks 4 --devices cpu,cpu --splits 2\n"
    "ex",
    "print('SPLITS', ex.splits, 'RUNS', len(ex.runs))",
]


def _notebook(path: pathlib.Path) -> None:
    cells = [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
              "source": source} for source in NOTEBOOK_CELLS]
    nb = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                      "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)")
    _notebook(tmp_path / "explorer.ipynb")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.token={token}", f"--ServerApp.root_dir={tmp_path}", "--ServerApp.disable_check_xsrf=True",
         "--ServerApp.open_browser=False"],
        cwd=tmp_path, env=env, stdout=open(tmp_path / "lab.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except Exception:
            if server.poll() is not None or time.time() > deadline:
                os.killpg(server.pid, signal.SIGKILL)
                pytest.fail("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
            time.sleep(0.5)
    try:
        yield url, token
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _output_text(page, index: int) -> str:
    return page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea").inner_text()


def _run_cell(page, index: int) -> None:
    """Select a cell by its prompt (command mode) and run it with Shift+Enter."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.locator(".jp-InputPrompt").click()
    page.keyboard.press("Shift+Enter")


def _accept_kernel_dialog(page) -> None:
    """JupyterLab may ask which kernel to start; take the one it proposes (the notebook's)."""
    dialog = page.locator(".jp-Dialog")
    try:
        dialog.wait_for(timeout=5_000)
    except playwright_sync.TimeoutError:
        return
    dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
    dialog.wait_for(state="hidden", timeout=10_000)


def _run_all(page) -> None:
    """Run > Run All Cells, as a person would; again if the kernel was not ready to take it."""
    for _ in range(6):
        _accept_kernel_dialog(page)
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


def test_drag_a_split_and_run_a_step_in_jupyterlab(lab):
    url, token = lab
    OUTPUT.mkdir(exist_ok=True)
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.goto(f"{url}/lab/workspaces/pipexplore-test/tree/explorer.ipynb?reset&token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            # Wait for the kernel, then run the notebook as a person would.
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
            _run_all(page)
            handle = page.wait_for_selector(".pipexplore-splitbar .handle", timeout=90_000)
            page.wait_for_function("document.querySelector('.jp-Notebook').innerText.includes('SPLITS [2]')",
                                   timeout=120_000)
            assert handle.get_attribute("aria-valuenow") == "2"
            predicted_before = page.locator(".js-plotly-plot .barlayer").first.inner_html()

            # Drag the handle to the boundary before layer 5.
            box = handle.bounding_box()
            target = page.locator(".pipexplore-splitbar .cell[data-layer='5']").bounding_box()
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            page.mouse.down()
            page.mouse.move(target["x"] + 2, box["y"] + box["height"] / 2, steps=12)
            page.mouse.up()
            page.wait_for_selector(".pipexplore-splitbar .handle[aria-valuenow='5']", timeout=30_000)

            # The kernel's explorer has the new split.
            _run_cell(page, 2)
            page.wait_for_function("document.querySelector('.jp-Notebook').innerText.includes('SPLITS [5]')",
                                   timeout=60_000)
            # The predicted timeline was drawn anew (the two stages' bars moved).
            page.wait_for_function(
                "b => document.querySelector('.js-plotly-plot .barlayer').innerHTML !== b",
                arg=predicted_before, timeout=30_000)

            # Run a real step from the button; the runs table grows by one row.
            page.get_by_role("button", name="Run step").click()
            page.wait_for_selector(".pipexplore-runs table tbody tr", timeout=120_000)
            assert page.locator(".pipexplore-runs table tbody tr").count() == 1
            _run_cell(page, 2)
            page.wait_for_function("document.querySelector('.jp-Notebook').innerText.includes('RUNS 1')",
                                   timeout=60_000)
            page.locator(".pipexplore-explorer").screenshot(path=str(OUTPUT / "explorer.png"))
        except BaseException:
            page.screenshot(path=str(OUTPUT / "failure.png"), full_page=True)
            (OUTPUT / "failure.txt").write_text(page.locator("body").inner_text())
            raise
        finally:
            browser.close()
