"""What the worker-process tests share: plans for processes, the pool's workers still running,
the rendezvous ports a test's pools used, and a check that every pool is gone after a module."""
from __future__ import annotations

import copy
import socket

import psutil
import pytest

import pipexplore
from pipexplore import pool
from pipexplore.distributed import shutdown_pool
from pipexplore.plan import Plan


def plan_for(model, x, splits, devices, schedule, chunks=4):
    table = pipexplore.profile(copy.deepcopy(model), x, repeats=1, calibrate=False)
    return Plan(table, tuple(splits), tuple(devices), chunks=chunks, schedule=schedule, executor="processes")


def assert_equals_unsplit(result, model, inputs, target, loss_fn) -> float:
    """A processes run's first loss and every rank's gradients (``return_grads=True``) equal one
    plain step of ``model`` (a traced model's parameter names, after the stage prefix); returns
    that step's loss."""
    import torch

    reference = copy.deepcopy(model)
    loss = loss_fn(reference(inputs), target)
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    named = dict(reference.named_parameters())
    assert len(result.metrics["grads"]) == len(named)
    for key, grad in result.metrics["grads"].items():
        torch.testing.assert_close(grad, named[key.split(".", 1)[1]].grad, rtol=1e-4, atol=1e-6)
    return loss.item()


def traced_tiny_transformer(points=("layers.1", "layers.2", "layers.3")):
    """The tests' tiny transformer traced, its batch, and the splits at ``points``: ``(model,
    tokens, target, table, splits)``."""
    from pipexplore.models import trace
    from tiny_transformer import build_model, get_batch

    model = build_model()
    tokens, target = get_batch()
    table = trace.candidates(copy.deepcopy(model), (tokens,), repeats=1)
    names = [str(n) for n in table["name"]]
    return model, tokens, target, table, [names.index(n) for n in points]


def torchrun_first_loss(script, pythonpath: str, ranks: int = 2) -> float:
    """Run ``script`` under ``torchrun --standalone`` with ``ranks`` processes on one node (its
    rendezvous on a port the agent's store picks and holds, a run id of its own), check it exits
    cleanly and return the loss it printed for step 0."""
    import os
    import pathlib
    import re
    import subprocess
    import sys

    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, PYTHONPATH=pythonpath)
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(ranks), str(script)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    match = re.search(r"step 0 loss=([0-9.]+)", done.stdout)
    assert match, done.stdout
    return float(match.group(1))


def worker_children():
    """This process's pool workers that are still running: started as ``python -m
    pipexplore.executors._worker`` or forked by the fork server (named ``pipexplore-rN``)."""
    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and ("-m pipexplore.executors._worker" in " ".join(p.cmdline()) or p.name().startswith("pipexplore-r"))]


def fork_server_left():
    """The fork server, if it still runs (``shutdown_pool`` stops it with the pool)."""
    return [p for p in psutil.Process().children() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and "pipexplore.executors.forkserver" in " ".join(p.cmdline())]


@pytest.fixture(autouse=True, scope="module")
def no_pool_left_behind():
    """After the module no rank runs; the fork server stays for the next module's pools (the
    session's end stops it and checks that nothing is left: ``conftest.py``)."""
    yield
    shutdown_pool(keep_server=True)
    assert worker_children() == [] and len(fork_server_left()) <= 1


@pytest.fixture
def port_spy(monkeypatch):
    """The rendezvous ports of the pools started in the test (it starts with none warm)."""
    shutdown_pool(keep_server=True)
    ports = []
    original = pool._free_port

    def spy():
        ports.append(original())
        return ports[-1]

    monkeypatch.setattr(pool, "_free_port", spy)
    return ports


def port_is_free(port):
    """Nothing listens on it any more: a new server can bind and listen (with SO_REUSEADDR, as
    servers do, since connections of the killed rendezvous may linger in TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    return True
