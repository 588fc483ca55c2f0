"""Launch the exported script under ``torchrun`` node agents from here, as a cluster would.

:func:`write_hooks` writes the hooks module the script imports (``build_model``, ``get_batch``,
``loss_fn``, ``build_optimizer``) for a model, batch, loss and optimizer sent by value with
cloudpickle, as the processes executor ships its jobs. :func:`launch` starts ``nodes`` agents
(``torchrun --nnodes N --nproc-per-node M --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT``:
torch's elastic agent, its rendezvous and its failure handling; no launcher of our own), each in
its own process group, and waits: progress from the steps the script prints, Cancel from the
run's :class:`~pipexplore.cancel.CancelToken`. The rendezvous store the agents meet at is
hosted here, on a port it holds from the moment it is chosen
(``--rdzv-conf is_host=false``): an agent that hosted it would bind the port seconds later, once
it has imported torch, and a port another process took meanwhile made the agents wait on a
socket that is not a store until the run's timeout. Every rank of every agent runs on this machine,
so they share its cores: ``OMP_NUM_THREADS`` is ``max(1, cores // ranks)`` unless the caller's
environment sets it (torchrun sets 1 only for an agent of several ranks; an agent of one leaves
its rank a thread per core, and two such ranks on 2 cores then spin against each other: 42–67
ms a step against 17–22 ms, measured). A rank that fails is named from torchrun's own
report (rank, host, exit code); on a failure, a timeout or a cancel every agent and every worker
is stopped (SIGTERM, then SIGKILL) and reaped, and none is left behind.

Example::

    write_hooks(folder, model, sample, target, loss_fn, optimizer)
    outcome = launch(folder / "train_pipeline.py", nodes=2, nproc_per_node=2,
                     args=["--record", str(folder / "run")], timeout=300)
"""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from pipexplore.cancel import Cancelled, current_token
from pipexplore.host import RANK_CORES_ENV, core_share, free_port, rank_cores

__all__ = ["TorchrunError", "LaunchOutcome", "launch", "write_hooks", "free_port", "torchrun_failures",
           "HOOKS_MODULE", "STEP_LINE", "printed_losses", "rank_environment", "steps_done", "rendezvous_store",
           "StepProgress", "last_words", "worth_quoting"]

HOOKS_MODULE = "pipexplore_run_hooks"
#: After the first agent fails, seconds the others get to fail on their own (their reports name
#: their ranks) before they are stopped.
FAILURE_GRACE = 15.0
#: Seconds an agent may take to stop its workers after SIGTERM before everything left is killed.
TERMINATE_GRACE = 5.0
POLL = 0.1
#: A step's line as the script prints it, behind torchrun's rank prefix: ``[default3]:step 0 loss=1.0 time=40.1ms``.
STEP_LINE = re.compile(r"^(?:\[\D*(?P<rank>\d+)\]:)?step (?P<step>\d+) loss=(?P<loss>\S+)", re.M)

_HOOKS_SOURCE = '''"""The explorer's model, batch, loss and optimizer (cloudpickled) as the exported script's hooks."""
import pathlib
import sys

import cloudpickle

# What the explorer's process could import, its classes and functions pickled by reference too.
sys.path[:0] = [path for path in {sys_path!r} if path not in sys.path]
_JOB = cloudpickle.loads(pathlib.Path(__file__).with_name("pipexplore_run_job.pkl").read_bytes())
loss_fn = _JOB["loss_fn"]
if _JOB["optimizer"] is not None:
    build_optimizer = _JOB["optimizer"]


def build_model():
    return _JOB["model"]


def get_batch():
    return _JOB["inputs"], _JOB["target"]
'''


class TorchrunError(RuntimeError):
    """The torchrun run failed: ``rank``, ``host`` and ``exitcode`` of its first failure (as
    torchrun reported it; None where it did not), the message quoting its report."""

    def __init__(self, message: str, rank: Optional[int] = None, host: Optional[str] = None,
                 exitcode: Optional[int] = None) -> None:
        super().__init__(message)
        self.rank, self.host, self.exitcode = rank, host, exitcode


@dataclass
class LaunchOutcome:
    """What the agents printed (stdout, stderr of each) and the wall time from launch to the last exit."""

    stdout: list[str]
    stderr: list[str]
    seconds: float


def rendezvous_store(timeout: Optional[float]) -> Any:
    """A TCP store on loopback for the agents' c10d rendezvous, on a port the system chose and the
    store holds (no other process can take it between the choice and the agents' start)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                    timeout=timedelta(seconds=max(60.0, timeout or 0.0) + 60.0))


def write_hooks(folder: pathlib.Path, model: Any, inputs: Any, target: Any, loss_fn: Any, optimizer: Any) -> str:
    """Write the hooks module (and its pickled job) into ``folder``; returns the module's name."""
    import cloudpickle

    folder.mkdir(parents=True, exist_ok=True)
    job = {"model": model, "inputs": inputs, "target": target, "loss_fn": loss_fn, "optimizer": optimizer}
    (folder / "pipexplore_run_job.pkl").write_bytes(cloudpickle.dumps(job))
    sys_path = [path for path in sys.path if isinstance(path, str) and path]
    (folder / f"{HOOKS_MODULE}.py").write_text(_HOOKS_SOURCE.replace("{sys_path!r}", repr(sys_path)))
    return HOOKS_MODULE


