"""Faults and concurrency: layers that raise or go NaN, interrupts, cancel, runs at once; no thread is ever left."""
from __future__ import annotations

import re
import signal
import threading
import time

import pytest
import torch
from torch import nn

from models import Sleep
from pipexplore import GPipe, profile
from pipexplore.cancel import Cancelled
from pipexplore.plan import Plan
from pipexplore.executors.step import run_step
from pipexplore.executors.threads import ScheduleExecutor
from pipexplore.timeline import record
from pipexplore.widgets import explore


def pipexplore_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("pipexplore")}


@pytest.fixture(autouse=True)
def no_thread_left():
    before = pipexplore_threads()
    yield
    assert pipexplore_threads() <= before, "a pipexplore thread was left running"


class Started(nn.Module):
    """Sleeps ``seconds`` per call and counts its calls; ``event`` (a class attribute, so that
    copies share it) is set when a call begins."""

    event = threading.Event()
    calls = 0

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        type(self).calls += 1
        type(self).event.set()
        time.sleep(self.seconds)
        return x * self.scale


@pytest.fixture
def started():
    Started.event.clear()
    Started.calls = 0
    return Started


class RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ArithmeticError("backward blew up in this layer")


class Faulty(nn.Module):
    """Raises in forward, raises in backward, or makes everything NaN, as ``mode`` (a class
    attribute) says; otherwise a linear layer."""

    mode = ""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        if Faulty.mode == "forward":
            raise ArithmeticError("forward blew up in this layer")
        y = self.linear(x)
        if Faulty.mode == "backward":
            return RaisesInBackward.apply(y)
        if Faulty.mode == "nan":
            return y * float("nan")
        return y


@pytest.fixture
def faulty():
    Faulty.mode = ""
    yield Faulty
    Faulty.mode = ""


def faulty_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), Faulty(), nn.Linear(6, 6))


@pytest.fixture(scope="module")
def table4():
    return profile(nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]), torch.randn(8, 6), repeats=1, max_repeats=1,
                   calibrate=False)


# ---- layers that raise or go NaN, in the threads and autograd executors ----------------------

@pytest.mark.parametrize("mode,message", [("forward", "forward blew up in this layer"),
                                          ("backward", "backward blew up in this layer")])
@pytest.mark.parametrize("executor,schedule", [("threads", "gpipe"), ("threads", "1f1b"), ("threads", "zero-bubble"),
                                               ("autograd", "gpipe")])
def test_a_layer_that_raises_fails_the_run_with_its_own_error(table4, faulty, mode, message, executor, schedule):
    faulty.mode = mode
    plan = Plan(table4, (2,), ("cpu", "cpu"), chunks=4, schedule=schedule, executor=executor, batch=8)
    with pytest.raises(ArithmeticError, match=message) as raised:
        run_step(faulty_model(), torch.randn(8, 6), plan, warmup=0, repeats=1)
    if mode == "backward" and schedule == "zero-bubble":
        assert any("input-gradient action (I)" in note for note in getattr(raised.value, "__notes__", []))


@pytest.mark.parametrize("executor,schedule", [("threads", "1f1b"), ("threads", "zero-bubble"), ("autograd", "gpipe")])
def test_a_nan_loss_marks_the_run_not_finite(table4, faulty, executor, schedule):
    plan = Plan(table4, (2,), ("cpu", "cpu"), chunks=4, schedule=schedule, executor=executor, batch=8)
    assert run_step(faulty_model(), torch.randn(8, 6), plan, warmup=0, repeats=1).metrics["finite"] is True
    faulty.mode = "nan"
    assert run_step(faulty_model(), torch.randn(8, 6), plan, warmup=0, repeats=1).metrics["finite"] is False


def test_a_non_finite_run_is_marked_warned_and_never_calibrates(faulty):
    ex = explore(faulty_model(), torch.randn(8, 6), devices=["cpu", "cpu"], splits=[2], chunks=2)
    faulty.mode = "nan"
    plan = ex.plan
    row = ex.run()
    assert row["finite"] is False and ex.runs["finite"].tolist() == [False]
    assert "not finite" in ex.w_status.value and "does not calibrate predictions" in ex.w_status.value
    assert ex.plan is plan  # not calibrated
    assert "⚠ no" in ex.w_runs.value
    faulty.mode = ""
    assert ex.run()["finite"] is True
    assert ex.plan is not plan and ex.plan.corrections.runs == plan.corrections.runs + 1  # a finite run calibrates
    assert ex.runs["finite"].tolist() == [False, True]


# ---- interrupts, abort and cancel ---------------------------------------------------------

def _interrupt_main_thread_once_started(event: threading.Event) -> threading.Thread:
    def send() -> None:
        if event.wait(30):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    thread = threading.Thread(target=send, name="test-interrupter", daemon=True)
    thread.start()
    return thread


