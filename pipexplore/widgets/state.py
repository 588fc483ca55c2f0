"""What the explorer knows: model, layer table, plan, runs, notes and status, and who to tell.

:class:`ExplorerState` imports neither ipywidgets nor anywidget: it is the explorer without a
page, and every behaviour of the explorer is tested on it. A view subscribes to its changes::

    state.subscribe(lambda change: ...)     # change: 'plan' | 'runs' | 'status' | 'shown'

``plan``: the current plan changed (splits, options, what calibration taught). ``runs``: a run was
added or the runs were cleared. ``status``: the status line, or whether a run is in progress.
``shown``: which run the page shows or compares, or the memory cap drawn.

Changes happen under one lock, from any thread (a background run finishes in its own), and
subscribers are called under it.
"""
from __future__ import annotations

import math
import threading
import traceback
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import pandas as pd
import torch
from torch import nn

from pipexplore import timeline as tl
from pipexplore import validate
from pipexplore.cancel import CancelToken
from pipexplore.devices import chosen_devices, device_memory, is_planned, planned_devices, stage_devices
from pipexplore.executors.base import LossFn, OptimizerFactory, RunResult
from pipexplore.microbatch import TensorOrTensors, batch_size
from pipexplore.models.hf import cache_note
from pipexplore.plan import CODE_KINDS, EXECUTORS, PLAN_SCHEDULES, Plan
from pipexplore.schedules import csv_schedule, is_csv, is_multi_stage, splits_backward
from pipexplore.predict.costs import Corrections
from pipexplore.predict.memory import MEMORY_COLUMNS, stage_memory
from pipexplore.models.trace import costs as traced_costs
from pipexplore.skip.skippable import verify_skippables
from pipexplore.widgets import layer_table as layers
from pipexplore.widgets.header import parse_bytes, plan_figures
from pipexplore.widgets.run_log import RUN_COLUMNS, RunLog

__all__ = ["ExplorerState", "Status", "RUN_COLUMNS", "UPDATABLE", "EVENTS"]

#: What :meth:`ExplorerState.update` changes.
UPDATABLE = ("splits", "devices", "chunks", "checkpoint", "schedule", "executor", "virtual_stages")
#: The changes a subscriber hears of.
EVENTS = ("plan", "runs", "status", "shown")


@dataclass(frozen=True)
class Status:
    """The status line: ``text``, whether work is under way (``busy``), whether it is an
    ``error``, and the error's ``traceback`` ('' otherwise)."""

    text: str = ""
    busy: bool = False
    error: bool = False
    traceback: str = ""