_FAILURE = re.compile(r"\[\d+\]:\s*\n\s*time\s*:\s*(?P<time>.*)\n\s*host\s*:\s*(?P<host>.*)\n\s*rank\s*:\s*"
                      r"(?P<rank>-?\d+)[^\n]*\n\s*exitcode\s*:\s*(?P<code>-?\d+)")


def torchrun_failures(stderr: str) -> list[dict[str, Any]]:
    """The failures torchrun's agent reported (its ``ChildFailedError`` summary): time, host,
    rank, exit code of each, the root cause first."""
    found = []
    for match in _FAILURE.finditer(stderr):
        found.append({"time": match["time"].strip(), "host": match["host"].strip(), "rank": int(match["rank"]),
                      "exitcode": int(match["code"])})
    return found


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop(agents: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every agent (torchrun stops its workers), then SIGKILL whatever is left: the
    agents' process groups and every worker's (each worker runs in a session of its own)."""
    below = {pid for agent in agents if agent.poll() is None for pid in _descendants(agent.pid)}
    for agent in agents:
        if agent.poll() is None:
            _signal_group(agent.pid, signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE
    for agent in agents:
        try:
            agent.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for agent in agents:
        below |= set(_descendants(agent.pid)) if agent.poll() is None else set()
        _signal_group(agent.pid, signal.SIGKILL)
    for pid in below:
        _signal_group(pid, signal.SIGKILL)
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for agent in agents:
        agent.wait()


def rank_environment(folder: pathlib.Path, world: int, env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of the ranks of a run of ``world`` ranks on this machine (``env``, or this
    process's): ``folder`` (the script's) on ``PYTHONPATH``, ``OMP_NUM_THREADS`` a share of the
    cores and each rank's own block of them (:data:`~pipexplore.host.RANK_CORES_ENV`, which the
    exported script keeps to), unless ``env`` sets them."""
    environment = dict(os.environ if env is None else env)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), environment.get("PYTHONPATH", "")]))
    environment.setdefault("OMP_NUM_THREADS", str(core_share(world)))
    blocks = [rank_cores(rank, world) for rank in range(world)]
    if all(blocks):  # each rank on cores of its own (the exported script keeps to them)
        environment.setdefault(RANK_CORES_ENV, ";".join(",".join(map(str, block)) for block in blocks if block))
    return environment


class StepProgress:
    """Says through ``progress`` (if any), when it changes, how many of ``steps`` the ranks of
    ``what`` have printed into ``outputs`` so far; called with the seconds since their start."""

    def __init__(self, progress: Optional[Callable[[str], None]], outputs: Sequence[pathlib.Path], steps: int,
                 what: str) -> None:
        self.progress, self.outputs, self.steps, self.what = progress, outputs, steps, what
        self.said = -1

    def __call__(self, seconds: float) -> None:
        if self.progress is None:
            return
        done = steps_done(self.outputs)
        if done != self.said:
            self.said = done
            self.progress(f"{self.what}, step {done} of {self.steps}" if done else
                          f"{self.what} starting ({seconds:.0f} s)")


def steps_done(outputs: Sequence[pathlib.Path]) -> int:
    """Steps the script's ranks have printed so far into ``outputs`` (:data:`STEP_LINE`)."""
    done = 0
    for path in outputs:
        try:
            done += len(STEP_LINE.findall(path.read_text()))
        except OSError:
            pass
    return done


