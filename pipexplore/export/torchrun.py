"""Export a split as a standalone ``torchrun`` script (``torch.distributed.pipelining``), and as
torchtitan's ``module_fqns_per_model_part``.

The script is assembled here from the plan and the source of real functions, each as it stands in
its module (where the tests import and run it): its docstring and imports, the plan's values as the
constants of :mod:`pipexplore.export.script_parts`, then the functions it shares with pipexplore (a
tied parameter's gradients, :mod:`pipexplore.executors.tied`; the stages' contiguous boundaries and
generated code, :mod:`pipexplore.models.trace.split`; a CSV schedule loaded and the warm-up sends
as :mod:`pipexplore.executors.distributed` has them; a mesh's parts, :mod:`pipexplore.export.mesh_parts`)
and its own (:data:`pipexplore.export.script_parts.FUNCTIONS`, ``main`` last).
"""
from __future__ import annotations

import inspect
import textwrap
from typing import Any, Mapping, Optional, Sequence

import pandas as pd

from pipexplore import validate
from pipexplore.executors import tied
from pipexplore.executors.distributed import _load_schedule_csv, _no_self_warmup
from pipexplore.export import mesh_parts
from pipexplore.models.trace import SCHEDULE_CLASSES
from pipexplore.models.trace.split import contiguous_boundaries, run_generated_code
from pipexplore.schedules import csv_schedule, is_csv, is_multi_stage, is_v_shaped

__all__ = ["torchrun_script", "module_fqns_per_model_part"]


def module_fqns_per_model_part(table: pd.DataFrame, splits: Sequence[int]) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part``: the block FQNs of each stage."""
    names = [str(n) for n in table["name"]]
    points = [0, *splits, len(names)]
    return [names[a:b] for a, b in zip(points, points[1:])]


#: The script's docstring, filled with the plan's values.
_DOC = '''"""Pipeline training with torch.distributed.pipelining, exported by pipexplore.

{stages} stages ({schedule}, {chunks} micro-batches per step), split at {split_points}.{mesh_doc}
Run on one machine:   torchrun --standalone --nproc-per-node {world} {filename}
On N nodes of M ranks (N x M = {world}), on each node:
  torchrun --nnodes N --nproc-per-node M --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
           {filename} --record runs/1