class ExplorerState(RunLog):
    """The explorer's model of one Plan and its runs (see the module docstring for its changes).

    Every argument is checked on entry (a ``ValueError``/``TypeError`` naming it), before anything
    is profiled; then the layers are profiled (unless a ``layer_table`` is given) and the plan is
    balanced by time where no ``splits`` are given. A traced model is profiled as the stages its runs
    execute (:mod:`pipexplore.models.trace.costs`: one more trace); ``profile_stages=False`` times its
    modules only, sooner (a 6-block GPT-2 on 2 CPU cores: ~0.8 s, not ~3 s), its first prediction shorter.

    Example::

        state = ExplorerState(model, sample, chunks=8)
        state.subscribe(print)              # 'plan', 'runs', ...
        state.update(splits=[4, 9])
        state.run()                         # a real step; a row in state.runs
    """

    def __init__(self, model: nn.Module, sample: TensorOrTensors, *, target: Any = None,
                 loss_fn: Optional[LossFn] = None, optimizer: Optional[OptimizerFactory] = None,
                 devices: Optional[Sequence[str]] = None, chunks: Optional[int] = None,
                 checkpoint: str = "except_last", schedule: str = "gpipe", splits: Optional[Sequence[int]] = None,
                 layer_table: Optional[pd.DataFrame] = None, profile_repeats: int = 3, executor: str = "threads",
                 calibrate: bool = True, granularity: str = "blocks", keep_timelines: int = 20,
                 memory_cap: Any = None, gpus_per_node: int = 8, mixed_precision: bool = False,
                 profile_stages: bool = True) -> None:
        #: Bytes of activation memory a stage may hold (drawn on the memory panel), or None.
        self._memory_cap = parse_bytes(memory_cap, "memory_cap")
        # An nn.Sequential is split by layers and runs in any executor; any other model is split at
        # candidate modules (``granularity``) by torch's tracer.
        #: Whether the model is split by torch's tracer (not an ``nn.Sequential``).
        self.traced = not isinstance(model, nn.Sequential)
        if not self.traced:
            if len(model) == 0:
                raise ValueError("the model has no layers to split")
            verify_skippables(model)
        elif not isinstance(model, nn.Module):
            raise TypeError(f"the explorer needs an nn.Module, got {type(model).__name__}")
        validate.sample(sample)
        validate.target(target, batch_size(sample))
        validate.optional_callable(loss_fn, "loss_fn", "loss_fn(output, target)")
        validate.optional_callable(optimizer, "optimizer", "optimizer(parameters) returning a torch.optim.Optimizer")
        #: Whether memory is counted for 16-bit training with fp32 master weights and gradients
        #: (Megatron-LM's 18 bytes a parameter with Adam), not in the parameters' own dtype.
        self.mixed_precision = validate.boolean(mixed_precision, "mixed_precision")
        #: Planned devices a node (which copies cross nodes), for plans on catalogue devices.
        self.gpus_per_node = validate.integer(gpus_per_node, "gpus_per_node")
        if devices is not None:
            devices = list(chosen_devices(devices, self.gpus_per_node))
        #: Whether the plan is for catalogue devices, costed but never run here.
        self.planned = bool(devices) and is_planned(devices[0])
        if layers.on_meta(model) and devices is None:
            raise ValueError(f"{type(model).__name__} is on the meta device (no weights): name the devices to plan it "
                             "for, from the catalogue (devices=['H100'] * 16, gpus_per_node=8), or devices here to "
                             "time its blocks one at a time")
        schedule = validate.schedule(schedule, PLAN_SCHEDULES, csv=True)
        # A CSV schedule file says the stages, ranks (devices) and micro-batches (chunks) it runs.
        file = csv_schedule(schedule) if is_csv(schedule) else None
        if chunks is None:  # the file's, else 4, or the most a small batch splits into exactly
            chunks = file.microbatches if file else max(c for c in validate.valid_chunks(batch_size(sample), 4)
                                                        if c <= 4)
        chunks = validate.chunks(chunks, batch=batch_size(sample))
        validate.checkpoint(checkpoint)
        validate.executor(executor, EXECUTORS)
        if self.planned and executor == "threads":
            executor = "processes"  # planned GPUs run a process each (torchrun), not threads of this one
        if splits is not None and not self.traced:
            splits = validate.splits(splits, len(model))
        if layer_table is not None and not isinstance(layer_table, pd.DataFrame):
            raise TypeError(f"layer_table must be a pandas DataFrame (from pipexplore.profile) or None, got "
                            f"{type(layer_table).__name__}")
        profile_repeats = validate.integer(profile_repeats, "profile_repeats", minimum=1)
        validate.boolean(calibrate, "calibrate")
        keep_timelines = validate.integer(keep_timelines, "keep_timelines", minimum=0)

        self.model = model  #: the user's model (runs train copies of it)
        self.sample = sample  #: one mini-batch
        self.target, self.loss_fn, self.optimizer = target, loss_fn, optimizer
        #: Whether runs teach the predictions (the executor's own costs, corrections per action).
        self.calibrate = calibrate
        #: What the executor probes measured (:func:`pipexplore.executors.probe.probe_kind` of each).
        self._probed: set[tuple[str, bool]] = set()
        #: Notes the page shows above the status line.
        self.notes: list[str] = []
        if loss_fn is None:
            self.notes.append("No loss_fn given: runs time a synthetic loss (the mean of the squared outputs).")
        self.profile_options = dict(granularity=granularity, repeats=profile_repeats,
                                    stages=validate.boolean(profile_stages, "profile_stages"),
                                    device=devices[0] if devices else None, mixed_precision=self.mixed_precision)
        if layer_table is None:
            if self.traced and isinstance(sample, Mapping):  # keyword inputs (a BatchEncoding too) as a dict
                self.sample = sample = dict(sample)
            planned = devices or stage_devices(max(2, torch.cuda.device_count()))[0]
            # The input/weight-gradient split is measured when a plan that splits backwards first needs it.
            layer_table = layers.profile_layers(model, sample, self.profile_options, chunks=chunks, devices=planned,
                                                split_backward=splits_backward(schedule), loss_fn=loss_fn,
                                                target=target, optimizer=optimizer)
        if self.traced and not self.planned:
            self.notes.append(f"{type(model).__name__} is not an nn.Sequential: its candidate split points are its "
                              f"{granularity} (by FQN), split by torch.distributed.pipelining's tracer; runs execute "
                              "the traced stages in this process (threads) or one process per stage (processes)"
                              + ("; each block is profiled as its traced stage." if layer_table.attrs.get("stage_extra")
                                 else "."))
            self.notes += [note for note in [cache_note(model)] if note]  # a config's use_cache=True, off
        if self.planned:
            self.notes.append(layers.planned_note(devices, self.gpus_per_node))
        self.notes += list(layer_table.attrs.get("notes", []))  # e.g. layers whose FLOPs could not be counted
        #: One row per layer (or traced candidate): names, costs, sizes (see :func:`pipexplore.profile`).
        self.layer_table = layer_table
        n = len(layer_table)
        if splits is not None:
            splits = validate.splits(splits, n)
        if splits is None:
            stages = min(n, file.stages if file else len(devices) if devices else (max(2, torch.cuda.device_count())))
            splits = layers.balanced_splits(layer_table, stages, "time", executor)
        if devices is None:
            devices, note = stage_devices(file.ranks if file else len(splits) + 1)
            if note:
                self.notes.append(note)
        self._lock = threading.Lock()  # one run at a time
        self._plan_lock = threading.RLock()  # plan changes, run completion and what subscribers do
        self._subscribers: list[Callable[[str], None]] = []
        self._figures_of: tuple[Optional[Plan], dict[str, Any]] = (None, {})
        #: The status line.
        self.status = Status()
        self._plan = self._with_executor_costs(Plan(layer_table, tuple(splits), tuple(devices), chunks, checkpoint,
                                                    schedule, executor=executor, batch=batch_size(sample),
                                                    gpus_per_node=self.gpus_per_node))
        self._runs: list[dict[str, Any]] = []  # a summary row for every run
        #: How many runs keep their full timelines (the latest ones).
        self.keep_timelines = keep_timelines
        self._results: deque[RunResult] = deque(maxlen=keep_timelines)
        self._next_run = 0
        self._thread: Optional[threading.Thread] = None
        self._cancel_token: Optional[CancelToken] = None
        #: Actions done per stage by the run in progress (None between runs).
        self.counter: Optional[tl.ActionCounter] = None
        #: Whether a background run is in progress (from :meth:`run_async` until its thread's last word).
        self.running = False
        #: The last error shown ('' after a change that worked).
        self.last_error = ""
        #: The run the page shows (None: the latest) and the one it compares with (None: none).
        self.shown_run: Optional[int] = None
        self.compare_run: Optional[int] = None

    # ---- changes --------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call ``callback(change)`` after every change (one of :data:`EVENTS`); returns what stops it."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def _emit(self, change: str) -> None:
        for callback in list(self._subscribers):
            callback(change)

    @property
    def thread(self) -> Optional[threading.Thread]:
        """The latest background run's thread (None before the first)."""
        return self._thread

    @property
    def lock(self) -> threading.RLock:
        """Held while the state changes and its subscribers run; hold it to read several parts at once."""
        return self._plan_lock

    # ---- the plan -------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return self._plan

    def update(self, **changes: Any) -> Plan:
        """Change ``chunks``, ``checkpoint``, ``schedule``, ``executor``, ``devices``, ``splits`` or
        ``virtual_stages`` (and ``memory_cap``, which is drawn, not planned); checked first.

        Raises:
            TypeError: a name that is not one of these.
            ValueError: a bad value, named; the plan stays as it was.
        """
        if "memory_cap" in changes:
            cap = changes.pop("memory_cap")
            plan = self.update(**changes) if changes else self._plan
            self.memory_cap = cap
            return plan
        unknown = sorted(set(changes) - set(UPDATABLE))
        if unknown:
            raise TypeError(f"update() cannot change {', '.join(map(repr, unknown))}: it changes "
                            f"{', '.join(UPDATABLE)}")
        if "devices" in changes:
            changes["devices"] = chosen_devices(changes["devices"], self.gpus_per_node)
            if is_planned(changes["devices"][0]) != self.planned:
                raise ValueError(f"devices: this explorer plans {'catalogue' if self.planned else 'this machine'}'s "
                                 f"devices ({', '.join(self._plan.devices[:3])}…), not "
                                 f"{', '.join(changes['devices'][:3])}: its costs are "
                                 f"{'the roofline of' if self.planned else 'measured on'} them; explore() again for "
                                 "the others")
        return self.change_plan(lambda plan: plan.with_options(**changes))

    def change_plan(self, change: Callable[[Plan], Plan]) -> Plan:
        """Apply ``change`` to the current plan, atomically with respect to runs finishing. A plan
        that cannot be predicted is refused (its error raised) before it replaces the old one."""
        with self._plan_lock:
            plan = change(self._plan)
            if splits_backward(plan.schedule) and self._with_backward_split() is not plan.layer_table:
                plan = replace(plan, layer_table=self.layer_table)
            plan = self._with_executor_costs(plan)
            _ = plan.predicted
            self._plan = plan
            self._emit("plan")
            return plan

    def _with_executor_costs(self, plan: Plan) -> Plan:
        """``plan`` with its executor's own cost per action, probed once per executor (see
        :func:`pipexplore.executors.probe`), so that even a first prediction includes it; a
        processes plan whose ranks start or stop outnumbering the cores is probed again for its
        hand-over (:func:`~pipexplore.executors.probe.needs_probe`) until a run teaches one."""
        from pipexplore.executors.probe import needs_probe, with_probed_costs

        if not self.calibrate or not needs_probe(plan, self._probed):
            return plan
        before = self.status
        if plan.executor == "processes":  # its rank processes start now, once: say so while they do
            self.say(f"measuring what an action costs the processes executor: starting its {plan.num_devices} rank "
                     "processes (once; the first run then finds them started)", busy=True)
        try:
            return with_probed_costs(plan, self._probed)
        finally:
            if self.status is not before:
                self.say(before.text, busy=before.busy, error=before.error, trace=before.traceback)

    def _with_backward_split(self) -> pd.DataFrame:
        """The layer table with its input/weight-gradient split, measured the first time a plan needs it."""
        self.layer_table = layers.with_backward_split(self.model, self.sample, self.layer_table,
                                                      self.profile_options)
        return self.layer_table

    def balance(self, by: str = "time") -> list[int]:
        """Set the splits the plan's executor can run that minimise the costliest stage (``by`` time or size)."""
        self.update(splits=layers.balanced_splits(self.layer_table, self._plan.num_stages, by, self._plan.executor))
        return list(self._plan.splits)

    def devices_for(self, stages: int) -> tuple[tuple[str, ...], str]:
        """The devices for ``stages`` stages: extra ones dropped, missing ones repeated from the
        last; and a note saying which ('' when none). A CSV schedule keeps its ranks."""
        plan = self._plan
        needed = plan.num_devices if is_csv(plan.schedule) else (
            max(1, stages // plan.virtual_stages) if is_multi_stage(plan.schedule) else stages)
        pool = list(plan.devices)
        if plan.planned and len(pool) < needed:  # more GPUs of the kind, numbered on
            added = needed - len(pool)
            devices = planned_devices(pool + [pool[-1].split(":")[0]] * added, self.gpus_per_node)
            return devices, f"{stages} stages: {added} more {pool[-1].split(':')[0]} planned"
        if len(pool) >= needed:
            dropped = pool[needed:]
            return tuple(pool[:needed]), (f"{stages} stages: {', '.join(dropped)} dropped" if dropped else "")
        added = needed - len(pool)
        return (tuple(pool + [pool[-1]] * added),
                f"{stages} stages: {pool[-1]} repeated for {added} more device{'s' if added > 1 else ''}")

    def set_stage_count(self, stages: Any) -> str:
        """Split into ``stages`` stages balanced by time; the devices follow. Returns what changed in them.

        Raises:
            ValueError: not a whole number from 1 to the number of layers.
        """
        count = len(self.layer_table)
        if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= count:
            raise ValueError(f"stages must be a whole number from 1 to {count} (the layers), got {stages!r}")
        devices, note = self.devices_for(stages)
        self.update(splits=layers.balanced_splits(self.layer_table, stages, "time", self._plan.executor),
                    devices=devices)
        return note

    def set_splits(self, proposed: Sequence[int]) -> str:
        """Move, add or remove splits (as the strip does); where the number of stages changes the
        devices follow. Returns what changed in the devices ('' when nothing)."""
        if len(proposed) == len(self._plan.splits):
            self.update(splits=list(proposed))
            return ""
        devices, note = self.devices_for(len(proposed) + 1)
        self.update(splits=list(proposed), devices=devices)
        return note

    def reprofile(self) -> pd.DataFrame:
        """Time every layer again for the current plan (its micro-batch size and its CPU stages'
        intra-op threads); what runs here taught is dropped (what runs on other kinds of device
        taught stays) and the executor is probed again.

        Raises:
            RuntimeError: a run is in progress, or the model's layers changed in number.
        """
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a run is in progress: re-profile once it has finished (or cancel it)")
        plan = self._plan
        if self.traced:  # its traced stages timed again too, not taken from this session's
            traced_costs.forget_measured()
        table = layers.profile_layers(self.model, self.sample, self.profile_options, chunks=plan.chunks,
                                      devices=plan.devices[: plan.num_devices],
                                      split_backward=splits_backward(plan.schedule), loss_fn=self.loss_fn,
                                      target=self.target, optimizer=self.optimizer)
        if len(table) != len(self.layer_table):
            raise RuntimeError(f"the model now has {len(table)} layers, not {len(self.layer_table)}: "
                               "start a new explorer for it")
        with self._plan_lock:
            self.layer_table = table
            # (what runs on other kinds of device taught stays: it is not about this machine's profile)
            self.change_plan(lambda _: replace(plan, layer_table=table,
                                               corrections=Corrections(kinds=plan.corrections.kinds)))
        return table

    def all_notes(self) -> list[str]:
        """The notes, with what to say about the profile's threads against the plan's."""
        return [n for n in [*self.notes, layers.thread_note(self.layer_table, self._plan)] if n]

    def figures(self) -> dict[str, Any]:
        """The current plan's predicted figures (step, bubble, throughput, peaks), once per plan."""
        plan, figures = self._figures_of
        if plan is not self._plan:
            figures = plan_figures(self._plan, batch_size(self.sample))
            self._figures_of = (self._plan, figures)
        return figures

    @property
    def memory_cap(self) -> Optional[float]:
        """Bytes of activation memory a stage may hold (drawn; stages over it are flagged), or None."""
        return self._memory_cap

    @memory_cap.setter
    def memory_cap(self, value: Any) -> None:
        with self._plan_lock:
            self._memory_cap = parse_bytes(value, "memory_cap")
            self._emit("shown")

    # ---- the status line ----------------------------------------------------------------
    def say(self, text: str, *, busy: bool = False, error: bool = False, trace: str = "") -> None:
        """Set the status line."""
        with self._plan_lock:
            self.status = Status(text, busy, error, trace)
            self._emit("status")

    def show_error(self, exc: BaseException) -> None:
        """Say what went wrong (out of memory with what to try); the plan and the runs stay."""
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            text = (f"out of memory: {exc}. Try more chunks, checkpoint='always', or more stages; "
                    "the plan and earlier runs are kept")
            torch.cuda.empty_cache()
        else:
            text = f"{type(exc).__name__}: {exc}"
        self.last_error = text
        self.say(text, error=True, trace="".join(traceback.format_exception(exc)))

    def attempt(self, action: Callable[[], Any]) -> bool:
        """Do ``action`` (a user's change); an error is shown and the plan kept. Returns whether it worked."""
        try:
            action()
        except Exception as exc:  # a bad value: show it, keep the plan
            self.show_error(exc)
            return False
        self.last_error = ""
        if self.running:
            self.say(self.status.text, busy=self.status.busy)  # a change during a run keeps its status
        else:
            self.say("")
        return True

    # ---- per stage ----------------------------------------------------------------------------
    def stage_table(self) -> pd.DataFrame:
        """Per stage: device, layers, time, parameters, activations, predicted peak activation
        memory, the measured peak of its device in the shown run (where the device reports it),
        and the training memory that decides whether it fits (:func:`pipexplore.predict.memory.stage_memory`):
        ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` (the user's optimizer), peak
        ``activation_bytes`` as the schedule holds them, ``peak_bytes``, the device's ``capacity``
        and ``fits`` (within it, and activations within ``memory_cap`` where one is set)."""
        stages = self._plan.stages
        peaks = self.figures()["peak_memory_per_stage"]
        result = self.shown_result()
        measured = result.timeline.attrs.get("peak_memory", {}) if result is not None else {}
        memory = stage_memory(self.layer_table, self._plan.splits, peak_activations=peaks, optimizer=self.optimizer,
                              mixed_precision=self.mixed_precision,
                              capacity=[device_memory(d) for d in stages["device"]])
        if self._memory_cap is not None:
            memory["fits"] &= memory["activation_bytes"] <= self._memory_cap
        return pd.DataFrame({
            "stage": stages["stage"], "device": stages["device"],
            "layers": [f"{a}–{b}" for a, b in zip(stages["first_layer"], stages["last_layer"])],
            "fwd+bwd": stages["forward"] + stages["backward"], "params": stages["param_bytes"],
            "activations": stages["activation_bytes"], "peak activations (predicted)": peaks,
            "peak memory (measured)": [float(measured.get(str(d), math.nan)) for d in stages["device"]],
            **{column: memory[column].to_numpy() for column in MEMORY_COLUMNS},
        })

    def shared_parameters(self) -> dict[str, list[int]]:
        """Parameters used by blocks of more than one stage (tied weights), with those stages."""
        if "shared" not in self.layer_table:
            return {}
        stage_of = [sum(1 for s in self._plan.splits if s <= k) for k in range(len(self.layer_table))]
        users: dict[str, set[int]] = {}
        for k, names in enumerate(self.layer_table["shared"]):
            for name in filter(None, str(names).split(",")):
                users.setdefault(name, set()).add(stage_of[k])
        return {name: sorted(st) for name, st in users.items() if len(st) > 1}

    # ---- export -------------------------------------------------------------------------------
    def export(self, kind: str = "gpipe", *, hooks: str = "train_hooks", steps: int = 1) -> str:
        """Code that reproduces the current split: ``'gpipe'`` (a ``GPipe(...)``, ``nn.Sequential``
        models), ``'pipelining'`` (a ``torch.distributed.pipelining`` split spec and schedule),
        ``'torchrun'`` (a standalone script importing ``build_model()``, ``get_batch()`` and
        ``loss_fn()`` from the ``hooks`` module) or ``'schedule-csv'`` (the plan's schedule in
        torch's CSV format, the text of a file for ``schedule="my.csv"`` or torch's ``_load_csv``).

        Raises:
            ValueError: a kind this model cannot export, or an unknown kind.
        """
        plan = self._plan
        if kind == "torchrun":
            from pipexplore.export.torchrun import torchrun_script

            return torchrun_script(self.layer_table, list(plan.splits), hooks=hooks, chunks=plan.chunks, steps=steps,
                                   schedule=plan.schedule if plan.schedule != "async-backends" else "gpipe",
                                   devices=plan.num_devices, device=plan.device_type, checkpoint=plan.export_checkpoint)
        if kind == "gpipe" and self.traced:
            raise ValueError(f"GPipe takes an nn.Sequential; {type(self.model).__name__} exports as 'pipelining' "
                             "or 'torchrun'")
        if kind not in CODE_KINDS:
            raise ValueError(f"unknown export kind {kind!r}: 'gpipe', 'pipelining', 'torchrun' or 'schedule-csv'")
        return plan.to_code(kind)

    @property
    def module_fqns_per_model_part(self) -> list[list[str]]:
        """The current split as torchtitan's ``module_fqns_per_model_part``."""
        from pipexplore.export.torchrun import module_fqns_per_model_part

        return module_fqns_per_model_part(self.layer_table, list(self._plan.splits))
