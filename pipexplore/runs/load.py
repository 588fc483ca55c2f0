"""Read a run the exported ``torchrun`` script recorded (``--record DIR``), whole or not at all.

:func:`read_run` checks the directory before anything is kept: ``plan.json`` and one
``rank-{r}.json`` per rank of its world, every file complete and of this format's version, all
of one run and one plan, each rank's measured steps holding every (stage, micro-batch) forward
and backward. Anything else is refused with a :class:`RunDirectoryError` that names the file and
what is missing or different. Every rank's events are put on rank 0's clock: its offset,
measured at the start and at the end of the run (NTP-style round trips), is interpolated over the
run where the two differ by more than their round trips allow, so a clock that drifts is
followed (else the better estimate stands); what remains is at most half the round trip of the
estimate used (``clock_residual``).

:func:`plan_of` rebuilds the :class:`~pipexplore.plan.Plan` the run ran on the explorer's layer
table, and :func:`run_result` makes the :class:`~pipexplore.executors.base.RunResult` any executor
gives: the measured step of median time, the first step's loss, the prediction beside it.

Example::

    recorded = read_run("runs/7")
    plan = plan_of(recorded, explorer.layer_table, explorer.plan)
    result = run_result(recorded, plan, samples=64, run=3)
"""
from __future__ import annotations

import json
import math
import pathlib
import socket
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from pipexplore.devices import catalogue_kind, device_kind, planned_devices
from pipexplore.executors.base import RunResult, result
from pipexplore.plan import Plan
from pipexplore.runs.record import FORMAT, PLAN_FILE, PLAN_KEYS, VERSION, plan_id, rank_file
from pipexplore.timeline import COLUMNS, COMPUTE_PHASES
from pipexplore.validate import CHECKPOINTS

__all__ = ["RunDirectoryError", "RecordedRun", "read_run", "run_kind", "plan_of", "run_result", "offset_model",
           "RANK_COLUMNS"]

#: Columns of :meth:`RecordedRun.rank_table`.
RANK_COLUMNS = ["rank", "node", "host", "device", "device_name", "stages", "threads", "cores", "offset_start",
                "offset_end", "drift", "rtt", "peak_memory", "peak_rss"]


class RunDirectoryError(ValueError):
    """A run directory that cannot be loaded whole: the message names the file and what is missing or different."""


@dataclass
class RecordedRun:
    """A recorded run, checked: the plan it ran, each rank's file, each measured step's timeline
    (every rank's events on rank 0's clock, from the step's first event), the losses per step."""

    directory: pathlib.Path
    plan: dict[str, Any]
    ranks: list[dict[str, Any]]
    steps: list[pd.DataFrame]
    losses: dict[int, list[float]] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return int(self.plan["world"])

    @property
    def nodes(self) -> int:
        return int(self.plan.get("nodes") or len({r["node"] for r in self.ranks}))

    @property
    def hosts(self) -> list[str]:
        """The ranks' host names, each once, in rank order."""
        return list(dict.fromkeys(r["host"] for r in self.ranks))

    @property
    def first_loss(self) -> float:
        """The first step's loss (at the model's weights), the mean of its micro-batches'."""
        if not self.losses:
            return math.nan
        first = self.losses[min(self.losses)]
        return sum(first) / len(first)

    @property
    def measured_losses(self) -> list[float]:
        measured = [int(s["step"].iloc[0]) for s in self.steps if "step" in s and len(s)]
        return [sum(self.losses[k]) / len(self.losses[k]) for k in measured if self.losses.get(k)]

    @property
    def clock_residual(self) -> float:
        """Seconds the alignment of clocks may be off at most: half the round trip of the estimates used."""
        return max((offset_model(r["clock"])[3] for r in self.ranks), default=0.0)

    def rank_table(self) -> pd.DataFrame:
        """One row per rank: node, host, device, stages, its clock's offset to rank 0's at the
        start and the end (seconds; ``drift`` their difference, ``rtt`` the round trip of the
        worse estimate), peak memory (GPU bytes allocated) and peak resident memory; ``threads``
        the rank's intra-op threads and ``cores`` the CPU cores it ran on (None in files written
        before they were recorded)."""
        rows = []
        for r in self.ranks:
            clock = r["clock"]
            rows.append((r["rank"], r["node"], r["host"], r["device"], r.get("device_name"), list(r["stages"]),
                         r.get("threads"), r.get("cores"), clock["offset_start"], clock["offset_end"],
                         clock["offset_end"] - clock["offset_start"], max(clock["rtt_start"], clock["rtt_end"]),
                         r.get("peak_memory"), r.get("peak_rss")))
        return pd.DataFrame(rows, columns=RANK_COLUMNS)


