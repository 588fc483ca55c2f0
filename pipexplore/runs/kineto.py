"""Read the Chrome/Kineto traces ``torch.profiler`` wrote per rank for a ``torch.distributed.pipelining``
run, as a timeline in pipexplore's schema (:mod:`pipexplore.timeline`).

What torch labels (its ``schedules.py``, torch 2.13, read for this module):

* the runtime schedules (``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, and a
  schedule loaded from a CSV) label each action ``PP:{stage}{F|I|W|B}{mb}`` (``PP:2F0``),
  ``PP:{stage}{SEND_F|RECV_F|SEND_B|RECV_B}{mb}`` for its sends and receives, ``PP:{stage}UNSHARD``,
  ``RESHARD``, ``REDUCE_GRAD`` (no micro-batch: not actions of the schema, skipped) and
  ``PP:({a};{b})OVERLAP_F_B`` for a forward and a backward run as one (both get its span, and
  ``overlapped`` says so);
* ``ScheduleGPipe`` labels ``Forward {i}`` and ``Backward {i}``; its stage is not in the label: it is
  the rank's (``stages=`` maps ranks to stages where they differ, as with data parallelism). The
  label also covers waiting for the input and posting the send;
* ``Schedule1F1B`` labels nothing per micro-batch: its traces are refused (:class:`TraceFileError`)
  rather than guessed. ``Optimizer.step#...`` (torch.optim) is read as the ``optimizer`` phase, of
  the rank's first stage where it holds several (one optimizer steps them all).

GPU kernels (``kernel``, ``gpu_memcpy``, ``gpu_memset``) are attributed as Holistic Trace Analysis
does: each to the action whose CPU span contains its launch (the runtime event of the same
``correlation``, or the ``ac2g`` flow that links them), on any thread of the rank's process (the
autograd engine launches backward kernels from its own thread while the schedule waits inside the
label). An action with kernels spans them (``clock='gpu'``); without, its CPU span
(``clock='cpu'``; all of a CPU-only trace). ``cpu_start``/``cpu_end`` keep the label's span.

Collectives (tensor- and data-parallel, FSDP's; not the pipeline's sends and receives) come back as
rows of their own, phase ``collective`` on the rank's collectives lane (``'<device> · collectives'``,
as predicted): each asked for by torch's ``c10d::`` operator inside an action (its stage and
micro-batch), run by the group as it labels it (``gloo:all_reduce``, ``nccl:…``), the row from the
asking to the running's end (``exposed`` where that action's span holds it whole).

Clocks: Kineto stamps events with the host's clock (µs since the epoch, or since
``baseTimeNanoseconds``). Ranks are put on one axis assuming the hosts' clocks agree (``offsets=``
corrects a known skew); ``timeline.attrs['rank_start']`` reports where each rank's trace starts.

Example::

    timeline = read_traces("traces/")      # trace_rank0.json, trace_rank1.json, ... or *.json.gz
"""
from __future__ import annotations

import bisect
import gzip
import json
import math
import pathlib
import re
import warnings
from typing import Any, Mapping, NamedTuple, Optional, Union, cast

import pandas as pd

from pipexplore.predict.mesh_costs import COLLECTIVE_LANE
from pipexplore.timeline import COLUMNS, OPTIMIZER_MICROBATCH

__all__ = ["TraceFileError", "Label", "parse_label", "find_traces", "is_trace", "read_traces"]

EXTRA_COLUMNS = ["rank", "clock", "cpu_start", "cpu_end", "overlapped", "collective", "exposed"]
#: A collective as the process group runs it (``gloo:all_reduce``, ``nccl:reduce_scatter``); its
#: point-to-point sends and receives are the pipeline's, and a barrier no data's.
_COLLECTIVE = re.compile(r"^(gloo|nccl):(?!send$|recv$|barrier$)(\w+)$")
#: A collective as the caller asks for it (torch's ``c10d::`` operator, on the calling thread), and
#: the name it is given here.
_ASKED = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather", "allgather_": "all_gather",
          "allgather_into_tensor_coalesced_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
          "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
          "broadcast_": "broadcast", "alltoall_base_": "all_to_all", "allreduce_coalesced_": "all_reduce"}
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_NOT_LABELS = GPU_CATEGORIES + ("gpu_user_annotation", "cuda_runtime", "cuda_driver", "ac2g", "fwdbwd", "Trace")
_PHASES = {"F": "forward", "B": "backward", "I": "input_grad", "W": "weight_grad",
           "SEND_F": "send", "SEND_B": "send", "RECV_F": "recv", "RECV_B": "recv"}
