"""The host's cores, and how CPU stages that run at once share them.

Every CPU stage of a step runs at the same time as the others (one worker thread each, or one
process each). Left alone, each would start the host's full count of intra-op threads, and on
``c`` cores ``w`` stages would run ``w·c`` threads that spin against each other: on 2 cores a
2-stage MLP step runs ~1.5× slower, and its time varies far more from step to step. As
``torchrun`` does for its processes, each CPU stage gets its share instead, ``max(1, c // w)``
intra-op threads; the profile times layers with the same share, so that what is predicted is
what runs::

    with sharing_cores(stage_threads(["cpu", "cpu"])):    # 1 thread each on 2 cores
        executor.step(x)

On a virtual machine the cores are not all the host's to give: the hypervisor runs other guests on
them, and what it takes (Linux's *steal* time) slows a measurement as no prediction made before it
can know. :class:`StealMeter` says how much it took while a step was measured::

    meter = StealMeter()
    executor.step(x)
    meter.share()                                          # 0.0 on a quiet machine; nan off Linux
"""
from __future__ import annotations

import contextvars
import ctypes
import math
import os
import socket
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

import torch

__all__ = ["host_cores", "free_port", "core_share", "rank_cores", "RANK_CORES_ENV", "keep_to_rank_cores",
           "stage_threads", "sharing_cores", "use_stage_threads", "as_stage_worker", "stage_worker_matters",
           "CPU_STAT", "cpu_ticks", "StealMeter"]


def free_port() -> int:
    """A TCP port on loopback that no process holds now (the system's choice): for a rendezvous
    whose holder starts later (another process may take it meanwhile; a store that holds its port
    from the start does not have that race: :func:`pipexplore.runs.launch.rendezvous_store`)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def host_cores() -> int:
    """Cores this process may run on: what CPU stages of one host share."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: Set by :func:`pipexplore.runs.launch.launch` for the ranks it starts on this machine: each
#: rank's cores, ``;`` between ranks, ``,`` between cores (``"0;1"``: rank 0 on core 0, rank 1 on 1).
RANK_CORES_ENV = "PIPEXPLORE_RANK_CORES"


def rank_cores(rank: int, world: int, cores: Optional[Sequence[int]] = None) -> Optional[list[int]]:
    """The cores rank ``rank`` of ``world`` ranks that share this host keeps to: its own block of
    ``len(cores) // world`` (of this process's cores, or ``cores``), or None where the ranks
    outnumber the cores (each then goes where the OS puts it).

    Left free, two single-threaded ranks on 2 cores were moved between the cores and now and
    then shared one: the same 2-rank plan's step took 27–30 ms in five launches of six (21.7 in
    the sixth), and 20.7–24.1 ms with each rank on a core of its own (torchrun runs of 8 × Linear
    512, alternately, measured)."""
    available = sorted(cores if cores is not None else (
        os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)))
    if world < 1 or world > len(available) or not 0 <= rank < world:
        return None
    share = len(available) // world
    return available[rank * share:(rank + 1) * share]


def keep_to_rank_cores(rank: int, world: int) -> Optional[list[int]]:
    """Keep this rank (of ``world`` on this host) to its :func:`rank_cores`: the calling thread
    and the threads it starts after (call it before torch's and gloo's threads start); the cores,
    or None where it was left free (too many ranks, no affinity here)."""
    cores = rank_cores(rank, world)
    if cores is None or not hasattr(os, "sched_setaffinity"):
        return None
    os.sched_setaffinity(0, cores)
    return cores


def core_share(workers: int, cores: Optional[int] = None) -> int:
    """Intra-op threads for each of ``workers`` that run at once on this host's cores (or ``cores``)."""
    return max(1, (cores or host_cores()) // workers)


def stage_threads(devices: Sequence[Any], cores: Optional[int] = None) -> Optional[int]:
    """Intra-op threads for each CPU stage when the stages on ``devices`` (names or
    ``torch.device``; one worker each) run at once: the host's cores shared among its CPU
    workers; ``None`` with fewer than two CPU workers (torch's own setting stays)."""
    workers = sum(1 for d in devices if str(d).split(":")[0] == "cpu")
    if workers < 2:
        return None
    return core_share(workers, cores)


@contextmanager
def sharing_cores(threads: Optional[int]) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads (``torch.set_num_threads``), and give the
    same count to the pipeline workers started inside it (:func:`use_stage_threads` at their
    start); restore this thread's count after it. Blocks in different threads may overlap (two
    explorers running at once): each worker sets its own count as it starts, so one block ending
    does not change the threads of another's. ``None``: nothing changes."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    token = _stage_threads.set(threads)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        _stage_threads.reset(token)
        torch.set_num_threads(before)


