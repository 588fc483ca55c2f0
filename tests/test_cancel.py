"""Cancel and Ctrl+C stop every executor fast and leave nothing behind; the loss a run reports.

Cancel (``Explorer.cancel()``, a :class:`~pipexplore.cancel.CancelToken`) stops worker threads
(the schedule executor on an ``nn.Sequential``, the traced executor on any model) within 1 s and
worker processes within 3 s, on layers that take seconds a step; nothing of the run is recorded,
no thread or process of it is left. A KeyboardInterrupt gets the same cleanup. A run's ``loss`` is
its first step's: the unsplit model's loss at the same weights, for every executor.
"""
from __future__ import annotations

import copy
import pathlib
import signal
import threading
import time

import psutil
import pytest
import torch
from torch import Tensor, nn

from pipexplore import profile
from pipexplore.models import trace
from pipexplore.cancel import Cancelled, CancelToken, cancel_scope
from pipexplore.executors.distributed import shutdown_pool
from pipexplore.executors.pool import fork_server_pid
from pipexplore.executors.step import run_step
from pipexplore.plan import Plan
from pipexplore.widgets import explore

# The cancel tests measure time (bounds in seconds): they run alone, not beside other tests (scripts/test.sh).
timing = pytest.mark.timing

#: Seconds each slow layer sleeps per call: a stage of two is busy 0.3 s per action, so a step of
#: 4 micro-batches on 2 stages takes 1.5 s or more, and a run (1 warm-up + 3 measured steps) seconds.
LAYER_SECONDS = 0.15
#: How soon a cancel or interrupt must have stopped everything: threads (the current action,
#: 0.3 s, then a join), processes (terminate, then kill after 1 s).
THREADS_BOUND, PROCESSES_BOUND = 1.0, 3.0
#: Set when a slow layer starts (in this process).
STARTED = threading.Event()


def run_threads() -> set[str]:
    """The threads of a run: the explorer's background run and every executor's workers."""
    return {t.name for t in threading.enumerate()
            if t.name.startswith(("pipexplore-run", "pipexplore-worker", "pipexplore-traced"))}


def pool_workers() -> list[psutil.Process]:
    """This process's worker processes that are still running (the fork server, an idle spare that
    outlives a discarded pool until ``shutdown_pool``, is not one; a rank it forked is)."""
    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and p.pid != fork_server_pid()]


@pytest.fixture(autouse=True)
def nothing_left_running():
    STARTED.clear()
    shutdown_pool(keep_server=True)  # a warm pool an earlier test left (its ranks would count as left by this test)
    before = run_threads()
    yield
    assert run_threads() <= before, f"threads left running: {run_threads() - before}"
    assert pool_workers() == [], "worker processes left running"


class Slow(nn.Module):
    """Sleeps ``seconds`` per call and says it started: ``STARTED`` here, the file ``mark`` in a worker process."""

    def __init__(self, seconds: float, mark: str = "") -> None:
        super().__init__()
        self.seconds, self.mark = seconds, mark
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        STARTED.set()
        if self.mark:
            pathlib.Path(self.mark).touch()
        time.sleep(self.seconds)
        return x * self.scale


def slow_sequential(seconds: float = LAYER_SECONDS, mark: str = "") -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 6), Slow(seconds, mark), Slow(seconds, mark), nn.Linear(6, 6))


@torch.library.custom_op("pipexplore_tests::slow", mutates_args=())
def slow_op(x: Tensor, seconds: float) -> Tensor:
    """Sleeps ``seconds`` (an op, so that it stays in the graph torch's tracer makes)."""
    STARTED.set()
    time.sleep(seconds)
    return x.clone()


@slow_op.register_fake
def _(x: Tensor, seconds: float) -> Tensor:
    return torch.empty_like(x)


slow_op.register_autograd(lambda ctx, grad: (grad, None))


class SlowNet(nn.Module):
    """Not an ``nn.Sequential``: blocks in a ModuleList, each a linear layer then a sleep of ``seconds``."""

    def __init__(self, seconds: float = LAYER_SECONDS, depth: int = 4) -> None:
        super().__init__()
        self.seconds = seconds
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = slow_op(torch.tanh(block(x)), self.seconds) if self.seconds else torch.tanh(block(x))
        return x


