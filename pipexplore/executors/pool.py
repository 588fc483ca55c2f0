"""A warm pool of worker processes, one per rank, that runs cloudpickled jobs and names any rank that dies.

Workers start with a clean main module (``python -m pipexplore.executors._worker``, or forked as
that module by the :mod:`~pipexplore.executors.forkserver`, which imports torch once for every
pool of the session: a pool that replaces a failed one starts in a fraction of a second, not in
seconds), so a user's script or notebook is never re-run in them; jobs travel by value with
``cloudpickle``, so classes, lambdas and closures defined in ``__main__`` or a notebook cell
reach them. The pool stays up between runs on the same world size and devices (a rerun pays no
process start-up), is discarded after any failure, timeout, interrupt or cancel (every process
terminated, killed if it lingers, and reaped), and is shut down, with the fork server, at exit or
by :func:`shutdown_pool`. While it waits for the ranks it watches the run's
:class:`~pipexplore.cancel.CancelToken` (:func:`pipexplore.cancel.cancel_scope`): a cancelled run
raises :class:`~pipexplore.cancel.Cancelled` within a poll (0.05 s) and stops them.

Example::

    payloads = [pack_job(function, {"x": 1}) for rank in range(2)]
    with warm_pool(2, ["cpu", "cpu"]) as (pool, startup_seconds):
        replies = pool.run(payloads, timeout=30.0)        # function(rank, world, x=1) per rank
    shutdown_pool()
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Optional, Sequence, cast

from pipexplore.cancel import Cancelled, CancelToken, current_token
from pipexplore.executors import forkserver
from pipexplore.executors.jobs import ensure_picklable, pack_job
from pipexplore.host import free_port as _free_port  # (its own name here: tests choose the port)

__all__ = ["WorkerPool", "DistributedRunError", "warm_pool", "shutdown_pool", "fork_server", "fork_server_pid",
           "preload_modules", "pack_job", "ensure_picklable", "STARTUP_TIMEOUT", "FORK_SERVER"]

#: Seconds the workers may take to start and join their process group (apart from a run's ``timeout``).
STARTUP_TIMEOUT = 120.0
#: After a first failure, how long to wait for other ranks' news, so that a dead rank is named
#: rather than a survivor complaining about it.
FAILURE_GRACE = 0.5
#: Lines of a dead rank's stderr quoted in the error.
STDERR_LINES = 20
#: Seconds a terminated worker may take to exit before it is killed.
TERMINATE_GRACE = 1.0
#: Seconds between looks at the run's cancel token (and at an interrupt another thread of this process
#: took) while waiting for the ranks.
CANCEL_POLL = 0.05
#: Pools started before giving up when the rendezvous port was taken between choosing it and
#: rank 0 listening on it (another process on the machine took it: a parallel test run, torchrun).
PORT_TRIES = 3
#: Fork ranks from the fork server where the platform allows it (Linux); ``False`` starts each
#: rank as a new interpreter, as other platforms do.
FORK_SERVER = True


class DistributedRunError(RuntimeError):
    """A rank failed, died or hung; the message names the rank and holds its traceback, or its
    exit code or signal and the last lines of its stderr."""


def _backend(devices: Sequence[str]) -> str:
    kinds = {str(d).split(":")[0] for d in devices}
    if kinds == {"cuda"}:
        return "nccl"
    return "cpu:gloo,cuda:nccl" if "cuda" in kinds else "gloo"


def _worker_env() -> dict[str, str]:
    """The parent's environment, with pipexplore importable before any job says where the rest is."""
    env = dict(os.environ)
    package_root = str(pathlib.Path(__file__).resolve().parents[2])  # the folder that holds pipexplore/
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _how_it_ended(code: Optional[int]) -> str:
    if code is None:
        return "closed its pipe without reporting and did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (signal {-code})"
    return f"exited with code {code}"


_server_lock = threading.Lock()
_server: Optional[forkserver.ForkServer] = None
#: Why the fork server could not start, once it could not: ranks then start as interpreters.
_server_refused: Optional[str] = None