def use_stage_threads() -> None:
    """In a pipeline worker thread (started in a copy of the caller's context): take the intra-op
    threads of the enclosing :func:`sharing_cores` block, if any."""
    threads = _stage_threads.get()
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


_stage_threads: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("pipexplore_stage_threads",
                                                                                default=None)


T = TypeVar("T")


def stage_worker_matters(device: torch.device) -> bool:
    """Whether work on ``device`` runs differently in a stage's worker thread than here (see
    :func:`as_stage_worker`): CPU work with two or more intra-op threads."""
    return device.type == "cpu" and torch.get_num_threads() > 1


def as_stage_worker(work: Callable[[], T]) -> T:
    """``work()`` run as a CPU stage's worker runs it: in a thread of its own (a copy of this
    context) with this thread's intra-op threads; its result returned, its error raised here.

    Where it matters: OpenMP (libgomp) keeps a pool of threads for each thread that has run a
    parallel region, and once the pools outnumber the cores it stops spinning between regions.
    The notebook's main thread keeps its pool for good, so a worker thread's layers with two or
    more intra-op threads run slower than the same layers in the main thread (~2× for a
    transformer block on 2 cores: 27–35 ms against 14–19 ms); with one thread there is no
    region and no difference. A profile timed in the main thread would predict the fast one.
    """
    threads = torch.get_num_threads()
    context = contextvars.copy_context()
    outcome: dict[str, Any] = {}

    def run() -> None:
        torch.set_num_threads(threads)
        try:
            outcome["value"] = work()
        except BaseException as exc:  # raised in the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=context.run, args=(run,), name="pipexplore-stage-worker", daemon=True)
    try:  # (start() inside: an interrupt that comes as the work begins, before start() returns, stops it too)
        worker.start()
        while worker.is_alive():
            worker.join(0.05)
    except BaseException:  # the caller interrupted (Ctrl+C, the kernel's interrupt): the work stops too
        if worker.ident is not None:  # started
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident),
                                                       ctypes.py_object(KeyboardInterrupt))
            worker.join()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


#: Where Linux counts the host's CPU time, by kind, since boot.
CPU_STAT = "/proc/stat"


def cpu_ticks(path: str = CPU_STAT) -> Optional[tuple[int, int]]:
    """The host's CPU time so far, in the kernel's ticks, from ``path``'s ``cpu`` line (``user nice
    system idle iowait irq softirq steal …``): the part the hypervisor gave other guests (steal), and
    all of it (the first eight fields; guest time is inside user's). None where there is no such
    file or line (not Linux)."""
    try:
        with open(path) as stat:
            for line in stat:
                fields = line.split()
                if fields and fields[0] == "cpu":
                    ticks = [int(value) for value in fields[1:9]]
                    return (ticks[7], sum(ticks)) if len(ticks) == 8 else None
    except (OSError, ValueError):
        return None
    return None


class StealMeter:
    """The share of the host's CPU time the hypervisor gave to other guests from this meter's start
    to each :meth:`share` (see the module docstring); ``path``: where the kernel counts it."""

    #: Fewer ticks than this (the kernel counts 100 a second a core) say too little to share out.
    MIN_TICKS = 20

    def __init__(self, path: str = CPU_STAT) -> None:
        self.path = path
        self.start = cpu_ticks(path)

    def share(self) -> float:
        """Stolen ticks over all ticks since the start: 0 to 1; nan where the kernel does not count
        them, or fewer than :attr:`MIN_TICKS` have passed (on two cores, a window under 0.1 s)."""
        now = cpu_ticks(self.path)
        if self.start is None or now is None or now[1] - self.start[1] < self.MIN_TICKS:
            return math.nan
        return (now[0] - self.start[0]) / (now[1] - self.start[1])
