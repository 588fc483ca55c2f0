"""A JupyterLab server on 127.0.0.1 for driving the explorer with headless Chromium (tests and benchmarks).

Example::

    with jupyterlab(tmp_path, {"explorer.ipynb": cells}) as (url, token):
        page.goto(f"{url}/lab/tree/explorer.ipynb?token={token}")
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Iterator, Mapping, Sequence

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run"]


class LabError(RuntimeError):
    """JupyterLab did not start; the message holds the end of its log."""


def write_notebook(path: pathlib.Path, cells: Sequence[str]) -> None:
    """A notebook of code cells (no outputs) for the python3 kernel."""
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": source}
                    for source in cells],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))


@contextlib.contextmanager
def jupyterlab(root: pathlib.Path, notebooks: Mapping[str, Sequence[str]]) -> Iterator[tuple[str, str]]:
    """Write ``notebooks`` (name → cells) under ``root``, serve it with JupyterLab, yield (url, token);
    the server's whole process group is stopped on exit."""
    for name, cells in notebooks.items():
        write_notebook(root / name, cells)
    token = secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(root / "config"), JUPYTER_RUNTIME_DIR=str(root / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(root / "workspaces"))
    # (port 0: the server takes a port the system gives it and writes it into its runtime file; a port
    # chosen here would be bound seconds later, once the server has started, and might be taken by then)
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--port=0", "--ip=127.0.0.1",
         f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.disable_check_xsrf=True",
         "--ServerApp.open_browser=False"],
        cwd=root, env=env, stdout=open(root / "lab.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    info = root / "runtime" / f"jpserver-{server.pid}.json"
    deadline = time.time() + 90
    while True:
        try:
            url = f"http://127.0.0.1:{json.loads(info.read_text())['port']}"
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except Exception:
            if server.poll() is not None or time.time() > deadline:
                os.killpg(server.pid, signal.SIGKILL)
                raise LabError("JupyterLab did not start:\n" + (root / "lab.log").read_text()[-3000:])
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


def accept_kernel_dialog(page, timeout_error: type) -> None:
    """JupyterLab may ask which kernel to start; take the one it proposes (the notebook's)."""
    dialog = page.locator(".jp-Dialog")
    try:
        dialog.wait_for(timeout=5_000)
    except timeout_error:
        return
    dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
    dialog.wait_for(state="hidden", timeout=10_000)


def run_cell(page, index: int) -> None:
    """Select a cell by its prompt (command mode) and run it with Shift+Enter."""
    cell = page.locator(".jp-Notebook .jp-Cell").nth(index)
    cell.locator(".jp-InputPrompt").click()
    page.keyboard.press("Shift+Enter")


def dismiss_news(page) -> None:
    """JupyterLab's "get notified about news?" toast covers the page's corner."""
    news = page.locator(".jp-Notification-Toast-Close, .jp-toast-button:has-text('No')")
    if news.count():
        news.first.click()
