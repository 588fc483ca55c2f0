from __future__ import annotations

import os
import signal
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def ctrl_c_raises():
    """Ctrl+C raises KeyboardInterrupt in the main thread, as in an interactive Python, whatever
    this process inherited (a shell without job control starts background jobs with SIGINT
    ignored, and Python then keeps it ignored)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _nothing_left_at_the_end():
    """The fork server outlives a module's pools (each module stops its ranks: ``ranks.py``); at
    the session's end it is stopped, and no rank or server of ours may still run."""
    yield
    from pipexplore.executors.pool import shutdown_pool
    from ranks import fork_server_left, worker_children

    shutdown_pool()
    assert worker_children() == [] and fork_server_left() == []
