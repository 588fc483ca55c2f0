"""The explorer's options as one frozen value, each checked as it is made: :class:`ExploreOptions`.

What ``explore(model, sample, ...)``, ``Explorer(...)`` and ``ExplorerState(...)`` take besides the
model and the sample. Each option is checked here, where it enters, with a ``TypeError`` or
``ValueError`` naming it and saying what would do; what needs the model or the sample to check (the
chunks against the batch's rows, the splits against the layers, the target's rows) is checked by
the state, still before anything is profiled::

    options = ExploreOptions.of(devices=["H100"] * 16, gpus_per_node=8, chunks=8, schedule="1f1b")
    options.chunks                          # 8
    ExploreOptions.of(**options.keywords()) == options      # True: the values it holds are checked ones
    replace(options, chunks=0)              # ValueError: chunks must be an integer ≥ 1, got 0
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

import pandas as pd

from pipexplore import validate
from pipexplore.devices import chosen_devices
from pipexplore.devices.mesh import Mesh
from pipexplore.models.trace.candidates import GRANULARITIES
from pipexplore.plan import EXECUTORS, PLAN_SCHEDULES, Plan
from pipexplore.predict.memory import check_data_parallel
from pipexplore.predict.moe_dispatch import check_dispatcher
from pipexplore.training import LossFn, OptimizerFactory
from pipexplore.widgets.header import parse_bytes

__all__ = ["ExploreOptions", "PLAN_DEFAULTS"]

#: The defaults of the options a plan holds as they are given (checkpoint, schedule, executor, nodes,
#: the mesh's data parallelism and the experts' options): :class:`~pipexplore.plan.Plan`'s own, one
#: default each.
PLAN_DEFAULTS: Mapping[str, Any] = {f.name: f.default for f in fields(Plan)}


@dataclass(frozen=True)
class ExploreOptions:
    """Everything an explorer is made with but the model and the sample, checked (see the module).

    Make it with keywords (``ExploreOptions(chunks=8)``) or with :meth:`of`, which also names an
    option that does not exist; change it with :func:`dataclasses.replace`, which checks again.
    The values held are the checked ones: ``memory_cap`` in bytes, ``devices`` as the names they
    resolve to, sequences as tuples.
    """

    #: What the loss compares the output with (None: the loss needs none); its rows the sample's.
    target: Any = field(default=None, compare=False)
    #: ``loss_fn(output, target)`` (None: a synthetic loss, the mean of the squared outputs).
    loss_fn: Optional[LossFn] = None
    #: ``optimizer(parameters)`` (None: SGD, lr 0.01).
    optimizer: Optional[OptimizerFactory] = None
    #: The devices, one a pipeline rank: this machine's (``"cpu"``, ``"cuda:1"``), or from the
    #: catalogue (``["H100"] * 16``: planned, never run here); a list or a comma-separated string.
    #: None: two or every GPU here. Each runs a stage, or two under a multi-stage schedule
    #: (:data:`~pipexplore.plan.VIRTUAL_STAGES`: ``interleaved``, ``zbv``, …) unless ``splits`` say.
    devices: Optional[Sequence[Any]] = None
    #: Micro-batches a step (None: 4, or fewer for a smaller batch; a CSV schedule's own).
    chunks: Optional[int] = None
    #: Activation checkpointing: ``'always'``, ``'except_last'`` or ``'never'``.
    checkpoint: str = PLAN_DEFAULTS["checkpoint"]
    #: A schedule of :data:`pipexplore.plan.PLAN_SCHEDULES`, or the path of a CSV file in torch's format.
    schedule: str = PLAN_DEFAULTS["schedule"]
    #: The first stage's split points (None: balanced by time).
    splits: Optional[Sequence[int]] = None
    #: A layer table to plan with instead of profiling (from :func:`pipexplore.profile_model`).
    layer_table: Optional[pd.DataFrame] = field(default=None, compare=False)
    #: Timed repeats a layer's profile takes.
    profile_repeats: int = 3
    #: What runs the plan: one of :data:`pipexplore.plan.EXECUTORS` (planned devices: processes).
    executor: str = PLAN_DEFAULTS["executor"]
    #: Whether runs teach the predictions (the executor's own costs, corrections per action).
    calibrate: bool = True
    #: A traced model's candidate split points: one of ``'blocks'`` or ``'children'``.
    granularity: str = "blocks"
    #: How many runs keep their whole timelines (every run keeps its row).
    keep_timelines: int = 20
    #: Bytes of activation memory a stage may hold, drawn (a number or ``'2 GiB'``); None: no cap.
    memory_cap: Optional[float] = None
    #: Planned devices a node (which copies cross nodes).
    gpus_per_node: int = PLAN_DEFAULTS["gpus_per_node"]
    #: Whether memory is counted for 16-bit training with fp32 master weights and gradients.
    mixed_precision: bool = False
    #: Whether a traced model is profiled as the stages its runs execute (one more trace).
    profile_stages: bool = True
    #: The mesh over the devices (``{"tp": 4, "pp": 8, "dp": 2}``, a :class:`~pipexplore.devices.mesh.Mesh`);
    #: None: every device a pipeline rank.
    mesh: Union[None, Mesh, Mapping[str, int]] = None
    #: How the mesh's replicas share the work: one of :data:`pipexplore.predict.memory.DATA_PARALLEL`.
    data_parallel: str = PLAN_DEFAULTS["data_parallel"]
    #: Whether a tensor-parallel block's norms and dropout are split along the sequence.
    sequence_parallel: bool = PLAN_DEFAULTS["sequence_parallel"]
    #: Whether FSDP frees a stage's gathered parameters after its forward.
    reshard_after_forward: bool = PLAN_DEFAULTS["reshard_after_forward"]
    #: Whether a mixture of experts' all-to-alls hide behind another micro-batch's compute where the
    #: schedule pairs a forward and a backward (1f1b, interleaved, dualpipev: :class:`~pipexplore.plan.Plan`'s).
    moe_overlap: bool = PLAN_DEFAULTS["moe_overlap"]
    #: How a mixture of experts' tokens reach their experts (:data:`pipexplore.predict.moe_dispatch.MOE_DISPATCHERS`):
    #: ``alltoall`` each routed copy, ``hybridep``/``deepep`` once a destination node and GPU.
    moe_dispatcher: str = PLAN_DEFAULTS["moe_dispatcher"]
    #: A mixture of experts' routing imbalance, a what-if of routing (not a token-dropping policy: Megatron-LM's
    #: ``--moe-expert-capacity-factor`` drops tokens, and no export writes it): the busiest expert-parallel rank
    #: receives this many times its balanced share of the routed tokens, its experts' token-bound kernels and its
    #: all-to-alls' bytes scaled so (:func:`pipexplore.predict.mesh_costs.mesh_layer_table`). A number from 1
    #: (balanced routing, as NVIDIA's published benchmarks force it) to the mesh's ``ep``; only 1 without experts.
    capacity_factor: float = PLAN_DEFAULTS["capacity_factor"]
    #: The tensor-parallel plan (module FQN pattern to style); None: the model's own.
    tp_plan: Optional[Mapping[str, str]] = None

    def __post_init__(self) -> None:
        def held(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        held("loss_fn", validate.optional_callable(self.loss_fn, "loss_fn", "loss_fn(output, target)"))
        held("optimizer", validate.optional_callable(self.optimizer, "optimizer",
                                                     "optimizer(parameters) returning a torch.optim.Optimizer"))
        held("gpus_per_node", validate.integer(self.gpus_per_node, "gpus_per_node"))
        if self.devices is not None:
            held("devices", tuple(chosen_devices(self.devices, self.gpus_per_node)))
        if self.chunks is not None:
            held("chunks", validate.chunks(self.chunks))
        held("checkpoint", validate.checkpoint(self.checkpoint))
        held("schedule", validate.schedule(self.schedule, PLAN_SCHEDULES, csv=True))
        if self.splits is not None:
            if isinstance(self.splits, (str, bytes)) or not hasattr(self.splits, "__iter__"):
                raise TypeError(f"splits must be a list of layer indices that begin a stage (e.g. [4, 9]) or None, "
                                f"got {self.splits!r} ({type(self.splits).__name__})")
            held("splits", tuple(self.splits))  # the indices are checked against the layers by the state
        if self.layer_table is not None and not isinstance(self.layer_table, pd.DataFrame):
            raise TypeError(f"layer_table must be a pandas DataFrame (from pipexplore.profile_model) or None, got "
                            f"{type(self.layer_table).__name__}")
        held("profile_repeats", validate.integer(self.profile_repeats, "profile_repeats", minimum=1))
        held("executor", validate.executor(self.executor, EXECUTORS))
        held("calibrate", validate.boolean(self.calibrate, "calibrate"))
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(map(repr, GRANULARITIES))}, got "
                             f"{self.granularity!r}")
        held("keep_timelines", validate.integer(self.keep_timelines, "keep_timelines", minimum=0))
        held("memory_cap", parse_bytes(self.memory_cap, "memory_cap"))
        for name in ("mixed_precision", "profile_stages", "sequence_parallel", "reshard_after_forward", "moe_overlap"):
            validate.boolean(getattr(self, name), name)
        if self.mesh is not None and not isinstance(self.mesh, (Mesh, Mapping)):
            raise ValueError(f"mesh is a mapping of tp, pp, dp and cp (ep and etp for experts) to their ranks "
                             f"({{'tp': 4, 'pp': 8}}), a Mesh, or None, got {self.mesh!r}")
        if isinstance(self.mesh, Mapping):
            held("mesh", dict(self.mesh))
        check_data_parallel(self.data_parallel)
        check_dispatcher(self.moe_dispatcher)
        held("capacity_factor", validate.capacity_factor(self.capacity_factor))  # (against ep: the plan)
        if self.tp_plan is not None:
            if not isinstance(self.tp_plan, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                                for k, v in self.tp_plan.items()):
                raise TypeError(f"tp_plan must map module names to parallel styles ({{'layers.*.attn.q': "
                                f"'colwise'}}) or be None, got {self.tp_plan!r}")
            held("tp_plan", dict(self.tp_plan))

    @classmethod
    def of(cls, **options: Any) -> ExploreOptions:
        """The options from keywords, as ``explore()`` takes them.

        Raises:
            TypeError: a keyword that is no option (the nearest one named); or as the class.
            ValueError: a bad value, named, with what would do.
        """
        known = cls.names()
        unknown = [name for name in options if name not in known]
        if unknown:
            near = difflib.get_close_matches(unknown[0], known, n=1)
            raise TypeError(f"explore() has no option {unknown[0]!r}" + (f": did you mean {near[0]!r}?" if near else "")
                            + f" (its options: {', '.join(known)})")
        return cls(**options)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option's name, in order."""
        return tuple(f.name for f in fields(cls))

    def keywords(self) -> dict[str, Any]:
        """Every option as a keyword: ``ExploreOptions.of(**options.keywords())`` makes these options again."""
        return {name: getattr(self, name) for name in self.names()}
