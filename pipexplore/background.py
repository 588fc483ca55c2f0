"""Work started in the background ahead of its first use (imports), and waiting for it.

``%load_ext pipexplore`` imports the explorer's modules while the next cell is written, and an
explorer, once the page has drawn it, imports what a run needs (``torch.optim`` and the
pipelining helpers, which bring in ``torch._dynamo``: ~1.5 s on 2 cores). Anything that times
work — a profile, a probe of an executor, a measured step — first waits for these threads: a
layer timed beside an import would hold that import's share of the interpreter.

Example::

    background.start(warm_up, "pipexplore-warm-up")
    background.wait()      # before timing anything
"""
from __future__ import annotations

import threading
from typing import Callable

__all__ = ["start", "wait", "running"]

_lock = threading.Lock()
_started: dict[str, threading.Thread] = {}  # by name: each is started once per process


def start(target: Callable[[], None], name: str) -> threading.Thread:
    """Run ``target`` in a daemon thread called ``name``, once per process (a second call with
    the same name returns the first thread); :func:`wait` waits for it."""
    with _lock:
        if name not in _started:
            _started[name] = threading.Thread(target=target, name=name, daemon=True)
            _started[name].start()
        return _started[name]


def running() -> list[threading.Thread]:
    """The background threads still running."""
    with _lock:
        return [t for t in _started.values() if t.is_alive()]


def wait() -> None:
    """Wait for every background thread started so far (but never for the calling one)."""
    for thread in running():
        if thread is not threading.current_thread():
            thread.join()