The hooks module ({hooks!r}) provides build_model(), get_batch() -> (inputs, target) (inputs: a
tensor, a tuple of positional inputs or a dict of keyword inputs, e.g. input_ids and attention_mask),
loss_fn(output, target) and, optionally, build_optimizer(parameters) (default: SGD, lr 0.01).
A model larger than a host's memory: build_model() builds it on the meta device (under
`with torch.device("meta"):`), each rank traces it there and makes only its own stages real, on its
device, filled by the hooks module's init_stage(module): the stage's parameters and buffers, by the
model's own names (module.named_parameters(), module.named_buffers()); from safetensors shards:
pipexplore.export.weights.load_stage(module, CHECKPOINT_DIR), which reads only the stage's tensors.
--record DIR: every rank writes what it did in the steps after --warmup (pipexplore's recorder;
load it with explorer.load_run(DIR)).
--profile DIR: torch.profiler traces the steps after --warmup, each rank into DIR/trace_rank{{RANK}}.json
(CPU and CUDA activity; explorer.load_run(DIR) reads them too, for the schedules that label each
micro-batch's actions). Both may be given: the recorder's and the profiler's clocks then time the
same actions.
"""
'''

#: What every script imports (its schedule class besides): the standard library and torch, no pipexplore.
_IMPORTS = ("from __future__ import annotations", "", "import argparse", "import importlib", "import inspect",
            "import os", "import re", "import time", "", "import torch", "import torch.distributed as dist",
            "from torch import nn", "from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline",
            "from torch.distributed.pipelining._IR import annotate_split_points",
            "from torch.distributed.pipelining.schedules import PipelineScheduleMulti",
            "from torch.utils._pytree import tree_unflatten")

#: The comment on the line above a constant of the script.
_ABOVE = {
    "CHECKPOINT": 'Activation checkpointing, as the plan: "never", "always" (every micro-batch) or "except_last".',
    "DEVICE": '"cuda": each rank on its node\'s GPU of its local rank (the CPU where the node has none); "cpu": every '
              'rank on the CPU.',
    "LAYERS": "The model's candidate split points, in order (the explorer's layer table):",
    "MODULE_FQNS_PER_MODEL_PART": "The same split for torchtitan's pipeline config:",
    "SCHEDULE_CSV": "A CSV schedule's file: each rank's actions, one row a rank (torch's CSV schedule format), and the "
                    "stages it gives each rank; None where SCHEDULE_CLASS orders them.",
    "MESH": "The device mesh: pp x dp x tp ranks (tensor-parallel ranks numbered fastest, then data-parallel); "
            "torchrun starts their product; ep, where given, folds the experts over each stage's dp ranks (ep "
            "fastest). None: pipeline ranks alone, every rank a pipeline rank.",
    "DATA_PARALLEL": 'How the replicas share a stage: "ddp" (gradients all-reduced), "zero1" (the optimizer state '
                     'sharded too), "fsdp" (FSDP2: parameters, gradients and optimizer state sharded).',
    "TP_PLAN": "Tensor parallelism: the plan the explorer counted (module-name patterns, * an index, to styles).",
    "CUT_FAMILIES": "The causal LMs cut_stage cuts by their modules, and the torch style of each of the plan's styles:",
    "EXPERT_FAMILIES": "The mixtures of experts whose stacked experts expert parallelism shards (their stages cut by cut_stage):",
}
#: The comment beside a constant of the script.
_BESIDE = {"SCHEDULE_CLASS": "torch's class that runs SCHEDULE",
           "V_SHAPED": "two stages a rank, in a V (the rank's and its mirror's)",
           "RESHARD_AFTER_FORWARD": "FSDP2's: gather again for the backward"}


def _constants(values: Mapping[str, Any]) -> str:
    """The script's constants, each with its comment; a class by its name."""
    lines = []
    for name, value in values.items():
        lines += textwrap.wrap(_ABOVE.get(name, ""), 120, initial_indent="# ", subsequent_indent="# ")
        text = value.__name__ if isinstance(value, type) else repr(value)
        lines.append(f"{name} = {text}" + (f"  # {_BESIDE[name]}" if name in _BESIDE else ""))
    return "\n".join(lines) + "\n"


def _sources(*parts: Any) -> str:
    return "\n\n".join(inspect.getsource(part) for part in parts)


def _script(values: dict[str, Any], *, doc: str, mesh: bool) -> str:
    """The script: its docstring, imports, the plan's values, then the source of what it runs."""
    # here, not at the top: script_parts imports torch's pipelining (~1 s), which planning, the
    # explorer and its page never need until a script is written
    from pipexplore.export import script_parts
    schedule_class = values["SCHEDULE_CLASS"]
    home = "torch.distributed.pipelining.schedules" if schedule_class.__name__.startswith("_") else \
        "torch.distributed.pipelining"
    missing = set(script_parts.CONSTANTS + (script_parts.MESH_CONSTANTS if mesh else ())) ^ set(values)
    assert not missing, f"the script's constants and script_parts' differ: {sorted(missing)}"
    shared = [contiguous_boundaries, run_generated_code, mesh_parts.full_state, _no_self_warmup]
    if values["SCHEDULE_CSV"] is not None:
        shared.append(_load_schedule_csv)
    imports = [*_IMPORTS, f"from {home} import {schedule_class.__name__}"]
    parts = [doc + "\n".join(imports) + "\n\n" + _constants(values)
             + (_constants(mesh_parts.SCRIPT_CONSTANTS) if mesh else "") + "\n" + tied.SOURCE, _sources(*shared)]
    if mesh:
        parts += [_sources(*mesh_parts.SCRIPT_FUNCTIONS)]
    parts += [_sources(*script_parts.FUNCTIONS), 'if __name__ == "__main__":\n    main()\n']
    return "\n\n".join(parts)


def torchrun_script(table: pd.DataFrame, splits: Sequence[int], *, hooks: str, chunks: int, schedule: str = "1f1b",
                    devices: int = 0, steps: int = 1, filename: str = "train_pipeline.py", device: str = "cuda",
                    checkpoint: str = "never", mesh: Optional[Mapping[str, int]] = None, data_parallel: str = "ddp",
                    reshard_after_forward: bool = False, tp_plan: Optional[Mapping[str, str]] = None) -> str:
    """A standalone script for ``torchrun --nproc-per-node N`` that builds the same split and
    schedule and trains with the model, data and loss of the ``hooks`` module (a Hugging Face
    model's KV cache off, as in the explorer: :mod:`pipexplore.models.hf`).

    ``schedule`` may be the path of a CSV file (torch's format): the script holds its text and each
    rank runs torch's ``_PipelineScheduleRuntime`` loading it (``_load_csv``), one rank per row,
    each with the stages the file gives it. ``device``: ``"cuda"`` (each rank on the GPU of its
    local rank where the node has GPUs, refusing a rank beyond them; else the CPU) or ``"cpu"`` (a
    plan on CPUs runs there, GPUs or not); the script's ``--device`` overrides it. ``checkpoint``:
    the plan's activation checkpointing, applied to each stage's forward per micro-batch
    (:func:`pipexplore.export.script_parts.checkpoint_stage`).

    ``mesh`` (``{"pp": …, "dp": …, "tp": …}``): the script runs the whole mesh
    (:mod:`pipexplore.export.mesh_parts`): a ``DeviceMesh`` of pp × dp × tp ranks, each stage's
    modules sharded over tp by ``parallelize_module`` with ``tp_plan`` (the stages then cut from
    the model by their modules, one a pipeline rank), shared by the dp replicas as
    ``data_parallel`` says (``fsdp`` with ``reshard_after_forward``, ``ddp``, ``zero1``), torch's
    schedule running FSDP's actions; each replica trains on its share of the global batch where
    ``get_batch`` takes ``replica=`` and ``replicas=``, and the loss printed is the global batch's.
    With ``"ep"`` above 1 (a mixture of experts: :data:`pipexplore.export.expert_parts.EXPERT_FAMILIES`)
    the experts are folded over each stage's dp ranks (:mod:`pipexplore.export.expert_parts`): each
    ep rank holds ``1/ep`` of every layer's experts, its tokens dispatched to them and combined by
    ``all_to_all_single`` over the ep group, the dense gradients averaged over the replicas.

    Raises:
        ValueError: what the script cannot run, by name (a schedule, a mesh with context parallelism,
            tensor parallelism without a plan, or beside several stages a rank; expert parallelism
            beside expert-tensor or tensor parallelism, FSDP or ZeRO-1, several stages a rank, or not
            dividing dp).
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device is 'cuda' or 'cpu', got {device!r}")
    validate.checkpoint(checkpoint)
    if not hooks or not all(part.isidentifier() for part in hooks.split(".")):
        raise ValueError(f"hooks must name an importable module (e.g. 'mypackage.train_hooks'), got {hooks!r}")
    mesh_doc, mesh_values = _mesh_fields(mesh, data_parallel, reshard_after_forward, tp_plan, schedule)
    replicas = mesh.get("dp", 1) * mesh.get("tp", 1) if mesh else 1
    stages = len(splits) + 1
    csv_values: dict[str, Any] = dict(SCHEDULE_CSV=None, SCHEDULE_CSV_FORMAT=None, STAGES_OF_RANK=None)
    if is_csv(schedule):
        file = csv_schedule(schedule).check_fits(stages=stages, microbatches=chunks, ranks=devices or None)
        schedule_class: type = _schedule_class("_PipelineScheduleRuntime")
        csv_values = dict(SCHEDULE_CSV=file.text, SCHEDULE_CSV_FORMAT=file.format, STAGES_OF_RANK=file.rank_stages)
        stages, world = file.stages, file.ranks * replicas
    elif schedule in SCHEDULE_CLASSES:
        schedule_class = _schedule_class(SCHEDULE_CLASSES[schedule])
        world = (devices or (stages // 2 if is_v_shaped(schedule) else stages)) * replicas
    else:
        raise ValueError(f"the torchrun export knows {', '.join(SCHEDULE_CLASSES)} and CSV schedule files; not "
                         f"{schedule!r}")
    names = [str(n) for n in table["name"]]
    split_points = [names[s] for s in splits]
    values: dict[str, Any] = dict(
        HOOKS=hooks, SPLIT_POINTS=split_points, CHUNKS=chunks, STEPS=steps, SCHEDULE=schedule,
        SCHEDULE_CLASS=schedule_class, V_SHAPED=not is_csv(schedule) and is_v_shaped(schedule), CHECKPOINT=checkpoint,
        DEVICE=device, LAYERS=names, MODULE_FQNS_PER_MODEL_PART=module_fqns_per_model_part(table, splits),
        **csv_values, MESH=mesh_values.pop("MESH"), **mesh_values)
    doc = _DOC.format(stages=stages, schedule=schedule, chunks=chunks, split_points=split_points, mesh_doc=mesh_doc,
                      world=world, filename=filename, hooks=hooks)
    return _script(values, doc=doc, mesh=bool(mesh_values))


def _expert_parallel(mesh: Mapping[str, int], shape: Mapping[str, int], data_parallel: str, schedule: str) -> int:
    """The mesh's ep, where the script can fold the experts so (else ValueError naming what would do)."""
    ep, etp = int(mesh.get("ep", 1)), int(mesh.get("etp", 1))
    if etp > 1:
        raise ValueError(f"the script shards the experts over ep ranks, each expert whole; this mesh has etp={etp} "
                         "(expert-tensor parallelism), which it would drop: export the mesh with etp=1 (ep alone), "
                         "or Megatron-LM's arguments (--expert-tensor-parallel-size)")
    if ep == 1:
        return ep
    if shape["tp"] > 1:
        raise ValueError(f"the script folds ep={ep} over each stage's dp ranks, not beside tensor parallelism "
                         f"(tp={shape['tp']}): plan tp=1 with dp a multiple of ep, or export Megatron-LM's arguments")
    if shape["dp"] % ep:
        raise ValueError(f"the script folds the experts over each stage's dp ranks: ep={ep} does not divide "
                         f"dp={shape['dp']}; plan dp a multiple of ep")
    if data_parallel != "ddp":
        raise ValueError(f"with expert parallelism the script averages the dense gradients over the replicas as DDP "
                         f"does; {data_parallel!r} it would drop: export with data_parallel='ddp'")
    if is_csv(schedule) or is_multi_stage(schedule):
        raise ValueError(f"with expert parallelism the script runs one stage a pipeline rank, and {schedule} runs "
                         "several: choose gpipe, 1f1b, or plan ep=1")
    return ep


def _schedule_class(name: str) -> type:
    """torch's schedule class of that name: the script runs a list of stages a rank where it is a
    ``PipelineScheduleMulti`` (:data:`pipexplore.models.trace.MULTI_STAGE`), else one."""
    from torch.distributed.pipelining import schedules

    return getattr(schedules, name)


_KINDS = {"ddp": "DDP (torch's replicate: gradients all-reduced)",
          "zero1": "ZeRO-1 (gradients all-reduced, the optimizer state sharded)",
          "fsdp": "FSDP2 (fully_shard: parameters, gradients and optimizer state sharded)"}


def _mesh_fields(mesh: Optional[Mapping[str, int]], data_parallel: str, reshard_after_forward: bool,
                 tp_plan: Optional[Mapping[str, str]], schedule: str) -> tuple[str, dict[str, Any]]:
    """The script's mesh: its docstring's line and its constants (``MESH`` alone, None, without a mesh)."""
    if not mesh:
        return "", {"MESH": None}
    shape = {d: int(mesh.get(d, 1)) for d in ("pp", "dp", "tp")}
    ep = _expert_parallel(mesh, shape, data_parallel, schedule)
    if int(mesh.get("cp", 1)) > 1:
        raise ValueError(f"the script runs pp, dp and tp; this mesh has cp={mesh['cp']} (context parallelism), "
                         "which it would drop: export the mesh with cp=1, or Megatron-LM's arguments")
    if data_parallel not in _KINDS:
        raise ValueError(f"unknown data_parallel {data_parallel!r}: {', '.join(_KINDS)}")
    if shape["tp"] > 1:
        if not tp_plan:
            raise ValueError(f"tp={shape['tp']}: the script needs the tensor-parallel plan the explorer counted "
                             "(tp_plan=), none was given")
        if is_csv(schedule) or is_multi_stage(schedule):
            raise ValueError(f"with tensor parallelism the script runs one stage a pipeline rank, and {schedule} "
                             "runs several: choose gpipe, 1f1b, or plan tp=1")
    doc = (f"\nThe mesh: pp {shape['pp']} x dp {shape['dp']} x tp {shape['tp']} ranks (tensor-parallel ranks "
           f"numbered fastest), replicas sharing each stage by {_KINDS[data_parallel]};\nget_batch(replica=, "
           "replicas=) gives each replica its share of the global batch where it takes them.")
    if ep > 1:
        shape["ep"] = ep
        doc += (f"\nExpert parallelism: ep {ep} over each stage's dp ranks (ep fastest), each ep rank 1/{ep} of every "
                "layer's experts,\nits tokens dispatched and combined by all-to-alls over the ep group.")
    return doc, dict(MESH=shape, DATA_PARALLEL=data_parallel, RESHARD_AFTER_FORWARD=bool(reshard_after_forward),
                     TP_PLAN=dict(tp_plan or {}))