def fork_server(cancel: Optional[CancelToken]) -> Optional[forkserver.ForkServer]:
    """The session's fork server, started on first use (``None`` where ranks start as interpreters).

    Raises:
        Cancelled: ``cancel`` was cancelled while it started.
    """
    global _server, _server_refused
    if not (FORK_SERVER and forkserver.supported()) or _server_refused is not None:
        return None
    with _server_lock:
        if _server is not None and not _server.alive():
            _server.close()
            _server = None
        if _server is None:
            try:
                _server = forkserver.ForkServer.start(_worker_env(), timeout=STARTUP_TIMEOUT,
                                                      stop=lambda: cancel is not None and cancel.cancelled)
            except RuntimeError as error:
                if cancel is not None and cancel.cancelled:
                    raise Cancelled("the run was cancelled during start-up: every rank is stopped; the plan and "
                                    "earlier runs are kept") from None
                _server_refused = str(error)
                warnings.warn(f"rank processes start as new interpreters in this session (slower to start): {error}",
                              RuntimeWarning, stacklevel=2)
                return None
        return _server


def _start_rank(argv: list[str], fd: int, stderr: Any, cancel: Optional[CancelToken]
                ) -> subprocess.Popen[bytes] | forkserver.ForkedProcess:
    """Start one rank: forked by the fork server, else ``python -m pipexplore.executors._worker ARGV``.
    Either way in a session of its own: a Ctrl-C in a terminal reaches this process, which stops it."""
    server = fork_server(cancel)
    if server is not None:
        try:
            return server.spawn(argv, fd, stderr.fileno(), _worker_env())
        except OSError:  # the server died: this rank starts as an interpreter; the next pool, a new server
            pass
    return subprocess.Popen([sys.executable, "-m", "pipexplore.executors._worker", *argv, str(os.getpid())],
                            pass_fds=(fd,), stderr=stderr, env=_worker_env(), start_new_session=True)


#: Modules whose import stopped a fork server (it started a thread or initialised CUDA): each rank
#: imports them itself from then on.
_not_preloaded: set[str] = set()


def preload_modules(names: Sequence[str], cancel: Optional[CancelToken] = None) -> None:
    """Have the session's fork server import ``names`` (installed libraries a job's model is made
    of: :func:`~pipexplore.executors.forkserver.installed_modules`) before it forks ranks for it;
    nothing where ranks start as interpreters. Modules whose import stopped a server are not asked
    for again (the next pool starts another server); a server that fails otherwise is left to the
    next pool."""
    names = [name for name in names if name not in _not_preloaded]
    server = fork_server(cancel) if names else None
    if server is not None:
        try:
            server.preload(names)
        except forkserver.ServerStopped as stopped:
            _not_preloaded.update(stopped.modules or names)
        except OSError:
            pass


def fork_server_pid() -> Optional[int]:
    """The fork server's process id while it runs (an idle spare, not a rank), else ``None``."""
    server = _server
    return server.pid if server is not None and server.alive() else None


