"""The schedule executor: gradients equal a plain step; measured bubbles equal the theory."""
from __future__ import annotations

import copy
import threading

import pandas as pd
import pytest
import torch
from torch import nn

from models import SleepFIW, plain_model, unet_model
from pipexplore import timeline as tl
from pipexplore.executors.threads import ScheduleExecutor
from pipexplore.predict.simulator import simulate

BALANCES = {  # (balance, devices) per stage count; interleaved spreads them over 2 devices
    "plain": {1: [8], 2: [4, 4], 3: [3, 3, 2], 4: [1, 2, 3, 2]},
    "unet": {1: [9], 2: [4, 5], 3: [2, 6, 1], 4: [1, 3, 3, 2]},
}


def _reference(model, x, target):
    ref = copy.deepcopy(model)
    loss = nn.functional.mse_loss(ref(x), target)
    loss.backward()
    return loss.item(), [p.grad for p in ref.parameters()]


#: (schedule, chunks, stages): every combination a schedule can run. Interleaved spreads the
#: stages over 2 devices, so it needs an even stage count and even chunks.
STEPS = [(schedule, chunks, stages) for schedule in ("gpipe", "1f1b", "zero-bubble", "interleaved")
         for chunks in (1, 3, 8) for stages in (1, 2, 3, 4)
         if schedule != "interleaved" or (stages % 2 == 0 and chunks % 2 == 0)]


@pytest.mark.parametrize("kind", ["plain", "unet"])
@pytest.mark.parametrize("schedule,chunks,stages", STEPS)
def test_losses_and_gradients_equal_a_plain_step(schedule, chunks, stages, kind):
    devices = ["cpu", "cpu"] if schedule == "interleaved" else ["cpu"] * stages
    model = plain_model() if kind == "plain" else unet_model()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    loss, grads = _reference(model, x, target)
    executor = ScheduleExecutor(copy.deepcopy(model), BALANCES[kind][stages], devices=devices, chunks=chunks,
                                schedule=schedule, checkpoint="except_last", loss_fn=nn.functional.mse_loss)
    result = executor.step(x, target)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    assert len(result.losses) == chunks
    for got, expected in zip(executor.parameters(), grads, strict=True):
        torch.testing.assert_close(got.grad, expected)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_checkpoint_modes(schedule, checkpoint):
    model = unet_model()
    x, target = torch.randn(12, 6), torch.randn(12, 6)
    loss, grads = _reference(model, x, target)
    executor = ScheduleExecutor(copy.deepcopy(model), [2, 6, 1], devices=["cpu"] * 3, chunks=4, schedule=schedule,
                                checkpoint=checkpoint, loss_fn=nn.functional.mse_loss)
    assert executor.step(x, target).loss == pytest.approx(loss, rel=1e-5)
    for got, expected in zip(executor.parameters(), grads, strict=True):
        torch.testing.assert_close(got.grad, expected)


def test_sum_reduction_adds_micro_batch_losses():
    model = plain_model()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    executor = ScheduleExecutor(copy.deepcopy(model), [4, 4], devices=["cpu"] * 2, chunks=4,
                                loss_fn=lambda out, t: nn.functional.mse_loss(out, t, reduction="sum"),
                                loss_reduction="sum")
    result = executor.step(x, target)
    ref = copy.deepcopy(model)
    nn.functional.mse_loss(ref(x), target, reduction="sum").backward()
    assert result.loss == pytest.approx(sum(result.losses))
    for got, expected in zip(executor.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad)


def test_recorded_phases_and_backward_overlapping_across_stages():
    model = nn.Sequential(*[SleepFIW(0.01, 0.01, 0.01) for _ in range(3)])
    executor = ScheduleExecutor(model, [1, 1, 1], devices=["cpu"] * 3, chunks=6, schedule="zero-bubble")
    with tl.record() as rec:
        executor.step(torch.ones(6, 1))
    t = rec.timeline
    assert set(t["phase"]) == {"forward", "input_grad", "weight_grad"}
    assert t.groupby("phase").size().to_dict() == {"forward": 18, "input_grad": 18, "weight_grad": 18}
    with tl.record() as rec:
        ScheduleExecutor(nn.Sequential(*[SleepFIW(0.01, 0.01, 0.01) for _ in range(3)]), [1, 1, 1],
                         devices=["cpu"] * 3, chunks=6, schedule="1f1b").step(torch.ones(6, 1))
    b = rec.timeline[rec.timeline.phase == "backward"]
    overlapping = sum(1 for r in b.itertuples() for q in b.itertuples()
                      if r.stage < q.stage and r.start < q.end and q.start < r.end)
    assert overlapping > 0  # unlike one backward() call, stages run backward at the same time


