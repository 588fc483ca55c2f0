"""How the suite shares two workers (``pytest -n 2 --dist loadfile``, see scripts/test.sh).

A file's tests run together in one worker, in order: a notebook's cells run in one kernel, the
browser tests share one JupyterLab, the worker-process tests one warm pool of rank processes,
other files their module fixtures. The files are handed out longest first, so that no long file
starts when the other worker is about to run out of work.
"""
from __future__ import annotations

import pytest

#: The longest files first (their seconds on 2 cores, in two workers); the others follow in their order.
LONGEST_FIRST = ("test_jupyterlab.py", "test_hf.py", "test_distributed.py", "test_trace_processes.py",
                 "test_distributed_faults.py", "04_beyond_sequential.ipynb", "test_trace.py", "test_explorer.py",
                 "03_schedules.ipynb", "test_explorer_page.py", "02_skip_connections.ipynb", "test_faults.py",
                 "05_expert_backends.ipynb", "01_quickstart.ipynb")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: a file keeps its order

