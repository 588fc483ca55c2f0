"""The exported script's ranks forked here: what ``torchrun --nproc-per-node N`` starts on one
machine, without its agent and without each rank's imports.

A mesh planned on this machine's CPUs runs as the exported ``torchrun`` script's ranks. Started by
torchrun's agent, each rank is a new interpreter that imports torch, its pipelining and the model's
library before any work (3.5–6 s of CPU a rank on a small machine, the agent ~1.6 s more), and
every rerun pays them again. :func:`launch_forked` forks each rank from the session's fork server
(:mod:`pipexplore.executors.forkserver`: torch and its pipelining imported once, the model's
installed library on request) with the environment torchrun's agent gives a rank (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` of a rendezvous store held here with ``TORCHELASTIC_USE_AGENT_STORE``, as an agent
holds it) and runs the script as ``__main__``: the same script, arguments and process group.

It waits as :func:`~pipexplore.runs.launch.launch` does: progress from the steps the script prints,
Cancel from the run's :class:`~pipexplore.cancel.CancelToken`, a timeout. A rank that fails is named
(rank, host, exit code and its last lines of stderr; of several, the one that failed first, as
each stamps its failure on its stderr file), and on a failure, a timeout or a cancel every rank is
stopped and reaped. Where ranks cannot be forked (no fork server on this platform, or it could not
start) the script runs under one torchrun agent instead.

Example::

    outcome = launch_forked(folder / "train_pipeline.py", ranks=4, args=["--record", str(folder / "run")],
                            timeout=300)
"""
from __future__ import annotations

import pathlib
import socket
import subprocess
import tempfile
import time
from typing import Callable, Optional, Sequence

from pipexplore.cancel import Cancelled, current_token
from pipexplore.executors import forkserver, pool
from pipexplore.runs.launch import (POLL, TERMINATE_GRACE, LaunchOutcome, StepProgress, TorchrunError, last_words,
                                    launch, rank_environment, rendezvous_store, worth_quoting)

__all__ = ["launch_forked", "rank_variables"]

#: Lines of a failed rank's stderr quoted in the error.
STDERR_LINES = 20


def rank_variables(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun's agent sets for rank ``rank`` of ``world`` on one node, whose rendezvous
    store (the agent's) listens on ``port`` of loopback."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": f"pipexplore-{port}", "PYTHONUNBUFFERED": "1"}


def launch_forked(script: pathlib.Path, *, ranks: int, args: Sequence[str] = (), env: Optional[dict[str, str]] = None,
                  timeout: Optional[float] = None, steps: int = 0, progress: Optional[Callable[[str], None]] = None,
                  preload: Sequence[str] = ()) -> LaunchOutcome:
    """Run ``script`` as ``ranks`` ranks on this machine, forked from the session's fork server
    (``preload``: installed modules it imports first, once a session: the model's library), with
    torchrun's environment for each; wait for all of them. The outcome's stdout and stderr are
    each rank's lines, prefixed with its rank as torchrun's ``--tee`` prefixes them.

    Raises:
        TorchrunError: a rank exited with an error (named: rank, host, exit code, its last words),
            or the run took longer than ``timeout`` seconds; every rank is stopped.
        pipexplore.cancel.Cancelled: the run's cancel token was cancelled; every rank is stopped.
    """
    token = current_token()
    if preload:
        pool.preload_modules(preload, token)
    server = pool.fork_server(token)
    if server is None:  # (ranks cannot be forked here: torchrun's agent starts them)
        return launch(script, nodes=1, nproc_per_node=ranks, args=args, env=env, timeout=timeout, steps=steps,
                      progress=progress)
    # (each rank's stdout and stderr in a folder of their own: the script's may be the user's)
    with tempfile.TemporaryDirectory(prefix="pipexplore-ranks-") as outputs:
        outs = [pathlib.Path(outputs, f"rank-{rank}.out") for rank in range(ranks)]
        errs = [pathlib.Path(outputs, f"rank-{rank}.err") for rank in range(ranks)]
        store = rendezvous_store(timeout)  # held until every rank is gone
        environment = rank_environment(script.parent, ranks, env)
        say = StepProgress(progress, outs, steps, f"{ranks} ranks here")
        processes: list[forkserver.ForkedProcess] = []
        started = time.monotonic()
        try:
            for rank in range(ranks):
                with open(outs[rank], "w") as out, open(errs[rank], "w") as err:
                    processes.append(server.spawn_script(str(script), list(args), out.fileno(), err.fileno(),
                                                         {**environment, **rank_variables(rank, ranks, store.port)}))
            while any(process.poll() is None for process in processes):
                if any(process.poll() not in (None, 0) for process in processes):
                    break
                if token is not None and token.cancelled:
                    raise Cancelled("the run was cancelled; its ranks are stopped")
                now = time.monotonic()
                if timeout is not None and now - started > timeout:
                    raise TorchrunError(f"the run took longer than {timeout:.0f} s and was stopped (every rank); "
                                        f"last words:\n{last_words(errs, 'rank', STDERR_LINES)}")
                say(now - started)
                time.sleep(POLL)
            failed = [process for process in processes if process.poll() not in (None, 0)]
            first = _failed_first(processes, failed, errs, server)
            _stop(processes)  # the others, once one failed (they would wait on it until gloo's timeout)
        except BaseException:
            _stop(processes)
            raise
        finally:
            del store
        if first is not None:
            raise _failure(processes, first, errs)
        return LaunchOutcome([_prefixed(outs)], [_prefixed(errs)], time.monotonic() - started)


def _failed_first(processes: Sequence[forkserver.ForkedProcess], failed: Sequence[forkserver.ForkedProcess],
                  errs: Sequence[pathlib.Path], server: forkserver.ForkServer
                  ) -> Optional[forkserver.ForkedProcess]:
    """Of the ranks that failed, the one that failed first: the earliest failure its child stamped
    on its stderr file (a rank raises, prints its last words and exits; a peer then finds it gone
    and fails in turn), the order the server reaped them in where two stamps are alike."""
    if not failed:
        return None
    reaped = server.exited_first(failed)
    return min(failed, key=lambda process: (forkserver.failed_at(errs[processes.index(process)]),
                                            process is not reaped))


def _stop(processes: Sequence[forkserver.ForkedProcess]) -> None:
    """SIGTERM every rank that runs, SIGKILL what is left after the grace, and reap them all."""
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # (killed below)
            pass
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def _prefixed(paths: Sequence[pathlib.Path]) -> str:
    """Every rank's lines, each behind ``[defaultRANK]:``."""
    lines = []
    for rank, path in enumerate(paths):
        lines += [f"[default{rank}]:{line}\n" for line in _read(path).splitlines()]
    return "".join(lines)


def _read(path: pathlib.Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _failure(processes: Sequence[forkserver.ForkedProcess], first: forkserver.ForkedProcess,
             errs: Sequence[pathlib.Path]) -> TorchrunError:
    """The error of a failed run: the rank that failed first, its exit code and last words, then
    the others that failed or were stopped."""
    rank, host, code = processes.index(first), socket.gethostname(), first.returncode
    others = [f"rank {n} (exit code {p.returncode})" for n, p in enumerate(processes)
              if p is not first and p.returncode != 0]
    said = [line for line in _read(errs[rank]).splitlines() if line.strip() and worth_quoting(line)][-STDERR_LINES:]
    message = f"rank {rank} on host {host} exited with code {code}"
    if others:
        message += "; the run stopped the others: " + ", ".join(others)
    message += (":\n" + "\n".join(said)) if said else " (it wrote nothing to stderr)"
    return TorchrunError(message, rank, host, code)
