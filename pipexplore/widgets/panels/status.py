"""The header (the figures that decide a split), the notes, the status line, and the progress of
a run in the background."""
from __future__ import annotations

import asyncio
import html
import time

import ipywidgets as W
import pandas as pd

from pipexplore import timeline as tl
from pipexplore.samples import batch_size
from pipexplore.widgets.header import header_html, plan_text
from pipexplore.widgets.state import ExplorerState

__all__ = ["StatusPanel", "header_of", "notes_html", "actions_per_stage"]

TICK_SECONDS = 0.25


def header_of(state: ExplorerState) -> str:
    """The header's HTML: the model and plan, predicted figures, and the last run against them."""
    title = f"{len(state.layer_table)} layers · batch {batch_size(state.sample)} · {plan_text(state.plan)}"
    rows = state.log.rows()
    plan = state.plan
    planned = (f"{len(set(plan.devices))} × {plan.devices[0].split(':')[0]} on {plan.nodes} node"
               f"{'s' if plan.nodes > 1 else ''}") if plan.planned else ""
    return header_html(title, state.figures(), rows[-1] if rows else None, state.memory_cap, planned)


def notes_html(state: ExplorerState) -> str:
    """The state's notes, one line each."""
    return "".join(f"<div class='pipexplore-note'>{html.escape(n)}</div>" for n in state.all_notes())


def actions_per_stage(predicted: pd.DataFrame, steps: int) -> dict[int, int]:
    """The compute actions each stage does in ``steps`` steps of a plan, from its prediction."""
    compute = predicted[predicted["phase"].isin(tl.COMPUTE_PHASES)]
    return {int(s): int(n) * steps for s, n in compute.groupby("stage").size().items()}


class StatusPanel:
    """Header, notes and status line; while a run is in the background, a bar and the actions done."""

    def __init__(self, state: ExplorerState) -> None:
        self.state = state
        self.w_header = W.HTML(header_of(state))
        self.w_status = W.HTML(notes_html(state))
        self.w_progress = W.FloatProgress(value=0.0, min=0.0, max=1.0, layout=W.Layout(width="160px", display="none"))
        self.box = W.HBox([self.w_progress, self.w_status])
        self._ticking = False

    def refresh(self, change: str) -> None:
        if change in ("plan", "runs", "shown"):
            self.w_header.value = header_of(self.state)
        if change in ("plan", "status"):
            self._show_status()
        if change == "status":
            if self.state.runner.running and not self._ticking:
                self._start_ticking()
            elif not self.state.runner.running:
                self.w_progress.layout.display = "none"

    def _show_status(self, progress: str = "") -> None:
        """The notes and the status line; ``progress`` follows a busy status's text (a run's time and actions)."""
        status = self.state.status
        spinner = ("<span class='pipexplore-spinner' role='progressbar' aria-label='working'></span>"
                   if status.busy else "")
        css = "pipexplore-status" + (" pipexplore-error-text" if status.error else "")
        text = notes_html(self.state) + f"<div class='{css}'>{spinner}{html.escape(status.text + progress)}</div>"
        if status.traceback:
            text += f"<details><summary>traceback</summary><pre>{html.escape(status.traceback)}</pre></details>"
        self.w_status.value = text

    def _start_ticking(self) -> None:
        """A tick every 0.25 s on the kernel's loop while the run lasts: time against the
        predicted during the warm-up, then the actions each stage has done."""
        state = self.state
        self.w_progress.value = 0.0
        self.w_progress.layout.display = ""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a script): the status line alone
            return
        self._ticking = True
        started = time.monotonic()
        expected = max(1e-3, 4 * tl.step_time(state.plan.predicted))  # 1 warm-up + 3 measured steps
        per_stage = actions_per_stage(state.plan.predicted, steps=3)

        def tick() -> None:
            if not state.runner.running:
                self._ticking = False
                return
            elapsed = time.monotonic() - started
            counter = state.runner.counter
            done = counter.done() if counter is not None else {}
            total = sum(per_stage.values())
            if done and total:  # the measured steps' actions, as the stages do them
                self.w_progress.value = min(0.99, sum(done.values()) / total)
                detail = " · ".join(f"stage {s}: {done.get(s, 0)}/{n}" for s, n in sorted(per_stage.items()))
                detail = f"measured steps, actions done: {detail}"
            else:  # the warm-up step (or a process per stage, which reports at the end)
                self.w_progress.value = min(0.95, elapsed / (expected + 0.5))
                detail = f"1 warm-up + 3 measured steps, predicted {expected:.2f} s"
            with state.lock:
                if state.status.busy:  # not once the run has said its last word
                    self._show_status(f" {elapsed:.1f} s ({detail})")
            loop.call_later(TICK_SECONDS, tick)

        loop.call_later(TICK_SECONDS, tick)