_SKIPPED = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
_PP = re.compile(r"PP:(\d+)(F|I|W|B|SEND_F|SEND_B|RECV_F|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)$")
_OVERLAP = re.compile(r"PP:\((.*)\)OVERLAP_F_B$")
_GPIPE = re.compile(r"(Forward|Backward) (\d+)$")
_STEP = re.compile(r"ProfilerStep#(\d+)$")
_RANK_IN_NAME = re.compile(r"rank[_\-.]?(\d+)", re.IGNORECASE)
_UNLABELLED = (
    "no per-micro-batch labels in {what}: torch's Schedule1F1B labels nothing per micro-batch in this "
    "torch version, so which work belongs to which micro-batch is not in the trace (nothing was guessed). "
    "ScheduleGPipe labels 'Forward i'/'Backward i'; the runtime schedules (ScheduleInterleaved1F1B, "
    "ScheduleLoopedBFS, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) label "
    "'PP:{{stage}}{{F|I|W|B}}{{mb}}'; or record the run with the exported script's --record")


class TraceFileError(ValueError):
    """A trace file or directory that cannot be read as a pipelining run; the message names it."""


class Label(NamedTuple):
    """One action a label names: ``stage`` is ``None`` where the label leaves it to the rank."""

    stage: Optional[int]
    phase: str
    microbatch: int


def parse_label(name: str) -> Optional[list[Label]]:
    """The actions a profiler label names: ``None`` if it is no label of torch's pipelining, ``[]``
    for one that names no action of the schema (``PP:0UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``).

    Example::

        parse_label("PP:2F0")        # [Label(stage=2, phase='forward', microbatch=0)]
        parse_label("Backward 3")    # [Label(stage=None, phase='backward', microbatch=3)]
        parse_label("aten::mm")      # None
    """
    if (match := _PP.match(name)) is not None:
        stage, kind, microbatch = match.groups()
        if kind in _SKIPPED:
            return []
        if not microbatch:
            raise TraceFileError(f"the label {name!r} names a {kind} action without its micro-batch")
        return [Label(int(stage), _PHASES[kind], int(microbatch))]
    if (match := _OVERLAP.match(name)) is not None:
        found: list[Label] = []
        for part in match.group(1).split(";"):
            sub = parse_label(f"PP:{part.strip()}") if part.strip() else []
            if sub is None:
                raise TraceFileError(f"the label {name!r} holds {part!r}, which is no action of torch's pipelining")
            found += sub
        return found
    if (match := _GPIPE.match(name)) is not None:
        return [Label(None, "forward" if match.group(1) == "Forward" else "backward", int(match.group(2)))]
    if name.startswith("Optimizer.step#"):
        return [Label(None, "optimizer", OPTIMIZER_MICROBATCH)]
    return None


def _open(path: pathlib.Path, mode: str = "rt") -> Any:
    return gzip.open(path, mode) if path.name.endswith(".gz") else open(path, mode)


def _sniff(path: pathlib.Path) -> Optional[bool]:
    """Whether the first 1 MiB of ``path`` mentions ``traceEvents``; ``None`` if it cannot be read."""
    try:
        with _open(path, "rb") as f:
            return b'"traceEvents"' in f.read(1 << 20)
    except (OSError, EOFError):
        return None


def is_trace(path: Union[str, pathlib.Path]) -> bool:
    """Whether ``path`` looks like a Chrome/Kineto trace (a ``.json``/``.json.gz`` file whose
    first 1 MiB mentions ``traceEvents``); reads no more than that."""
    path = pathlib.Path(path)
    return path.is_file() and path.name.endswith((".json", ".json.gz")) and bool(_sniff(path))


