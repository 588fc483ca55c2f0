"""Progress shown while the explorer profiles a model, in the notebook cell that builds it."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Generator, Optional

__all__ = ["profile_progress", "in_kernel"]


def in_kernel() -> bool:
    """True inside a Jupyter kernel (where a widget can be shown while the cell still runs).

    Example::

        in_kernel()   # False in a script or under pytest
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


@contextmanager
def profile_progress(what: str = "profiling layers") -> Generator[Optional[Callable[[int, int], None]], None, None]:
    """A ``progress(done, total)`` callback that shows a bar and a count ("profiling layers 12 of 48
    · 1.3 s") under the running cell, removed when the block ends; None outside a kernel.

    Example::

        with profile_progress() as progress:
            table = pipexplore.profile(model, sample, progress=progress)
    """
    if not in_kernel():
        yield None
        return
    import ipywidgets as W
    from IPython.display import display

    bar = W.IntProgress(value=0, min=0, max=1, layout=W.Layout(width="240px"))
    label = W.HTML(f"<span class='pipexplore-note'>{what}…</span>")
    box = W.HBox([bar, label])
    display(box)
    started = time.monotonic()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < 0.1:  # at most ten messages a second
            return
        last[0] = now
        bar.max, bar.value = max(1, total), min(done, total)
        label.value = f"<span class='pipexplore-note'>{what} {done} of {total} · {now - started:.1f} s</span>"

    try:
        yield progress
    finally:
        box.close()