def test_keyboard_interrupt_in_the_schedule_executor_stops_and_joins_the_workers(started, ctrl_c_raises):
    # (32 micro-batches through layers of 0.2 s, as for GPipe below: the forwards alone take ~6.6 s, so
    # a loaded machine may delay the interrupt (by 1.6 s once, on a fresh clone), not past them all;
    # an interrupt on time stops the step within a layer)
    layers = nn.Sequential(started(0.2), started(0.2))
    executor = ScheduleExecutor(layers, [1, 1], devices=["cpu", "cpu"], chunks=32, schedule="1f1b")
    sender = _interrupt_main_thread_once_started(started.event)
    with pytest.raises(KeyboardInterrupt):
        executor.step(torch.ones(32, 1))
    sender.join()
    assert started.calls < 64  # the rest of the step did not run: every worker stopped and was joined
    Started.calls = 0
    for layer in layers:
        layer.seconds = 0.0
    executor.step(torch.ones(32, 1))  # and the executor still works: the whole step
    assert started.calls >= 64


def test_keyboard_interrupt_in_gpipe_joins_its_workers(started, ctrl_c_raises):
    # (layers of 0.2 s: the 64 forwards take ~6.6 s, so a busy machine may delay the interrupt without
    # letting every forward finish before it lands: with 16 forwards of ~1.6 s, a fresh clone's run
    # under load once saw all 16 start first)
    pipe = GPipe(nn.Sequential(started(0.2), started(0.2)), balance=[1, 1], devices=["cpu", "cpu"], chunks=32)
    sender = _interrupt_main_thread_once_started(started.event)
    with pytest.raises(KeyboardInterrupt):
        pipe(torch.ones(32, 1, requires_grad=True)).sum().backward()
    sender.join()
    assert started.calls < 64


class TakesTheInterrupt(Started):
    """On its first call, the worker thread running it takes a SIGINT (as any thread may take a
    Ctrl+C sent to the process): Python raises it in the main thread when that thread next runs."""

    def forward(self, x):
        if type(self).calls == 0:
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        return super().forward(x)


@pytest.mark.parametrize("executor", ["schedule", "gpipe"])
def test_an_interrupt_a_worker_thread_takes_stops_the_step(started, ctrl_c_raises, executor):
    # (before: the caller waited without a timeout, which the signal did not wake, so it was raised
    # only once the step was over: every one of the 64 forwards ran)
    TakesTheInterrupt.calls = 0
    layers = nn.Sequential(TakesTheInterrupt(0.2), TakesTheInterrupt(0.2))
    with pytest.raises(KeyboardInterrupt):
        if executor == "schedule":
            ScheduleExecutor(layers, [1, 1], devices=["cpu", "cpu"], chunks=32, schedule="1f1b").step(torch.ones(32, 1))
        else:
            pipe = GPipe(layers, balance=[1, 1], devices=["cpu", "cpu"], chunks=32)
            pipe(torch.ones(32, 1, requires_grad=True)).sum().backward()
    assert TakesTheInterrupt.calls < 8  # stopped within a layer or two, every worker joined


def test_abort_mid_step_joins_every_worker(started):
    # (32 micro-batches through layers of 0.05 s: ~1.7 s of forwards, a margin for a loaded machine)
    layers = nn.Sequential(started(0.05), started(0.05), started(0.05))
    executor = ScheduleExecutor(layers, [1, 1, 1], devices=["cpu"] * 3, chunks=32, schedule="gpipe")
    aborter = threading.Thread(target=lambda: started.event.wait(30) and executor.abort(), name="test-aborter")
    aborter.start()
    with pytest.raises(Cancelled, match=r"the step was aborted \(executor.abort\(\) or a cancelled run\)"):
        executor.step(torch.ones(32, 1))
    aborter.join()
    assert started.calls < 96
    for layer in layers:
        layer.seconds = 0.0
    assert executor.step(torch.ones(32, 1)).losses  # a later step runs whole


def test_cancel_stops_a_background_run_and_keeps_plan_and_runs(table4, started):
    model = nn.Sequential(*[started(0.03) for _ in range(4)])
    ex = explore(model, torch.ones(8, 6), devices=["cpu", "cpu"], splits=[2], chunks=4, layer_table=table4,
                 calibrate=False)
    assert ex.cancel() is False  # nothing to cancel
    ex.run()
    plan, runs = ex.plan, ex.runs.copy()
    started.event.clear()
    thread = ex.run_async()
    assert started.event.wait(30)
    assert ex.cancel() is True
    assert not thread.is_alive()
    assert ex.plan is plan and ex.runs.equals(runs)
    assert "run cancelled: the plan and earlier runs are kept" in ex.w_status.value
    assert not ex.w_run.disabled
    assert ex.run()["run"] == 1  # the explorer goes on


# ---- a session's memory ------------------------------------------------------------------

