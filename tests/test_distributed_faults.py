"""Multi-process steps that fail: a rank that raises, dies, hangs or is interrupted is named, and
every rank is reaped (its port free again)."""
from __future__ import annotations

import copy
import os
import signal
import sys
import threading
import time

import pytest
import torch
from torch import nn

from models import plain_model
from pipexplore.executors.distributed import DistributedRunError, run_processes, shutdown_pool
from ranks import no_pool_left_behind, port_spy  # noqa: F401  (fixtures)
from ranks import plan_for as _plan, port_is_free as _port_is_free
from ranks import worker_children as _children

pytestmark = pytest.mark.slow


class FailInWorker(nn.Module):
    """The identity in the test's own process (so that profiling works); in a worker, fails as told."""

    def __init__(self, how, mark=""):
        super().__init__()
        self.how, self.home, self.mark = how, os.getpid(), mark

    def forward(self, x):
        if os.getpid() != self.home:
            if self.how == "SIGKILL":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "exit code 1":
                sys.stderr.write("the layer gives up on purpose\n")
                sys.stderr.flush()
                os._exit(1)
            if self.how == "exit code 0":
                os._exit(0)
            if self.how == "raise":
                raise RuntimeError("the layer failed on purpose")
            if self.how == "hang":
                if self.mark:  # says it hangs now
                    open(self.mark, "w").close()
                time.sleep(3600)
        return x


def _failing_model(how, mark=""):
    model = plain_model()
    model.insert(5, FailInWorker(how, mark))  # in stage 1 (splits [4]): rank 1
    return model


def test_a_raising_rank_fails_the_run_with_its_traceback(port_spy):
    model, x = _failing_model("raise"), torch.randn(8, 6)
    with pytest.raises(DistributedRunError, match=r"(?s)rank 1 failed:\n.*RuntimeError: the layer failed on purpose"):
        run_processes(model, x, _plan(model, x, [4], ["cpu"] * 2, "gpipe"), timeout=60)
    assert _children() == []
    assert _port_is_free(port_spy[-1])


@pytest.mark.parametrize("how,said", [
    ("SIGKILL", r"was killed by SIGKILL \(signal 9\)"),
    ("exit code 1", r"exited with code 1 .*the layer gives up on purpose"),
    ("exit code 0", r"exited with code 0 "),
])
def test_a_dead_rank_is_named_with_its_exit_code_at_once(port_spy, how, said):
    model, x = _failing_model(how), torch.randn(8, 6)
    plan = _plan(model, x, [4], ["cpu"] * 2, "gpipe")
    started = time.monotonic()
    with pytest.raises(DistributedRunError, match=rf"(?s)^rank 1 \(cpu, pid \d+\) {said}"):
        run_processes(model, x, plan, timeout=120)
    assert time.monotonic() - started < 60  # named when it dies, not when the timeout runs out
    assert _children() == []
    assert _port_is_free(port_spy[-1])


def test_a_hanging_rank_times_out_and_every_process_is_reaped(port_spy):
    model, x = _failing_model("hang"), torch.randn(8, 6)
    with pytest.raises(DistributedRunError,
                       match=r"timed out after 4 s \(timeout=4\): rank\(s\) \[0, 1\] did not finish"):
        run_processes(model, x, _plan(model, x, [4], ["cpu"] * 2, "gpipe"), timeout=4)
    assert _children() == []
    assert _port_is_free(port_spy[-1])


@pytest.mark.timing  # a bound in seconds: runs alone (scripts/test.sh)
def test_an_interrupt_stops_and_reaps_every_rank_within_three_seconds(ctrl_c_raises, tmp_path):
    mark = tmp_path / "hanging"
    model, x = _failing_model("hang", str(mark)), torch.randn(8, 6)
    plan = _plan(model, x, [4], ["cpu"] * 2, "gpipe")
    interrupted: list[float] = []
    done = threading.Event()

    def ctrl_c() -> None:  # Ctrl-C while rank 1 hangs in its step, taken by this thread, not the caller's
        deadline = time.monotonic() + 120  # (as any thread may take a signal sent to the process)
        while not mark.exists() and not done.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not done.is_set():
            interrupted.append(time.monotonic())
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    sender = threading.Thread(target=ctrl_c, name="test-interrupter", daemon=True)
    sender.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_processes(model, x, plan, timeout=120)
    finally:
        done.set()
        sender.join()
    took = time.monotonic() - interrupted[0]
    assert _children() == []  # terminated, killed where they lingered, and reaped
    assert took < 3.0, f"the ranks took {took:.2f} s to stop after Ctrl-C (bound 3 s)"


@pytest.mark.gpu
def test_a_rank_on_cuda_equals_one_process_and_its_death_is_named():
    torch.manual_seed(0)
    model, x, target = plain_model(), torch.randn(8, 6), torch.randn(8, 6)
    plan = _plan(model, x, [4], ["cuda:0"], "interleaved")  # two stages on one rank (NCCL)
    result = run_processes(model, x, plan, target=target, loss_fn=nn.functional.mse_loss, return_grads=True,
                           warmup=0, timeout=120)
    reference = copy.deepcopy(model).cuda()
    loss = nn.functional.mse_loss(reference(x.cuda()), target.cuda())
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-4)
    named = dict(reference.named_parameters())
    for key, grad in result.metrics["grads"].items():
        torch.testing.assert_close(grad, named[key.split(".", 1)[1]].grad.cpu(), rtol=1e-4, atol=1e-5)
    failing = _failing_model("exit code 1")
    with pytest.raises(DistributedRunError, match=r"(?s)^rank 0 \(cuda:0, pid \d+\) exited with code 1 .*on purpose"):
        run_processes(failing, x, _plan(failing, x, [4], ["cuda:0"], "interleaved"), timeout=120)
    assert _children() == []


def test_a_rendezvous_port_taken_before_rank_0_listens_is_chosen_again(monkeypatch):
    """Another process may take the free port the pool chose before its rank 0 listens on it (a
    parallel test run, a torchrun launch): the start fails with EADDRINUSE and the pool starts
    again on another port, rather than failing the run."""
    from pipexplore.executors import pool

    shutdown_pool(keep_server=True)
    original, ports = pool._free_port, []
    with _listening() as taken:
        def chosen():  # the taken port first, then free ones
            ports.append(taken.getsockname()[1] if not ports else original())
            return ports[-1]

        monkeypatch.setattr(pool, "_free_port", chosen)
        try:
            with pool.warm_pool(2, ["cpu", "cpu"]) as (running, startup):
                assert running.port == ports[1] != ports[0] and startup > 0
                assert running.run([pool.pack_job(_rank_of, {})] * 2, timeout=60.0) == [0, 1]
        finally:
            shutdown_pool(keep_server=True)
    monkeypatch.setattr(pool, "PORT_TRIES", 1)  # with no second try the start fails, naming the port
    with _listening() as taken:
        monkeypatch.setattr(pool, "_free_port", lambda: taken.getsockname()[1])
        with pytest.raises(DistributedRunError, match=r"(?i)address already in use"):
            with pool.warm_pool(2, ["cpu", "cpu"]):
                pass
    assert _children() == []


def _listening():
    """A socket listening on a loopback port: a port another process has taken."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    return taken


def _rank_of(rank, world):
    return rank
