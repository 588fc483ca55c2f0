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


#: What a forked rank has imported before it starts: what every exported script imports; the
#: recorder a script imports for ``--record`` (itself only: the package imports its names on first
#: use); and transformers with its models' shared base (``modeling_utils``), which the hooks of most
#: scripts run here import (the Llama, MoE, zoo and Hugging Face defaults' hooks): ~1.1 s of CPU a rank
#: when each imported it, once a test process here (as the pool's fork server imports the
#: libraries a model is made of once, not in every rank).
RANK_PRELOAD = ["torch", "torch.distributed", "torch.distributed.pipelining", "pipexplore.runs.record",
                "transformers", "transformers.modeling_utils", "ranks"]


def run_ranks(script, args=(), ranks: int = 2, pythonpath: str = "", timeout: float = 300.0) -> list[str]:
    """Run ``script`` as ``torchrun --standalone --nproc-per-node RANKS script ARGS`` runs it: one
    process a rank with the environment torchrun's agent gives it (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` of a store held here, ``OMP_NUM_THREADS=1``),
    the script run as ``__main__`` with ``sys.argv`` as torchrun sets it. Each rank is forked from
    a process that has imported torch and its pipelining once (multiprocessing's fork server, one a
    test process): a rank started by torchrun as a new interpreter pays ~3 s of CPU importing them,
    and the agent ~2 s more. What torchrun itself does (agents, rendezvous, a rank that dies) is
    tested by ``test_cluster_roundtrip.py`` and notebooks 04 and 07 under torchrun itself.

    Returns each rank's stdout; fails the test (quoting its stderr) when a rank exits non-zero or
    the ranks do not finish within ``timeout`` seconds (every rank is then killed)."""
    import multiprocessing
    import os
    import tempfile
    import time
    from multiprocessing import connection

    from pipexplore.runs.forked import rank_variables
    from pipexplore.runs.launch import rendezvous_store

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)
    # the rendezvous store, held here as an agent holds it (TORCHELASTIC_USE_AGENT_STORE): its port
    # is the one it is bound to, so no other process can take it between choosing and binding
    store = rendezvous_store(timeout)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        outputs = [(os.path.join(folder, f"{rank}.out"), os.path.join(folder, f"{rank}.err")) for rank in range(ranks)]
        processes = [context.Process(target=_rank, args=(str(script), [str(a) for a in args], pythonpath,
                                                         {**env, **rank_variables(rank, ranks, store.port)},
                                                         outputs[rank]), name=f"rank{rank}")
                     for rank in range(ranks)]
        began = time.time()
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        try:  # until every rank is done, one fails (torchrun then stops the others) or the time is up
            while time.monotonic() < deadline:
                # (which ranks still run is read once a round: read twice, an exit reported between the
                # two readings left the wait no sentinel, and it slept until the deadline, then passed)
                running = [process for process in processes if process.exitcode is None]
                if not running or any(process.exitcode not in (None, 0) for process in processes):
                    break
                connection.wait([process.sentinel for process in running], deadline - time.monotonic())
        finally:
            # (each process the wait gave up on, and the fork server, as the kernel has them: for the report)
            left = {rank: _proc_state(p.pid) for rank, p in enumerate(processes) if p.exitcode is None}
            if left:
                from multiprocessing import forkserver

                left["fork server"] = _proc_state(getattr(forkserver._forkserver, "_forkserver_pid", None))
            for process in processes:
                if process.exitcode is None:
                    process.kill()
                    process.join()
        read = [tuple(pathlib.Path(path).read_text(errors="replace") for path in pair) for pair in outputs]
    _say_if_slow(time.time() - began, began, read, left)
    failed = [(rank, process.exitcode) for rank, process in enumerate(processes) if process.exitcode != 0]
    assert not failed, f"ranks failed (rank, exit code; a negative one: killed): {failed}\n" + "\n".join(
        f"rank {rank} stderr:\n{read[rank][1][-2000:]}" for rank, _ in failed)
    return [out for out, _ in read]


#: Seconds after which a run of ranks is slow: it then says where each rank was (its stack, written by
#: ``faulthandler`` into its stderr at that moment), when each ended, and what the processes the wait
#: gave up on were, as a warning of the test that ran it. (A run here takes 2–17 s.)
SLOW = 60.0
_ENDED = "rank ended at "


def _proc_state(pid) -> str:
    """A process's state, where the kernel has it waiting, and its signals blocked and pending."""
    try:
        status = dict(line.split(":", 1) for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines())
        wchan = pathlib.Path(f"/proc/{pid}/wchan").read_text()
    except (OSError, ValueError):
        return f"pid {pid}: gone"
    said = ", ".join(f"{key} {status[key].strip()}" for key in ("State", "Threads", "SigBlk", "SigPnd", "ShdPnd")
                     if key in status)
    return f"pid {pid}: {said}, waiting in {wchan or '-'}"


def _say_if_slow(seconds: float, began: float, read: list, left: dict) -> None:
    if seconds < SLOW:
        return
    import re
    import warnings

    said = []
    for rank, (out, err) in enumerate(read):
        ended = re.findall(_ENDED + r"([0-9.]+)", err)
        steps = re.findall(r"^step .*$", out, re.M)
        said.append(f"rank {rank}: ended {float(ended[-1]) - began:.1f} s after the start" if ended else
                    f"rank {rank}: did not say it ended")
        said.append(f"  its steps: {steps}")
        said.append("  its stderr's last lines:\n    " + "\n    ".join(err.splitlines()[-40:]))
    said += [f"not seen to exit when the wait ended: {name}: {state}" for name, state in left.items()]
    warnings.warn(f"the ranks' run took {seconds:.0f} s (slow beyond {SLOW:.0f} s):\n" + "\n".join(said))


def _rank(script: str, args: list[str], pythonpath: str, env: dict, outputs: tuple[str, str]) -> None:
    """A forked rank: torchrun's environment, stdout and stderr to files, ``script`` as ``__main__``."""
    import faulthandler
    import os
    import runpy
    import sys
    import time

    import torch

    for fd, path in zip((1, 2), outputs, strict=True):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, fd)
        os.close(file)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.dump_traceback_later(SLOW, file=sys.stderr)  # where it is, if the run is slow
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 would have set at the interpreter's start
    sys.path[:0] = [os.path.dirname(os.path.abspath(script))] + [p for p in pythonpath.split(os.pathsep) if p]
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        print(f"{_ENDED}{time.time():.3f}", file=sys.stderr)
        faulthandler.dump_traceback_later(SLOW, file=sys.stderr)  # and where, if leaving is slow
        sys.stdout.flush()
        sys.stderr.flush()


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