def _read(path: pathlib.Path, kind: str) -> dict[str, Any]:
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RunDirectoryError(f"{path.name} in {path.parent} is truncated or not JSON ({exc.msg} at character "
                                f"{exc.pos} of {len(path.read_text())}): the rank did not finish writing it; rerun, "
                                "or copy the file again") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise RunDirectoryError(f"{path.name} in {path.parent} is not a file of a recorded pipexplore run "
                                f"(format {payload.get('format') if isinstance(payload, dict) else None!r})")
    if payload.get("version") != VERSION:
        raise RunDirectoryError(f"{path.name} is of version {payload.get('version')!r} of the run format; this "
                                f"pipexplore reads version {VERSION}: load it with the pipexplore that recorded it")
    if payload.get("kind") != kind:
        raise RunDirectoryError(f"{path.name} holds a {payload.get('kind')!r} record, not a {kind!r} one")
    return payload


def _differences(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    changes = [f"{key} {theirs.get(key)!r} there, {ours.get(key)!r} in {PLAN_FILE}" for key in PLAN_KEYS
               if theirs.get(key) != ours.get(key)]
    return "; ".join(changes) or "its plan digest differs"


def _check_rank(rank: int, payload: dict[str, Any], plan: dict[str, Any]) -> None:
    name = rank_file(rank)
    if payload.get("rank") != rank:
        raise RunDirectoryError(f"{name} holds rank {payload.get('rank')!r}'s record, not rank {rank}'s")
    if payload.get("plan_id") != plan["plan_id"] or plan_id(payload.get("plan", {})) != plan["plan_id"]:
        raise RunDirectoryError(f"{name} is from another plan than {PLAN_FILE}: "
                                f"{_differences(plan, payload.get('plan', {}))}; a directory holds one run")
    if payload.get("run_id") != plan["run_id"]:
        raise RunDirectoryError(f"{name} is from another run of the same plan (run id {payload.get('run_id')!r}, "
                                f"{PLAN_FILE}'s {plan['run_id']!r}): the directory mixes two runs; record each "
                                "run into a directory of its own")
    expected = [int(s) for s in payload.get("stages", [])]
    if not expected or any(not 0 <= s < int(plan["stages"]) for s in expected):
        raise RunDirectoryError(f"{name} ran stages {payload.get('stages')}, not stages of the plan's "
                                f"{plan['stages']}")
    chunks = int(plan["chunks"])
    for step in payload["steps"]:
        seen = {(int(stage), int(mb), "backward" if phase == "input_grad" else phase)
                for stage, mb, phase, _, _ in step["events"]}
        for stage in expected:
            for mb in range(chunks):
                for phase in ("forward", "backward"):
                    if (stage, mb, phase) not in seen:
                        raise RunDirectoryError(f"{name} lacks stage {stage}'s {phase} of micro-batch {mb} in "
                                                f"step {step['step']}: the rank's recording is incomplete")


def offset_model(clock: dict[str, Any]) -> tuple[float, float, float, float]:
    """``(offset, slope, at, residual)``: the rank's clock minus rank 0's is ``offset + slope × (t -
    at)`` at its time ``t``. The two estimates are interpolated (a clock that drifts) where they
    differ by more than their round trips allow; otherwise the one of least round trip stands
    alone (an estimate taken while the machine was busy does not tilt the line). ``residual``:
    half the round trip of what was used, the most the alignment can be off."""
    a0, a1 = float(clock["at_start"]), float(clock["at_end"])
    o0, o1 = float(clock["offset_start"]), float(clock["offset_end"])
    r0, r1 = float(clock["rtt_start"]), float(clock["rtt_end"])
    if abs(o1 - o0) <= (r0 + r1) / 2 or a1 <= a0:
        return (o0, 0.0, a0, r0 / 2) if r0 <= r1 else (o1, 0.0, a1, r1 / 2)
    return o0, (o1 - o0) / (a1 - a0), a0, max(r0, r1) / 2


def _aligned(payload: dict[str, Any], origin0_ns: int) -> list[tuple[int, int, int, str, float, float]]:
    """The rank's events (step, stage, micro-batch, phase, start, end) on rank 0's clock, in seconds
    from rank 0's origin (:func:`offset_model`)."""
    clock = payload["clock"]
    o0, slope, a0, _ = offset_model(clock)
    base = (int(clock["origin_ns"]) - origin0_ns) / 1e9

    def moved(t: float) -> float:
        return base + t - (o0 + slope * (t - a0))

    return [(int(step["step"]), int(stage), int(mb), str(phase), moved(float(start)), moved(float(end)))
            for step in payload["steps"] for stage, mb, phase, start, end in step["events"]]


def read_run(directory: Any) -> RecordedRun:
    """Read and check a recorded run directory (see the module's docstring); refuse it whole.

    Raises:
        FileNotFoundError: no such directory.
        RunDirectoryError: a file missing, truncated, of another version, run or plan, or
            incomplete; the message names it.
    """
    path = pathlib.Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"no run directory {str(path)!r}")
    plan_path = path / PLAN_FILE
    ranks_here = sorted(path.glob("rank-*.json"))
    if not plan_path.exists():
        found = ", ".join(p.name for p in ranks_here) or "no rank files either"
        raise RunDirectoryError(f"{path} has no {PLAN_FILE} (rank 0 writes it when the run ends; found {found}): "
                                "the run did not finish, or the directory was copied in part")
    plan = _read(plan_path, "plan")
    world = int(plan["world"])
    if plan_id(plan) != plan.get("plan_id"):
        raise RunDirectoryError(f"{PLAN_FILE} was changed after the run: its fields no longer match its digest")
    mesh = _mesh(plan)
    expected = {rank_file(r) for r in range(world)}
    missing = sorted(expected - {p.name for p in ranks_here}, key=lambda n: int(n[5:-5]))
    if missing:
        named = [f"{name} ({mesh.place(int(name[5:-5]))})" if mesh else name for name in missing]
        raise RunDirectoryError(f"{path} lacks {', '.join(named)} of the {world} ranks' files: "
                                f"{'that rank' if len(missing) == 1 else 'those ranks'} did not finish or the file "
                                "was not copied back; nothing was loaded")
    stray = sorted({p.name for p in ranks_here} - expected)
    if stray:
        raise RunDirectoryError(f"{path} holds {', '.join(stray)}, not of this run's {world} ranks: a directory "
                                "holds one run")
    ranks = []
    for r in range(world):
        payload = _read(path / rank_file(r), "rank")
        _check_rank(r, payload, plan)
        if mesh is not None:
            _check_place(r, payload, mesh)
        ranks.append(payload)
    for replica in _replicas(ranks, mesh):  # (a mesh: each replica of the pipeline holds every stage once)
        held = sorted(s for r in replica for s in r["stages"])
        if held != list(range(int(plan["stages"]))):
            which = f" of replica {_replica_text(replica[0])}" if mesh else ""
            raise RunDirectoryError(f"the ranks' files{which} hold stages {held}, not each of the plan's "
                                    f"{plan['stages']} once")
    measured = [[int(s["step"]) for s in r["steps"]] for r in ranks]
    if any(m != measured[0] for m in measured):
        odd = next(r for r, m in enumerate(measured) if m != measured[0])
        raise RunDirectoryError(f"{rank_file(odd)} measured steps {measured[odd]}, rank 0 steps {measured[0]}")
    if not measured[0]:
        raise RunDirectoryError(f"{path}'s ranks recorded no step: run more steps than --warmup")
    origin0 = int(ranks[0]["clock"]["origin_ns"])
    rows = [(rank["rank"], rank["host"], *event) for rank in ranks for event in _aligned(rank, origin0)]
    events = pd.DataFrame(rows, columns=["rank", "host", "step", "stage", "microbatch", "phase", "start", "end"])
    spread = None
    if mesh is not None:  # the timeline is the first replica's; the others' spread, a column beside it
        first = {r["rank"] for r in ranks if not (r["coordinates"]["dp"] or r["coordinates"]["tp"])}
        took = events.assign(took=events["end"] - events["start"])
        keys = ["step", "stage", "microbatch", "phase"]
        spread = took.groupby(keys)["took"].agg(lambda t: float(t.max() - t.min())).rename("replica_spread")
        events = events[events["rank"].isin(first)]
    steps = []
    for step, frame in events.groupby("step", sort=True):
        # The step begins with its first computation (stage 0's first forward); a rank that came to
        # the step earlier and waited for its input waited from then (its wait is cut there).
        frame = frame.copy()
        compute = frame["phase"].isin(list(COMPUTE_PHASES))
        origin = frame.loc[compute, "start"].min() if compute.any() else frame["start"].min()
        frame["start"] = (frame["start"] - origin).clip(lower=0.0)
        frame["end"] = (frame["end"] - origin).clip(lower=0.0)
        if spread is not None:
            frame = frame.join(spread, on=["step", "stage", "microbatch", "phase"])
        steps.append(frame.sort_values(["start", "stage"]).reset_index(drop=True))
    losses: dict[int, list[float]] = {}
    for rank in ranks:  # a mesh: every replica's micro-batches (the global batch's), each once (its tp rank 0)
        if mesh is None or not rank["coordinates"]["tp"]:
            for k, v in rank.get("losses", {}).items():
                losses[int(k)] = ([] if mesh is None else losses.get(int(k), [])) + [float(x) for x in v]
    return RecordedRun(path, plan, ranks, steps, losses)


