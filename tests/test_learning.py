"""What runs teach the cost model beyond each action's seconds: the hand-over that reproduces a
threads or processes run's step, and later runs averaged with the earlier ones (simulated timelines: exact)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from pipexplore.predict.costs import LEARNING_MEMORY, Corrections, handoff_gaps
from pipexplore.plan import Plan
from pipexplore.timeline import step_time


def _table(n: int = 8) -> pd.DataFrame:
    costs = np.full(n, 1e-3)
    table = pd.DataFrame({"name": [str(k) for k in range(n)], "forward": costs, "backward": 2 * costs,
                          "output_bytes": 0.0, "param_bytes": 8.0, "share_forward": 1.0, "share_backward": 1.0})
    table.attrs["batch"] = 8
    return table


def _plan(executor: str = "processes", splits=(2, 4, 6), transfer: float = 1e-4) -> Plan:
    devices = ("cpu",) * (len(splits) + 1)
    costs = Corrections().with_executor_costs(executor, 0.0, 0.0, transfer)
    schedule = "gpipe" if executor == "autograd" else "1f1b"  # (the GPipe module runs gpipe only)
    return Plan(_table(), splits=tuple(splits), devices=devices, chunks=4, schedule=schedule, executor=executor,
                batch=8, corrections=costs)


def _with_scales(corrections: Corrections, scales: dict) -> Corrections:
    """``corrections`` with layers costing ``scales[(executor, phase)]`` times their profile."""
    return replace(corrections, scales={**corrections.scales, **scales})


def _stalled(plan: Plan, at: float, stall: float) -> pd.DataFrame:
    """``plan``'s predicted step with one stall: everything from ``at`` on ``stall`` seconds later
    (a rank woken late by one send). Every action keeps its seconds and the median hand-over
    hardly moves; only the step says where the time went."""
    timeline = plan.predicted.copy()
    later = timeline["start"] >= at
    timeline.loc[later, ["start", "end"]] += stall
    return timeline


def test_a_processes_run_is_predicted_again_at_its_step_through_the_hand_over():
    plan = _plan()
    measured = _stalled(plan, at=0.3 * step_time(plan.predicted), stall=5e-3)
    median = handoff_gaps(measured)[1]
    assert median == pytest.approx(1e-4, abs=1e-6)  # what the hand-overs' median says: no stall
    learnt = plan.calibrated(measured)
    assert step_time(learnt.predicted) == pytest.approx(step_time(measured), rel=1e-3)
    assert learnt.corrections.transfer("processes") > 1e-4  # the stall, spread over the critical path
    # Threads too: a worker woken late (the other stages hold the cores, or the interpreter's
    # lock) waits beyond the median hand-over, and the run is predicted again at its step.
    threads = _plan("threads")
    stalled = _stalled(threads, at=0.3 * step_time(threads.predicted), stall=5e-3)
    assert handoff_gaps(stalled)[1] == pytest.approx(1e-4, abs=1e-6)
    taught = threads.calibrated(stalled)
    assert step_time(taught.predicted) == pytest.approx(step_time(stalled), rel=1e-3)
    assert taught.corrections.transfer("threads") > 1e-4
    # The GPipe module's (autograd's) hand-overs are the autograd engine's: their median is taken as it is.
    autograd = _plan("autograd")
    kept = autograd.calibrated(_stalled(autograd, at=0.3 * step_time(autograd.predicted), stall=5e-3))
    assert kept.corrections.transfer("autograd") == pytest.approx(1e-4, abs=1e-6)


def test_the_hand_over_is_found_where_it_was_and_left_where_the_step_has_no_hand_over():
    plan = _plan()
    truth = plan.with_options(corrections=plan.corrections.with_executor_costs("processes", 0.0, 0.0, 1.7e-3))
    found = plan.corrections.step_fitted("processes", lambda c: plan.with_options(corrections=c).predict(),
                                         truth.predicted)
    assert found.transfer("processes") == pytest.approx(1.7e-3, rel=1e-3)
    # a shorter step: the hand-over shrinks, never below zero
    shorter = _plan(transfer=2e-3).corrections.step_fitted(
        "processes", lambda c: plan.with_options(corrections=c).predict(), plan.predicted)
    assert shorter.transfer("processes") == pytest.approx(1e-4, rel=1e-3)
    one = _plan(splits=())
    longer = _stalled(one, at=0.0, stall=0.0).assign(end=lambda t: t["end"] * 1.5)
    same = one.corrections.step_fitted("processes", lambda c: one.with_options(corrections=c).predict(), longer)
    assert same.transfer("processes") == 1e-4  # one stage: no hand-over to put a step's time on


def test_a_later_run_is_averaged_with_what_the_runs_before_taught():
    plan = _plan("threads")

    def slower(factor: float) -> pd.DataFrame:  # a run where every layer costs ``factor`` times its profile
        scales = {("threads", phase): np.full(8, factor) for phase in ("forward", "backward")}
        return plan.with_options(corrections=_with_scales(plan.corrections, scales)).predicted

    first = plan.calibrated(slower(2.0))
    assert first.corrections.counts == {"threads": 1}
    assert first.corrections.scale("threads", "forward") == pytest.approx(np.full(8, 2.0), rel=1e-2)  # as it ran
    second = first.calibrated(slower(1.0))  # weighs a half: the geometric mean of 2 and 1
    assert second.corrections.scale("threads", "forward") == pytest.approx(np.full(8, 2 ** 0.5), rel=1e-2)
    third = second.calibrated(slower(1.0))  # from the third on, a third
    assert LEARNING_MEMORY == 3 and third.corrections.counts == {"threads": 3}
    assert third.corrections.scale("threads", "forward") == pytest.approx(np.full(8, 2 ** (0.5 * 2 / 3)), rel=1e-2)
    assert third.corrections.runs == 3
    # Another executor's first run is its own first: taken as it is, whatever the threads' runs taught.
    processes = _plan("processes").with_options(corrections=third.corrections.with_executor_costs(
        "processes", 0.0, 0.0, 1e-4))
    scales = {("processes", phase): np.full(8, 3.0) for phase in ("forward", "backward")}
    ran = processes.with_options(corrections=_with_scales(processes.corrections, scales)).predicted
    taught = processes.calibrated(ran).corrections
    assert taught.scale("processes", "forward") == pytest.approx(np.full(8, 3.0), rel=1e-2)
    assert taught.counts == {"threads": 3, "processes": 1}