def find_traces(directory: Union[str, pathlib.Path]) -> list[pathlib.Path]:
    """The trace files in ``directory`` (``*.json``, ``*.json.gz``, not recursive), sorted; a file
    that is JSON but no trace (a run's plan) is left out, one that cannot be read is kept (reading
    it names it)."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise TraceFileError(f"{directory} is not a directory (expected one holding a trace per rank)")
    found = sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith((".json", ".json.gz")))
    return [p for p in found if _sniff(p) is not False]


def _load(path: pathlib.Path) -> dict[str, Any]:
    try:
        with _open(path) as f:
            data = json.load(f)
    except (OSError, EOFError, ValueError, UnicodeDecodeError) as exc:
        raise TraceFileError(f"cannot read the trace {path}: {exc}") from exc
    if isinstance(data, list):  # the Trace Event Format's array form
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceFileError(f"{path} is no Chrome/Kineto trace (it has no 'traceEvents' list)")
    return data


def _rank_of(path: pathlib.Path, data: dict[str, Any], alone: bool) -> tuple[int, Optional[int]]:
    info = data.get("distributedInfo") or {}
    if "rank" in info:
        return int(info["rank"]), (int(info["world_size"]) if "world_size" in info else None)
    if (match := _RANK_IN_NAME.search(path.name)) is not None:
        return int(match.group(1)), None
    if alone:
        return 0, 1
    raise TraceFileError(f"{path} says no rank: it has no 'distributedInfo' (torch.distributed was not initialised "
                     "when it was profiled) and its name has none (name it e.g. trace_rank0.json)")


class _Rank:
    """One rank's trace, read once: its labelled actions, kernels and launches, in integer ns."""

    def __init__(self, path: pathlib.Path, data: dict[str, Any], rank: int) -> None:
        self.path, self.rank = path, rank
        self.host = data.get("host_name")
        self.devices = {int(p["id"]): p.get("name") for p in data.get("deviceProperties") or [] if "id" in p}
        base = int(data.get("baseTimeNanoseconds") or 0)
        self.actions: list[tuple[int, int, Label, bool]] = []  # start, end, label, overlapped
        self.keys: list[tuple[str, int]] = []  # the label's name (and place in it): repeats mean steps
        self.steps: list[tuple[int, int, int]] = []  # start, end, ProfilerStep number
        self.launches: dict[Any, int] = {}  # correlation -> launch time
        self.flow_starts: dict[Any, int] = {}
        self.flow_ends: dict[tuple[Any, Any, int], Any] = {}
        self.kernels: list[tuple[int, int, Any, Any, Any, Any]] = []  # start, end, corr, device, pid, tid
        self.collectives: list[tuple[int, int, str]] = []  # start, end, collective: as the group ran it
        self.asked: list[tuple[int, str]] = []  # start, collective: as the caller asked for it
        self.first: Optional[int] = None  # the earliest event, None in a trace with none
        for event in data["traceEvents"]:
            if not isinstance(event, dict) or "ts" not in event or event.get("ph") == "M":
                continue
            start = base + _ns(event["ts"])
            self.first = start if self.first is None else min(self.first, start)
            cat, ph, args = event.get("cat"), event.get("ph"), event.get("args") or {}
            if cat == "ac2g":
                if ph == "s":
                    self.flow_starts[event.get("id")] = start
                elif ph == "f":
                    self.flow_ends[(event.get("pid"), event.get("tid"), start)] = event.get("id")
                continue
            if ph != "X":
                continue
            end = start + _ns(event.get("dur", 0))
            if cat in GPU_CATEGORIES:
                self.kernels.append((start, end, args.get("correlation"), args.get("device", event.get("pid")),
                                     event.get("pid"), event.get("tid")))
            elif "correlation" in args and cat in ("cuda_runtime", "cuda_driver", None):
                self.launches[args["correlation"]] = start
            elif cat not in _NOT_LABELS:
                name = str(event.get("name", ""))
                if (match := _STEP.match(name)) is not None:
                    self.steps.append((start, end, int(match.group(1))))
                    continue
                if (match := _COLLECTIVE.match(name)) is not None:
                    self.collectives.append((start, end, match.group(2)))
                    continue
                if name.startswith("c10d::") and name[6:] in _ASKED:
                    self.asked.append((start, _ASKED[name[6:]]))
                    continue
                try:
                    labels = parse_label(name) or []
                except TraceFileError as exc:
                    raise TraceFileError(f"{path}: {exc}") from None
                for k, label in enumerate(labels):
                    self.actions.append((start, end, label, len(labels) > 1))
                    self.keys.append((name, k))
        order = sorted(range(len(self.actions)), key=lambda k: (self.actions[k][0], -self.actions[k][1], k))
        self.actions = [self.actions[k] for k in order]
        self.keys = [self.keys[k] for k in order]
        self.labelled = any(label.phase != "optimizer" for _, _, label, _ in self.actions)

    def attribute(self) -> tuple[dict[int, list[tuple[int, int, Any]]], int]:
        """Each action's kernels (by index in :attr:`actions`), and how many kernels no action launched."""
        starts = [a[0] for a in self.actions]
        reach, latest = [], None
        for _, end, _, _ in self.actions:  # the latest end so far: how far back a containing action may be
            latest = end if latest is None else max(latest, end)
            reach.append(latest)
        found: dict[int, list[tuple[int, int, Any]]] = {}
        lost = 0
        for start, end, corr, device, pid, tid in self.kernels:
            launch = self.launches.get(corr) if corr is not None else None
            if launch is None:
                launch = self.flow_starts.get(self.flow_ends.get((pid, tid, start)))
            owner = None
            if launch is not None:
                k = bisect.bisect_right(starts, launch) - 1
                while k >= 0 and reach[k] >= launch:
                    if self.actions[k][1] >= launch:
                        owner = k  # the latest-starting action that contains the launch: the innermost
                        break
                    k -= 1
            if owner is None:
                lost += 1
                continue
            while owner > 0 and self.actions[owner - 1][:2] == self.actions[owner][:2]:
                owner -= 1  # an OVERLAP_F_B's actions share its span, and its kernels
            for twin in range(owner, len(self.actions)):
                if self.actions[twin][:2] != self.actions[owner][:2]:
                    break
                found.setdefault(twin, []).append((start, end, device))
        return found, lost


