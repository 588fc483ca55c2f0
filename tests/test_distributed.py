"""Multi-process steps with torch.distributed.pipelining: equal to one process, robust to failures."""
from __future__ import annotations

import copy
import multiprocessing
import socket

import pytest
import torch
from torch import nn

import pipexplore
from models import plain_model
from pipexplore import distributed
from pipexplore.distributed import DistributedRunError, run_processes
from pipexplore.plan import Plan

pytestmark = pytest.mark.slow


def _plan(model, x, splits, devices, schedule, chunks=4):
    table = pipexplore.profile(copy.deepcopy(model), x, repeats=1, calibrate=False)
    return Plan(table, tuple(splits), tuple(devices), chunks=chunks, schedule=schedule, executor="processes")


@pytest.mark.parametrize("schedule,splits,devices", [
    ("gpipe", [4], ["cpu"] * 2),
    ("1f1b", [4], ["cpu"] * 2),
    ("1f1b", [2, 4, 6], ["cpu"] * 4),
    ("zero-bubble", [4], ["cpu"] * 2),
    ("interleaved", [2, 4, 6], ["cpu"] * 2),  # 4 stages on 2 ranks
])
def test_loss_and_gradients_equal_one_process(schedule, splits, devices):
    torch.manual_seed(0)
    model = plain_model()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    result = run_processes(model, x, _plan(model, x, splits, devices, schedule), target=target,
                           loss_fn=nn.functional.mse_loss, return_grads=True, warmup=0)
    reference = copy.deepcopy(model)
    loss = nn.functional.mse_loss(reference(x), target)
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    named = dict(reference.named_parameters())
    grads = result.metrics["grads"]
    assert len(grads) == len(named)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, named[key.split(".", 1)[1]].grad)
    timeline = result.timeline
    assert set(timeline["stage"]) == set(range(len(splits) + 1)) and set(timeline["source"]) == {"measured"}
    assert (timeline.groupby("phase").size() == 4 * (len(splits) + 1)).all()  # each micro-batch, each stage
    assert timeline["start"].min() == 0.0


def _children():
    return [p for p in multiprocessing.active_children() if p.name.startswith("pipexplore-rank")]


@pytest.fixture
def port_spy(monkeypatch):
    ports = []
    original = distributed._free_port

    def spy():
        ports.append(original())
        return ports[-1]

    monkeypatch.setattr(distributed, "_free_port", spy)
    return ports


def _port_is_free(port):
    """Nothing listens on it any more: a new server can bind and listen (with SO_REUSEADDR, as
    servers do, since connections of the killed rendezvous may linger in TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    return True


def test_a_crashing_rank_fails_the_run_with_its_traceback(port_spy):
    model, x = plain_model(), torch.randn(8, 6)
    with pytest.raises(DistributedRunError, match=r"(?s)rank 1 failed:\n.*rank 1 crashed on purpose"):
        run_processes(model, x, _plan(model, x, [4], ["cpu"] * 2, "gpipe"), _crash_rank=1, timeout=60)
    assert _children() == []
    assert _port_is_free(port_spy[-1])


def test_a_hanging_rank_times_out_and_every_process_is_reaped(port_spy):
    model, x = plain_model(), torch.randn(8, 6)
    with pytest.raises(DistributedRunError, match=r"timed out after 8 s; rank\(s\) \[0, 1\] did not finish"):
        run_processes(model, x, _plan(model, x, [4], ["cpu"] * 2, "gpipe"), _hang_rank=1, timeout=8)
    assert _children() == []
    assert _port_is_free(port_spy[-1])


def test_explorer_runs_the_processes_executor_beside_threads():
    from pipexplore.widgets import explore

    ex = explore(plain_model(), torch.randn(8, 6), devices=["cpu", "cpu"], splits=[4], chunks=4, schedule="1f1b")
    ex.run()
    row = ex.run(executor="processes")
    assert row["executor"] == "processes" and row["schedule"] == "1f1b"
    assert ex.runs["executor"].tolist() == ["threads", "processes"]
    assert set(ex.timeline("measured")["stage"]) == {0, 1}


def test_bad_plans_are_refused_before_any_process_starts():
    model, x = plain_model(), torch.randn(8, 6)
    with pytest.raises(ValueError, match=r"Schedule1F1B needs at least as many micro-batches as stages: chunks 2 < 4"):
        run_processes(model, x, _plan(model, x, [2, 4, 6], ["cpu"] * 4, "1f1b", chunks=2))
    with pytest.raises(ValueError, match="8 rows do not divide into 3 chunks"):
        run_processes(model, x, _plan(model, x, [4], ["cpu"] * 2, "gpipe", chunks=3))
    assert _children() == []
