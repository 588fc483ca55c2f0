"""The explorer's mesh: which one it plans, how its replicas share the work, and one tensor-parallel
rank's layer table for each ``tp`` it has counted.

A part of :class:`pipexplore.widgets.state.ExplorerState` (``state.meshes``): the state asks it for
the plan a new mesh makes (:meth:`MeshChoice.replanned`) and keeps it once the plan is taken.

Example::

    choice = MeshChoice({"tp": 8, "pp": 4, "dp": 2}, placement, data_parallel="fsdp")
    plan = choice.replanned(state.plan, {"tp": 4, "pp": 8, "dp": 2}, table_for)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

import pandas as pd

from pipexplore import validate
from pipexplore.devices.mesh import Mesh
from pipexplore.devices.placement import Placement
from pipexplore.plan import Plan
from pipexplore.predict.memory import check_data_parallel
from pipexplore.predict.moe_dispatch import check_dispatcher
from pipexplore.schedules import is_multi_stage
from pipexplore.widgets import layer_table as layers

__all__ = ["MeshChoice"]

_NO_MESH_HERE = ("mesh: on this machine's devices a mesh is pipeline, data and tensor parallelism (cp 1; each rank "
                 "a process of the exported torchrun script); context parallelism is planned for devices from the "
                 "catalogue (devices=['H100'] * 64, gpus_per_node=8, mesh={'tp': 8, 'pp': 4, 'cp': 2})")


_NO_EXPERTS_HERE = ("mesh: on this machine's devices the experts fold over ep ranks only (etp 1: each rank a process "
                    "of the exported torchrun script, whose experts are whole on their rank); expert-tensor "
                    "parallelism is planned for devices from the catalogue (devices=['H100'] * 256, "
                    "mesh={'tp': 2, 'pp': 8, 'dp': 16, 'ep': 16, 'etp': 2})")


def _refused_here(mesh: Mesh, placement_planned: bool) -> None:
    """A mesh of this machine's devices runs no context or expert-tensor parallelism (the exported script has
    neither; its experts fold over ``ep``)."""
    if not placement_planned and mesh.cp > 1:
        raise ValueError(_NO_MESH_HERE)
    if not placement_planned and mesh.etp > 1:
        raise ValueError(_NO_EXPERTS_HERE)


class MeshChoice:
    """The mesh over an explorer's planned devices (``mesh``: None, every device a pipeline rank),
    its ``options`` (``data_parallel``, ``sequence_parallel``, ``reshard_after_forward``, ``moe_overlap``,
    ``moe_dispatcher``, ``capacity_factor``), the ``tp_plan`` given (None: the model's own), and the layer
    tables counted per ``tp``.

    Raises:
        ValueError: context or expert parallelism on devices here, a mesh that does not fill the devices,
            an unknown ``data_parallel`` or ``moe_dispatcher``, a ``capacity_factor`` below 1 or above the
            mesh's ``ep`` where it folds experts (otherwise the plan checks it against its experts).
        TypeError: options that are not booleans, a ``capacity_factor`` that is not a number.
    """

    def __init__(self, spec: Any, placement: Placement, *, data_parallel: str = "ddp",
                 sequence_parallel: bool = True, reshard_after_forward: bool = False, moe_overlap: bool = False,
                 moe_dispatcher: str = "alltoall", capacity_factor: float = 1.0,
                 tp_plan: Optional[dict[str, str]] = None) -> None:
        self.mesh: Optional[Mesh] = None
        if spec is not None:
            self.mesh = Mesh.of(spec, len(placement.devices))
            _refused_here(self.mesh, placement.planned)
        self.options: dict[str, Any] = {
            "data_parallel": check_data_parallel(data_parallel),
            "sequence_parallel": validate.boolean(sequence_parallel, "sequence_parallel"),
            "reshard_after_forward": validate.boolean(reshard_after_forward, "reshard_after_forward"),
            "moe_overlap": validate.boolean(moe_overlap, "moe_overlap"), "moe_dispatcher": check_dispatcher(moe_dispatcher),
            # checked against a mesh that folds experts before anything is profiled; else by the plan, which
            # knows whether its layer table has experts at all
            "capacity_factor": validate.capacity_factor(
                capacity_factor, ep=self.mesh.ep if self.mesh is not None and self.mesh.ep > 1 else None)}
        self.tp_plan = tp_plan
        self._tables: dict[int, pd.DataFrame] = {}

    @property
    def tp(self) -> int:
        """The tensor-parallel ranks a layer table is counted for (1 without a mesh)."""
        return self.mesh.tp if self.mesh is not None else 1

    def notes(self, gpus_per_node: int) -> list[str]:
        """What the page says of the mesh: whose costs the stages carry, and what it does that large
        runs avoid (:meth:`pipexplore.devices.mesh.Mesh.notes`)."""
        mesh = self.mesh
        if mesh is None:
            return []
        source = "the tensor-parallel plan given" if self.tp_plan is not None else "its config's base_model_tp_plan"
        experts = (f" The routed experts are folded over the same GPUs as etp {mesh.etp} × ep {mesh.ep} × edp "
                   f"{mesh.edp} × pp {mesh.pp}: a GPU holds 1/{mesh.ep * mesh.etp} of each layer's experts and "
                   "computes its own tokens' share of the routed work." if mesh.has_experts else "")
        return [f"Mesh {mesh.tp} × {mesh.pp} × {mesh.dp} (tp × pp × dp): each stage's costs are one GPU's"
                + (f", its blocks sharded by torch's parallelize_module with {source} on a fake process group and "
                   "counted there" if mesh.tp > 1 else "")
                + "; the sample is one data-parallel replica's batch." + experts, *mesh.notes(gpus_per_node)]

    def table_for(self, tp: int, current: pd.DataFrame, count: Callable[[int], pd.DataFrame]) -> pd.DataFrame:
        """The layer table of one tensor-parallel rank of ``tp``: ``current`` where it is that one,
        else ``count(tp)``, once per ``tp``."""
        if int(current.attrs.get("tp", 1)) == tp:
            return current
        if tp not in self._tables:
            self._tables[tp] = count(tp)
        return self._tables[tp]

    def replanned(self, plan: Plan, spec: Any, table_for: Callable[[int], pd.DataFrame], **options: Any) -> Plan:
        """``plan`` with the mesh ``spec`` and ``options``: the rank's table of its ``tp``, its
        ``pp`` stages (times the schedule's stages a rank) balanced by time. Not kept until
        :meth:`take` (the state takes it once the plan is predicted).

        Raises:
            TypeError: an option that is not one of :attr:`options`.
            ValueError: a mesh for devices here, one that does not fit the devices or the layers,
                or a model it cannot shard.
        """
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise TypeError(f"set_mesh() takes {', '.join(self.options)}, not {', '.join(unknown)}")
        chosen = Mesh.of(spec, len(plan.devices))
        _refused_here(chosen, plan.planned)
        table = table_for(chosen.tp)
        Mesh.of(chosen, len(plan.devices), experts=(table.attrs.get("experts") or {}).get("count", 0))
        stages = chosen.pp * (plan.virtual_stages if is_multi_stage(plan.schedule) else 1)
        if stages > len(table):
            raise ValueError(f"pp={chosen.pp} needs {stages} stages but the model has {len(table)} layers")
        splits = layers.balanced_splits(table, stages, "time", plan.executor)
        return replace(plan, layer_table=table, splits=tuple(splits), mesh=chosen, **{**self.options, **options})

    def take(self, plan: Plan) -> None:
        """Keep the mesh and options of ``plan`` (a plan :meth:`replanned` made, now the explorer's)."""
        self.mesh = plan.mesh
        self.options.update(data_parallel=plan.data_parallel, sequence_parallel=plan.sequence_parallel,
                            reshard_after_forward=plan.reshard_after_forward, moe_overlap=plan.moe_overlap,
                            moe_dispatcher=plan.moe_dispatcher, capacity_factor=plan.capacity_factor)
