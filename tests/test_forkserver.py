"""The fork server: pool ranks forked from one process that imported torch once, as fresh as new interpreters."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time
import warnings

import psutil
import pytest
import torch

from pipexplore.executors import forkserver, pool
from pipexplore.executors.pool import DistributedRunError, pack_job, shutdown_pool, warm_pool
from ranks import no_pool_left_behind, worker_children  # noqa: F401  (no_pool_left_behind: a fixture)

pytestmark = pytest.mark.skipif(not forkserver.supported(), reason="ranks are forked only on Linux")


@pytest.fixture(autouse=True, scope="module")
def _servers_without_pipelining():
    """This module starts a dozen servers whose ranks run jobs of its own, no schedule: they import
    torch and the worker but not torch's pipelining (1.2 s of CPU a start). At its end the server
    is stopped, so the next module's pools fork from a server that imported everything."""
    full = forkserver.PRELOAD
    heavy = ("torch.distributed.pipelining", "pipexplore.executors.distributed")  # the second imports the first
    forkserver.PRELOAD = tuple(name for name in full if name not in heavy)
    yield
    forkserver.PRELOAD = full
    shutdown_pool()


def _facts(rank, world, name):
    import torch.distributed as dist

    return {"rank": rank, "world": world, "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
            "env": os.environ.get(name), "cwd": os.getcwd(), "random": random.getrandbits(64),
            "group": dist.get_world_size(), "argv0": sys.argv[0]}


def _run(world, **kwargs):
    with warm_pool(world, ["cpu"] * world) as (running, startup):
        return running.run([pack_job(_facts, kwargs) for _ in range(world)], timeout=60.0), startup


def test_ranks_are_forked_from_one_server_that_outlives_a_failed_pool(monkeypatch, tmp_path):
    shutdown_pool()
    monkeypatch.setenv("PIPEXPLORE_FORK_TEST", "first")
    first, _ = _run(2, name="PIPEXPLORE_FORK_TEST")
    server = pool.fork_server_pid()
    assert server is not None and psutil.Process(server).ppid() == os.getpid()
    assert [r["rank"] for r in first] == [0, 1] and {r["group"] for r in first} == {2}
    assert {r["ppid"] for r in first} == {server}  # forked by the server, not started by this process
    assert all(r["sid"] == r["pid"] for r in first)  # each in a session of its own (Ctrl-C reaches us only)
    assert sorted(p.name() for p in worker_children()) == ["pipexplore-r0", "pipexplore-r1"]
    assert first[0]["random"] != first[1]["random"]  # fresh random state per rank
    # a failed run discards the pool; the next one forks new ranks from the same server, with the
    # environment and working directory the caller has now
    with pytest.raises(DistributedRunError, match=r"rank 1 .* exited with code 7"):
        with warm_pool(2, ["cpu", "cpu"]) as (running, _):
            running.run([pack_job(_facts, {"name": "X"}), pack_job(_exit_seven, {})], timeout=60.0)
    assert worker_children() == []
    monkeypatch.setenv("PIPEXPLORE_FORK_TEST", "second")
    monkeypatch.chdir(tmp_path)
    second, startup = _run(3, name="PIPEXPLORE_FORK_TEST")
    assert pool.fork_server_pid() == server
    assert {r["ppid"] for r in second} == {server} and not {r["pid"] for r in second} & {r["pid"] for r in first}
    assert {r["env"] for r in second} == {"second"} and {r["cwd"] for r in second} == {str(tmp_path)}
    assert [r["group"] for r in second] == [3, 3, 3]
    assert 0 < startup
    shutdown_pool()
    assert pool.fork_server_pid() is None and not psutil.pid_exists(server)  # stopped and reaped


def _exit_seven(rank, world):
    os._exit(7)


def _killed(rank, world):
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_rank_is_named_with_its_signal_through_the_server():
    with pytest.raises(DistributedRunError, match=r"rank 0 \(cpu, pid \d+\) was killed by SIGKILL \(signal 9\)"):
        with warm_pool(1, ["cpu"]) as (running, _):
            running.run([pack_job(_killed, {})], timeout=60.0)
    assert worker_children() == []