def test_summary_rows_for_every_run_timelines_for_the_last_few(table4, monkeypatch):
    import pipexplore.widgets.panels.runs as runs_panel

    monkeypatch.setattr(runs_panel, "RUNS_SHOWN", 2)
    ex = explore(nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]), torch.randn(8, 6), devices=["cpu", "cpu"],
                 splits=[2], chunks=2, layer_table=table4, calibrate=False, keep_timelines=2)
    for _ in range(3):
        ex.run()
    assert ex.runs["run"].tolist() == [0, 1, 2]
    assert set(ex.timeline("measured")["run"]) == {2}
    assert set(ex.timeline("measured", run=1)["run"]) == {1}
    with pytest.raises(LookupError, match=r"run 0's timeline is not kept: the explorer keeps the last 2"):
        ex.timeline("measured", run=0)
    # The runs view shows the latest rows, each formatted once, and says where the others are.
    assert ex.w_runs.value.count("<tr>") == 1 + 2 and re.search(r"\b1 earlier .*explorer\.runs", ex.w_runs.value)
    ex.clear_runs()
    assert ex.runs.empty and "no runs yet" in ex.w_runs.value
    with pytest.raises(LookupError, match="no run yet"):
        ex.timeline("measured")
    assert ex.run()["run"] == 3  # run numbers stay unique within the session


def test_no_timeline_kept_when_keep_timelines_is_zero(table4):
    ex = explore(nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]), torch.randn(8, 6), devices=["cpu", "cpu"],
                 splits=[2], chunks=2, layer_table=table4, calibrate=False, keep_timelines=0)
    ex.run()
    assert len(ex.runs) == 1
    with pytest.raises(LookupError, match=r"no timeline is kept \(keep_timelines=0\)"):
        ex.timeline("measured")


# ---- concurrency: what a run records is its own work only ----------------------------------

def _forward_rows(timeline):
    return timeline[timeline["phase"] == "forward"]


def test_two_explorers_running_at_once_each_record_their_own_rows(table4):
    table6 = profile(nn.Sequential(*[nn.Linear(6, 6) for _ in range(6)]), torch.randn(8, 6), repeats=1, max_repeats=1,
                     calibrate=False)
    first = explore(nn.Sequential(*[Sleep(0.004) for _ in range(4)]), torch.ones(8, 6), devices=["cpu", "cpu"],
                    splits=[2], chunks=2, layer_table=table4, calibrate=False)
    second = explore(nn.Sequential(*[Sleep(0.004) for _ in range(6)]), torch.ones(8, 6), devices=["cpu"] * 3,
                     splits=[2, 4], chunks=4, layer_table=table6, calibrate=False)
    threads = [first.run_async(), second.run_async()]
    for thread in threads:
        thread.join(60)
    for ex, stages, chunks in ((first, 2, 2), (second, 3, 4)):
        assert len(ex.runs) == 1, ex.w_status.value
        forward = _forward_rows(ex.timeline("measured"))
        assert len(forward) == stages * chunks
        assert set(forward["stage"]) == set(range(stages)) and set(forward["microbatch"]) == set(range(chunks))


def test_a_users_gpipe_during_a_background_run_is_not_in_the_runs_timeline(table4):
    ex = explore(nn.Sequential(*[Sleep(0.01) for _ in range(4)]), torch.ones(8, 6), devices=["cpu", "cpu"],
                 splits=[2], chunks=2, layer_table=table4, calibrate=False)
    users = GPipe(nn.Sequential(*[nn.Linear(6, 6) for _ in range(6)]), balance=[1] * 6, devices=["cpu"] * 6, chunks=8)
    thread = ex.run_async()
    own_runs = 0
    while thread.is_alive() or own_runs == 0:
        users(torch.randn(16, 6)).sum().backward()  # unrecorded
        with record() as rec:  # recorded by the user: the user's work only
            users(torch.randn(16, 6)).sum().backward()
        assert set(rec.timeline["stage"]) == set(range(6)) and len(_forward_rows(rec.timeline)) == 6 * 8
        own_runs += 1
    thread.join()
    forward = _forward_rows(ex.timeline("measured"))
    assert len(ex.runs) == 1 and len(forward) == 2 * 2
    assert set(ex.timeline("measured")["stage"]) == {0, 1}
    assert set(ex.timeline("measured")["microbatch"]) == {0, 1, -1}  # -1: each stage's optimizer step


def test_update_racing_a_finishing_run_is_never_undone(table4, monkeypatch):
    ex = explore(nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]), torch.randn(8, 6), devices=["cpu", "cpu"],
                 splits=[2], chunks=4, layer_table=table4)
    calibrated = Plan.calibrated
    updaters = []

    def calibrated_while_the_user_updates(plan, measured):
        # The user changes the plan while the run installs its calibration: the change waits for
        # the run to finish (one lock), or, done first, is kept (the run sees the plan changed).
        updater = threading.Thread(target=lambda: ex.update(chunks=2), name="test-updater")
        updater.start()
        updater.join(0.3)
        updaters.append(updater)
        return calibrated(plan, measured)

    monkeypatch.setattr(Plan, "calibrated", calibrated_while_the_user_updates)
    ex.run()
    for updater in updaters:
        updater.join(30)
    assert len(updaters) == 1 and ex.plan.chunks == 2
    assert ex.plan.corrections.runs == 1  # the run's calibration is there too, under the user's change
