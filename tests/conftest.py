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