def _mesh(plan: dict[str, Any]) -> Any:
    """The run's mesh (:class:`~pipexplore.devices.Mesh`, its experts' ep and etp too), or None for
    pipeline ranks alone."""
    shape = plan.get("mesh")
    if not shape:
        return None
    from pipexplore.devices.mesh import Mesh

    mesh = Mesh(**{d: int(v) for d, v in shape.items() if d in ("pp", "dp", "tp", "cp", "ep", "etp")})
    if mesh.size != int(plan["world"]):
        raise RunDirectoryError(f"{PLAN_FILE} says the mesh {mesh.describe()} ({mesh.size} ranks), but the run's "
                                f"world was {plan['world']}")
    return mesh


def _check_place(rank: int, payload: dict[str, Any], mesh: Any) -> None:
    """Refuse a rank's file whose place in the mesh is not the rank's (a file from another mesh)."""
    where = payload.get("coordinates") or {}
    expected = mesh.coordinates(rank)
    if any(int(where.get(d, -1)) != expected[d] for d in ("pp", "dp", "tp")):
        raise RunDirectoryError(f"{rank_file(rank)} was recorded at {where or 'no place in a mesh'}, but rank {rank} "
                                f"of the run's mesh ({mesh.describe()}) is at {mesh.place(rank)}: the file is from "
                                "another mesh; a directory holds one run")