def test_forked_process_reports_exit_codes_as_popen_does():
    server = pool.fork_server(None)  # the session's: started here if no other test started it
    import multiprocessing

    ours, theirs = multiprocessing.Pipe()
    with open(os.devnull, "wb") as sink:
        # a rank that cannot join its group (world 2, nobody else): it waits until killed
        child = server.spawn(["0", "2", str(pool._free_port()), str(theirs.fileno()), "gloo"], theirs.fileno(),
                             sink.fileno(), pool._worker_env())
    theirs.close()
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.terminate()
    assert child.wait(timeout=10) == -15 and child.returncode == -15
    child.kill()  # ended already: nothing is sent to a pid that may be reused
    ours.close()
    assert server.alive()  # a child's end is not the server's


def test_without_the_server_nothing_is_forked(monkeypatch):
    shutdown_pool()
    monkeypatch.setattr(pool, "FORK_SERVER", False)
    assert pool.fork_server(None) is None and pool.fork_server_pid() is None  # ranks start as interpreters
    # (what they then are: test_a_server_that_cannot_start_leaves_ranks_to_start_as_interpreters)


def test_the_server_and_its_ranks_leave_when_their_caller_dies(tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from pipexplore.executors import pool
        with pool.warm_pool(2, ["cpu", "cpu"]) as (running, _):
            pids = running.pids
        print(pool.fork_server_pid(), *pids, flush=True)
        os._exit(0)  # no clean-up: as a killed kernel
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr[-2000:]
    pids = [int(v) for v in done.stdout.split()]
    assert len(pids) == 3
    deadline = time.monotonic() + 15.0  # each looks for its parent twice a second; a loaded machine delays them
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.1)
    assert [pid for pid in pids if _running(pid)] == []


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_server_that_cannot_start_leaves_ranks_to_start_as_interpreters(monkeypatch):
    shutdown_pool()
    monkeypatch.setattr(forkserver, "PRELOAD", ("pipexplore_no_such_module",))
    with pytest.warns(RuntimeWarning, match=r"(?s)rank processes start as new interpreters in this session \(slower "
                                            r"to start\): the fork server exited while it started: .*No module named "
                                            r"'pipexplore_no_such_module'"):
        replies, _ = _run(1, name="PATH")  # (one rank: an interpreter is ~3 s of CPU)
    assert pool.fork_server_pid() is None and {r["ppid"] for r in replies} == {os.getpid()}
    workers = worker_children()
    assert len(workers) == 1 and all("-m pipexplore.executors._worker" in " ".join(p.cmdline()) for p in workers)
    pool._pool.close(kill=True)  # the pool discarded, as after a failed run: the refusal stays
    pool._pool = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not tried (nor warned) again before shutdown_pool()
        replies, _ = _run(1, name="PATH")
    assert {r["ppid"] for r in replies} == {os.getpid()}
    shutdown_pool()  # which forgets the refusal: the next pool tries a server again
    monkeypatch.setattr(forkserver, "PRELOAD", ("pipexplore",))
    replies, _ = _run(1, name="PATH")
    assert {r["ppid"] for r in replies} == {pool.fork_server_pid()}
    shutdown_pool()


def test_a_rank_outliving_a_closed_server_is_still_waited_for():
    """After the server is closed (shutdown at exit while a run is in flight), a handle still says
    whether its rank runs and waits for it to end: by its pid, the status itself gone with the server."""
    server = forkserver.ForkServer.start(pool._worker_env())
    import multiprocessing

    ours, theirs = multiprocessing.Pipe()
    with open(os.devnull, "wb") as sink:
        child = server.spawn(["0", "2", str(pool._free_port()), str(theirs.fileno()), "gloo"], theirs.fileno(),
                             sink.fileno(), pool._worker_env())
    theirs.close()
    server.close()  # its child notices its parent gone and leaves within a second or so
    assert child.wait(timeout=30) == -9  # (its real status was the server's to report)
    assert child.poll() == -9
    ours.close()


