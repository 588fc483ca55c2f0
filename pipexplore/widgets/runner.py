"""The explorer's runner: real training steps of the current plan, run here (blocking or in the
background, cancellable; a mesh's as the exported script's ranks forked here) or under torchrun, or
loaded from a run recorded elsewhere; each kept in the run log and teaching the plan.

:class:`Runner` is a part the explorer's state has (``state.runner``): it holds what one run in
progress needs (its thread, its cancel token, its action counter, the lock that lets one run at a
time) and reads and changes the rest through the state.

Example::

    state.runner.run()                 # a real step of the current plan; a row in state.runs
    state.runner.run_async()           # the same in a background thread (the page's button)
    state.runner.cancel()
"""
from __future__ import annotations

import math
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import pandas as pd

from pipexplore import timeline as tl
from pipexplore import validate
from pipexplore.cancel import Cancelled, CancelToken, cancel_scope, check_cancelled
from pipexplore.executors.base import RunResult
from pipexplore.executors.step import run_step
from pipexplore.samples import batch_size
from pipexplore.plan import EXECUTORS
from pipexplore.widgets.run_log import refuse_planned, run_summary

if TYPE_CHECKING:  # pragma: no cover
    from pipexplore.widgets.state import ExplorerState

__all__ = ["Runner"]


