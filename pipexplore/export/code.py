"""The code that reproduces a plan: a ``GPipe(...)``, a ``torch.distributed.pipelining`` split spec and
schedule, a standalone ``torchrun`` script, or the schedule as torch's CSV file.

Example::

    print(plan_code(plan, "torchrun", hooks="train_hooks"))     # python -m torch.distributed.run ... it
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from pipexplore.export.megatron import megatron_arguments
from pipexplore.export.torchrun import torchrun_script
from pipexplore.export.torchtitan import torchtitan_command
from pipexplore.plan import CODE_KINDS, Plan

__all__ = ["plan_code", "EXPORT_KINDS", "mesh_options"]

#: What a plan exports as.
EXPORT_KINDS = ("gpipe", "pipelining", "torchrun", "schedule-csv", "megatron", "torchtitan")


def plan_code(plan: Plan, kind: str = "gpipe", *, traced: bool = False, model_name: str = "the model",
              hooks: str = "train_hooks", steps: int = 1, config: Any = None,
              tp_plan: Optional[Mapping[str, str]] = None) -> str:
    """Code that reproduces ``plan``'s split: ``'gpipe'`` (a ``GPipe(...)``, ``nn.Sequential`` models),
    ``'pipelining'`` (a ``torch.distributed.pipelining`` split spec and schedule), ``'torchrun'`` (a
    standalone script importing ``build_model()``, ``get_batch()`` and ``loss_fn()`` from the ``hooks``
    module, running ``steps`` steps) or ``'schedule-csv'`` (the plan's schedule in torch's CSV format,
    the text of a file for ``schedule="my.csv"`` or torch's ``_load_csv``). ``traced``: the model is
    not an ``nn.Sequential`` (it is split by torch's tracer), named ``model_name`` in a refusal.
    A plan with a mesh exports as ``'torchrun'`` (the whole mesh: :func:`pipexplore.export.torchrun.torchrun_script`,
    its tensor parallelism by ``tp_plan``, the plan the explorer counted), ``'megatron'`` or
    ``'schedule-csv'``; the others write pipeline ranks only and refuse it.

    Raises:
        ValueError: a kind this model cannot export, or an unknown kind (the kinds named).
    """
    if kind == "megatron":  # the whole mesh, as Megatron-LM's arguments (the model's shape from ``config``)
        return megatron_arguments(plan, config=config)
    if kind == "torchtitan":  # the whole mesh, as torchtitan's trainer command (its model from ``config``)
        return torchtitan_command(plan, config=config)
    mesh = plan.mesh
    if mesh is not None and kind not in ("schedule-csv", "torchrun") and (mesh.tp > 1 or mesh.dp > 1 or mesh.cp > 1):
        raise ValueError(f"the plan's mesh ({mesh.describe()}) is planned, but the {kind!r} "
                         "export writes pipeline ranks only: its tensor and data parallelism would be dropped. Export "
                         "the pipeline of a mesh with tp=1 and dp=1, or 'schedule-csv' for its schedule")
    if kind == "torchrun":
        return torchrun_script(plan.layer_table, list(plan.splits), hooks=hooks, chunks=plan.chunks, steps=steps,
                               schedule=plan.schedule if plan.schedule != "async-backends" else "gpipe",
                               devices=plan.num_devices, device=plan.device_type,
                               checkpoint=plan.export_checkpoint, **mesh_options(plan, tp_plan))
    if kind == "gpipe" and traced:
        raise ValueError(f"GPipe takes an nn.Sequential; {model_name} exports as 'pipelining' or 'torchrun'")
    if kind not in CODE_KINDS:
        known = ", ".join(map(repr, EXPORT_KINDS[:-1])) + f" or {EXPORT_KINDS[-1]!r}"
        raise ValueError(f"unknown export kind {kind!r}: {known}")
    return plan.to_code(kind)


def mesh_options(plan: Plan, tp_plan: Optional[Mapping[str, str]]) -> dict[str, Any]:
    """What the torchrun script of a plan with a mesh runs: the mesh, its data parallelism and the
    tensor-parallel plan (none without a mesh)."""
    mesh = plan.mesh
    if mesh is None or (mesh.tp == 1 and mesh.dp == 1 and mesh.cp == 1):
        return {}
    return dict(mesh={"pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp, "cp": mesh.cp}, data_parallel=plan.data_parallel,
                reshard_after_forward=plan.reshard_after_forward, tp_plan=dict(tp_plan or {}))