def _replicas(ranks: list[dict[str, Any]], mesh: Any) -> list[list[dict[str, Any]]]:
    """The ranks in groups that each hold the whole pipeline once: all of them, or a mesh's (dp, tp) replicas."""
    if mesh is None:
        return [ranks]
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for rank in ranks:
        groups.setdefault((rank["coordinates"]["dp"], rank["coordinates"]["tp"]), []).append(rank)
    return list(groups.values())


def _replica_text(rank: dict[str, Any]) -> str:
    return f"dp {rank['coordinates']['dp']}, tp {rank['coordinates']['tp']}"


def run_kind(recorded: RecordedRun) -> str | None:
    """The catalogue's name for the GPUs a run ran on (``'H100'``, from the name each rank recorded),
    or None: CPUs, GPUs the catalogue does not know, or ranks of different kinds."""
    kinds = {catalogue_kind(str(r.get("device_name") or "")) if str(r.get("device", "")).startswith("cuda") else None
             for r in recorded.ranks}
    return kinds.pop() if len(kinds) == 1 else None


def untaught(recorded: RecordedRun) -> str | None:
    """Why the run can teach no corrections, or None where it can: its ranks ran here (this
    machine's corrections) or on GPUs of one kind the catalogue knows (that kind's). A run on
    other hosts' CPUs, on GPUs the catalogue does not know, on ranks of different kinds, or on
    GPUs whose names it did not record would otherwise correct this machine's plans with another
    machine's speed."""
    if set(recorded.hosts) == {socket.gethostname()} or run_kind(recorded) is not None:
        return None
    gpus = [r for r in recorded.ranks if str(r.get("device", "")).startswith("cuda")]
    if not gpus:
        return f"its ranks ran on other hosts' CPUs ({', '.join(sorted(set(recorded.hosts)))}), not this machine's"
    names = sorted({str(r.get("device_name") or "") for r in gpus})
    if "" in names:
        return "its ranks did not record their GPUs' names, so their kind is unknown"
    kinds = sorted({catalogue_kind(name) or name for name in names} | ({"cpu"} if len(gpus) < len(recorded.ranks)
                                                                        else set()))
    if len(kinds) > 1:
        return f"its ranks ran on devices of different kinds ({', '.join(kinds)})"
    return (f"its GPUs ({names[0]}) are not in the catalogue: register a DeviceSpec of them "
            "(pipexplore.devices.register_device) to keep what such runs teach for plans on them")