class Runner:
    """Runs of an explorer's current plan (see the module docstring)."""

    def __init__(self, state: ExplorerState) -> None:
        self.state = state  #: the explorer whose plan runs, and which keeps what the runs give
        self._lock = threading.Lock()  # one run at a time
        self._thread: Optional[threading.Thread] = None
        self._cancel_token: Optional[CancelToken] = None
        #: Actions done per stage by the run in progress (None between runs).
        self.counter: Optional[tl.ActionCounter] = None
        #: Whether a background run is in progress (from :meth:`run_async` until its thread's last word).
        self.running = False

    @property
    def thread(self) -> Optional[threading.Thread]:
        """The latest background run's thread (None before the first)."""
        return self._thread

    def run(self, executor: Optional[str] = None, *, timeout: Optional[float] = None, nodes: int = 1) -> pd.Series:
        """Run a real training step of the current plan (blocking) and add it to :attr:`runs`.

        ``executor``: ``'threads'`` (the schedule executor, in this process), ``'autograd'`` (the
        ``GPipe`` module) or ``'processes'`` (one process per stage); it becomes the plan's.
        ``'torchrun'``: the exported script under ``nodes`` torchrun node agents here (see
        :meth:`run_torchrun`; the plan's executor stays). A plan with a mesh runs by default as the
        exported script's ranks forked here with torchrun's environment (``nodes`` 1: the same
        script and process group without the agent and each rank's imports), or under ``nodes``
        agents where ``nodes`` is more than 1.
        ``timeout`` (seconds, ``'processes'`` and ``'torchrun'``) bounds the step in the worker processes.

        Raises:
            RuntimeError: the plan is for planned devices (catalogue names), which are not here.
            Exception: what the step raised (a bad device, out of memory, a layer, a crashed
                worker); the plan and earlier runs are kept.
            pipexplore.cancel.Cancelled: the run was cancelled; nothing of it is recorded.
        """
        state = self.state
        if executor is not None:
            validate.executor(executor, (*EXECUTORS, "torchrun"))
        refuse_planned(state.plan)
        if executor == "torchrun" or (executor is None and state.plan.mesh is not None):
            # (a mesh's ranks are the exported script's processes: forked here, or under torchrun's agents)
            return self.run_torchrun(nodes=nodes, timeout=timeout, forked=executor is None and nodes == 1)
        if executor is not None and executor != state.plan.executor:
            state.update(executor=executor)
        with self._lock:
            with state.lock:
                plan, number = state.plan, state.log.next_number
            result = run_step(state.model, state.sample, plan, **state.training.keywords(), run=number,
                              timeout=timeout)
            row = {"run": number, **result.row()}
            if plan.schedule == "async-backends":
                row["executor"] = "backends"
            loss = row.get("loss", math.nan)
            row["finite"] = bool(row.get("finite", True)) and isinstance(loss, float) and math.isfinite(loss)
            with state.lock:  # atomic with update(): a plan changed meanwhile is never replaced
                check_cancelled()  # a Cancel that came as the step ended: nothing of it is recorded
                state.log.add(row, result)
                if row["finite"] and state.calibrate and plan.schedule != "async-backends" and state.plan == plan:
                    # Later predictions include the executor's own cost per action, as this run measured it.
                    state.taught(plan.calibrated(result.timeline))
                state.notify("runs")
                state.say(run_summary(row), error=not row["finite"])
        return pd.Series(row)

    def run_async(self, executor: Optional[str] = None, **options: Any) -> threading.Thread:
        """Start :meth:`run` in a background thread (what the button does); returns the thread.
        ``executor`` and ``options`` (``nodes``, ``timeout``) go to :meth:`run`.

        Raises:
            RuntimeError: a run is already in progress, or the plan is for planned devices.
        """
        state = self.state
        refuse_planned(state.plan)
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a run is already in progress")
        self._cancel_token = token = CancelToken()
        self._thread = threading.Thread(target=self._run_in_background, args=(token, executor, options),
                                        name="pipexplore-run", daemon=True)
        self.running = True
        state.say("running a training step…", busy=True)
        self._thread.start()
        return self._thread

    def cancel(self, timeout: float = 60.0) -> bool:
        """Stop the background run: its workers stop after their current action and are joined;
        nothing of it is recorded, the plan and earlier runs are kept. Returns whether a run was
        in progress (and has ended within ``timeout`` seconds)."""
        thread, token = self._thread, self._cancel_token
        if thread is None or token is None or not thread.is_alive():
            return False
        token.cancel()
        thread.join(timeout)
        return not thread.is_alive()

    def _run_in_background(self, token: CancelToken, executor: Optional[str] = None,
                           options: Optional[dict[str, Any]] = None) -> None:
        state = self.state
        try:
            with cancel_scope(token), tl.counting_actions() as counter:
                self.counter = counter
                self.run(executor, **(options or {}))
        except Cancelled:
            state.say("run cancelled: the plan and earlier runs are kept")
        except BaseException as exc:  # shown; the plan and the runs stay
            state.show_error(exc)
        finally:
            with state.lock:
                self.counter = None
                self.running = False
                state.notify("status")

    def run_torchrun(self, nodes: int = 2, *, timeout: Optional[float] = None, forked: bool = False) -> pd.Series:
        """Export the current plan, run it under ``nodes`` torchrun node agents on this machine
        (c10d rendezvous on loopback, gloo; predicted, whatever the plan's executor, with the
        processes executor's own costs, probed once: its ranks are processes), wait with progress on
        the status line (Cancel stops every agent and rank), and load the run as :meth:`load_run`
        does. Returns its row. ``forked``: its ranks forked here with torchrun's environment
        instead (:mod:`pipexplore.runs.forked`; ``nodes`` 1).

        Raises:
            pipexplore.runs.launch.TorchrunError: a rank failed (its rank, host and exit code), or a timeout.
            pipexplore.cancel.Cancelled: cancelled; nothing is recorded.
        """
        state = self.state
        from pipexplore.runs.roundtrip import torchrun_result  # (on first use: it brings in the launcher)

        refuse_planned(state.plan)
        with self._lock:
            with state.lock:
                plan, number = state.plan, state.log.next_number
                if plan.executor != "processes":  # its ranks are processes: predicted with what an action costs them
                    plan = state.with_executor_costs(plan.with_options(executor="processes"))
            state.say(f"exporting the plan for its {plan.mesh_or_pipeline.size} ranks here…" if forked else
                      f"torchrun: exporting the plan for {nodes} node agents…", busy=True)
            result = torchrun_result(state.model, state.sample, plan, nodes=nodes, **state.training.keywords(),
                                     run=number, timeout=timeout, forked=forked,
                                     progress=lambda text: state.say(text, busy=True),
                                     tp_plan=state.tp_plan() if plan.mesh is not None else None)
            return self._keep_loaded(result, number)

    def load_run(self, directory: Any) -> pd.Series:
        """Add a run recorded elsewhere (the exported script's ``--record DIR``) as a row of
        :attr:`runs` (executor ``torchrun``, its nodes, ranks and hosts), its timeline on rank 0's
        clock, predicted again for the plan it ran (rebuilt on this layer table from the one it
        recorded) and teaching the cost model as a local run does. Refused whole (nothing kept)
        when a rank's file is missing, truncated or of another run or plan, or the run is of
        another model (:class:`pipexplore.runs.load.RunDirectoryError`)."""
        state = self.state
        from pipexplore.runs.roundtrip import load_result

        with self._lock:
            with state.lock:
                plan, number = state.plan, state.log.next_number
            _, result = load_result(directory, state.layer_table, plan, samples=batch_size(state.sample), run=number)
            return self._keep_loaded(result, number)

    def _keep_loaded(self, result: RunResult, number: int) -> pd.Series:
        """Keep a run made under torchrun (loaded or launched) as any run; learn from it."""
        state = self.state
        row = {"run": number, **{k: v for k, v in result.row().items() if k != "rank_table"}}
        loss = row.get("loss", math.nan)
        row["finite"] = bool(row.get("finite", True)) and isinstance(loss, float) and math.isfinite(loss)
        with state.lock:
            check_cancelled()
            state.log.add(row, result)
            untaught = result.metrics.get("untaught")
            if row["finite"] and state.calibrate and not untaught:  # what it teaches carries to this explorer's plan
                learnt = result.plan.calibrated(result.timeline).corrections
                state.taught(replace(state.plan, corrections=learnt))
            state.notify("runs")
            state.say(f"{run_summary(row)} · torchrun, {row.get('nodes', '?')} nodes, {row.get('ranks', '?')} ranks "
                     f"({row.get('hosts', '?')}), prediction error {row['prediction_error'] * 100:+.1f} %"
                     + (f" · it teaches the predictions nothing: {untaught}" if untaught and state.calibrate else ""))
        return pd.Series(row)
