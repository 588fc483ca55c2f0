"""What the exported ``torchrun`` script records with ``--record DIR``: one file per rank.

Imported by the script only when it records (a plain run needs no pipexplore on the cluster), and
importable from the installed package without the explorer (no widget library). Each rank wraps
its ``torch.distributed.pipelining`` stages as :mod:`pipexplore.executors.distributed` does
(``forward_one_chunk``, ``backward_one_chunk`` — full or input gradient — and
``backward_weight_one_chunk``), and the schedule's point-to-point calls: a ``send`` is the time
the rank took to post it, a ``recv`` the time it waited for its data (both on the rank's own
thread or stream, so a lane never overlaps itself). Marks are CUDA events on a GPU and the host
clock (``perf_counter_ns``) on a CPU, resolved once the run is done, never during a step. Before
the first and after the last step the rank measures its clock against rank 0's (a few round trips
over a gloo group, the one of least round-trip time kept, as NTP does); the loader maps every
event onto rank 0's clock with them.

Files (:data:`FORMAT`, version :data:`VERSION`): ``plan.json`` (rank 0: the plan it ran) and
``rank-{r}.json`` (every rank: its events per measured step, losses, peak memory, host, device,
clock). Each is written whole, to a temporary name then renamed: a file that is there is complete.

Example (what the exported script does)::

    recorder = RankRecorder("runs/7", stages, device, warmup=1, plan=PLAN)
    for step in range(steps):
        recorder.begin_step(step)
        schedule.step(...)
        recorder.optimizer_steps(zip(stages, optimizers))
        recorder.end_step(step, losses)
    recorder.finish()
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import platform
import socket
import time
import uuid
from typing import Any, Iterable, Optional, Sequence

import torch

__all__ = ["FORMAT", "VERSION", "RankRecorder", "plan_id", "rank_file", "PLAN_FILE", "CLOCK_SHIFT_ENV",
           "write_json", "measure_offset"]

FORMAT = "pipexplore-run"
VERSION = 1
PLAN_FILE = "plan.json"
#: Test hook: ``"RANK=SECONDS"`` shifts that rank's clock (a host whose clock is off), e.g. ``"3=5.0"``.
CLOCK_SHIFT_ENV = "PIPEXPLORE_RECORD_CLOCK_SHIFT"
#: Round trips per rank for each clock estimate (the one of least round-trip time is kept).
ROUNDS = 16
#: The plan's fields that say which plan a rank ran (its identity across files).
PLAN_KEYS = ("split_points", "layers", "chunks", "schedule", "stages", "world", "model")


def rank_file(rank: int) -> str:
    return f"rank-{rank}.json"


def plan_id(plan: dict[str, Any]) -> str:
    """A digest of the plan's identity (:data:`PLAN_KEYS`): the same in every rank's file of one run."""
    text = json.dumps({k: plan.get(k) for k in PLAN_KEYS}, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def write_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
    """Write whole or not at all: a temporary file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(payload, allow_nan=True))
    os.replace(temporary, path)


def _clock_shift_ns(rank: int) -> int:
    text = os.environ.get(CLOCK_SHIFT_ENV, "")
    for item in filter(None, text.split(",")):
        who, _, seconds = item.partition("=")
        if who.strip() == str(rank):
            return int(float(seconds) * 1e9)
    return 0


