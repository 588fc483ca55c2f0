"""A fork server for pool workers: one process that imports torch once and forks each rank from it.

Starting a rank as a new interpreter costs its imports (torch alone: ~3.5 s of CPU on a small
machine), paid again by every pool that replaces one after a failure, a timeout or a cancel. The
fork server (``python -m pipexplore.executors.forkserver FD``) pays them once: it imports torch,
``torch.distributed``, ``torch.distributed.pipelining`` (every rank's stages and schedule: it
brings in torch's compiler and DTensor, ~2 s of CPU more a rank), cloudpickle and pipexplore,
touches nothing that starts threads or a device, and then forks one child per request. Each
child is what ``python -m pipexplore.executors._worker`` would be (its own session, its own
stderr file, the caller's environment and working directory at the time of the request, fresh
random state) and runs :func:`pipexplore.executors._worker.main`; or, asked for a script
(:meth:`ForkServer.spawn_script`), is what ``python SCRIPT ARGS`` would be: the exported
``torchrun`` script's rank, started in milliseconds (:mod:`pipexplore.runs.forked`).

A server may also import more on request (:meth:`ForkServer.preload`): the pool asks it for the
modules of installed libraries a job's model is made of (:func:`installed_modules`: a Hugging Face
model's ``transformers`` modules, ~1.5 s of CPU a rank), so that ranks forked later have them. A
module of the user's own (a notebook's, a source tree's, an editable install's) is never preloaded:
each rank imports it as it is at the rank's start, edits included. An import that starts a thread
(a child forked then could inherit a lock that thread holds) or initialises CUDA stops the server:
the next pool starts another, and the pool does not ask for those modules again.

The caller holds a :class:`ForkedProcess` per child, with the part of :class:`subprocess.Popen`
that the pool uses (``pid``, ``poll``, ``wait``, ``terminate``, ``kill``): the server reaps its
children and reports each exit status (a negative code for a signal, as ``Popen`` does).

How it ends: :meth:`ForkServer.close` (called by :func:`pipexplore.executors.pool.shutdown_pool`,
so at exit too) stops it; it leaves by itself when the process that started it is gone, and its
children then leave too (each watches its parent, the server). On platforms without ``fork``
(anything but Linux here: forking a process that has imported torch is unsafe on macOS) the pool
starts each rank as a new interpreter, as it did before; so it does, after one warning, where the
server cannot start (an import fails, or an import initialised CUDA, which a forked child could
not use), until :func:`~pipexplore.executors.pool.shutdown_pool`.

Why one module: the caller's end (:class:`ForkServer`, :class:`ForkedProcess`) and the server's
loop speak one protocol (the requests, the messages back, what a child does with the descriptors it
is sent), which is read and changed together.

Example::

    server = ForkServer.start(env=dict(os.environ))
    child = server.spawn(["0", "2", "29500", str(fd), "gloo"], pass_fd=fd, stderr_fd=err.fileno())
    child.wait(timeout=10)
    server.close()
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional, Sequence

__all__ = ["ForkServer", "ForkedProcess", "ServerStopped", "supported", "installed_modules", "failed_at", "PRELOAD"]

#: Modules the server imports before it forks: what every rank imports anyway, and the library a
#: rank's job may call (the modules of ``pipexplore``'s public names, which ``import pipexplore``
#: no longer imports: its names are imported on first use).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.pipelining", "cloudpickle", "pipexplore",
           "pipexplore.executors._worker", "pipexplore.executors.distributed", "pipexplore.balance",
           "pipexplore.gpipe", "pipexplore.executors.threads", "pipexplore.models.flatten", "pipexplore.models.profile",
           "pipexplore.profiling.sequential", "pipexplore.predict.simulator")
#: Seconds between the server's looks at its parent.
PARENT_POLL = 0.5
#: The largest message on the control socket (a request carries the caller's environment).
MESSAGE_BYTES = 1 << 20


class ServerStopped(OSError):
    """The server stopped after an import it was asked for: ``modules`` started a thread, or an
    import initialised CUDA (``modules`` then empty: which one is not known)."""

    def __init__(self, message: str, modules: Sequence[str] = ()):
        super().__init__(message)
        #: The modules whose import started a thread.
        self.modules = list(modules)


def installed_modules(model: Any) -> list[str]:
    """The modules defining the classes of ``model`` and its submodules that an installed
    distribution provides (their file lies in a site-packages directory), already imported here and
    not among :data:`PRELOAD`'s packages: what a fork server may import once for every rank to come."""
    import site
    import sysconfig

    roots = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages(),
                                            sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]}
    modules = getattr(model, "modules", None)
    names = {type(m).__module__ for m in modules()} if callable(modules) else {type(model).__module__}
    preloaded = {name.split(".")[0] for name in PRELOAD}
    found = []
    for name in sorted(names):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if name.split(".")[0] in preloaded or not path:
            continue
        if any(os.path.realpath(path).startswith(root + os.sep) for root in roots):
            found.append(name)
    return found