class WorkerPool:
    """One worker process per rank, joined in one process group, serving jobs until closed.

    Start-up (process start, imports, process-group rendezvous on a free loopback port) happens
    in the constructor and is measured as :attr:`startup_seconds`; each rank's stderr goes to its
    own file, whose last lines name what happened to a rank that dies.

    Example::

        pool = WorkerPool(2, ["cpu", "cpu"])
        replies = pool.run([pack_job(fn, {}), pack_job(fn, {})], timeout=10.0)
        pool.close()
    """

    def __init__(self, world: int, devices: Sequence[str], cancel: Optional[CancelToken] = None) -> None:
        self.world, self.devices = world, tuple(str(d) for d in devices)
        self.port = _free_port()
        self._processes: list[subprocess.Popen[bytes] | forkserver.ForkedProcess] = []
        self._connections: list[Connection] = []
        self._stderr: list[Any] = []
        self._stderr_start = [0] * world
        started = time.monotonic()
        try:
            for rank in range(world):
                parent_end, child_end = multiprocessing.Pipe()
                stderr = tempfile.TemporaryFile(prefix=f"pipexplore-rank{rank}-", suffix=".stderr")
                self._stderr.append(stderr)
                argv = [str(rank), str(world), str(self.port), str(child_end.fileno()), _backend(self.devices)]
                self._processes.append(_start_rank(argv, child_end.fileno(), stderr, cancel))
                child_end.close()
                self._connections.append(parent_end)
            ready = self._collect(range(world), started + STARTUP_TIMEOUT, lambda waiting: (
                f"the worker processes did not start within {STARTUP_TIMEOUT:g} s: rank(s) {waiting} never "
                "joined the process group; every rank was stopped"), during="start-up", cancel=cancel)
        except BaseException:
            self.close(kill=True)
            raise
        self.pids: list[int] = [int(ready[rank]) for rank in range(world)]
        self.startup_seconds = time.monotonic() - started

    def alive(self) -> bool:
        """Whether every worker is still running (a pool with a dead worker is not reused)."""
        return bool(self._processes) and all(p.poll() is None for p in self._processes)

    def run(self, payloads: Sequence[bytes], timeout: float, cancel: Optional[CancelToken] = None) -> list[Any]:
        """Send ``payloads[rank]`` (from :func:`pack_job`) to each rank; their replies, by rank.

        Raises :class:`DistributedRunError` naming the first rank that failed or died, or the
        ranks still busy after ``timeout`` seconds, and :class:`~pipexplore.cancel.Cancelled` once
        ``cancel`` is cancelled. The caller discards the pool after any error.
        """
        deadline = time.monotonic() + timeout
        sys_path = [p for p in sys.path if isinstance(p, str)]
        for rank, payload in enumerate(payloads):
            self._stderr_start[rank] = os.fstat(self._stderr[rank].fileno()).st_size
            try:
                self._connections[rank].send_bytes(pickle.dumps((sys_path, payload)))
            except OSError:  # it is dead: _collect reads its end and names it
                pass
        replies = self._collect(range(self.world), deadline, lambda waiting: (
            f"the run timed out after {timeout:g} s (timeout={timeout:g}): rank(s) {waiting} did not finish; every "
            "rank was stopped. If the step is just slow, pass a larger timeout="), during="the run", cancel=cancel)
        return [replies[rank] for rank in range(self.world)]

    def _collect(self, ranks: Iterator[int] | range, deadline: float, on_timeout: Callable[[list[int]], str],
                 during: str, cancel: Optional[CancelToken] = None) -> dict[int, Any]:
        replies: dict[int, Any] = {}
        failures: list[tuple[str, int, Any]] = []
        pending = {self._connections[rank]: rank for rank in ranks}
        grace_end: Optional[float] = None
        while pending:
            if cancel is not None and cancel.cancelled:
                raise Cancelled(f"the run was cancelled during {during}: every rank is stopped; the plan and earlier "
                                "runs are kept")
            now = time.monotonic()
            if grace_end is None and now >= deadline:
                raise DistributedRunError(on_timeout(sorted(pending.values())))
            if grace_end is not None and now >= grace_end:
                break
            end = grace_end or deadline
            # (a timed wait even without a token: a Ctrl+C that another thread of this process took is
            # raised here only when this thread runs Python again: see _actions.join_workers)
            # cast: wait returns some of the objects it was given, here the ranks' connections
            for connection in cast(list[Connection], wait(list(pending), timeout=min(end - now, CANCEL_POLL))):
                rank = pending.pop(connection)
                try:
                    status, payload = connection.recv()
                except (EOFError, OSError, pickle.UnpicklingError):
                    failures.append(("died", rank, None))  # exited (or was killed) without reporting
                    continue
                if status in ("ok", "ready"):
                    replies[rank] = payload
                else:
                    failures.append((status, rank, payload))
            if failures and grace_end is None:
                grace_end = time.monotonic() + FAILURE_GRACE
        if failures:
            raise DistributedRunError(self._describe(failures, during))
        return replies

    def _describe(self, failures: list[tuple[str, int, Any]], during: str) -> str:
        """The first rank that died (else the first that raised), with what the others did after it."""
        deaths = [f for f in failures if f[0] == "died"]
        status, rank, payload = (deaths or failures)[0]
        device = self.devices[rank]
        if status == "died":
            try:
                code: Optional[int] = self._processes[rank].wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            tail = self._stderr_tail(rank)
            text = (f"rank {rank} ({device}, pid {self._processes[rank].pid}) {_how_it_ended(code)} during {during}, "
                    "before reporting its result; " + (f"the last lines of its stderr:\n{tail}" if tail else
                                                        "its stderr is empty"))
        elif status == "unpicklable":
            last = payload.strip().splitlines()[-1]
            text = (f"rank {rank} ({device}) could not load the job it was sent: {last}. What the run sends is "
                    "pickled by value only when defined in __main__ or a notebook; anything from a module must be "
                    "importable in the workers (on sys.path, as here), or registered with "
                    f"cloudpickle.register_pickle_by_value(module).\n{payload}")
        else:
            text = f"rank {rank} failed:\n{payload}"
        others = sorted({r for _, r, _ in failures} - {rank})
        if others:
            text += f"\n(after it, rank(s) {others} failed too; every rank was stopped)"
        return text

    def _stderr_tail(self, rank: int) -> str:
        fd = self._stderr[rank].fileno()
        start = self._stderr_start[rank]
        data = os.pread(fd, max(0, os.fstat(fd).st_size - start), start)  # pread: the worker shares the offset
        lines = data.decode(errors="replace").rstrip().splitlines()
        return "\n".join(lines[-STDERR_LINES:])

    def close(self, *, kill: bool = False) -> None:
        """Stop every worker and reap it: ask them to exit (or, with ``kill``, terminate them: a rank
        busy in a step or a collective cannot listen), then kill stragglers."""
        if not kill:
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.send_bytes(pickle.dumps(([], None)))
        else:
            for process in self._processes:
                if process.poll() is None:
                    process.terminate()
        deadline = time.monotonic() + (TERMINATE_GRACE if kill else 5.0)
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.poll() is None:
                process.kill()
        for process in self._processes:
            process.wait()
        for connection in self._connections:
            connection.close()
        for stderr in self._stderr:
            stderr.close()
        self._processes, self._connections, self._stderr = [], [], []