def measure_offset(group: Any, rank: int, world: int, now: Any, rounds: int = ROUNDS) -> tuple[float, float]:
    """This rank's clock minus rank 0's, in seconds, and the round trip it was measured in
    (rank 0: 0, 0). Rank 0 serves each other rank in turn: ``rounds`` exchanges of
    ``(t1) -> (t2, t3)``, the offset of the one of least round trip kept (NTP's estimate:
    ``((t2 - t1) + (t3 - t4)) / 2`` is rank 0 minus this rank). A collective: every rank calls it."""
    import torch.distributed as dist

    best = (0.0, 0.0)
    if rank == 0:
        for peer in range(1, world):
            for _ in range(rounds):
                ask = torch.zeros(1, dtype=torch.int64)
                dist.recv(ask, src=peer, group=group)
                t2 = now()
                dist.send(torch.tensor([t2, now()], dtype=torch.int64), dst=peer, group=group)
    else:
        samples = []
        for _ in range(rounds):
            t1 = now()
            dist.send(torch.tensor([t1], dtype=torch.int64), dst=0, group=group)
            reply = torch.zeros(2, dtype=torch.int64)
            dist.recv(reply, src=0, group=group)
            t4 = now()
            t2, t3 = int(reply[0]), int(reply[1])
            rank0_minus_mine = ((t2 - t1) + (t3 - t4)) / 2
            samples.append(((t4 - t1) - (t3 - t2), -rank0_minus_mine))
        rtt, offset = min(samples)
        best = (offset / 1e9, rtt / 1e9)
    dist.barrier(group=group)
    return best