def _checkpoint_ran(recorded: RecordedRun) -> str:
    """The activation checkpointing the run's script applied (``never`` for runs recorded before
    the script applied any). The plan keeps it; its predictions follow it where the plan is for
    catalogue devices (:attr:`~pipexplore.plan.Plan.run_checkpoint`)."""
    mode = str(recorded.plan.get("checkpoint", "never"))
    if mode not in CHECKPOINTS:
        raise RunDirectoryError(f"the run recorded checkpoint {mode!r}: not one of {', '.join(CHECKPOINTS)}")
    return mode


def _schedule_ran(recorded: RecordedRun) -> str:
    """The schedule the run ran: its name, or for a CSV schedule the file the run directory holds
    (``schedule.csv``, written from the text the run recorded: the original may be on another
    machine, or edited since)."""
    schedule, text = str(recorded.plan["schedule"]), recorded.plan.get("schedule_csv")
    if not text:
        return schedule
    path = pathlib.Path(recorded.directory) / "schedule.csv"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return str(path)


def plan_of(recorded: RecordedRun, layer_table: pd.DataFrame, base: Plan) -> Plan:
    """The plan the run ran, on ``layer_table`` (the explorer's) with ``base``'s corrections and
    options: its splits (by the split points' names), chunks, schedule (a CSV schedule from the text
    the run recorded, as the run directory's ``schedule.csv``), the stages per rank of an
    interleaved schedule, and the ``processes`` executor (``torch.distributed.pipelining`` in one
    process per rank). Its devices: on other hosts' GPUs the catalogue knows (:func:`run_kind`),
    planned devices of that kind (``'H100:0'`` …, the run's ranks a node), so that what it teaches corrects plans
    for them (:attr:`~pipexplore.plan.Plan.device_kind`) and not this machine's; else ``base``'s
    devices where it has as many of this machine's, else the ranks' own (``cpu``, ``cuda:r``: a
    CPU run is never taken for a run on planned GPUs).

    Raises:
        RunDirectoryError: the run's model is not this layer table's (names differ).
    """
    plan = recorded.plan
    names = [str(n) for n in layer_table["name"]]
    recorded_layers = [str(n) for n in plan.get("layers", names)]
    if recorded_layers != names:
        first = next((i for i, (a, b) in enumerate(zip(recorded_layers, names)) if a != b),
                     min(len(names), len(recorded_layers)))
        raise RunDirectoryError(
            f"the run is of another model or split granularity than the explorer's: its layers differ from "
            f"position {first} ({recorded_layers[first:first + 3]} there, {names[first:first + 3]} here; "
            f"{len(recorded_layers)} layers there, {len(names)} here)")
    splits = tuple(names.index(str(point)) for point in plan["split_points"])
    world, stages = int(plan["world"]), int(plan["stages"])
    mesh = _mesh(plan)
    devices = tuple(base.devices[: base.mesh_or_pipeline.size])
    # GPUs of this machine (every rank ran here: the page's own torchrun) are this machine's kind
    kind = run_kind(recorded) if set(recorded.hosts) != {socket.gethostname()} else None
    options: dict[str, Any] = {}
    if kind is not None and (len(devices) != world or device_kind(devices) != kind):
        # GPUs the catalogue knows: the run is of that kind, what it teaches is kept for plans on it
        per_node = max(1, world // max(1, recorded.nodes))
        devices = planned_devices([kind] * world, per_node)
        options["gpus_per_node"] = per_node
    elif len(devices) != world or device_kind(devices) != kind:
        # the ranks' own devices: never planned ones of a kind the run did not run on
        devices = tuple("cpu" if r["device"] == "cpu" else f"cuda:{r['rank']}" for r in recorded.ranks)
    options.update(splits=splits, chunks=int(plan["chunks"]), schedule=_schedule_ran(recorded), devices=devices,
                   executor="processes", checkpoint=_checkpoint_ran(recorded), mesh=mesh)
    if mesh is not None:  # the mesh the run ran, its replicas sharing each stage as it did
        options["data_parallel"] = str(plan.get("data_parallel") or "ddp")
    ranks = mesh.pp if mesh is not None else world
    if stages > ranks:  # stages per rank (interleaved, a V)
        options["virtual_stages"] = stages // ranks
    return base.with_options(**options)


def run_result(recorded: RecordedRun, plan: Plan, *, samples: int, run: Any = 0) -> RunResult:
    """The run as any executor's result: the measured step of median time (its events in the
    common schema, with ``rank`` and ``host``), the first step's loss, the measured steps'
    losses, the prediction of ``plan`` beside it; ``metrics`` add ``nodes``, ``ranks``, ``hosts``,
    ``clock_residual``, ``rank_table``, ``steps_measured`` and ``executor`` ``'torchrun'``."""
    steps = sorted(recorded.steps, key=lambda frame: float(frame["end"].max() - frame["start"].min()))
    kept = steps[len(steps) // 2]
    stage_devices = plan.stage_devices
    frame = kept.assign(run=run, device=[stage_devices[s] for s in kept["stage"]], source="measured")
    frame = frame[COLUMNS + ["rank", "host"] + (["replica_spread"] if "replica_spread" in frame else [])]
    frame = frame.reset_index(drop=True)
    peaks = [r.get("peak_memory") for r in recorded.ranks]
    frame.attrs["peak_memory"] = {f"{r['device']}@rank{r['rank']}": p for r, p in zip(recorded.ranks, peaks) if p}
    measured_losses = recorded.measured_losses
    loss = recorded.first_loss
    out = result(plan, frame, loss, torch.empty((samples, 0)), set(), measured_losses=measured_losses,
                 executor="torchrun")
    finite_peaks = [float(p) for p in peaks if p is not None]
    out.metrics.update(
        executor="torchrun", nodes=recorded.nodes, ranks=recorded.world, hosts=",".join(recorded.hosts),
        peak_bytes=max(finite_peaks) if finite_peaks else math.nan, clock_residual=recorded.clock_residual,
        rank_table=recorded.rank_table(), steps_measured=len(recorded.steps), directory=str(recorded.directory),
        losses=recorded.losses.get(int(kept["step"].iloc[0]), []), untaught=untaught(recorded))
    return out