_lock = threading.Lock()
_pool: Optional[WorkerPool] = None


@contextlib.contextmanager
def warm_pool(world: int, devices: Sequence[str]) -> Iterator[tuple[WorkerPool, float]]:
    """The pool for ``world`` ranks on ``devices`` and its start-up seconds (0 when it was warm).

    A pool for other ranks or devices, or with a dead worker, is replaced; the pool is
    discarded (every process terminated, killed and reaped) when the block raises,
    KeyboardInterrupt and :class:`~pipexplore.cancel.Cancelled` included; the start-up of a
    new pool stops when this thread's run is cancelled. One run uses the pool at a time.

    Example::

        with warm_pool(2, ["cpu", "cpu"]) as (pool, startup_seconds):
            pool.run(payloads, timeout=30.0)
    """
    global _pool
    with _lock:
        if _pool is not None and ((_pool.world, _pool.devices) != (world, tuple(map(str, devices)))
                                  or not _pool.alive()):
            _pool.close(kill=not _pool.alive())
            _pool = None
        startup_seconds = 0.0
        if _pool is None:
            began = time.monotonic()
            for attempt in range(PORT_TRIES):
                try:
                    _pool = WorkerPool(world, devices, cancel=current_token())
                    break
                except DistributedRunError as error:  # every rank of the failed start is stopped
                    if attempt + 1 == PORT_TRIES or not _port_taken(error):
                        raise
            assert _pool is not None
            startup_seconds = time.monotonic() - began
        try:
            yield _pool, startup_seconds
        except BaseException:
            _pool.close(kill=True)
            _pool = None
            raise


def _port_taken(error: DistributedRunError) -> bool:
    """Whether a pool's start failed because its rendezvous port was taken before rank 0 listened."""
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def shutdown_pool(keep_server: bool = False) -> None:
    """Stop the warm worker processes and the fork server, if any (also done at exit); the next run
    starts new ones. ``keep_server``: stop the ranks only (what they hold is freed), and keep the
    server, so that the next pool forks its ranks at once rather than importing torch again
    (~4.5 s of CPU on a 2-core machine).

    Example::

        pipexplore.executors.distributed.shutdown_pool()
    """
    global _pool, _server, _server_refused
    acquired = _lock.acquire(timeout=10.0)  # a run still in flight at exit: stop its workers anyway
    try:
        if _pool is not None:
            _pool.close(kill=not acquired)
            _pool = None
        if keep_server:
            return
        with _server_lock:
            if _server is not None:
                _server.close()
                _server = None
            _server_refused = None  # the next run tries again
    finally:
        if acquired:
            _lock.release()


atexit.register(shutdown_pool)