def _ns(microseconds: Any) -> int:
    """µs as integer ns, without the float product's rounding (µs since the epoch need 51 bits)."""
    value = float(microseconds)
    whole = math.floor(value)
    return whole * 1000 + round((value - whole) * 1000)


def _step_of(rank: _Rank) -> list[Optional[int]]:
    """Which profiled step each action belongs to: the ``ProfilerStep#N`` around it, or, without
    those, the how-many-th time its (stage, phase, micro-batch) was labelled."""
    if rank.steps:
        steps = sorted(rank.steps)
        out: list[Optional[int]] = []
        for start, _, _, _ in rank.actions:
            inside = [n for s, e, n in steps if s <= start <= e]
            out.append(inside[-1] if inside else None)
        return out
    seen: dict[tuple[str, int], int] = {}
    out = []
    for key in rank.keys:
        count = seen.get(key, 0)
        out.append(count)
        seen[key] = count + 1
    return out


def read_traces(directory: Union[str, pathlib.Path], *, run: Any = None, step: Optional[int] = None,
                stages: Optional[Mapping[int, int]] = None,
                offsets: Optional[Mapping[int, float]] = None) -> pd.DataFrame:
    """The timeline of one step of a ``torch.distributed.pipelining`` run, from the traces
    ``torch.profiler`` wrote, one file per rank, in ``directory`` (see the module's docstring).

    ``run`` labels the rows (the directory's name by default). ``step``: which profiled step
    (``ProfilerStep#N``'s N, or the how-many-th repetition of the labels from 0); by default the last
    one every rank has. ``stages``: rank -> stage for labels that leave the stage to the rank
    (``ScheduleGPipe``; by default the rank). ``offsets``: seconds to add to a rank's clock.

    Times are seconds from the step's origin (its first event on any rank). Besides the schema's
    columns: ``rank``, ``clock`` ('gpu': the span of the action's kernels; 'cpu': of its label),
    ``cpu_start``/``cpu_end`` (the label's span), ``overlapped`` (part of an OVERLAP_F_B). ``attrs``:
    ``rank_start`` (each rank's trace start, seconds since the epoch), ``origin`` (the same clock),
    ``clock`` (the assumption made), ``hosts``, ``files``, ``world``, ``steps``, ``step``, ``labels``,
    ``stages_from_rank``, ``unattributed_kernels`` (per rank), ``device_names``.
    """
    directory = pathlib.Path(directory)
    paths = find_traces(directory)
    if not paths:
        raise TraceFileError(f"no profiler traces in {directory}: looked for *.json and *.json.gz files holding "
                         "'traceEvents' (torch.profiler's export_chrome_trace or tensorboard_trace_handler), "
                         "one per rank")
    ranks: dict[int, _Rank] = {}
    worlds = set()
    for path in paths:
        data = _load(path)
        try:
            number, world = _rank_of(path, data, alone=len(paths) == 1)
            if number in ranks:
                raise TraceFileError(f"two traces of rank {number}: {ranks[number].path} and {path} "
                                     "(keep one per rank)")
            ranks[number] = _Rank(path, data, number)
        except TraceFileError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise TraceFileError(f"{path} is no trace this reader understands: {exc!r}") from exc
        if world is not None:
            worlds.add(world)
    if len(worlds) > 1:
        raise TraceFileError(f"the traces in {directory} come from runs of different sizes (world {sorted(worlds)})")
    world = worlds.pop() if worlds else max(ranks) + 1
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        raise TraceFileError(f"{directory} lacks the traces of rank(s) {missing} of a world of {world}: nothing loaded")
    unlabelled = sorted(r for r, trace in ranks.items() if not trace.labelled)
    if len(unlabelled) == len(ranks):
        raise TraceFileError(_UNLABELLED.format(what=f"the traces in {directory}"))
    if unlabelled:
        raise TraceFileError(_UNLABELLED.format(what=", ".join(str(ranks[r].path) for r in unlabelled)))

    step_ids = {r: _step_of(trace) for r, trace in ranks.items()}
    common = set.intersection(*({s for s in ids if s is not None} for ids in step_ids.values()))
    if step is None:
        if not common:
            raise TraceFileError(f"the traces in {directory} share no profiled step "
                                 "(ProfilerStep numbers differ by rank)")
        step = max(common)
    elif step not in common:
        raise TraceFileError(f"step {step} is not in every trace of {directory}; they share {sorted(common)}")
    offsets, stages = dict(offsets or {}), dict(stages or {})
    run = directory.name if run is None else run
    rows: list[dict[str, Any]] = []
    lost: dict[int, int] = {}
    for r, trace in sorted(ranks.items()):
        kernels, lost[r] = trace.attribute()
        shift = round(offsets.get(r, 0.0) * 1e9)
        own = sorted({a[2].stage for a in trace.actions if a[2].stage is not None}) or [stages.get(r, r)]
        on_gpu = bool(trace.kernels)
        for k, (start, end, label, overlapped) in enumerate(trace.actions):
            if step_ids[r][k] != step:
                continue
            stage = label.stage if label.stage is not None else (own[0] if label.phase == "optimizer"
                                                                   else stages.get(r, r))
            spans = kernels.get(k)
            gpu = spans[0][2] if spans else (next(iter(trace.kernels))[3] if on_gpu else None)
            rows.append({
                "run": run, "stage": stage, "microbatch": label.microbatch, "phase": label.phase,
                "device": f"cuda:{gpu}" if gpu is not None else "cpu", "source": "measured", "rank": r,
                "clock": "gpu" if spans else "cpu", "overlapped": overlapped,
                "start_ns": (min(s for s, _, _ in spans) if spans else start) + shift,
                "end_ns": (max(e for _, e, _ in spans) if spans else end) + shift,
                "cpu_start_ns": start + shift, "cpu_end_ns": end + shift, "collective": "", "exposed": False})
        rows += _collective_rows(trace, step, rows, r, shift)
    origin = min(min(row["start_ns"], row["cpu_start_ns"]) for row in rows)
    for row in rows:
        for key in ("start", "end", "cpu_start", "cpu_end"):
            row[key] = (row.pop(f"{key}_ns") - origin) / 1e9
    timeline = pd.DataFrame(rows, columns=COLUMNS + EXTRA_COLUMNS)
    timeline = timeline.sort_values(["start", "rank", "stage"], kind="stable").reset_index(drop=True)
    _warn_if_incomplete(timeline, directory)
    timeline.attrs.update({
        # cast: every rank is labelled (checked above), so its trace has events and a first one
        "rank_start": {r: (cast(int, t.first) + round(offsets.get(r, 0.0) * 1e9)) / 1e9
                       for r, t in sorted(ranks.items())},
        "origin": origin / 1e9,
        "clock": "Kineto timestamps are each host's clock (µs since the epoch); the ranks are put on one axis "
                 "assuming the hosts' clocks agree" + (f", shifted by {offsets} s" if offsets else
                                                       " (no offset was estimated)"),
        "hosts": {r: t.host for r, t in sorted(ranks.items())},
        "files": {r: str(t.path) for r, t in sorted(ranks.items())},
        "world": world, "step": step, "steps": sorted(common),
        "labels": sorted({_kind(a[2]) for t in ranks.values() for a in t.actions if a[2].phase != "optimizer"}),
        "stages_from_rank": any(a[2].stage is None and a[2].phase != "optimizer"
                                for t in ranks.values() for a in t.actions),
        "unattributed_kernels": lost,
        "device_names": {r: t.devices for r, t in sorted(ranks.items()) if t.devices},
        "peak_memory": {},
    })
    return timeline