THEORY = {"gpipe": lambda p, m, v: (p - 1) / (m + p - 1), "1f1b": lambda p, m, v: (p - 1) / (m + p - 1),
          "zero-bubble": lambda p, m, v: (p - 1) / (3 * m + p - 1),
          "interleaved": lambda p, m, v: (p - 1) / (v * m + p - 1)}


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 3, 6, 1), ("1f1b", 3, 6, 1), ("zero-bubble", 3, 6, 1),
                                            ("interleaved", 2, 4, 2)])
def test_each_worker_runs_the_predicted_order_and_the_prediction_has_the_theorys_bubble(schedule, p, m, v):
    # Layers that sleep as long in forward, on the input-gradient path and on the weight-gradient
    # path. How close the measured bubble and step come to these: benchmarks/prediction_accuracy.py.
    seconds = 0.002
    stages = p * v
    model = nn.Sequential(*[SleepFIW(seconds, seconds, seconds) for _ in range(stages)])
    executor = ScheduleExecutor(model, [1] * stages, devices=["cpu"] * p, chunks=m, schedule=schedule)
    with tl.record() as rec:
        executor.step(torch.ones(m, 1))
    by = "device" if schedule == "interleaved" else "stage"
    measured = rec.timeline.assign(device=lambda t: [f"worker{s % p}" for s in t["stage"]])
    table = pd.DataFrame({"forward": [seconds * m] * stages, "backward": [2 * seconds * m] * stages,
                          "output_bytes": [0] * stages})
    predicted = simulate(table, list(range(1, stages)), chunks=m, schedule=schedule, checkpoint="never",
                         executor="threads", cpu_stages_overlap=True, virtual_stages=max(v, 1),
                         devices=[f"worker{d}" for d in range(p)] if schedule == "interleaved" else None)
    assert tl.bubble_fraction(predicted, by=by) == pytest.approx(THEORY[schedule](p, m, v), abs=1e-9)
    # Work a worker: its stages' micro-batches, a forward and a backward (I and W) each.
    assert tl.step_time(predicted) == pytest.approx(v * m * 3 * seconds / (1 - THEORY[schedule](p, m, v)))
    # Each worker ran its actions one after another in the order the prediction lays out.
    compute = predicted[predicted["phase"] != "copy"]
    for worker, ran in measured.sort_values("start").groupby(by):
        planned = compute[compute[by] == worker].sort_values("start")
        assert list(zip(ran["stage"], ran["phase"], ran["microbatch"], strict=True)) == list(
            zip(planned["stage"], planned["phase"], planned["microbatch"], strict=True)), worker
        assert (ran["start"].to_numpy()[1:] >= ran["end"].to_numpy()[:-1]).all(), worker


def test_a_failing_stage_raises_and_leaves_no_thread():
    class Boom(nn.Module):
        def forward(self, x):
            raise ArithmeticError("stage blew up")

    before = set(threading.enumerate())
    executor = ScheduleExecutor(nn.Sequential(nn.Linear(2, 2), Boom(), nn.Linear(2, 2)), [1, 1, 1],
                                devices=["cpu"] * 3, chunks=4, schedule="1f1b")
    with pytest.raises(ArithmeticError, match="stage blew up"):
        executor.step(torch.randn(8, 2))
    assert set(threading.enumerate()) == before


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(schedule="2f2b"), ValueError, "unknown schedule '2f2b'"),
    (dict(schedule="interleaved", devices=["cpu"] * 3), ValueError,
     "interleaved spreads 4 stages over 3 devices"),
    (dict(schedule="interleaved", devices=["cpu"] * 2, chunks=3), ValueError,
     r"chunks \(3\) to be a multiple of the device count \(2\)"),
    (dict(devices=["cpu"] * 2), IndexError, r"too few devices to hold given partitions"),
    (dict(checkpoint="sometimes"), ValueError, "checkpoint is not one of"),
    (dict(loss_reduction="max"), ValueError, "loss_reduction is 'mean' or 'sum'"),
])
def test_bad_arguments(kwargs, error, message):
    args = dict(devices=["cpu"] * 4, chunks=4)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        ScheduleExecutor(plain_model(), [2, 2, 2, 2], **args)


