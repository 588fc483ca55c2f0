"""What the worker-process tests share: plans for processes, the pool's workers still running,
the rendezvous ports a test's pools used, and a check that every pool is gone after a module."""
from __future__ import annotations

import copy
import pathlib
import socket

import psutil
import pytest

import pipexplore
from pipexplore.executors import pool
from pipexplore.executors.distributed import shutdown_pool
from pipexplore.plan import Plan


def plan_for(model, x, splits, devices, schedule, chunks=4):
    table = pipexplore.profile(copy.deepcopy(model), x, repeats=1, calibrate=False)
    return Plan(table, tuple(splits), tuple(devices), chunks=chunks, schedule=schedule, executor="processes")


def assert_equals_unsplit(result, model, inputs, target, loss_fn) -> float:
    """A run's first loss and every stage's gradients (``return_grads=True``) equal one plain step
    of ``model`` (a traced model's parameter names, after the stage prefix): every parameter has
    one, a tied weight under either of its names; returns that step's loss."""
    import torch

    reference = copy.deepcopy(model)
    loss = loss_fn(reference(inputs), target)
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    named = dict(reference.named_parameters(remove_duplicate=False))
    grads = result.metrics["grads"]
    assert {id(named[key.split(".", 1)[1]]) for key in grads} == {id(p) for p in named.values()}
    for key, grad in grads.items():
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


#: Installed libraries the fork server imports once for the ranks of :func:`run_ranks`:
#: transformers with its models' shared base (``modeling_utils``), which the hooks of most scripts run
#: here import (the Llama, MoE, zoo and Hugging Face defaults' hooks; ~1.1 s of CPU a rank when each
#: imported it).
RANK_LIBRARIES = ["transformers", "transformers.modeling_utils"]


def run_ranks(script, args=(), ranks: int = 2, pythonpath: str = "", timeout: float = 300.0) -> list[str]:
    """Run ``script`` as ``torchrun --standalone --nproc-per-node RANKS script ARGS`` runs it: one
    process a rank with the environment torchrun's agent gives it (``OMP_NUM_THREADS=1``,
    ``pythonpath`` on the path), forked from the session's fork server
    (:func:`pipexplore.runs.forked.launch_forked`, as ``ex.run()`` runs a mesh's ranks): a rank started
    by torchrun as a new interpreter pays ~3 s of CPU importing torch and its pipelining, and the
    agent ~2 s more. What torchrun itself does (agents, rendezvous, a rank that dies) is tested by
    ``test_cluster_roundtrip.py`` and notebooks 04 and 07 under torchrun itself.

    Returns each rank's stdout; fails the test (an ``AssertionError`` quoting the failed rank's last
    lines of stderr) when a rank exits non-zero or the ranks do not finish within ``timeout`` seconds
    (every rank is then stopped)."""
    import os
    import re

    from pipexplore.runs.forked import launch_forked
    from pipexplore.runs.launch import TorchrunError

    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p))
    try:
        outcome = launch_forked(pathlib.Path(script), ranks=ranks, args=[str(a) for a in args], env=env,
                                timeout=timeout, preload=RANK_LIBRARIES)
    except TorchrunError as failed:
        raise AssertionError(f"ranks failed: {failed}") from None
    outs: list[list[str]] = [[] for _ in range(ranks)]
    for line in outcome.stdout[0].splitlines(keepends=True):
        rank = re.match(r"\[default(\d+)\]:", line)
        assert rank, line
        outs[int(rank[1])].append(line[rank.end():])
    return ["".join(lines) for lines in outs]


def torchrun_first_loss(script, pythonpath: str, ranks: int = 2) -> float:
    """The loss ``script`` (an exported one) prints for step 0, run on ``ranks`` ranks as torchrun
    runs it (:func:`run_ranks`); the ranks must exit cleanly."""
    import re

    stdout = "".join(run_ranks(script, ranks=ranks, pythonpath=pythonpath))
    match = re.search(r"step 0 loss=([0-9.]+)", stdout)
    assert match, stdout
    return float(match.group(1))


def worker_children():
    """This process's pool workers that are still running: started as ``python -m
    pipexplore.executors._worker`` or forked by the fork server (named ``pipexplore-rN``)."""
    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and ("-m pipexplore.executors._worker" in " ".join(p.cmdline()) or p.name().startswith("pipexplore-r"))]


def script_ranks_left():
    """Ranks of a script forked by the fork server (``pipexplore.runs.forked``, named ``pipexplore-sN``)
    that are still running below this process."""
    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and p.name().startswith("pipexplore-s")]


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