def _collective_rows(trace: _Rank, step: int, rows: list[dict[str, Any]], rank: int,
                     shift: int) -> list[dict[str, Any]]:
    """The rank's collectives in profiled step ``step`` (its ``ProfilerStep`` span, else its actions')
    as rows of their own (phase ``collective`` on the rank's collectives lane, ``collective``
    naming what was asked), each of the action that asked for it (the ``c10d::`` operator's time:
    its stage and micro-batch; micro-batch -1 where none did), from the asking to the end of the
    group's running it (the first run of the group's not yet matched that begins once asked):
    ``exposed`` where the action's span holds it whole, the action waited for it. A trace without
    the callers' operators falls back on the group's spans alone."""
    mine = [row for row in rows if row["rank"] == rank]
    if not trace.collectives or not mine:
        return []
    spans = [(s + shift, e + shift) for s, e, n in trace.steps if n == step]
    # the step's span: its ProfilerStep's, else from the rank's first action of the step to its last
    first, last = spans[0] if spans else (min(row["cpu_start_ns"] for row in mine),
                                          max(row["cpu_end_ns"] for row in mine))
    ran = sorted((s + shift, e + shift, n) for s, e, n in trace.collectives)
    asked = sorted((s + shift, n) for s, n in trace.asked) or [(s, n) for s, _, n in ran]
    taken = [False] * len(ran)
    out = []
    for start, name in asked:
        k = next((k for k, (s, _, _) in enumerate(ran) if not taken[k] and s >= start), None)
        if k is None:
            continue
        taken[k] = True
        end = ran[k][1]
        if not first <= start <= last:
            continue
        holding = [row for row in mine if row["cpu_start_ns"] <= start <= row["cpu_end_ns"]]
        owner = min(holding, key=lambda row: row["cpu_end_ns"] - row["cpu_start_ns"]) if holding else None
        base = owner or mine[0]
        out.append({"run": base["run"], "stage": base["stage"], "microbatch": owner["microbatch"] if owner else -1,
                    "phase": "collective", "device": f"{base['device']}{COLLECTIVE_LANE}", "source": "measured",
                    "rank": rank, "clock": "cpu", "overlapped": False, "start_ns": start, "end_ns": end,
                    "cpu_start_ns": start, "cpu_end_ns": end, "collective": name,
                    "exposed": owner is not None and end <= owner["cpu_end_ns"]})
    return out


def _kind(label: Label) -> str:
    return "PP:{stage}{F|I|W|B}{mb}" if label.stage is not None else "Forward i / Backward i"


def _warn_if_incomplete(timeline: pd.DataFrame, directory: pathlib.Path) -> None:
    """A stage whose micro-batches went forward but not backward (or back) was cut by the
    profiler's window: said, not filled in."""
    work = timeline[timeline["phase"].isin(["forward", "backward", "input_grad"])]
    for stage, rows in work.groupby("stage"):
        forward = set(rows.loc[rows["phase"] == "forward", "microbatch"])
        backward = set(rows.loc[rows["phase"] != "forward", "microbatch"])
        if forward != backward:
            warnings.warn(f"{directory}: stage {stage} has forwards of micro-batches {sorted(forward)} but backwards "
                          f"of {sorted(backward)}: the profiler's window cut the step?", stacklevel=3)