@pytest.fixture(scope="module")
def sequential_table():
    return profile(slow_sequential(0.0), torch.randn(8, 6), repeats=1, max_repeats=1, calibrate=False)


@pytest.fixture(scope="module")
def traced_table():
    return trace.candidates(SlowNet(0.0), torch.randn(8, 6), repeats=1)


def _cancel_through_the_explorer(ex, started, bound: float) -> float:
    """Start a run, cancel it once ``started()``; assert nothing is recorded; the seconds cancel took."""
    plan, runs = ex.plan, ex.runs.copy()
    thread = ex.run_async()
    deadline = time.monotonic() + 120
    while not started():
        assert thread.is_alive() and time.monotonic() < deadline, "the run never started its layers"
        time.sleep(0.01)
    time.sleep(0.1)  # well inside the run: a step takes seconds
    assert thread.is_alive()
    begun = time.perf_counter()
    assert ex.cancel(timeout=30) is True
    took = time.perf_counter() - begun
    assert not thread.is_alive()
    assert "run cancelled" in ex.state.status.text, ex.state.status.text  # Cancelled, not another error
    assert ex.plan is plan and ex.runs.equals(runs)  # nothing recorded, the plan kept
    assert took < bound, f"cancel took {took:.2f} s (bound {bound} s)"
    return took


# ---- cancel ------------------------------------------------------------------------------

@timing
def test_cancel_stops_the_threads_executor_within_a_second(sequential_table):
    ex = explore(slow_sequential(), torch.randn(8, 6), devices=["cpu", "cpu"], splits=[2], chunks=4,
                 schedule="1f1b", layer_table=sequential_table, calibrate=False)
    _cancel_through_the_explorer(ex, STARTED.is_set, THREADS_BOUND)


@timing
def test_cancel_stops_the_traced_executor_within_a_second(traced_table):
    ex = explore(SlowNet(), torch.randn(8, 6), devices=["cpu", "cpu"], splits=[2], chunks=4, schedule="1f1b",
                 layer_table=traced_table, calibrate=False)
    assert ex.traced and ex.plan.executor == "threads"
    _cancel_through_the_explorer(ex, STARTED.is_set, THREADS_BOUND)


@timing
@pytest.mark.slow
def test_cancel_stops_the_processes_executor_within_three_seconds(sequential_table, tmp_path):
    shutdown_pool(keep_server=True)
    mark = tmp_path / "started"
    ex = explore(slow_sequential(mark=str(mark)), torch.randn(8, 6), devices=["cpu", "cpu"], splits=[2], chunks=4,
                 schedule="1f1b", layer_table=sequential_table, calibrate=False, executor="processes")
    _cancel_through_the_explorer(ex, mark.exists, PROCESSES_BOUND)  # and (fixture) every rank is reaped


@pytest.mark.parametrize("executor", ["threads", "traced"])
def test_a_cancelled_token_raises_cancelled_from_run_step(executor, sequential_table, traced_table):
    model, table = (slow_sequential(), sequential_table) if executor == "threads" else (SlowNet(), traced_table)
    plan = Plan(table, (2,), ("cpu", "cpu"), chunks=4, schedule="1f1b", batch=8)
    token = CancelToken()
    cancelled_at: list[float] = []

    def cancel() -> None:
        if STARTED.wait(60):
            cancelled_at.append(time.perf_counter())
            token.cancel()

    canceller = threading.Thread(target=cancel, name="test-canceller")
    canceller.start()
    with pytest.raises(Cancelled), cancel_scope(token):
        run_step(model, torch.randn(8, 6), plan, warmup=1, repeats=3)
    canceller.join()
    # from the cancel, not from the start (which holds the step's start-up, beside the other workers)
    assert cancelled_at and time.perf_counter() - cancelled_at[0] < 1.5 + THREADS_BOUND  # a whole run takes 6 s


# ---- Ctrl+C --------------------------------------------------------------------------------

