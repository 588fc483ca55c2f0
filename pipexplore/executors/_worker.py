"""Entry point of one pool worker process: ``python -m pipexplore.executors._worker RANK WORLD PORT FD BACKEND``.

The worker is started by :class:`pipexplore.executors.pool.WorkerPool` with a clean main module (this
one), so a user's script is never re-run in it. It joins the process group once, reports
``("ready", pid)`` on the pipe whose file descriptor it was given, then runs jobs until told to
exit or until the pipe closes: each job is ``(sys_path, payload)`` where ``payload`` is the
cloudpickled ``(function, kwargs)``; it answers ``("ok", function(rank, world, **kwargs))``,
``("error", traceback)`` or ``("unpicklable", traceback)``. It exits on its own when the process
that started it is gone.

Example::

    python -m pipexplore.executors._worker 0 2 29500 5 gloo      # what the pool runs; not for users
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

__all__ = ["main", "GROUP_TIMEOUT", "exit_with_parent"]

#: How long one collective or point-to-point operation may wait inside the process group. The
#: pool enforces each run's own ``timeout`` from the parent and kills the workers past it.
GROUP_TIMEOUT = timedelta(hours=1)


def exit_with_parent(parent_pid: int) -> None:
    """Leave at once when the process that started this rank is gone (killed kernel, crashed
    script, closed fork server). ``parent_pid`` is the one its starter named, not read here: a
    parent that ended before this thread began would otherwise be taken for its successor."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def _set_threads(rank: int, world: int, backend: str) -> None:
    """Share the CPU cores among the ranks (as torchrun does), each rank on cores of its own
    (:func:`pipexplore.host.keep_to_rank_cores`), unless the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in os.environ or backend == "nccl":
        return
    import torch

    from pipexplore.host import core_share, keep_to_rank_cores

    keep_to_rank_cores(rank, world)
    torch.set_num_threads(core_share(world))


def main(argv: list[str] | None = None, parent: int | None = None) -> None:
    """Run one rank of the pool: join the process group, then serve jobs until told to exit.
    ``argv``: rank, world, port, the pipe's fd, the backend and (for an interpreter) the pid of
    the process that started it; ``parent``: that pid, from a fork server, which knows its own."""
    argv = list(argv or sys.argv[1:])
    rank, world, port, fd = (int(v) for v in argv[:4])
    backend = argv[4]
    if parent is None:
        parent = int(argv[5]) if len(argv) > 5 else os.getppid()
    faulthandler.enable()  # a crash in native code leaves its stack in this rank's captured stderr
    threading.Thread(target=exit_with_parent, args=(parent,), daemon=True).start()
    connection = Connection(fd)
    import torch.distributed as dist

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        _set_threads(rank, world, backend)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
        connection.send(("ready", os.getpid()))
    except BaseException:
        connection.send(("error", traceback.format_exc()))
        sys.exit(1)
    try:
        while True:
            try:
                message = connection.recv_bytes()
            except EOFError:
                break
            sys_path, payload = pickle.loads(message)
            if payload is None:  # the pool shuts down
                break
            sys.path[:0] = [p for p in sys_path if p not in sys.path]
            try:
                function, kwargs = pickle.loads(payload)  # cloudpickle's output loads with plain pickle
            except BaseException:
                connection.send(("unpicklable", traceback.format_exc()))
                continue
            try:
                connection.send(("ok", function(rank, world, **kwargs)))
            except BaseException:
                connection.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        connection.close()


if __name__ == "__main__":
    main()