def _imported(rank, world, name):
    return name in sys.modules  # the job itself imports nothing


def test_a_server_imports_installed_libraries_on_request_for_the_ranks_forked_after():
    """What a job's model is made of from installed libraries (transformers for a Hugging Face
    model) is imported once by the server, not by every rank; a module that cannot be imported is
    skipped, and a module is asked for once."""
    shutdown_pool()
    with warm_pool(2, ["cpu"] * 2) as (running, _):
        assert running.run([pack_job(_imported, {"name": "yaml"})] * 2, timeout=60.0) == [False, False]
    server = pool.fork_server(None)
    assert server.preload(["yaml", "pipexplore_no_such_module"]) == ["yaml"]
    assert server.preload(["yaml", "pipexplore_no_such_module"]) == []  # asked once: no request at all
    with warm_pool(3, ["cpu"] * 3) as (running, _):  # another world: new ranks, forked after the import
        assert running.run([pack_job(_imported, {"name": "yaml"})] * 3, timeout=60.0) == [True] * 3
    assert pool.fork_server_pid() == server.pid
    shutdown_pool()


class _Local(torch.nn.Module):  # defined here, not by an installed library
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)


def test_installed_modules_are_the_libraries_a_model_is_made_of_never_the_users_own():
    import warnings

    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                    n_positions=16))
    assert "transformers.models.gpt2.modeling_gpt2" in forkserver.installed_modules(gpt2)
    assert all(name.startswith("transformers.") for name in forkserver.installed_modules(gpt2))
    assert forkserver.installed_modules(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []  # torch: preloaded
    assert forkserver.installed_modules(_Local()) == []  # this file is the user's: each rank imports it as it is


THREAD_AT_IMPORT = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"


def test_an_import_that_starts_a_thread_stops_the_server_and_is_not_asked_for_again(tmp_path, monkeypatch):
    """A forked child could inherit a lock another thread holds: a server whose import started a
    thread says so and exits; the pool then starts another and leaves that module to each rank."""
    (tmp_path / "pipexplore_thread_at_import.py").write_text(THREAD_AT_IMPORT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    monkeypatch.setattr(forkserver, "PRELOAD", ())  # servers that fork nothing here need not import torch
    shutdown_pool()
    server = pool.fork_server(None)
    with pytest.raises(forkserver.ServerStopped, match=r"the fork server stopped: an import started a thread "
                                                       r"\(pipexplore_thread_at_import\)") as stopped:
        server.preload(["yaml", "pipexplore_thread_at_import"])
    assert stopped.value.modules == ["pipexplore_thread_at_import"] and not server.alive()
    pool.preload_modules(["pipexplore_thread_at_import"])  # the pool's own server, asked: it stops too
    stopped = pool._server
    assert stopped is not None and not stopped.alive()
    pool.preload_modules(["pipexplore_thread_at_import", "yaml"])  # a new server, asked for yaml only
    assert pool._server is not stopped and pool._server.alive() and pool._server.preloaded == {"yaml"}
    shutdown_pool()
    pool._not_preloaded.clear()


def test_a_rank_whose_parent_ended_before_it_looked_leaves_at_once(monkeypatch):
    """A rank is told its parent's pid (the server's, or the pool's for an interpreter): one whose
    parent ended before its watcher began (a server closed right after a fork, on a busy machine)
    sees another parent and leaves, rather than watching its successor forever."""
    from pipexplore.executors import _worker

    class Left(Exception):
        pass

    def leave(code):
        raise Left(code)

    import types

    monkeypatch.setattr(_worker, "os", types.SimpleNamespace(getppid=lambda: 1, _exit=leave))  # adopted
    monkeypatch.setattr(_worker, "time", types.SimpleNamespace(sleep=lambda seconds: pytest.fail("it waited")))
    with pytest.raises(Left, match="1"):
        _worker.exit_with_parent(4242)