@timing
@pytest.mark.parametrize("executor", ["threads", "traced"])
def test_keyboard_interrupt_stops_run_step_and_joins_every_worker(executor, sequential_table, traced_table,
                                                                 ctrl_c_raises):
    model, table = (slow_sequential(), sequential_table) if executor == "threads" else (SlowNet(), traced_table)
    plan = Plan(table, (2,), ("cpu", "cpu"), chunks=4, schedule="1f1b", batch=8)
    sent: list[float] = []

    def interrupt() -> None:
        if STARTED.wait(60):
            time.sleep(0.1)
            sent.append(time.perf_counter())
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    sender = threading.Thread(target=interrupt, name="test-interrupter", daemon=True)
    sender.start()
    with pytest.raises(KeyboardInterrupt):
        run_step(model, torch.randn(8, 6), plan, warmup=1, repeats=3)
    took = time.perf_counter() - sent[0]
    sender.join()
    assert took < THREADS_BOUND, f"the interrupt took {took:.2f} s to stop the step"
    # (fixture) no worker thread is left: they were stopped and joined before the interrupt propagated


# ---- repeats and the reported loss -----------------------------------------------------------

def test_repeats_are_honoured_for_traced_models(traced_table, monkeypatch):
    from pipexplore.executors.traced import TracedExecutor

    steps = []
    original = TracedExecutor.step
    monkeypatch.setattr(TracedExecutor, "step", lambda self, *a, **k: steps.append(1) or original(self, *a, **k))
    plan = Plan(traced_table, (2,), ("cpu", "cpu"), chunks=2, schedule="1f1b", batch=8)
    result = run_step(SlowNet(0.0), torch.randn(8, 6), plan, warmup=1, repeats=5)
    assert len(steps) == 1 + 5 and len(result.measured_losses) == 5
    # the timeline of one step (the median's): its micro-batches, and each stage's optimizer step (-1)
    assert set(result.timeline["microbatch"]) == {0, 1, -1}


def _reference_losses(model: nn.Module, x: Tensor, target: Tensor, steps: int) -> list[float]:
    """The unsplit model's loss before each of ``steps`` SGD steps (lr 0.01, as the executors' default)."""
    model = copy.deepcopy(model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        sgd.zero_grad()
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("executor,schedule,chunks", [("threads", "1f1b", 4), ("threads", "zero-bubble", 4),
                                                      ("autograd", "gpipe", 4),
                                                      pytest.param("processes", "1f1b", 4, marks=pytest.mark.slow),
                                                      ("threads", "async-backends", 1)])
def test_the_loss_is_the_first_steps_the_unsplit_models_at_the_same_weights(executor, schedule, chunks,
                                                                              sequential_table):
    torch.manual_seed(0)
    model = slow_sequential(0.0)
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    plan = Plan(sequential_table, (2,), ("cpu", "cpu"), chunks=chunks, schedule=schedule, executor=executor, batch=8)
    result = run_step(model, x, plan, target=target, loss_fn=nn.functional.mse_loss, warmup=1, repeats=2)
    expected = _reference_losses(model, x, target, 3)
    assert expected[1] != pytest.approx(expected[0], rel=1e-6)  # one SGD step changes it: the test can tell
    assert result.loss == pytest.approx(expected[0], rel=1e-5)
    assert result.row()["loss"] == result.loss and result.metrics["measured_losses"] == result.measured_losses
    if executor != "threads" or schedule != "async-backends":  # processes too: warm-up + 2 steps in the ranks
        assert result.measured_losses == pytest.approx(expected[1:3], rel=1e-5)
    if executor == "processes":
        shutdown_pool(keep_server=True)


def test_the_traced_loss_is_the_first_steps_too(traced_table):
    torch.manual_seed(0)
    model = SlowNet(0.0)
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    plan = Plan(traced_table, (2,), ("cpu", "cpu"), chunks=4, schedule="1f1b", batch=8)
    result = run_step(model, x, plan, target=target, loss_fn=nn.functional.mse_loss, warmup=1, repeats=2)
    expected = _reference_losses(model, x, target, 3)
    assert result.loss == pytest.approx(expected[0], rel=1e-5)
    assert result.measured_losses == pytest.approx(expected[1:3], rel=1e-5)
