"""Cancelling a run from another thread: a token bound to the thread that runs it."""
from __future__ import annotations

import contextvars
import threading
from contextlib import contextmanager
from typing import Callable, Generator, Optional

__all__ = ["Cancelled", "CancelToken", "cancel_scope", "current_token", "check_cancelled"]


class Cancelled(Exception):
    """The run was cancelled (``Explorer.cancel()``, ``CancelToken.cancel()``) or aborted
    (``ScheduleExecutor.abort()``); its workers are joined, nothing of it is recorded."""


class CancelToken:
    """Set once, from any thread; executors running under :func:`cancel_scope` stop their workers.

    Example::

        token = CancelToken()
        worker = threading.Thread(target=lambda: run_in_scope(token))   # with cancel_scope(token): ...
        token.cancel()           # the run's executor aborts its workers and raises Cancelled
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        """Cancel: every registered callback runs once (abort the workers), now, in this thread."""
        with self._lock:
            self._event.set()
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()

    def check(self) -> None:
        """Raise :class:`Cancelled` when the token is cancelled."""
        if self.cancelled:
            raise Cancelled("the run was cancelled; the plan and earlier runs are kept")

    @contextmanager
    def on_cancel(self, callback: Callable[[], None]) -> Generator[None, None, None]:
        """Call ``callback`` when the token is cancelled while the block runs (at once when it already is)."""
        with self._lock:
            self._callbacks.append(callback)
            already = self._event.is_set()
        if already:
            callback()
        try:
            yield
        finally:
            with self._lock:
                self._callbacks.remove(callback)


_current: contextvars.ContextVar[Optional[CancelToken]] = contextvars.ContextVar("pipexplore_cancel", default=None)


def current_token() -> Optional[CancelToken]:
    """The token of the enclosing :func:`cancel_scope` of this thread, or None."""
    return _current.get()


@contextmanager
def cancel_scope(token: CancelToken) -> Generator[CancelToken, None, None]:
    """Runs in the block (and the worker threads they start) stop when ``token`` is cancelled.

    Example::

        with cancel_scope(token):
            run_step(model, sample, plan)     # raises Cancelled once token.cancel() is called
    """
    reset = _current.set(token)
    try:
        yield token
    finally:
        try:
            _current.reset(reset)
        except ValueError:
            _current.set(None)


def check_cancelled() -> None:
    """Raise :class:`Cancelled` when this thread's run has been cancelled."""
    token = _current.get()
    if token is not None:
        token.check()