def launch(script: pathlib.Path, *, nodes: int, nproc_per_node: int, args: Sequence[str] = (),
           env: Optional[dict[str, str]] = None, timeout: Optional[float] = None, steps: int = 0,
           progress: Optional[Callable[[str], None]] = None) -> LaunchOutcome:
    """Run ``script`` under ``nodes`` torchrun node agents of ``nproc_per_node`` ranks each on this
    machine (c10d rendezvous on a free loopback port; gloo on CPUs), the script's folder on the
    path; wait for all of them.

    Raises:
        TorchrunError: an agent exited with an error (the rank, host and exit code torchrun
            reported), or the run took longer than ``timeout`` seconds; every process is stopped.
        pipexplore.cancel.Cancelled: the run's cancel token was cancelled; every process is stopped.
    """
    folder = script.parent
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    command = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    store = rendezvous_store(timeout)  # held until every agent is gone
    port = store.port
    command += ["--nnodes", str(nodes), "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=false", "--rdzv-id",
                f"pipexplore-{port}", "--max-restarts", "0",
                "--tee", "3"]  # each rank's lines prefixed with its rank ("[default3]:"), and kept in --log-dir
    environment = rank_environment(folder, nodes * nproc_per_node, env)
    token = current_token()
    outs = [folder / f"agent-{n}.out" for n in range(nodes)]
    errs = [folder / f"agent-{n}.err" for n in range(nodes)]
    agents: list[subprocess.Popen] = []
    started = time.monotonic()
    try:
        for n in range(nodes):
            with open(outs[n], "w") as out, open(errs[n], "w") as err:
                agent = [*command, "--log-dir", str(folder / "logs" / f"agent-{n}"), str(script), *args]
                agents.append(subprocess.Popen(agent, cwd=folder, env=environment, stdout=out, stderr=err,
                                               stdin=subprocess.DEVNULL, start_new_session=True))
        failed_at: Optional[float] = None
        first_failed: Optional[int] = None
        say = StepProgress(progress, outs, steps, f"torchrun: {nodes} node agents × {nproc_per_node} ranks")
        while any(agent.poll() is None for agent in agents):
            if token is not None and token.cancelled:
                raise Cancelled("the torchrun run was cancelled; its agents and ranks are stopped")
            now = time.monotonic()
            if failed_at is None and any(agent.poll() not in (None, 0) for agent in agents):
                failed_at = now
                first_failed = next(n for n, agent in enumerate(agents) if agent.poll() not in (None, 0))
            if failed_at is not None and now - failed_at > FAILURE_GRACE:
                break
            if timeout is not None and now - started > timeout:
                _stop(agents)
                raise TorchrunError(f"the torchrun run took longer than {timeout:.0f} s and was stopped "
                                    f"(every agent and rank); last words:\n{last_words(errs, 'agent')}")
            say(now - started)
            time.sleep(POLL)
        _stop(agents)  # agents that hung on after another failed; a no-op when all are done
    except BaseException:
        _stop(agents)
        raise
    finally:
        del store  # (closed once the agents are gone)
    seconds = time.monotonic() - started
    stdout = [path.read_text() for path in outs]
    stderr = [path.read_text() for path in errs]
    codes = [agent.returncode for agent in agents]
    if any(codes):
        raise _failure(codes, stderr, first_failed)
    return LaunchOutcome(stdout, stderr, seconds)


def printed_losses(stdout: Sequence[str]) -> dict[int, float]:
    """The loss of each step as the script printed it (the last stage's rank prints them)."""
    return {int(m["step"]): float(m["loss"]) for text in stdout for m in STEP_LINE.finditer(text)}


def last_words(paths: Sequence[pathlib.Path], who: str, lines: int = 15) -> str:
    """The last ``lines`` lines that say something of each file of ``paths`` (the stderr of each
    agent or rank, named ``who`` and its number), each behind ``[who N]``."""
    text = []
    for n, path in enumerate(paths):
        try:
            last = [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-lines:]
        except OSError:
            last = []
        text.append(f"[{who} {n}] " + f"\n[{who} {n}] ".join(last) if last else f"[{who} {n}] (nothing)")
    return "\n".join(text)


def worth_quoting(line: str) -> bool:
    """Whether a rank's line of stderr may say something of its failure: not one of torch's warnings."""
    return "FutureWarning" not in line and "return cls.__new__" not in line


def _failure(codes: Sequence[Optional[int]], stderr: Sequence[str], first: Optional[int] = None) -> TorchrunError:
    """The error of a failed run: the root cause torchrun's first failing agent reported (its rank,
    host and exit code) and that rank's last lines of stderr, then the others it took down."""
    order = ([first] if first is not None else []) + [n for n in range(len(stderr)) if n != first]
    failures = []  # the first failing agent's root cause first, then the rest by time
    for n in order:
        found = torchrun_failures(stderr[n])
        found.sort(key=lambda f: f["exitcode"] in (-signal.SIGTERM, -signal.SIGKILL))  # a rank killed: not a cause
        failures += found
    if not failures:
        agents = ", ".join(f"agent {n} exit code {c}" for n, c in enumerate(codes) if c)
        last = "\n".join(line for text in stderr for line in text.splitlines()[-10:])
        return TorchrunError(f"the torchrun run failed ({agents}) without naming a rank:\n{last}")
    cause, rest = failures[0], failures[1:]
    others = [f"rank {f['rank']} on {f['host']} (exit code {f['exitcode']})" for f in rest
              if (f["rank"], f["exitcode"]) != (cause["rank"], cause["exitcode"])]
    prefix = re.compile(rf"^\[\D*{cause['rank']}\]:")
    said = [prefix.sub("", line) for text in stderr for line in text.splitlines() if prefix.match(line)]
    said = [line for line in said if worth_quoting(line)][-8:]
    message = (f"rank {cause['rank']} on host {cause['host']} exited with code {cause['exitcode']} "
               f"(torchrun's root cause, at {cause['time']})")
    if others:
        message += "; the run stopped the others: " + ", ".join(dict.fromkeys(others))
    message += (":\n" + "\n".join(said)) if said else " (it wrote nothing to stderr)"
    return TorchrunError(message, cause["rank"], cause["host"], cause["exitcode"])
