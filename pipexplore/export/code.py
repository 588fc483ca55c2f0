"""The code that reproduces a plan, one writer a kind (:mod:`pipexplore.export.registry` names them):
a ``GPipe(...)``, a ``torch.distributed.pipelining`` split spec and schedule, the schedule as torch's
CSV file, the standalone ``torchrun`` script, Megatron-LM's arguments and torchtitan's command.

Each writer takes the plan and the options of :func:`pipexplore.export.registry.plan_code`, reads
those it needs and leaves the others.

Example::

    print(gpipe_code(plan))                          # pipe = GPipe(model, balance=[...], ...)
    print(torchrun_code(plan, hooks="train_hooks"))  # python -m torch.distributed.run ... it
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional

from pipexplore.export.megatron import megatron_arguments
from pipexplore.export.torchrun import torchrun_script
from pipexplore.export.torchtitan import torchtitan_command
from pipexplore.models.trace.split import run_generated_code
from pipexplore.plan import Plan
from pipexplore.schedules import TORCH_CLASSES, csv_schedule, is_csv, is_multi_stage, is_v_shaped, schedule_csv_text

__all__ = ["gpipe_code", "pipelining_code", "schedule_csv_code", "torchrun_code", "megatron_code", "torchtitan_code",
           "mesh_options"]


def _pipeline_ranks_only(plan: Plan, kind: str) -> None:
    """Refuse to write ``kind`` (pipeline ranks only) for a plan whose mesh would be dropped."""
    mesh = plan.mesh
    if mesh is not None and (mesh.tp > 1 or mesh.dp > 1 or mesh.cp > 1):  # ep and etp fold over these ranks
        dropped = "tensor, data and expert" if mesh.ep * mesh.etp > 1 else "tensor and data"
        raise ValueError(f"the plan's mesh ({mesh.describe()}) is planned, but the {kind!r} "
                         f"export writes pipeline ranks only: its {dropped} parallelism would be dropped. "
                         "Export the pipeline of a mesh with tp=1 and dp=1, or 'schedule-csv' for its schedule")


def gpipe_code(plan: Plan, *, traced: bool = False, model_name: str = "the model", **_: Any) -> str:
    """A ``pipexplore.GPipe`` of the plan, given ``model`` (the ``nn.Sequential``). ``traced``: the
    model is not an ``nn.Sequential`` (it is split by torch's tracer), named ``model_name`` in the
    refusal."""
    _pipeline_ranks_only(plan, "gpipe")
    if traced:
        raise ValueError(f"GPipe takes an nn.Sequential; {model_name} exports as 'pipelining' or 'torchrun'")
    devices = ", ".join(repr(d) for d in plan.devices[: plan.num_stages])
    return (
        "from pipexplore import GPipe\n\n"
        f"# model: the nn.Sequential of {plan.num_layers} layers that was explored\n"
        f"pipe = GPipe(model, balance={plan.balance}, devices=[{devices}],\n"
        f"             chunks={plan.chunks}, checkpoint={plan.checkpoint!r})\n"
    )


def pipelining_code(plan: Plan, **_: Any) -> str:
    """A ``torch.distributed.pipelining`` split of the plan's layers, given ``model`` and ``sample``,
    with the matching schedule class, for one process per device (one per stage; the looped and
    interleaved schedules give each rank its stages ``rank, rank + ranks, …``, zbv and dualpipev
    ``rank`` and ``2·ranks − 1 − rank``; a CSV schedule the stages its file gives the rank, run by
    torch's ``_PipelineScheduleRuntime`` loading the file). Its stages run their generated code
    (:func:`pipexplore.models.trace.split.run_generated_code`, whose source it holds)."""
    _pipeline_ranks_only(plan, "pipelining")
    csv_file = csv_schedule(plan.schedule) if is_csv(plan.schedule) else None
    schedule_class = "_PipelineScheduleRuntime" if csv_file else {
        **TORCH_CLASSES, "async-backends": "ScheduleGPipe"}[plan.schedule]
    spec = ",\n    ".join(f"{name!r}: SplitPoint.BEGINNING" for name in plan.split_spec())
    if csv_file is not None:  # the stages the file gives each rank, its order loaded by torch
        build = (f"#   stages = [pipe.build_stage(s, device) for s in {csv_file.rank_stages}[rank]]\n"
                 f"#   schedule = {schedule_class}(stages, n_microbatches=chunks, loss_fn=loss_fn)\n"
                 f"#   schedule._load_csv({plan.schedule!r}, format={csv_file.format!r})\n")
    elif is_v_shaped(plan.schedule):  # two stages per rank, in a V
        build = ("#   stages = [pipe.build_stage(s, device)\n"
                 "#             for s in (rank, 2 * world_size - 1 - rank)]\n"
                 f"#   schedule = {schedule_class}(stages, n_microbatches=chunks, loss_fn=loss_fn)\n")
    elif is_multi_stage(plan.schedule) or plan.schedule == "zero-bubble":  # a list of stages per rank
        build = ("#   stages = [pipe.build_stage(s, device)\n"
                 "#             for s in range(rank, pipe.num_stages, world_size)]\n"
                 f"#   schedule = {schedule_class}(stages, n_microbatches=chunks, loss_fn=loss_fn)\n")
    else:
        build = ("#   stage = pipe.build_stage(rank, device)\n"
                 f"#   schedule = {schedule_class}(stage, n_microbatches=chunks, loss_fn=loss_fn)\n")
    imports = ("from torch.distributed.pipelining import SplitPoint, pipeline\n"
               f"from torch.distributed.pipelining.schedules import {schedule_class}\n" if csv_file else
               f"from torch.distributed.pipelining import SplitPoint, pipeline, {schedule_class}\n")
    return (
        "import torch\n"
        + imports + "from torch import nn\n\n\n"
        + inspect.getsource(run_generated_code) + "\n\n"
        f"# model: the nn.Sequential of {plan.num_layers} layers; sample: one mini-batch\n"
        + (f"split_spec = {{\n    {spec}\n}}\n" if spec else "split_spec = {}  # one stage\n")
        + f"chunks = {plan.chunks}\n"
        "pipe = pipeline(model, mb_args=(sample.chunk(chunks)[0],), split_spec=split_spec)\n"
        "run_generated_code(pipe.split_gm)  # the stages' generated code, not torch.fx's interpreter (2x on CPU)\n"
        "# Under torchrun, rank r builds its stage(s) and runs the schedule:\n"
        + build
    )


def schedule_csv_code(plan: Plan, **_: Any) -> str:
    """The plan's schedule in torch's CSV format, each rank's actions in the order the prediction
    has them (a CSV schedule: its file as written); torch's ``_PipelineScheduleRuntime._load_csv``
    reads it, and ``schedule="that.csv"`` predicts the same. A mesh's is its pipeline's."""
    if plan.schedule == "async-backends":
        raise ValueError("async-backends serves the stages as expert backends, in no fixed order of actions: "
                         "there is no schedule to write; choose a schedule such as gpipe or 1f1b")
    if is_csv(plan.schedule):
        return csv_schedule(plan.schedule).text
    return schedule_csv_text(plan.schedule, plan.num_stages, plan.chunks, plan.virtual_stages)


def torchrun_code(plan: Plan, *, hooks: str = "train_hooks", steps: int = 1,
                  tp_plan: Optional[Mapping[str, str]] = None, **_: Any) -> str:
    """The standalone ``torchrun`` script of the plan (:func:`pipexplore.export.torchrun.torchrun_script`),
    importing ``build_model()``, ``get_batch()`` and ``loss_fn()`` from the ``hooks`` module and
    running ``steps`` steps; a plan with a mesh runs the whole mesh, its tensor parallelism by
    ``tp_plan`` (the plan the explorer counted)."""
    return torchrun_script(plan.layer_table, list(plan.splits), hooks=hooks, chunks=plan.chunks, steps=steps,
                           schedule=plan.schedule if plan.schedule != "async-backends" else "gpipe",
                           devices=plan.num_devices, device=plan.device_type,
                           checkpoint=plan.export_checkpoint, **mesh_options(plan, tp_plan))


def megatron_code(plan: Plan, *, config: Any = None, **_: Any) -> str:
    """The whole mesh as Megatron-LM's arguments, the model's shape from ``config``
    (:func:`pipexplore.export.megatron.megatron_arguments`)."""
    return megatron_arguments(plan, config=config)


def torchtitan_code(plan: Plan, *, config: Any = None, **_: Any) -> str:
    """The whole mesh as torchtitan's trainer command, its model from ``config``
    (:func:`pipexplore.export.torchtitan.torchtitan_command`)."""
    return torchtitan_command(plan, config=config)


def mesh_options(plan: Plan, tp_plan: Optional[Mapping[str, str]]) -> dict[str, Any]:
    """What the torchrun script of a plan with a mesh runs: the mesh (its experts' ep and etp too),
    its data parallelism and the tensor-parallel plan (none without a mesh)."""
    mesh = plan.mesh
    if mesh is None or (mesh.tp == 1 and mesh.dp == 1 and mesh.cp == 1):
        return {}
    experts = {"ep": mesh.ep, "etp": mesh.etp} if mesh.has_experts else {}
    return dict(mesh={"pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp, "cp": mesh.cp, **experts},
                data_parallel=plan.data_parallel,
                reshard_after_forward=plan.reshard_after_forward, tp_plan=dict(tp_plan or {}))
