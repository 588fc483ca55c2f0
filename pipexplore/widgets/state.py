"""What the explorer knows: model, devices, layer table, plan, runs, notes and status, and who to tell.

:class:`ExplorerState` imports neither ipywidgets nor anywidget: it is the explorer without a page,
and every behaviour of the explorer is tested on it. Its parts: :attr:`~ExplorerState.placement`
(the devices), :attr:`~ExplorerState.meshes` (the mesh over them), :attr:`~ExplorerState.log` (the
runs kept) and :attr:`~ExplorerState.runner` (what runs the plan). A view subscribes to its changes::

    state.subscribe(lambda change: ...)     # change: 'plan' | 'runs' | 'status' | 'shown'

``plan``: the current plan changed (splits, options, what calibration taught). ``runs``: a run was
added or the runs were cleared. ``status``: the status line, or whether a run is in progress.
``shown``: which run the page shows or compares, or the memory cap drawn.

Changes happen under one lock, from any thread (a background run finishes in its own), and
subscribers are called under it.

Why one module: every method here changes the one plan under that lock and tells the subscribers,
or routes to what does (the explorer's methods, written once here); what is a concept of its own
(the options, devices, the mesh, runs, the runner, sweeps, the stage table, the exported code) is
already a part or a function elsewhere, and this class only routes to it.
"""
from __future__ import annotations

import threading
import traceback
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import pandas as pd
import torch
from torch import nn

from pipexplore import validate
from pipexplore.devices import chosen_devices, is_planned
from pipexplore.devices.mesh import Mesh
from pipexplore.devices.placement import Placement, devices_for, place
from pipexplore.export.registry import plan_code
from pipexplore.export.torchrun import module_fqns_per_model_part
from pipexplore.samples import Sample, batch_size
from pipexplore.models.hf import cache_note
from pipexplore.models.inputs import tokens_per_sample
from pipexplore.models.profile import ProfileOptions, on_meta, profile_model, with_backward_split
from pipexplore.models.trace import profile_candidates
from pipexplore.plan import EXECUTORS, VIRTUAL_STAGES, Plan
from pipexplore.predict.costs import Corrections
from pipexplore.schedules import CsvSchedule, csv_schedule, is_csv, is_multi_stage, splits_backward
from pipexplore.skip.skippable import verify_skippables
from pipexplore.widgets import layer_table as layers
from pipexplore.widgets import what_if
from pipexplore.widgets.mesh_choice import MeshChoice
from pipexplore.widgets.options import ExploreOptions
from pipexplore.widgets.header import parse_bytes, plan_figures, plan_text
from pipexplore.widgets.progress import profile_progress
from pipexplore.widgets.run_log import RUN_COLUMNS, RunLog
from pipexplore.widgets.runner import Runner
from pipexplore.splits import shared_parameters
from pipexplore.training import Training
from pipexplore.widgets.stage_table import stage_table

__all__ = ["ExplorerState", "Status", "RUN_COLUMNS", "UPDATABLE", "EVENTS"]

#: What :meth:`ExplorerState.update` changes.
UPDATABLE = ("splits", "devices", "chunks", "checkpoint", "schedule", "executor", "virtual_stages")
#: The changes a subscriber hears of.
EVENTS = ("plan", "runs", "status", "shown")


def _check_model(model: Any) -> bool:
    """Whether ``model`` is traced (not an ``nn.Sequential``); an empty one or a non-module refused."""
    if isinstance(model, nn.Sequential):
        if len(model) == 0:
            raise ValueError("the model has no layers to split")
        verify_skippables(model)
        return False
    if not isinstance(model, nn.Module):
        raise TypeError(f"the explorer needs an nn.Module, got {type(model).__name__}")
    return True


@dataclass(frozen=True)
class Status:
    """The status line: ``text``, whether work is under way (``busy``), whether it is an
    ``error``, and the error's ``traceback`` ('' otherwise)."""

    text: str = ""
    busy: bool = False
    error: bool = False
    traceback: str = ""


