"""Plan: a layer table plus the choices a user makes (splits, devices, chunks, checkpoint, schedule).

Immutable: every change gives a new Plan. From a Plan follow its stages (cost, memory), the
skip routes that cross stages and its predicted timeline; the code that reproduces it is written by
:func:`pipexplore.export.plan_code` (export sits below the plan)::

    plan = Plan(table, splits=[4], devices=("cpu", "cpu"), chunks=8)
    plan.balance                   # [4, n - 4]
    plan.with_splits([5]).stages   # per-stage forward/backward/bytes
    print(plan_code(plan))         # GPipe(model, balance=[...], ...)

``schedule`` is a name (:data:`PLAN_SCHEDULES`) or the path of a CSV file in torch's format
(``schedule="my.csv"``: :mod:`pipexplore.schedules.csv_files`), which must schedule the plan's stages and
chunks; its ranks are the plan's devices.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Optional, Sequence

import pandas as pd

from pipexplore import validate
from pipexplore.devices import device_kind, is_planned, node_of
from pipexplore.devices.mesh import Mesh
from pipexplore.predict.memory import check_data_parallel
from pipexplore.predict.mesh_costs import mesh_layer_table, with_collective_rows
from pipexplore.predict.moe_dispatch import check_dispatcher
from pipexplore.predict.costs import Corrections
from pipexplore.predict.simulator import SCHEDULES, simulate, stage_costs
from pipexplore.schedules import csv_schedule, is_csv, is_multi_stage, is_v_shaped, stage_ranks
from pipexplore.splits import SplitError, splits_to_balance

__all__ = ["Plan", "SkipRoute", "skip_routes", "VIRTUAL_STAGES"]

CHECKPOINTS = ("always", "except_last", "never")
#: Schedules a plan can name: the simulated ones, and stages served as expert backends.
PLAN_SCHEDULES = (*SCHEDULES, "async-backends")
#: How a step runs: ``threads`` (the schedule executor, one worker per stage), ``autograd`` (the
#: ``GPipe`` module: one ``backward()`` call) or ``processes`` (``torch.distributed.pipelining``).
EXECUTORS = ("threads", "autograd", "processes")


#: What :attr:`Plan.rank_table` is made of: a plan changed elsewhere keeps its rank table.
_RANK_TABLE_FIELDS = {"layer_table", "mesh", "devices", "gpus_per_node", "data_parallel", "sequence_parallel",
                      "reshard_after_forward", "moe_dispatcher", "capacity_factor"}


@dataclass(frozen=True)
class SkipRoute:
    """A skip tensor from the layer that stashes it to the layer that pops it."""

    name: str
    stash_layer: int
    pop_layer: int
    stash_stage: int
    pop_stage: int

    @property
    def crosses(self) -> bool:
        """Whether it crosses stages (and so costs a copy through a portal)."""
        return self.stash_stage != self.pop_stage


def _stage_of(layer: int, splits: Sequence[int]) -> int:
    return sum(1 for s in splits if s <= layer)


def skip_routes(layer_table: pd.DataFrame, splits: Sequence[int]) -> list[SkipRoute]:
    """Pair each stash with the pop of the same (namespaced) name, as ``verify_skippables`` does."""
    stash_col = "stash_keys" if "stash_keys" in layer_table else "stash"
    pop_col = "pop_keys" if "pop_keys" in layer_table else "pop"
    empty = [""] * len(layer_table)
    pending: dict[str, list[int]] = {}
    routes = []
    for index, (stash, pop) in enumerate(zip(layer_table.get(stash_col, empty), layer_table.get(pop_col, empty))):
        for key in filter(None, str(pop or "").split(",")):
            if pending.get(key):
                start = pending[key].pop()
                routes.append(SkipRoute(key.split("@")[0], start, index, _stage_of(start, splits),
                                        _stage_of(index, splits)))
        for key in filter(None, str(stash or "").split(",")):
            pending.setdefault(key, []).append(index)
    return sorted(routes, key=lambda r: (r.stash_layer, r.pop_layer))


#: Stages a device holds under the multi-stage schedules (interleaved, looped-bfs,
#: interleaved-zero-bubble, zbv, dualpipev) unless a plan says otherwise: ZB-V's and DualPipeV's V.
VIRTUAL_STAGES = 2


@dataclass(frozen=True)
class Plan:
    """How to run a model as a pipeline. Validated on construction; change it with ``with_*``."""

    layer_table: pd.DataFrame = field(repr=False, compare=False)
    splits: tuple[int, ...] = ()
    devices: tuple[str, ...] = ()
    chunks: int = 1
    checkpoint: str = "except_last"
    schedule: str = "gpipe"
    virtual_stages: int = VIRTUAL_STAGES
    executor: str = "threads"
    #: Seconds added to every compute action's span (a what-if knob; 0 by default).
    action_overhead: float = 0.0
    #: Rows of the mini-batch a step runs (default: the profiled sample's, ``layer_table.attrs['batch']``).
    batch: Optional[int] = None
    #: What measured runs taught the cost model (see :meth:`calibrated`); not part of the plan's identity.
    corrections: Corrections = field(default_factory=Corrections, compare=False, repr=False)
    #: Planned devices per node (``'H100:0'`` … ``'H100:7'`` on node 0): which copies cross nodes.
    gpus_per_node: int = 8
    #: The device mesh (:class:`~pipexplore.devices.mesh.Mesh`, or ``{"tp": 4, "pp": 8, "dp": 2}``)
    #: over ``devices`` (all of them, in rank order); None: every device a pipeline rank.
    mesh: Optional[Mesh] = None
    #: How data-parallel replicas share the training state: ``ddp``, ``zero1`` or ``fsdp``
    #: (:data:`pipexplore.predict.memory.DATA_PARALLEL`).
    data_parallel: str = "ddp"
    #: Activations (and the sends between stages) divided across the tensor-parallel ranks.
    sequence_parallel: bool = True
    #: FSDP: parameters freed after each forward and gathered again (FSDP2's name).
    reshard_after_forward: bool = False
    #: A mixture of experts' all-to-alls of one micro-batch hidden behind another's compute where the
    #: schedule pairs a forward and a backward (``1f1b``/``interleaved``: Megatron-Core's
    #: ``--overlap-moe-expert-parallel-comm``; ``dualpipev``: its overlapped pairs):
    #: :mod:`pipexplore.predict.moe_overlap`. Off: every all-to-all exposed.
    moe_overlap: bool = False
    #: How a mixture of experts' tokens reach their experts: ``alltoall`` (each routed copy), or
    #: ``hybridep``/``deepep`` (once a destination node and GPU):
    #: :data:`pipexplore.predict.moe_dispatch.MOE_DISPATCHERS`.
    moe_dispatcher: str = "alltoall"
    #: A mixture of experts' routing imbalance (a what-if of routing, not a token-dropping policy): the
    #: busiest expert-parallel rank receives this many times its balanced share of the routed tokens, its
    #: experts' token-bound kernels and its all-to-alls' bytes scaled so
    #: (:func:`~pipexplore.predict.mesh_costs.mesh_layer_table`); from 1 (balanced, the default) to the
    #: mesh's ``ep``, and only 1 for a layer table without routed experts.
    capacity_factor: float = 1.0

    def __post_init__(self) -> None:
        n = len(self.layer_table)
        if n == 0:
            raise ValueError("a plan needs at least one layer")
        object.__setattr__(self, "splits", tuple(validate.splits(self.splits, n)))
        if isinstance(self.devices, (tuple, list)) and not self.devices:
            object.__setattr__(self, "devices", ("cpu",) * self.num_stages)  # the default: CPUs
        else:
            object.__setattr__(self, "devices", validate.devices(self.devices, exist=False))
        if self.batch is not None:
            object.__setattr__(self, "batch", validate.integer(self.batch, "batch", minimum=1))
        object.__setattr__(self, "chunks", validate.chunks(self.chunks, batch=self.batch))
        validate.checkpoint(self.checkpoint)
        object.__setattr__(self, "schedule", validate.schedule(self.schedule, PLAN_SCHEDULES, csv=True))
        if is_csv(self.schedule):  # read and checked (once per change of the file), then against the plan
            csv_schedule(self.schedule).check_fits(stages=self.num_stages, microbatches=self.chunks)
        validate.executor(self.executor, EXECUTORS)
        object.__setattr__(self, "virtual_stages", validate.virtual_stages(self.virtual_stages))
        object.__setattr__(self, "gpus_per_node", validate.integer(self.gpus_per_node, "gpus_per_node", minimum=1))
        if isinstance(self.action_overhead, bool) or not isinstance(self.action_overhead, (int, float)) or not (
                0 <= self.action_overhead < float("inf")):
            raise ValueError(f"action_overhead must be a finite number of seconds ≥ 0, got {self.action_overhead!r}")
        if self.executor == "autograd" and self.schedule != "gpipe":
            raise ValueError(f"the autograd executor (the GPipe module) runs only the gpipe schedule, "
                             f"not {self.schedule!r}: choose executor 'threads'")
        self._check_mesh()
        needed = self.num_devices
        if len(self.devices) < needed:
            raise SplitError(f"{self.num_stages} stages need {needed} devices but {len(self.devices)} are chosen "
                             f"({', '.join(self.devices)}): add devices or remove split points (splits "
                             f"{list(self.splits)})")

    def _check_mesh(self) -> None:
        """The mesh, its data parallelism and the table it costs checked against each other."""
        check_data_parallel(self.data_parallel)
        for name in ("sequence_parallel", "reshard_after_forward", "moe_overlap"):
            validate.boolean(getattr(self, name), name)
        check_dispatcher(self.moe_dispatcher)
        experts = (self.layer_table.attrs.get("experts") or {}).get("count")
        object.__setattr__(self, "capacity_factor", validate.capacity_factor(self.capacity_factor))
        if self.capacity_factor != 1 and not experts:
            raise ValueError(f"capacity_factor {self.capacity_factor:g}: routing imbalance is a mixture of experts' "
                             "(the busiest expert-parallel rank's share of the routed tokens), and this plan has no "
                             "experts (its layer table counts none): leave capacity_factor at 1")
        counted_tp = int(self.layer_table.attrs.get("tp", 1))
        if self.mesh is None:
            validate.capacity_factor(self.capacity_factor, ep=1)
            if counted_tp != 1:
                raise ValueError(f"the layer table is one tensor-parallel rank's of tp={counted_tp}: give the plan a "
                                 f"mesh with tp={counted_tp}")
            return
        mesh = self.mesh if isinstance(self.mesh, Mesh) else Mesh.of(self.mesh, len(self.devices))
        object.__setattr__(self, "mesh", mesh)
        if mesh.size != len(self.devices):
            raise ValueError(f"the mesh has {mesh.size} ranks but the plan has {len(self.devices)} devices")
        if mesh.cp > 1:
            if "kv_bytes" not in self.layer_table:
                raise ValueError(f"cp={mesh.cp}: context parallelism gathers each attention layer's keys and values, "
                                 "and this layer table does not say their widths (a model whose config names "
                                 "num_key_value_heads and head_dim, planned on catalogue devices, does)")
            tokens = int(self.layer_table.attrs.get("tokens_per_sample", 0))
            if tokens and tokens % (2 * mesh.cp):
                raise ValueError(f"cp={mesh.cp}: each sequence is split into 2·cp = {2 * mesh.cp} chunks, balanced "
                                 f"across the ranks, and {tokens} tokens do not split so")
        if mesh.has_experts and not experts:
            raise ValueError(f"mesh: ep {mesh.ep}, etp {mesh.etp}: expert parallelism folds a mixture of experts' "
                             "routed experts, and this layer table counts none (a model whose config counts its "
                             "experts, planned on catalogue devices, has them): leave ep and etp at 1")
        mesh.check_experts(experts)
        validate.capacity_factor(self.capacity_factor, ep=mesh.ep)
        if mesh.tp != counted_tp:
            raise ValueError(f"the mesh has tp={mesh.tp} but the layer table counts a rank of tp={counted_tp}: "
                             f"profile the model with tp={mesh.tp} (explore(..., mesh=...) does)")
        if mesh.tp > 1 and not self.sequence_parallel:
            raise ValueError("tensor parallelism without sequence parallelism: which activations each rank keeps whole "
                             "is not counted yet; plan it with sequence_parallel=True, as Megatron-LM's large runs do")
        if mesh.pp != self.num_devices:
            expected = mesh.pp * (self.virtual_stages if is_multi_stage(self.schedule) else 1)
            raise SplitError(f"the mesh has pp={mesh.pp} pipeline ranks but the plan's {self.num_stages} stages run "
                             f"on {self.num_devices}: split the model into {expected} stages, or change the mesh's pp")

    # -- derived ------------------------------------------------------------------------
    @property
    def pipeline_devices(self) -> list[str]:
        """The device of each pipeline rank: with a mesh, its first tensor- and data-parallel rank's
        (rank ``mesh.rank(pp=r)``: the farthest apart, as ranks are placed); else the first
        :attr:`num_devices` devices."""
        if self.mesh is None:
            return list(self.devices[: self.num_devices])
        return [self.devices[self.mesh.rank(pp=r)] for r in range(self.mesh.pp)]

    @property
    def step_batch(self) -> Optional[int]:
        """Rows of the mini-batch a step runs: :attr:`batch`, else the profiled sample's (None where
        the layer table does not say)."""
        batch = self.batch or self.layer_table.attrs.get("batch")
        return int(batch) if batch else None

    @property
    def mesh_or_pipeline(self) -> Mesh:
        """The plan's mesh, or every pipeline rank alone (``Mesh(pp=…)``)."""
        return self.mesh if self.mesh is not None else Mesh(pp=self.num_devices)

    @property
    def num_layers(self) -> int:
        return len(self.layer_table)

    @property
    def num_stages(self) -> int:
        return len(self.splits) + 1

    @property
    def num_devices(self) -> int:
        """Devices the plan runs on: one per stage, stages / virtual_stages for the multi-stage
        schedules (interleaved, looped-bfs, interleaved-zero-bubble, zbv, dualpipev), or a CSV
        schedule's ranks."""
        if is_csv(self.schedule):
            return csv_schedule(self.schedule).ranks
        if is_multi_stage(self.schedule):
            return max(1, self.num_stages // self.virtual_stages)
        return self.num_stages

    @property
    def planned(self) -> bool:
        """Whether the plan is for catalogue devices (``'H100:0'``, …) rather than devices here:
        its costs are predicted, never measured here."""
        return any(is_planned(d) for d in self.devices)

    @property
    def export_checkpoint(self) -> str:
        """The activation checkpointing an exported ``torchrun`` script applies: the plan's own on
        catalogue devices (what the cluster's step is predicted with, and a run loaded back from
        them keeps), else ``never``, as this machine's processes and the page's own torchrun runs
        execute torch's runtime (:attr:`run_checkpoint`)."""
        return self.checkpoint if self.planned else "never"

    @property
    def device_type(self) -> str:
        """Where an exported ``torchrun`` script runs its ranks: ``"cpu"`` for a plan on this
        machine's CPUs, else ``"cuda"`` (GPUs here or planned ones)."""
        return "cpu" if all(str(d).split(":")[0] == "cpu" for d in self.devices) else "cuda"

    @property
    def device_kind(self) -> Optional[str]:
        """The kind of device its runs teach and its predictions use corrections of
        (:meth:`~pipexplore.predict.costs.Corrections.for_kind`): None for this machine's own devices,
        else the catalogue name of its planned ones (``'H100'``)."""
        return device_kind(self.pipeline_devices)

    @property
    def learnt(self) -> Corrections:
        """The corrections its predictions use: what runs on its kind of device taught."""
        return self.corrections.for_kind(self.device_kind)

    @property
    def nodes(self) -> int:
        """Nodes the plan's devices span (``gpus_per_node`` planned devices a node; 1 otherwise)."""
        if not self.planned:
            return 1
        used = self.devices if self.mesh is not None else self.pipeline_devices
        return len({node_of(d, self.gpus_per_node) for d in used})

    @property
    def stage_devices(self) -> list[str]:
        """The device of each stage: round-robin, in a V for zbv and dualpipev (device ``d`` holds
        stages ``d`` and ``2p − 1 − d``), or on the rank a CSV schedule puts it."""
        p, ranks = self.num_devices, self.pipeline_devices
        if is_csv(self.schedule) or is_v_shaped(self.schedule):
            return [ranks[r] for r in stage_ranks(self.schedule, self.num_stages, p)]
        return [ranks[s % p] for s in range(self.num_stages)]

    @property
    def balance(self) -> list[int]:
        return splits_to_balance(list(self.splits), self.num_layers)

    @cached_property
    def stages(self) -> pd.DataFrame:
        """Per-stage forward, backward, parameter and activation bytes, with its device."""
        costs = stage_costs(self.layer_table, list(self.splits))
        costs["device"] = self.stage_devices
        return costs

    @cached_property
    def skip_routes(self) -> list[SkipRoute]:
        return skip_routes(self.layer_table, self.splits)

    @cached_property
    def predicted(self) -> pd.DataFrame:
        """The predicted timeline of one step with the plan's own options (computed once)."""
        return self.predict()

    def predict(self, **kwargs: object) -> pd.DataFrame:
        """The predicted timeline of one step (see :func:`pipexplore.simulate`); ``kwargs`` override.
        With a mesh, a pipeline rank's, and its collectives as rows of their own (phase
        ``collective``, columns ``collective`` and ``exposed``:
        :func:`pipexplore.predict.mesh_costs.collective_rows`).

        ``async-backends`` is predicted as a fill-drain pipeline with a worker per stage (it does
        not model how the pools merge micro-batches into batches).
        """
        options = {**self.simulate_options(), **kwargs}
        frame = simulate(self.rank_table, list(self.splits), **options)
        if self.mesh is None:
            return frame
        batch = options.get("batch") or self.rank_table.attrs.get("batch")
        return with_collective_rows(frame, self.rank_table, list(self.splits), batch=int(batch),
                                    chunks=options["chunks"], data_parallel=self.data_parallel)

    @cached_property
    def rank_table(self) -> pd.DataFrame:
        """The layer table as a pipeline rank of the mesh runs it (its data-parallel collectives,
        FSDP's gathers: :func:`pipexplore.predict.mesh_costs.mesh_layer_table`); without a mesh, the
        layer table itself."""
        if self.mesh is None:
            return self.layer_table
        return mesh_layer_table(self.layer_table, self.mesh, self.devices, gpus_per_node=self.gpus_per_node,
                                data_parallel=self.data_parallel, sequence_parallel=self.sequence_parallel,
                                reshard_after_forward=self.reshard_after_forward, moe_dispatcher=self.moe_dispatcher,
                                capacity_factor=self.capacity_factor)

    def simulate_options(self) -> dict[str, Any]:
        """The options :meth:`predict` gives :func:`pipexplore.simulate` for this plan."""
        backends = self.schedule == "async-backends"
        options: dict[str, Any] = dict(chunks=self.chunks, schedule="gpipe" if backends else self.schedule,
                                       checkpoint=self.run_checkpoint,
                                       devices=self.pipeline_devices,
                                       virtual_stages=self.virtual_stages)
        options["executor"] = self.predict_executor
        options["action_overhead"] = self.action_overhead
        options["corrections"] = self.learnt
        if self.planned:
            options["gpus_per_node"] = self.gpus_per_node
        elif self.mesh is not None and self.mesh.size > self.mesh.pp:  # replicas of each stage share this machine
            options["replicas"] = self.mesh.size // self.mesh.pp
        if self.batch is not None:
            options["batch"] = self.batch
        if self.moe_overlap:
            options["moe_overlap"] = True
        return options

    def calibrated(self, measured: pd.DataFrame) -> "Plan":
        """This plan with its cost model corrected by a measured timeline of it.

        Each action measured is matched with the predicted one (stage, micro-batch, phase); per
        stage and phase their ratio rescales the layers of that stage, for this plan's executor,
        and the executor's own time between actions is measured (see
        :class:`pipexplore.predict.costs.Corrections`); for the threads and processes executors
        the hand-over is then the one that reproduces the run's step
        (:meth:`~pipexplore.predict.costs.Corrections.step_fitted`). The corrected layer costs carry over to other
        splits, chunks and schedules of the same executor, on the same kind of device
        (:attr:`device_kind`: a planned device's runs, brought back from a cluster, correct plans
        for those devices only, and this machine's runs this machine's plans only).
        """
        executor, kind = self.predict_executor, self.device_kind
        learnt = self.learnt.fitted(
            self.layer_table, list(self.splits), executor,
            lambda corrections: replace(self, corrections=self.corrections.with_kind(kind, corrections)).predict(),
            measured, fit_step=executor in ("threads", "processes"))
        return replace(self, corrections=self.corrections.with_kind(kind, learnt))

    @property
    def run_checkpoint(self) -> str:
        """The checkpoint mode the plan's runs execute: its own, except where the executor has none
        (``processes`` here, torch's pipelining runtime, and the expert backends recompute nothing:
        ``never``, which their predictions, timelines and memory follow). A plan for catalogue
        devices keeps its own: it says what the cluster's training applies (activation
        checkpointing of the blocks, as torchtitan's), and the search weighs it."""
        if self.schedule == "async-backends" or (self.executor == "processes" and not self.planned):
            return "never"
        return self.checkpoint

    @property
    def predict_executor(self) -> str:
        """The executor whose costs the prediction uses (``async-backends`` runs as threads)."""
        return "autograd" if self.executor == "autograd" and self.schedule != "async-backends" else (
            "processes" if self.executor == "processes" else "threads")

    # -- changes ------------------------------------------------------------------------
    def with_splits(self, splits: Sequence[int]) -> "Plan":
        return self.with_options(splits=tuple(splits))

    def with_options(self, **changes: object) -> "Plan":
        changed = replace(self, **changes)  # type: ignore[arg-type]
        if "rank_table" in self.__dict__ and not set(changes) & _RANK_TABLE_FIELDS:
            # the same rank costs (one table: the page re-times a moved split with it)
            changed.__dict__["rank_table"] = self.__dict__["rank_table"]
        return changed

    # -- export -------------------------------------------------------------------------
    def split_spec(self) -> dict[str, str]:
        """``{layer name: 'BEGINNING'}`` for every split point (``torch.distributed.pipelining``)."""
        names = [str(n) for n in self.layer_table["name"]]
        return {names[s]: "BEGINNING" for s in self.splits}