def test_fewer_rows_than_chunks_is_refused():
    executor = ScheduleExecutor(plain_model(), [4, 4], devices=["cpu"] * 2, chunks=8)
    with pytest.raises(ValueError, match=r"chunks=8 is more than the batch's 4 rows: .* choose chunks between 1 and 4"):
        executor.step(torch.randn(4, 6))
    executor = ScheduleExecutor(plain_model(), [4, 4], devices=["cpu"] * 2, chunks=8)
    with pytest.raises(ValueError, match=r"chunks=8 cannot split a batch of 10 rows into 8 micro-batches: torch.chunk "
                                         r"makes 5 micro-batches of up to 2 rows; "
                                         r"choose chunks among 1, 2, 3, 4, 5, 10"):
        executor.step(torch.randn(10, 6))


def test_a_failing_stage_is_named_with_its_device_and_action():
    class Boom(nn.Module):
        def forward(self, x):
            raise ArithmeticError("stage blew up")

    executor = ScheduleExecutor(nn.Sequential(nn.Linear(2, 2), Boom()), [1, 1], devices=["cpu"] * 2, chunks=2)
    with pytest.raises(ArithmeticError, match="stage blew up") as raised:
        executor.step(torch.randn(4, 2))
    assert "(in stage 1 on cpu: forward of micro-batch 0)" in raised.value.__notes__


def test_where_an_error_ran_is_said_where_python_has_no_notes():
    """Python 3.10 (which the package supports) has no ``add_note``: the note ends the message."""
    from pipexplore.executors._actions import add_note

    class NoNotes(ArithmeticError):  # an exception as 3.10 makes them
        @property
        def add_note(self):
            raise AttributeError("add_note")

    error = NoNotes("stage blew up", 3)
    add_note(error, "(in stage 1 on cpu: forward of micro-batch 0)")
    assert error.args == ("stage blew up\n(in stage 1 on cpu: forward of micro-batch 0)", 3)
    bare = NoNotes()
    add_note(bare, "(in stage 1)")
    assert bare.args == ()
    noted = ArithmeticError("stage blew up")
    add_note(noted, "(in stage 1)")
    assert noted.args == ("stage blew up",) and noted.__notes__ == ["(in stage 1)"]


class _Hog(nn.Module):
    """Asks for more memory than the device has, while ``armed``."""

    armed = True

    def forward(self, x):
        if _Hog.armed:
            free, _ = torch.cuda.mem_get_info(x.device)
            torch.empty(2 * free, dtype=torch.uint8, device=x.device)
        return x


@pytest.mark.gpu
def test_out_of_memory_in_one_cuda_stage_is_named_released_and_the_next_step_runs():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), _Hog(), nn.Linear(64, 64))
    reference = copy.deepcopy(model).cuda()
    before = set(threading.enumerate())
    executor = ScheduleExecutor(model, [2, 2], devices=["cuda:0", "cuda:0"], chunks=4, schedule="1f1b",
                                loss_fn=nn.functional.mse_loss)
    x, target = torch.randn(16, 64, device="cuda:0"), torch.randn(16, 64, device="cuda:0")
    _Hog.armed = False
    executor.step(x, target)  # warm: gradients, cuBLAS workspaces
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(0)
    _Hog.armed = True
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
            executor.step(x, target)
    finally:
        _Hog.armed = False
    assert "(in stage 1 on cuda:0: forward of micro-batch 0)" in raised.value.__notes__
    assert set(threading.enumerate()) == before
    del raised
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(0) <= baseline + 1024 ** 2  # what the failed step held is released
    for p in executor.parameters():
        p.grad = None
    loss = nn.functional.mse_loss(reference(x), target)
    loss.backward()
    assert executor.step(x, target).loss == pytest.approx(loss.item(), rel=1e-5)  # the next step works
    for got, expected in zip(executor.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad)