def _ranks(stages: int, schedule: str, virtual_stages: int = VIRTUAL_STAGES) -> int:
    """The devices ``stages`` stages run on under ``schedule``: one a stage, or ``virtual_stages`` a
    device under a multi-stage schedule (as :attr:`pipexplore.plan.Plan.num_devices` counts them)."""
    return max(1, stages // virtual_stages) if is_multi_stage(schedule) else stages


class ExplorerState:
    """The explorer's model of one Plan and its runs (see the module docstring for its changes).

    Its parts: the devices, resolved once (:attr:`placement`), the layer table, the plan, the run
    log (:attr:`log`), the notes and the status line. It is made with ``options``
    (:class:`~pipexplore.widgets.options.ExploreOptions`, held as :attr:`options`) or the same as
    keywords, each checked on entry (a ``ValueError``/``TypeError`` naming it) before anything is
    profiled; then the layers are profiled (:func:`pipexplore.models.profile.profile_model`,
    unless a ``layer_table`` is given) and the plan is balanced by time where no ``splits`` are
    given. A traced model is profiled as the stages its runs execute
    (:mod:`pipexplore.models.trace.profile_candidates`: one more trace); ``profile_stages=False`` times its
    modules only, sooner, its first prediction shorter.

    Its public methods and properties are the explorer's too (:class:`~pipexplore.widgets.explorer.Explorer`
    is this class with its page): they are defined here, once.

    Example::

        state = ExplorerState(model, sample, chunks=8)
        state.subscribe(print)              # 'plan', 'runs', ...
        state.update(splits=[4, 9])
        state.run()                         # a real step; a row in state.runs
    """

    #: The options it was made with, checked (:class:`~pipexplore.widgets.options.ExploreOptions`):
    #: ``options`` with ``keywords`` over them.
    options: ExploreOptions
    #: Whether the model is split by torch's tracer (not an ``nn.Sequential``: split at candidate modules).
    traced: bool
    #: What runs and profiles train on: the loss, optimizer and target, each the user's or the
    #: default, resolved here once (:class:`~pipexplore.training.Training`).
    training: Training
    #: Whether memory is counted for 16-bit training with fp32 master weights and gradients
    #: (Megatron-LM's 18 bytes a parameter with Adam), not in the parameters' own dtype.
    mixed_precision: bool
    #: Where the stages run (:class:`pipexplore.devices.placement.Placement`).
    placement: Placement
    #: The mesh over the planned devices and how its replicas share the work
    #: (:class:`~pipexplore.widgets.mesh_choice.MeshChoice`).
    meshes: MeshChoice
    #: How the layers are profiled (:func:`~pipexplore.models.profile.profile_model`'s options).
    profile_options: ProfileOptions
    #: Whether runs teach the predictions (the executor's own costs, corrections per action).
    calibrate: bool
    #: The user's model (runs train copies of it).
    model: nn.Module
    #: One mini-batch (a traced model's mapping as a dict).
    sample: Sample
    #: One row per layer (or traced candidate): names, costs, sizes (see :func:`pipexplore.profile_model`).
    layer_table: pd.DataFrame
    #: Notes the page shows above the status line.
    notes: list[str]
    #: The status line.
    status: Status
    #: The last error shown ('' after a change that worked).
    last_error: str
    #: The runs made: rows, kept results, which the page shows (:class:`~pipexplore.widgets.run_log.RunLog`).
    log: RunLog
    #: What runs the plan, here or under torchrun (:class:`~pipexplore.widgets.runner.Runner`).
    runner: Runner

    def __init__(self, model: nn.Module, sample: Sample, options: Optional[ExploreOptions] = None,
                 **keywords: Any) -> None:
        # 1. What the user gave, checked where it enters: nothing is profiled before all of it holds.
        self.options = ExploreOptions.of(**{**(options.keywords() if options is not None else {}), **keywords})
        given = self.options
        self._memory_cap = given.memory_cap
        self.traced = _check_model(model)
        validate.sample(sample)
        self.training = Training.of(given.loss_fn, given.optimizer, given.target, rows=batch_size(sample))
        self.mixed_precision = given.mixed_precision
        # 2. The devices, resolved once: planned from the catalogue or present here.
        self.placement = place(given.devices, gpus_per_node=given.gpus_per_node)
        if on_meta(model) and not self.placement.given:
            raise ValueError(f"{type(model).__name__} is on the meta device (no weights): name the devices to plan it "
                             "for, from the catalogue (devices=['H100'] * 16, gpus_per_node=8), or devices here to "
                             "time its blocks one at a time")
        self.meshes = MeshChoice(given.mesh, self.placement, data_parallel=given.data_parallel,
                                 sequence_parallel=given.sequence_parallel,
                                 reshard_after_forward=given.reshard_after_forward, moe_overlap=given.moe_overlap,
                                 moe_dispatcher=given.moe_dispatcher, capacity_factor=given.capacity_factor,
                                 tp_plan=dict(given.tp_plan) if given.tp_plan is not None else None)
        # 3. The schedule, its micro-batches and the executor.
        schedule = given.schedule
        file = csv_schedule(schedule) if is_csv(schedule) else None  # a file says its stages, ranks and chunks
        chunks = validate.first_chunks(given.chunks, batch_size(sample), file.microbatches if file else None)
        checkpoint, executor, splits = given.checkpoint, given.executor, given.splits
        if self.planned and executor == "threads":
            executor = "processes"  # planned GPUs run a process each (torchrun), not threads of this one
        if splits is not None and not self.traced:
            splits = validate.splits(splits, len(model) if isinstance(model, nn.Sequential) else 0)
        self.profile_options = ProfileOptions(granularity=given.granularity, repeats=given.profile_repeats,
                                              profile_stages=given.profile_stages,
                                              mixed_precision=self.mixed_precision)
        self.calibrate = given.calibrate

        self.model = model
        self.sample = dict(sample) if self.traced and isinstance(sample, Mapping) else sample
        # 4. The layer table: profiled as the plan will run (the input/weight-gradient split is
        # measured when a plan that splits backwards first needs it).
        self.layer_table = (given.layer_table if given.layer_table is not None
                            else self._profile(chunks, splits_backward(schedule)))
        # 5. What the page says of all this.
        self.notes = self._first_notes(given.granularity)
        # 6. The first plan: the splits given, else balanced by time; its executor's own costs probed.
        splits = self._first_splits(splits, file, executor, schedule)
        plan_devices, note = self.placement.for_stages(file.ranks if file else _ranks(len(splits) + 1, schedule))
        self.notes += [note] if note else []
        #: What the executor probes measured (:func:`pipexplore.executors.probe.probe_kind` of each).
        self._probed: set[tuple[str, str]] = set()
        self._plan_lock = threading.RLock()  # plan changes, run completion and what subscribers do
        self._subscribers: list[Callable[[str], None]] = []
        self._figures_of: tuple[Optional[Plan], dict[str, Any]] = (None, {})
        self.status = Status()
        self._plan = self.with_executor_costs(Plan(self.layer_table, tuple(splits), tuple(plan_devices), chunks,
                                                    checkpoint, schedule, executor=executor,
                                                    batch=batch_size(sample), gpus_per_node=self.gpus_per_node,
                                                    mesh=self.mesh, **self.meshes.options))
        self.last_error = ""
        # 7. Its runs: none yet, and what makes them.
        self.log = RunLog(given.keep_timelines)
        self.runner = Runner(self)

    def _profile(self, chunks: int, split_backward: bool, tp: Optional[int] = None) -> pd.DataFrame:
        """The layer table, profiled for this explorer's devices (in a notebook, with a progress bar);
        with a mesh, one tensor-parallel rank's of ``tp`` (default: the mesh's)."""
        tp = tp if tp is not None else self.meshes.tp
        with profile_progress() as progress:
            return profile_model(self.model, self.sample, devices=self.placement, chunks=chunks,
                                 split_backward=split_backward, **self.training.keywords(), progress=progress, tp=tp,
                                 tp_plan=self.meshes.tp_plan, **self.profile_options)

    def table_for_tp(self, tp: int) -> pd.DataFrame:
        """The layer table of one tensor-parallel rank of ``tp`` (counted once per ``tp``, on meta)."""
        return self.meshes.table_for(tp, self.layer_table, lambda n: self._profile(self._plan.chunks, False, tp=n))

    def set_mesh(self, mesh: Any, **options: Any) -> Plan:
        """Plan the mesh ``mesh`` (``{"tp": 4, "pp": 8, "dp": 2}`` over the plan's devices) with
        ``options`` (``data_parallel``, ``sequence_parallel``, ``reshard_after_forward``, ``moe_overlap``,
        ``moe_dispatcher``, ``capacity_factor``): its rank's layers counted for its ``tp``, its ``pp`` stages balanced by time
        (:meth:`~pipexplore.widgets.mesh_choice.MeshChoice.replanned`).

        Raises:
            ValueError: what was wrong, named; the plan stays as it was.

        Example::

            explorer.set_mesh({"tp": 4, "pp": 8, "dp": 2}, data_parallel="fsdp")
        """
        plan = self.meshes.replanned(self._plan, mesh, self.table_for_tp, **options)
        changed = self.change_plan(lambda _: plan)
        self.meshes.take(changed)
        self.layer_table = changed.layer_table
        return changed

    @property
    def mesh(self) -> Optional[Mesh]:
        """The plan's mesh (None: every device is a pipeline rank)."""
        return self.meshes.mesh

    def _first_notes(self, granularity: str) -> list[str]:
        """What the page first says: the loss it times, how a traced model is split, what a plan on
        catalogue devices is, and what the profile noted."""
        notes = [] if self.training.given_loss else [
            "No loss_fn given: runs time a synthetic loss (the mean of the squared outputs)."]
        if self.traced and not self.planned:
            notes.append(f"{type(self.model).__name__} is not an nn.Sequential: its candidate split points are its "
                         f"{granularity} (by FQN), split by torch.distributed.pipelining's tracer; runs execute "
                         "the traced stages in this process (threads) or one process per stage (processes)"
                         + ("; each block is profiled as its traced stage."
                            if self.layer_table.attrs.get("stage_extra") else "."))
            notes += [note for note in [cache_note(self.model)] if note]  # a config's use_cache=True, off
        if self.planned:
            notes.append(layers.planned_note(self.placement))
        notes += self.meshes.notes(self.gpus_per_node)
        return notes + list(self.layer_table.attrs.get("notes", []))  # e.g. layers whose FLOPs could not be counted

    def _first_splits(self, splits: Optional[Sequence[int]], file: Optional[CsvSchedule], executor: str,
                      schedule: str = "gpipe") -> list[int]:
        """The splits given (checked against the table), else the stages of the devices (or of the
        CSV file) balanced by time: a stage a device, or :data:`~pipexplore.plan.VIRTUAL_STAGES` a
        device under a multi-stage schedule (as torch's multi-stage schedules place them: every
        device given runs stages)."""
        count = len(self.layer_table)
        if splits is not None:
            return list(validate.splits(splits, count))
        per_rank = VIRTUAL_STAGES if is_multi_stage(schedule) else 1
        stages = min(count, file.stages if file else len(self.placement.devices) * per_rank)
        if self.mesh is not None:  # its pipeline ranks
            stages = min(count, self.mesh.pp * per_rank)
        if not file and stages > per_rank:  # fewer layers than that: whole ranks' worth of stages
            stages -= stages % per_rank
        return layers.balanced_splits(self.layer_table, stages, "time", executor)

    @property
    def planned(self) -> bool:
        """Whether the plan is for catalogue devices, costed but never run here."""
        return self.placement.planned

    @property
    def gpus_per_node(self) -> int:
        """Planned devices a node (which copies cross nodes), for plans on catalogue devices."""
        return self.placement.gpus_per_node

    # ---- changes --------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call ``callback(change)`` after every change (one of :data:`EVENTS`); returns what stops it."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def notify(self, change: str) -> None:
        """Tell every subscriber of ``change`` (one of :data:`EVENTS`); call it under :attr:`lock`."""
        for callback in list(self._subscribers):
            callback(change)

    @property
    def lock(self) -> threading.RLock:
        """Held while the state changes and its subscribers run; hold it to read several parts at once."""
        return self._plan_lock

    # ---- the plan -------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The current plan (immutable; every change makes a new one)."""
        return self._plan

    @property
    def splits(self) -> list[int]:
        """The current split points (the index of each stage's first layer after the first); set
        them to move them (as :meth:`update`)."""
        return list(self._plan.splits)

    @splits.setter
    def splits(self, value: Sequence[int]) -> None:
        self.update(splits=value)

    def update(self, **changes: Any) -> Plan:
        """Change ``chunks``, ``checkpoint``, ``schedule``, ``executor``, ``devices``, ``splits``,
        ``virtual_stages`` or ``memory_cap`` (drawn, not planned); checked first. ``devices`` is a
        list or a comma-separated string. A change made while a run is in progress stays.

        Raises:
            TypeError: a name that is not one of these.
            ValueError: a bad value, named; the plan stays as it was.

        Example::

            explorer.update(chunks=8, schedule="1f1b")
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
            if splits_backward(plan.schedule) and self.with_backward_split() is not plan.layer_table:
                plan = replace(plan, layer_table=self.layer_table)
            plan = self.with_executor_costs(plan)
            _ = plan.predicted
            self._plan = plan
            self.notify("plan")
            return plan

    def with_executor_costs(self, plan: Plan) -> Plan:
        """``plan`` with its executor's own cost per action, probed once per executor (see
        :func:`pipexplore.executors.probe`), so that even a first prediction includes it; a
        processes plan whose ranks start or stop outnumbering the cores is probed again for its
        hand-over (:func:`~pipexplore.executors.probe.needs_probe`) until a run teaches one."""
        from pipexplore.executors.probe import co_run_shares, needs_probe, runs_as_script, with_probed_costs

        if not self.calibrate or not needs_probe(plan, self._probed):
            return plan
        before = self.status
        measure = None
        if runs_as_script(plan):  # its runs are the exported script's ranks: probed through the script
            self.say(f"measuring what the exported script's {plan.mesh_or_pipeline.size} ranks cost beside their "
                     "layers (a few steps of busy stages, once)", busy=True)
            measure = self._script_probe
        elif plan.executor == "processes":  # its rank processes start now, once: say so while they do
            self.say(f"measuring what an action costs the processes executor: starting its {plan.num_devices} rank "
                     "processes (once; the first run then finds them started)", busy=True)
        try:
            plan = with_probed_costs(plan, self._probed, measure)
            if self.options.layer_table is None:  # (a table the user gave is costed as given)
                try:
                    shared = co_run_shares(plan, self.model, self.sample)
                except Exception as error:  # a refinement of the first prediction: never a reason to stop
                    warnings.warn(f"the co-run probe did not run ({type(error).__name__}: {error}); the first "
                                  "prediction uses the profile's shares of the host", RuntimeWarning, stacklevel=2)
                    shared = None
                if shared is not None:
                    self.layer_table = shared
                    plan = plan.with_options(layer_table=shared)
            return plan
        finally:
            if self.status is not before:
                self.say(before.text, busy=before.busy, error=before.error, trace=before.traceback)

    def _script_probe(self, plan: Plan) -> tuple[dict[str, float], float, float]:
        """The executor's costs of a mesh run as the exported script's ranks
        (:func:`pipexplore.runs.script_probe.script_probe`), else the processes probe's, with a warning
        saying why."""
        from pipexplore.executors.probe import probe
        from pipexplore.runs.script_probe import parameter_tensors, script_probe

        try:
            return script_probe(plan, tensors=parameter_tensors(self.model, plan.num_stages),
                                optimizer=self.training.optimizer)
        except Exception as error:  # a refinement of the first prediction: never a reason to stop
            warnings.warn(f"the exported script's ranks were not probed ({type(error).__name__}: {error}); the first "
                          "prediction takes the processes executor's costs", RuntimeWarning, stacklevel=2)
            return probe(plan)

    def with_backward_split(self) -> pd.DataFrame:
        """The layer table with its input/weight-gradient split, measured the first time a plan needs it."""
        self.layer_table = with_backward_split(self.model, self.sample, self.layer_table,
                                               device=self.placement.profiling_device,
                                               repeats=self.profile_options["repeats"])
        return self.layer_table

    def balance(self, by: str = "time") -> list[int]:
        """Set the splits that minimise the most expensive stage (``by`` ``'time'`` or ``'size'``) among
        those the plan's executor can run (:func:`pipexplore.splits.first_runnable_layer`)."""
        self.update(splits=layers.balanced_splits(self.layer_table, self._plan.num_stages, by, self._plan.executor))
        return list(self._plan.splits)

    def devices_for(self, stages: int) -> tuple[tuple[str, ...], str]:
        """The devices for ``stages`` stages from the plan's, and a note saying what changed
        (:func:`pipexplore.devices.placement.devices_for`). A CSV schedule keeps its ranks."""
        plan = self._plan
        needed = plan.num_devices if is_csv(plan.schedule) else _ranks(stages, plan.schedule, plan.virtual_stages)
        return devices_for(plan.devices, needed, stages=stages, gpus_per_node=self.gpus_per_node)

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
        taught stays) and the executor is probed again. Returns the new table.

        Example::

            explorer.update(devices="cpu,cpu,cpu,cpu")   # 4 CPU stages: fewer threads each
            explorer.reprofile()

        Raises:
            RuntimeError: a run is in progress, or the model's layers changed in number.
        """
        if self.runner.running:
            raise RuntimeError("a run is in progress: re-profile once it has finished (or cancel it)")
        plan = self._plan
        if self.traced:  # its traced stages timed again too, not taken from this session's
            profile_candidates.forget_measured()
        placement = replace(self.placement, devices=tuple(plan.devices[: plan.num_devices]), given=True)
        with profile_progress() as progress:
            table = profile_model(self.model, self.sample, devices=placement, chunks=plan.chunks,
                                  split_backward=splits_backward(plan.schedule), **self.training.keywords(),
                                  progress=progress, **self.profile_options)
        if len(table) != len(self.layer_table):
            raise RuntimeError(f"the model now has {len(table)} layers, not {len(self.layer_table)}: "
                               "start a new explorer for it")
        with self._plan_lock:
            self.layer_table = table
            # (what runs on other kinds of device taught stays: it is not about this machine's profile)
            self.change_plan(lambda _: replace(plan, layer_table=table,
                                               corrections=Corrections(kinds=plan.corrections.kinds)))
        return self.layer_table  # (the executor's probes may have scaled its shares: the table the plan reads)

    def all_notes(self) -> list[str]:
        """The notes, with what to say about the profile's threads against the plan's."""
        return [n for n in [*self.notes, layers.thread_note(self.layer_table, self._plan)] if n]

    def figures(self) -> dict[str, Any]:
        """The current plan's predicted figures, once per plan (:func:`pipexplore.widgets.header.plan_figures`:
        step, bubble, throughput, each stage's peak activations on one GPU; on planned GPUs MFU and
        HFU, tokens a second and ``peak_bytes_per_gpu``)."""
        plan, figures = self._figures_of
        if plan is not self._plan:
            samples = self._plan.batch or batch_size(self.sample)
            figures = plan_figures(self._plan, samples, tokens_per_sample(self.sample))
            self._figures_of = (self._plan, figures)
            if self._plan.planned:  # the fullest GPU's training memory, as the stage table counts it
                table = self._stage_table(figures)
                figures["peak_bytes_per_gpu"] = float(table.groupby("device")["peak_bytes"].sum().max())
        return figures

    @property
    def memory_cap(self) -> Optional[float]:
        """Bytes of activation memory a stage may hold (drawn on the memory panel; stages over it
        are flagged), or None. Set it as bytes or text (``"2 GiB"``)."""
        return self._memory_cap

    @memory_cap.setter
    def memory_cap(self, value: Any) -> None:
        with self._plan_lock:
            self._memory_cap = parse_bytes(value, "memory_cap")
            self.notify("shown")

    # ---- the status line ----------------------------------------------------------------
    def say(self, text: str, *, busy: bool = False, error: bool = False, trace: str = "") -> None:
        """Set the status line."""
        with self._plan_lock:
            self.status = Status(text, busy, error, trace)
            self.notify("status")

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
        if self.runner.running:
            self.say(self.status.text, busy=self.status.busy)  # a change during a run keeps its status
        else:
            self.say("")
        return True

    # ---- runs ---------------------------------------------------------------------------------
    def run(self, executor: Optional[str] = None, *, timeout: Optional[float] = None, nodes: int = 1) -> pd.Series:
        """Run a real training step of the current plan (blocking) and add it to :attr:`runs`;
        returns its row. ``executor``: ``'threads'``, ``'autograd'`` or ``'processes'`` (it becomes
        the plan's), or ``'torchrun'``: the exported script under ``nodes`` torchrun node agents
        here, its recording loaded back (as :meth:`load_run`); ``timeout`` bounds a ``'processes'``
        or ``'torchrun'`` run. Errors propagate; the plan and earlier runs are kept
        (:meth:`pipexplore.widgets.runner.Runner.run`)."""
        return self.runner.run(executor, timeout=timeout, nodes=nodes)

    def load_run(self, directory: Any) -> pd.Series:
        """Add a run the exported script recorded (``--record DIR``, on any cluster) to :attr:`runs`."""
        return self.runner.load_run(directory)

    def run_async(self, executor: Optional[str] = None, **options: Any) -> threading.Thread:
        """Start :meth:`run` in a background thread (what the button does); returns the thread."""
        return self.runner.run_async(executor, **options)

    def cancel(self, timeout: float = 60.0) -> bool:
        """Stop the background run: nothing of it is recorded, the plan and earlier runs are kept.
        Returns whether a run was in progress (and has ended within ``timeout`` seconds).

        Example::

            explorer.run_async()
            explorer.cancel()          # True; explorer.runs as before
        """
        return self.runner.cancel(timeout)

    @property
    def keep_timelines(self) -> int:
        """How many of the latest runs keep their whole timelines (every run keeps its row)."""
        return self.log.keep_timelines

    def timeline(self, kind: str = "predicted", run: Optional[int] = None) -> pd.DataFrame:
        """``'predicted'``: the current plan's; ``'measured'``: the latest run's, or run ``run``'s
        while it is among the last ``keep_timelines`` runs.

        Raises:
            ValueError: another ``kind``.
            LookupError: no run yet, or that run's timeline is no longer kept.
        """
        if kind == "predicted":
            return self._plan.predicted
        if kind != "measured":
            raise ValueError(f"timeline kind is 'predicted' or 'measured', not {kind!r}")
        return self.log.measured_timeline(run)

    def residuals(self, run: int = -1) -> pd.DataFrame:
        """Each action of a run (default: the latest) against its prediction."""
        return self.log.residuals(run)

    @property
    def runs(self) -> pd.DataFrame:
        """One row per run: the plan, what was measured, the prediction's error, the loss at the
        plan's weights, and whether the loss and gradients were ``finite`` (the run log's, :attr:`log`)."""
        return self.log.frame()

    def clear_runs(self) -> None:
        """Forget every run (rows and timelines); the plan and what calibration taught it stay."""
        with self._plan_lock:
            self.log.clear()
            self.notify("runs")

    def show(self, run: Optional[int] = None, compare: Optional[int] = -1) -> None:
        """Show run ``run`` (None: the latest) and compare it with run ``compare`` (None: with none;
        -1: keep the comparison)."""
        with self._plan_lock:
            self.log.show(run, compare)
            self.notify("shown")

    def taught(self, plan: Plan) -> None:
        """Make ``plan``, the current plan as a run taught it, current (the runner calls it under :attr:`lock`)."""
        self._plan = plan
        self.notify("plan")

    def restore(self, run: Optional[int]) -> Plan:
        """Make the plan of run ``run`` (its number in :attr:`runs`) the current plan again; what
        calibration learnt since is kept.

        Raises:
            LookupError: no such run.
        """
        row = self.log.row_of(run)
        result = self.log.result_of(run)
        if result is not None:
            old = result.plan
            options = dict(splits=old.splits, devices=old.devices, chunks=old.chunks, checkpoint=old.checkpoint,
                           schedule=old.schedule, executor=old.executor, virtual_stages=old.virtual_stages)
        else:
            executor = row["executor"] if row["executor"] in EXECUTORS else self._plan.executor
            options = dict(splits=tuple(row["splits"]), devices=tuple(str(row["devices"]).split(",")),
                           chunks=int(row["chunks"]), checkpoint=str(row["checkpoint"]), schedule=str(row["schedule"]),
                           executor=executor)
        plan = self.change_plan(lambda plan: plan.with_options(**options))
        self.say(f"restored the plan of run {run}: {plan_text(plan)}")
        return plan

    # ---- what if: other plans predicted, and one of them taken -------------------------------------
    def sweep(self, *, stages: Sequence[int] = (), chunks: Sequence[int] = (), schedules: Sequence[str] = (),
              checkpoint: Sequence[str] = (), measure: int = 0) -> pd.DataFrame:
        """Predict every combination (each with its balanced split), ranked by predicted step time;
        with ``measure=k`` the top ``k`` rows are also run. Apply a row with :meth:`apply`
        (:func:`pipexplore.widgets.what_if.sweep_state`).

        Example::

            table = explorer.sweep(stages=[2, 3, 4], chunks=[4, 8], schedules=["gpipe", "1f1b"], measure=3)
            explorer.apply(table.iloc[0])
        """
        return what_if.sweep_state(self, stages=stages, chunks=chunks, schedules=schedules, checkpoint=checkpoint,
                                   measure=measure)

    def search(self, *, memory_cap: Any = None, stages: Sequence[int] = (), chunks: Sequence[int] = (),
               schedules: Sequence[str] = (), checkpoint: Sequence[str] = (), virtual_stages: Sequence[int] = (),
               workers: Optional[int] = None, mesh: Optional[str] = None, data_parallel: Sequence[str] = (),
               microbatch_rows: Sequence[int] = (), cp: Sequence[int] = (), ep: Sequence[int] = (),
               etp: Sequence[int] = ()) -> pd.DataFrame:
        """Every combination, each with the fastest split whose every device holds it within
        ``memory_cap`` (bytes or ``'80 GiB'``: parameters, gradients, optimizer state and the
        activations its schedule holds; None: each device's memory), predicted; the plans that
        fit first, by predicted step, with ``predicted_step_time``, ``peak_bytes``, ``fits`` and
        ``pareto``. Nothing fits: a ``ValueError`` naming the closest plan and how far over it is.
        Apply a row with :meth:`apply`. ``mesh="auto"`` (devices from the catalogue): every mesh of
        the devices (tp × pp × dp, × ``cp`` where asked, with each of ``data_parallel`` and ``microbatch_rows``;
        a mixture of experts folded every way, or at the ``ep`` and ``etp`` asked for, each at the plan's
        ``capacity_factor``: a mesh whose ``ep`` is below it is left out, named), the global batch
        kept, with ``tp``, ``pp``, ``dp``, ``cp``, ``ep``, ``etp`` and ``notes`` columns
        (:func:`pipexplore.widgets.what_if.search_state`).

        Example::

            table = explorer.search(memory_cap="80 GiB", stages=[4, 8], chunks=[8, 16],
                                    schedules=["gpipe", "1f1b"], checkpoint=["never", "always"])
            explorer.apply(table.iloc[0])
            meshes = explorer.search(mesh="auto", data_parallel=["zero1", "fsdp"], checkpoint=["always"])
        """
        return what_if.search_state(self, memory_cap=memory_cap, stages=stages, chunks=chunks, schedules=schedules,
                                    checkpoint=checkpoint, virtual_stages=virtual_stages, workers=workers, mesh=mesh,
                                    data_parallel=data_parallel, microbatch_rows=microbatch_rows, cp=cp, ep=ep,
                                    etp=etp)

    def apply(self, row: Any) -> Plan:
        """Make a row of :meth:`sweep` or :meth:`search` the current plan, or a mapping of some of
        their plan columns (the others kept): ``ex.apply({"splits": [2, 4]})``."""
        return what_if.apply(self, row)

    # ---- per stage, and the code that reproduces the plan -----------------------------------------
    def stage_table(self) -> pd.DataFrame:
        """Per stage: device, layers, time, parameters, activations, predicted peak memory, and the
        measured peak of its device in the shown run (:func:`pipexplore.widgets.stage_table.stage_table`)."""
        return self._stage_table(self.figures())

    def _stage_table(self, figures: dict[str, Any]) -> pd.DataFrame:
        result = self.log.shown_result()
        return stage_table(self._plan, figures["activation_bytes_per_stage"],
                           measured=result.timeline.attrs.get("peak_memory", {}) if result is not None else {},
                           optimizer=self.training.optimizer, mixed_precision=self.mixed_precision,
                           memory_cap=self._memory_cap)

    def shared_parameters(self) -> dict[str, list[int]]:
        """Parameters used by blocks of more than one stage (tied weights), with those stages."""
        return shared_parameters(self.layer_table, self._plan.splits)

    def export(self, kind: str = "gpipe", *, hooks: str = "train_hooks", steps: int = 1, **options: Any) -> str:
        """The current plan exported as ``kind``, one of :data:`pipexplore.export.registry.KINDS`
        (:func:`pipexplore.export.registry.plan_code`, given this model's options; the Chrome trace
        of the shown run, or of the predicted step where none is shown). ``options``: more of
        ``plan_code``'s (the page's ``report``)."""
        result = self.log.shown_result()
        return plan_code(self._plan, kind, traced=self.traced, model_name=type(self.model).__name__, hooks=hooks,
                         steps=steps, config=getattr(self.model, "config", None), tp_plan=self.tp_plan(),
                         timeline=result.timeline if result is not None else None, **options)

    def tp_plan(self) -> dict[str, str]:
        """The tensor-parallel plan the mesh is counted with: the one given, else the model's own."""
        from pipexplore.models.sharded import tensor_parallel_plan

        return tensor_parallel_plan(self.model, self.meshes.tp_plan)

    @property
    def module_fqns_per_model_part(self) -> list[list[str]]:
        """The current split as torchtitan's ``module_fqns_per_model_part``."""
        return module_fqns_per_model_part(self.layer_table, list(self._plan.splits))