def supported() -> bool:
    """Whether ranks are forked from a server here (Linux); elsewhere each starts a new interpreter."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(socket, "send_fds")


class ForkedProcess:
    """A child of the fork server, as the pool sees a :class:`subprocess.Popen`.

    Its exit status comes from the server, which reaps it: ``returncode`` is ``None`` while it runs,
    then its exit code, or ``-N`` when signal ``N`` ended it.
    """

    def __init__(self, server: "ForkServer", pid: int) -> None:
        self._server = server
        #: The child's process id.
        self.pid = pid
        #: Its exit code once it has ended (``-N``: killed by signal ``N``), else ``None``.
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        """Its exit code if it has ended, else ``None`` (never blocks)."""
        if self.returncode is None:
            self.returncode = self._server._exit_code(self.pid, timeout=0.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for it to end and return its exit code.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        if self.returncode is None:
            self.returncode = self._server._exit_code(self.pid, timeout=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Send it ``signum``, unless it has already ended (its pid may be reused by then)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM)."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Stop it now (SIGKILL)."""
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The server process and the caller's end of its control socket (one caller thread at a time
    talks to it; :meth:`spawn`, the exit codes and :meth:`close` take a lock)."""

    def __init__(self, process: subprocess.Popen[bytes], control: socket.socket, pid: int) -> None:
        self._process = process
        self._control = control
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._imported: Optional[tuple[list[str], Optional[str], list[str]]] = None
        #: Modules imported on request (:meth:`preload`), beside :data:`PRELOAD`.
        self.preloaded: set[str] = set()
        #: The server's process id (its children's parent).
        self.pid = pid

    @classmethod
    def start(cls, env: dict[str, str], timeout: float = 120.0, stop: Callable[[], bool] = lambda: False,
              preload: Optional[Sequence[str]] = None) -> "ForkServer":
        """Start a server with ``env`` and wait until it has imported ``preload`` (:data:`PRELOAD`).

        Raises:
            RuntimeError: it exited (an import failed: its stderr quoted), refused to serve (an
                import initialised CUDA, which a forked child cannot use), did not get ready
                within ``timeout`` seconds, or ``stop()`` became true while it started; it is
                killed and reaped.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Its stderr goes to a file, read if it fails to start: a pipe could fill while it imports,
        # and once closed would break a late write (a warning) of a server that runs for hours.
        stderr = tempfile.TemporaryFile(prefix="pipexplore-forkserver-", suffix=".stderr")
        process = subprocess.Popen([sys.executable, "-m", "pipexplore.executors.forkserver", str(theirs.fileno()),
                                    ",".join(PRELOAD if preload is None else preload), str(os.getpid())],
                                   pass_fds=(theirs.fileno(),), env=env, start_new_session=True,
                                   stderr=stderr, stdin=subprocess.DEVNULL)
        theirs.close()
        deadline = time.monotonic() + timeout
        try:
            while not select.select([ours], [], [], 0.05)[0]:
                if stop():
                    raise RuntimeError("the fork server's start was stopped")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the fork server did not start within {timeout:g} s")
            message = ours.recv(MESSAGE_BYTES)
            if not message:
                process.wait(timeout=5)
                stderr.seek(0)
                raise RuntimeError("the fork server exited while it started: "
                                   + stderr.read().decode(errors="replace")[-2000:])
            status, pid = pickle.loads(message)
            if status != "ready":
                raise RuntimeError(f"the fork server refused to serve: {pid}")
        except BaseException:
            ours.close()
            process.kill()
            process.wait()
            raise
        finally:
            stderr.close()  # (the server keeps its own descriptor of the file; its children get their own)
        return cls(process, ours, pid)

    def alive(self) -> bool:
        """Whether the server still runs."""
        return self._process.poll() is None

    def spawn(self, argv: Sequence[str], pass_fd: int, stderr_fd: int, env: dict[str, str]) -> ForkedProcess:
        """Fork a rank that runs ``_worker.main(argv)`` with ``pass_fd`` as its pipe (``argv[3]`` is
        replaced by the number it has there), its stderr on ``stderr_fd``, ``env`` as its
        environment and this process's working directory as its own.

        Raises:
            OSError: the server is gone or did not answer.
        """
        request = pickle.dumps({"argv": list(argv), "env": env, "cwd": os.getcwd()})
        return self._request(request, [pass_fd, stderr_fd])

    def spawn_script(self, script: str, args: Sequence[str], stdout_fd: int, stderr_fd: int,
                     env: dict[str, str]) -> ForkedProcess:
        """Fork a process that runs ``script`` as ``__main__`` (``sys.argv``: the script, then
        ``args``; its folder first on ``sys.path``), as ``python SCRIPT ARGS`` would with ``env``
        as its environment, this process's working directory, stdout on ``stdout_fd`` and stderr on
        ``stderr_fd``: a rank of an exported script, as torchrun would start it, without its imports.
        Torch's intra-op threads are ``OMP_NUM_THREADS`` of ``env`` where it is set (a new
        interpreter reads it at its start; the fork inherits the server's).

        Raises:
            OSError: the server is gone or did not answer.
        """
        request = pickle.dumps({"script": str(script), "argv": [str(a) for a in args], "env": env, "cwd": os.getcwd()})
        return self._request(request, [stdout_fd, stderr_fd])

    def _request(self, request: bytes, fds: list[int]) -> ForkedProcess:
        with self._lock:
            socket.send_fds(self._control, [request], fds)
            deadline = time.monotonic() + 30.0
            while not self._started:
                if not self._read(max(0.0, deadline - time.monotonic())):
                    raise OSError("the fork server did not answer a request to start a rank")
            return ForkedProcess(self, self._started.pop())

    def exited_first(self, processes: Sequence[ForkedProcess]) -> Optional[ForkedProcess]:
        """Of ``processes`` that have ended, the one whose exit the server reported first (it reaps
        them as they end): the root cause of a failure that took the others down."""
        with self._lock:  # (another caller's thread may be filing exits meanwhile)
            order = {pid: n for n, pid in enumerate(self._exits)}
        ended = [process for process in processes if process.pid in order]
        return min(ended, key=lambda process: order[process.pid]) if ended else None

    def preload(self, names: Sequence[str], timeout: float = 120.0) -> list[str]:
        """Have the server import ``names`` (those not imported yet), so that ranks forked from now
        on have them; a module that fails to import is skipped (each rank then imports it itself).
        Returns the modules it imported.

        Raises:
            ServerStopped: an import started a thread or initialised CUDA; the server has exited
                (the next pool starts another).
            OSError: the server is gone, or did not answer within ``timeout`` seconds.
        """
        missing = [name for name in names if name not in self.preloaded]
        if not missing:
            return []
        with self._lock:
            self._control.send(pickle.dumps({"import": missing}))
            deadline = time.monotonic() + timeout
            while self._imported is None:
                if not self._read(max(0.0, deadline - time.monotonic())):
                    raise OSError(f"the fork server did not import {', '.join(missing)} within {timeout:g} s")
            imported, refused, culprits = self._imported
            self._imported = None
        self.preloaded.update(missing)  # those that failed are not asked for again
        if refused:
            self.close()  # it exits after saying why: gone when this returns
            raise ServerStopped(f"the fork server stopped: {refused}", culprits)
        return imported

    def _read(self, timeout: Optional[float]) -> bool:
        """File the server's next message (a child started or exited, modules imported); ``False``
        after ``timeout``.

        Raises:
            OSError: the server is gone.
        """
        if self._control.fileno() < 0:
            raise OSError("the fork server is closed")
        if not select.select([self._control], [], [], timeout)[0]:
            return False
        data = self._control.recv(MESSAGE_BYTES)
        if not data:
            raise OSError("the fork server is gone")
        message = pickle.loads(data)
        if message[0] == "exit":
            self._exits[message[1]] = message[2]
        elif message[0] == "imported":
            self._imported = (message[1], message[2], message[3])
        else:
            self._started.append(message[1])
        return True

    def _exit_code(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """``pid``'s exit code once the server has reported it; ``None`` if it runs after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    if not self._read(left):
                        return None
                except OSError:  # the server is gone: its children leave after it
                    return self._gone(pid, deadline)
            return self._exits[pid]

    @staticmethod
    def _gone(pid: int, deadline: Optional[float]) -> Optional[int]:
        """Without a server to report it: ``-SIGKILL`` once ``pid`` no longer exists (its real
        status is lost with the server), else ``None`` at ``deadline``."""
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return -int(signal.SIGKILL)
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def close(self) -> None:
        """Stop the server (its children are the pool's to stop) and reap it."""
        with self._lock:
            self._control.close()  # it sees the end of its control socket and exits
            try:
                self._process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


# ---- the server process ------------------------------------------------------------------------

def _name_process(name: str) -> None:
    """Set the name ``ps`` and ``top`` show (Linux; 15 bytes), as far as the platform allows."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def _child(request: dict[str, Any], fds: list[int], closing: list[int], server: int) -> None:
    """In the forked child: become a fresh rank process and run the worker or the script asked for
    (either leaves when ``server``, its parent, is gone); never returns. A child that fails stamps
    the moment it failed on its stderr file (its modification time, to the nanosecond, set last):
    which of several failed ranks failed first (:func:`failed_at`), where the order they are reaped in
    may put a rank whose peer's exit took it down before that peer."""
    code, failed = 1, 0
    try:
        for fd in closing:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setsid()
        pipe_fd, stderr_fd = fds
        if "script" in request:  # (its first descriptor is its stdout)
            os.dup2(pipe_fd, 1)
            os.close(pipe_fd)
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
        os.environ.clear()
        os.environ.update(request["env"])
        try:
            os.chdir(request["cwd"])
        except OSError:  # the caller's directory is gone (a started interpreter would still sit in it)
            pass
        import random

        random.seed()
        if "script" in request:
            _run_script(request["script"], request["argv"], server)
        else:
            argv = list(request["argv"])
            argv[3] = str(pipe_fd)
            _name_process(f"pipexplore-r{argv[0]}")
            from pipexplore.executors import _worker

            _worker.main(argv, parent=server)
        code = 0
    except SystemExit as exit_:  # as an interpreter leaves: None is 0; a message goes to stderr, then 1
        code = 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
        failed = time.time_ns() if code else 0
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:
        failed = time.time_ns()
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if failed:
            try:
                os.utime(2, ns=(failed, failed))
            except OSError:  # (a stderr that is not a file)
                pass
        os._exit(code)


def failed_at(path: str | os.PathLike) -> int:
    """When the rank whose stderr file is ``path`` failed (nanoseconds since the epoch), as its
    forked child stamped it (:func:`_child`); else when it last wrote (0 if there is no file)."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _run_script(script: str, args: list[str], server: int) -> None:
    """In a forked child: run ``script`` as ``python SCRIPT ARGS`` would (its stdout and stderr
    already in place), leaving when ``server`` is gone."""
    import faulthandler
    import runpy

    from pipexplore.executors._worker import exit_with_parent

    _name_process("pipexplore-s" + os.environ.get("RANK", ""))
    faulthandler.enable()  # a crash in native code leaves its stack in the rank's stderr
    threading.Thread(target=exit_with_parent, args=(server,), daemon=True).start()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if threads.isdigit() and int(threads) > 0 and torch is not None:
        torch.set_num_threads(int(threads))
    sys.argv = [script, *args]
    # (as an interpreter starts: the script's folder, then PYTHONPATH's, before what the server had)
    sys.path[:0] = [os.path.dirname(os.path.abspath(script)),
                    *[path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]]
    runpy.run_path(script, run_name="__main__")


def _threads() -> int:
    """This process's threads, Python's and native ones alike."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # pragma: no cover - the server runs on Linux
        return threading.active_count()


def _import(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """Import what can be of ``names``: those imported, and those whose import started a thread."""
    import importlib

    done, threading_ = [], []
    for name in names:
        before = _threads()
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception:  # the rank that needs it imports it and reports what fails there
            pass
        if _threads() > before:
            threading_.append(name)
    return done, threading_


def serve(fd: int, preload: Sequence[str] = PRELOAD, parent: Optional[int] = None) -> None:
    """The server's loop: preload, say ready, then fork on request (or import more) and report
    exits until the control socket closes or the parent is gone. It refuses to serve (and exits)
    where an import initialised CUDA (a forked child cannot use CUDA that its parent initialised),
    or where an import on request started a thread (a forked child could inherit its locks held).
    ``parent``: the caller's pid, as the caller named it (read here it could already be another's)."""
    control = socket.socket(fileno=fd)
    if parent is None:
        parent = os.getppid()
    me = os.getpid()  # the children's parent, named to them before they run (they cannot ask later)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    import importlib

    for name in preload:
        importlib.import_module(name)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        control.send(pickle.dumps(("refused", "an import initialised CUDA, which ranks forked from it could not "
                                              "use")))
        os._exit(0)
    control.send(pickle.dumps(("ready", os.getpid())))
    children: set[int] = set()
    watched: list[socket.socket | int] = [control, wake_read]
    while True:
        ready = select.select(watched, [], [], PARENT_POLL)[0]
        if os.getppid() != parent:
            os._exit(0)  # the caller is gone; the children see this server gone and leave too
        if wake_read in ready:
            try:
                while os.read(wake_read, 512):
                    pass
            except BlockingIOError:
                pass
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            control.send(pickle.dumps(("exit", pid, os.waitstatus_to_exitcode(status))))
        if control in ready:
            data, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 2)
            if not data:
                os._exit(0)
            request = pickle.loads(data)
            if "import" in request:
                imported, culprits = _import(request["import"])
                refused = ("an import initialised CUDA" if torch is not None and torch.cuda.is_initialized() else
                           f"an import started a thread ({', '.join(culprits)})" if culprits else None)
                control.send(pickle.dumps(("imported", imported, refused, culprits)))
                if refused:
                    os._exit(0)
                continue
            pid = os.fork()
            if pid == 0:
                _child(request, list(fds), [control.fileno(), wake_read, wake_write], me)
            for received in fds:
                os.close(received)
            children.add(pid)
            control.send(pickle.dumps(("started", pid)))


if __name__ == "__main__":
    serve(int(sys.argv[1]), [name for name in sys.argv[2].split(",") if name] if len(sys.argv) > 2 else PRELOAD,
          int(sys.argv[3]) if len(sys.argv) > 3 else None)