class RankRecorder:
    """One rank's recording: wraps its stages and the schedule's send/receive, keeps the marks of
    the measured steps (those from ``warmup`` on), measures its clock at the start and the end, and
    writes ``rank-{rank}.json`` (rank 0 also ``plan.json``) in ``directory`` on :meth:`finish`.

    ``plan``: what the script ran (``split_points``, ``layers``, ``chunks``, ``schedule``,
    ``stages``, ``world``, ``model``, and for a mesh ``mesh`` and ``data_parallel``, …);
    ``coordinates``: the rank's place in that mesh (``{"pp": …, "dp": …, "tp": …}``). Constructing
    it is a collective (every rank, once the process group is up): it agrees on a run id and
    measures the clocks.
    """

    def __init__(self, directory: Any, stages: Sequence[Any], device: Any, *, warmup: int,
                 plan: dict[str, Any], coordinates: Optional[dict[str, int]] = None) -> None:
        import torch.distributed as dist

        self.directory = pathlib.Path(directory)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device)
        self.stages = list(stages)
        self.warmup = int(warmup)
        self._shift = _clock_shift_ns(self.rank)
        # Clock round trips on the host, over gloo (NCCL would time its streams, not the hosts).
        self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._origin_ns = self.now()
        box = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        self.run_id = str(box[0])
        self.plan = {**plan, "world": self.world}
        self.coordinates = dict(coordinates) if coordinates else None  # the rank's place in the plan's mesh
        self.plan_id = plan_id(self.plan)
        self.clock: dict[str, Any] = {"origin_ns": self._origin_ns, "shift_injected": self._shift / 1e9}
        self._sync("start")
        self._anchor: Optional[tuple[Any, int]] = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            torch.cuda.synchronize(self.device)
            self._anchor = (event, self.now())
            torch.cuda.reset_peak_memory_stats(self.device)
        self._marks: list[tuple[int, int, int, str, Any, Any]] = []  # step, stage, microbatch, phase, start, end
        self._steps: list[dict[str, Any]] = []
        self._losses: dict[int, list[float]] = {}
        self._step: Optional[int] = None  # the measured step under way (None: not recording)
        self._tags: dict[int, tuple[Any, tuple[int, int, str]]] = {}  # id(op) -> (op, (stage, mb, phase))
        self._works: dict[int, tuple[Any, list[tuple[int, int, str]]]] = {}
        self._restore: list[tuple[Any, str, Any]] = []
        for stage in self.stages:
            self._wrap_stage(stage)
        self._wrap_p2p()

    # -- clocks -------------------------------------------------------------------------------
    def now(self) -> int:
        """This rank's host clock in nanoseconds (monotonic; shifted where a test asks)."""
        return time.perf_counter_ns() + self._shift

    def _sync(self, when: str) -> None:
        offset, rtt = measure_offset(self._group, self.rank, self.world, self.now)
        self.clock[f"at_{when}"] = (self.now() - self._origin_ns) / 1e9
        self.clock[f"offset_{when}"] = offset
        self.clock[f"rtt_{when}"] = rtt

    def mark(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter_ns() + self._shift

    def _seconds(self, mark: Any) -> float:
        if isinstance(mark, int):
            return (mark - self._origin_ns) / 1e9
        assert self._anchor is not None
        event, host_ns = self._anchor
        return (host_ns - self._origin_ns) / 1e9 + event.elapsed_time(mark) / 1e3

    # -- wrapping -----------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._restore.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, replacement)

    def _wrap_stage(self, stage: Any) -> None:
        index = stage.stage_index

        def timed(name: str, phase_of: Any) -> None:
            original = getattr(stage, name)

            def wrapper(chunk: int, *args: Any, **kwargs: Any) -> Any:
                if self._step is None:
                    return original(chunk, *args, **kwargs)
                start = self.mark()
                out = original(chunk, *args, **kwargs)
                self._marks.append((self._step, index, chunk, phase_of(*args, **kwargs), start, self.mark()))
                return out

            self._patch(stage, name, wrapper)

        timed("forward_one_chunk", lambda *a, **k: "forward")
        timed("backward_one_chunk", lambda *a, full_backward=True, **k: "backward" if full_backward else "input_grad")
        timed("backward_weight_one_chunk", lambda *a, **k: "weight_grad")

        def tagging(name: str, phase: str) -> None:
            original = getattr(stage, name)

            def wrapper(chunk: int, *args: Any, **kwargs: Any) -> Any:
                ops = original(chunk, *args, **kwargs)
                if self._step is not None:
                    for op in ops:
                        self._tags[id(op)] = (op, (index, chunk, phase))
                return ops

            self._patch(stage, name, wrapper)

        for name, phase in (("get_fwd_recv_ops", "recv"), ("get_bwd_recv_ops", "recv"),
                            ("get_fwd_send_ops", "send"), ("get_bwd_send_ops", "send")):
            tagging(name, phase)

    def _wrap_p2p(self) -> None:
        from torch.distributed.pipelining import schedules

        batch, wait = schedules._batch_p2p, schedules._wait_batch_p2p

        def batch_p2p(p2p_ops: list, desc: Optional[str] = None) -> list:
            if self._step is None or not p2p_ops:
                return batch(p2p_ops, desc)
            start = self.mark()
            works = batch(p2p_ops, desc)
            end = self.mark()
            tags = [self._tags.pop(id(op), (None, None))[1] for op in p2p_ops]
            sends = {t for t in tags if t is not None and t[2] == "send"}
            for stage, chunk, _ in sorted(sends):
                self._marks.append((self._step, stage, chunk, "send", start, end))
            recvs = [t if t is not None and t[2] == "recv" else None for t in tags]
            if len(works) == len(p2p_ops):
                pairs = [(w, [t]) for w, t in zip(works, recvs) if t is not None]
            else:  # coalesced: every work stands for all the batch's receives
                pairs = [(w, [t for t in recvs if t is not None]) for w in works]
            for work, found in pairs:
                if found:
                    self._works[id(work)] = (work, found)
            return works

        def wait_p2p(work: list) -> Any:
            found = [self._works.pop(id(w))[1] for w in work if id(w) in self._works] if self._works else []
            if self._step is None or not found:
                return wait(work)
            start = self.mark()
            out = wait(work)
            end = self.mark()
            for stage, chunk, phase in sorted({t for tags in found for t in tags}):
                self._marks.append((self._step, stage, chunk, phase, start, end))
            return out

        self._patch(schedules, "_batch_p2p", batch_p2p)
        self._patch(schedules, "_wait_batch_p2p", wait_p2p)

    # -- the steps ----------------------------------------------------------------------------
    def begin_step(self, step: int, record: Optional[bool] = None) -> None:
        """Before ``step``; from ``warmup`` on it is recorded (``record`` says otherwise: every rank
        the same). The ranks meet (a barrier) before the first recorded step only: a barrier every
        step would cost a step on a busy CPU more than the recording does, and the loader tells
        the steps apart by their numbers."""
        import torch.distributed as dist

        record = step >= self.warmup if record is None else record
        if record and not self._steps:
            dist.barrier(group=self._group)
        self._tags.clear()
        self._works.clear()
        if record:
            self._step = step
            self._steps.append({"step": step, "begin": self.mark()})

    def optimizer_steps(self, pairs: Iterable[tuple[Any, Any]]) -> None:
        """Step each ``(stage, optimizer)``, each recorded as its stage's ``optimizer`` event (micro-batch -1)."""
        for stage, optimizer in pairs:
            start = self.mark() if self._step is not None else None
            if optimizer is not None:
                optimizer.step()
            if self._step is not None:
                self._marks.append((self._step, stage.stage_index, -1, "optimizer", start, self.mark()))

    def end_step(self, step: int, losses: Sequence[Any] = ()) -> None:
        """After ``step``: its micro-batches' losses (the last stage's rank has them)."""
        if losses:
            self._losses[step] = [float(loss.detach()) for loss in losses]
        if self._step is not None:
            self._steps[-1]["end"] = self.mark()
        self._step = None

    def finish(self) -> pathlib.Path:
        """Measure the clock again, resolve the marks, write this rank's file (and rank 0 the plan's).
        A collective. Returns this rank's file."""
        import torch.distributed as dist

        for owner, name, original in reversed(self._restore):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._restore.clear()
        peak = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = float(torch.cuda.max_memory_allocated(self.device))
        self._sync("end")
        steps = []
        for entry in self._steps:
            k = entry["step"]
            events = [[stage, chunk, phase, self._seconds(start), self._seconds(end)]
                      for s, stage, chunk, phase, start, end in self._marks if s == k]
            steps.append({"step": k, "begin": self._seconds(entry["begin"]),
                          "end": self._seconds(entry["end"]) if "end" in entry else None, "events": events})
        try:
            import resource

            rss = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        except (ImportError, OSError):  # pragma: no cover - not on Linux
            rss = None
        payload = {
            "format": FORMAT, "version": VERSION, "kind": "rank", "run_id": self.run_id, "plan_id": self.plan_id,
            "plan": {k: self.plan.get(k) for k in PLAN_KEYS}, "rank": self.rank, "world": self.world,
            "local_rank": int(os.environ.get("LOCAL_RANK", self.rank)),
            "node": int(os.environ.get("GROUP_RANK", 0)), "host": socket.gethostname(), "pid": os.getpid(),
            "device": str(self.device), "device_name": (torch.cuda.get_device_name(self.device)
                                                        if self.device.type == "cuda" else platform.processor()
                                                        or platform.machine()),
            "stages": [stage.stage_index for stage in self.stages], "warmup": self.warmup, "clock": self.clock,
            "steps": steps, "losses": {str(k): v for k, v in sorted(self._losses.items())},
            "peak_memory": peak, "peak_rss": rss, "threads": torch.get_num_threads(),
            "cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch": torch.__version__, "coordinates": self.coordinates,
        }
        path = self.directory / rank_file(self.rank)
        write_json(path, payload)
        if self.rank == 0:
            layers, points = self.plan.get("layers") or [], self.plan.get("split_points") or []
            write_json(self.directory / PLAN_FILE, {
                "format": FORMAT, "version": VERSION, "kind": "plan", "run_id": self.run_id, "plan_id": self.plan_id,
                **self.plan, "splits": [layers.index(p) for p in points] if set(points) <= set(layers) else None,
                "nodes": int(os.environ.get("GROUP_WORLD_SIZE", 1)),
                "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", self.world)), "warmup": self.warmup,
                "backend": dist.get_backend(), "torch": torch.__version__})
        dist.barrier(group=self._group)
        return path


_MISSING = object()
