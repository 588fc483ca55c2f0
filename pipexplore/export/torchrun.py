"""Export a split as a standalone ``torchrun`` script (``torch.distributed.pipelining``), and as
torchtitan's ``module_fqns_per_model_part``.

Why one module: the script is one text, its template here, and the rest of the module fills its
fields (a schedule's classes and stages a rank, a CSV schedule's block, a mesh's constants and the
source it runs: :mod:`pipexplore.export.mesh_parts`); a field moved away from the template would be
read apart from the code that uses it.
"""
from __future__ import annotations

import inspect
import textwrap
from typing import Mapping, Optional, Sequence

import pandas as pd

from pipexplore import validate
from pipexplore.executors.tied import SOURCE as TIED_SOURCE
from pipexplore.export.mesh_parts import MESH_SOURCE, full_state
from pipexplore.models.hf import EXPORT_SOURCE
from pipexplore.models.trace import MULTI_STAGE, SCHEDULE_CLASSES
from pipexplore.models.trace.split import CONTIGUOUS_SOURCE
from pipexplore.plan import RUN_GENERATED_CODE
from pipexplore.schedules import csv_schedule, is_csv, is_multi_stage, is_v_shaped

__all__ = ["torchrun_script", "module_fqns_per_model_part"]


def module_fqns_per_model_part(table: pd.DataFrame, splits: Sequence[int]) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part``: the block FQNs of each stage."""
    names = [str(n) for n in table["name"]]
    points = [0, *splits, len(names)]
    return [names[a:b] for a, b in zip(points, points[1:])]


_SCRIPT = '''"""Pipeline training with torch.distributed.pipelining, exported by pipexplore.

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
import argparse
import importlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn
{schedule_import}

HOOKS = {hooks!r}
SPLIT_POINTS = {split_points!r}
CHUNKS = {chunks}
STEPS = {steps}
SCHEDULE = {schedule!r}
# Activation checkpointing, as the plan: "never", "always" (every micro-batch) or "except_last".
CHECKPOINT = {checkpoint!r}
# "cuda": each rank on its node's GPU of its local rank (the CPU where the node has none); "cpu": every rank on the CPU.
DEVICE = {device!r}
# The model's candidate split points, in order (the explorer's layer table):
LAYERS = {layers!r}
# The same split for torchtitan's pipeline config:
MODULE_FQNS_PER_MODEL_PART = {fqns!r}
{mesh_constants}


{cache_off}


{contiguous_source}

{checkpoint_source}
{mesh_source}
{csv_block}
def call_inputs(inputs):
    """The model's inputs as get_batch() gives them: (positional, keyword)."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    return (tuple(inputs), {{}}) if isinstance(inputs, (tuple, list)) else ((inputs,), {{}})


def late_inputs(pipe):
    """The model's inputs a stage after the first reads itself: torch's stages feed them to the first only."""
    return sorted({{node.name for node in pipe.split_gm.graph.nodes if node.op == "placeholder" for user in node.users
                   if user.op == "call_module" and str(user.target).startswith("submod_")
                   and int(str(user.target).rsplit("_", 1)[1]) > 0}})


def model_output(flat, spec):
    """The output as the model returns it (a ModelOutput, a dict, a tuple …), rebuilt from the last
    stage's flat outputs with the structure the tracer recorded: what loss_fn sees in the explorer."""
    leaves = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    if spec is not None and spec.num_leaves == len(leaves):
        return tree_unflatten(leaves, spec)
    return leaves[0] if len(leaves) == 1 else tuple(leaves)


def traced(model, args, kwargs):
    """torch's pipeline of the model split at SPLIT_POINTS, and the structure of the model's output
    (torch's own annotation of the split points, then its tracer, whose graph records it)."""
    annotate_split_points(model, {{fqn: SplitPoint.BEGINNING for fqn in SPLIT_POINTS}})
    captured = {{}}

    def keep_output_spec(gm):
        captured["spec"] = getattr(getattr(getattr(gm.graph, "_codegen", None), "pytree_info", None), "out_spec", None)
        return gm

    pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None, split_policy=keep_output_spec)
    return pipe, captured.get("spec")


def on_meta(model) -> bool:
    """Whether build_model() built the model on the meta device (no weights anywhere yet)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def materialize(module, device, hooks) -> None:
    """A stage traced from a model on the meta device, made real on this rank's device only: its
    parameters and buffers allocated there, then filled by the hooks' init_stage(module)."""
    module.to_empty(device=device)
    with torch.no_grad():
        hooks.init_stage(module)


def replica_batch(get_batch, replica, replicas):
    """get_batch() for one data-parallel replica: given replica= and replicas= where it takes them
    (each replica its own share of the global batch), else as it is."""
    import inspect

    taken = inspect.signature(get_batch).parameters
    return get_batch(replica=replica, replicas=replicas) if "replica" in taken else get_batch()


def traced_stages(model, args, model_kwargs, indices, stages_of, ranks, pp_rank, rank, device, group, meta, hooks):
    """This rank's stages of the model traced by torch's pipelining and split at SPLIT_POINTS (the
    model's inputs as given: on the meta device where the model is), the structure of the model's
    output, and the tied parameters its stages share with others."""
    traced_on = next(iter([*model.parameters(), *model.buffers()]), torch.empty(0)).device
    # (a model on the meta device is traced on meta inputs: nothing of it is computed here)
    first = lambda value: value.chunk(CHUNKS)[0].to("meta" if meta else value.device) \\
        if torch.is_tensor(value) else value  # noqa: E731
    pipe, output_spec = traced(model, tuple(first(a) for a in args), {{k: first(v) for k, v in model_kwargs.items()}})
    contiguous_boundaries(pipe.split_gm)  # gloo sends and receives contiguous tensors only
    late = late_inputs(pipe)
    if late:
        raise SystemExit(f"rank {{rank}}: later stages read the model's inputs {{late}} themselves, "
                         "but torch's stages feed them to the first stage only: begin the second stage at a later "
                         "block (SPLIT_POINTS; the explorer's balance does for processes plans), or read them in "
                         "loss_fn")
{run_generated_code}
    # A parameter in several stages (a tied embedding and head) trains as one: its copies' gradients summed.
    tied = tied_groups(tied_parameters(pipe), rank_of=lambda s: next(r for r in range(ranks) if s in stages_of(r)),
                       rank=pp_rank)
    stages = [pipe.build_stage(s, device, group=group) for s in indices]{v_warmup}
    for stage in stages:
        place_graph_devices(stage.submod, traced_on, device)
        if meta:  # this rank's stages made real, nothing else of the model
            materialize(stage.submod, device, hooks)
    return stages, pipe.num_stages, output_spec, tied


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--record", metavar="DIR", help="record every rank's actions into DIR (needs pipexplore)")
    parser.add_argument("--profile", metavar="DIR", help="trace every rank's steps with torch.profiler into DIR")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=DEVICE, help="where ranks run (default: DEVICE)")
    parser.add_argument("--warmup", type=int, default=None, help="steps not recorded (default 1 of 2 or more)")
    parser.add_argument("--save", metavar="DIR", help="write the trained parameters into DIR, a file a stage "
                        "(stage{{N}}.pt: the model's names to whole tensors)")
    options = parser.parse_args()
    warmup = options.warmup if options.warmup is not None else min(1, options.steps - 1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Ranks that share one machine's CPU cores (pipexplore's launcher says which): each keeps to its own.
    rank_cores = os.environ.get("PIPEXPLORE_RANK_CORES", "").split(";")
    if rank < len(rank_cores) and rank_cores[rank] and options.device == "cpu" and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [int(core) for core in rank_cores[rank].split(",")])
    hooks = importlib.import_module(HOOKS)
    if options.device == "cuda" and torch.cuda.is_available():
        local, gpus = int(os.environ.get("LOCAL_RANK", rank)), torch.cuda.device_count()
        if local >= gpus:
            raise SystemExit(f"rank {{rank}}: local rank {{local}}, but this node has {{gpus}} GPU(s): start at most "
                             f"{{gpus}} rank(s) a node (--nproc-per-node), or pass --device cpu")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # The device mesh (pp x dp x tp; a world that is not the mesh's refused), or pipeline ranks alone.
    mesh = make_mesh(MESH, device.type, world) if MESH else None
    ranks, pp_rank = (MESH["pp"], mesh["pp"].get_local_rank()) if mesh else (world, rank)
    dp_rank, tp_rank = (mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()) if mesh else (0, 0)
    model = without_kv_cache(hooks.build_model())
    meta = on_meta(model)
    if meta and not callable(getattr(hooks, "init_stage", None)):
        raise SystemExit(f"rank {{rank}}: build_model() gave a model on the meta device, so each rank makes only its "
                         f"own stages real: {{HOOKS}} must define init_stage(module), which fills a stage's parameters "
                         "and buffers by name")
    inputs, target = replica_batch(hooks.get_batch, dp_rank, MESH["dp"] if mesh else 1)
    args, model_kwargs = call_inputs(inputs)

    def stages_of(rank):
        return {stage_indices}

    indices = stages_of(pp_rank)
    if mesh and MESH["tp"] > 1:  # tensor parallelism shards the model's own modules: each stage cut from them
        if meta:
            raise SystemExit("tensor parallelism here shards a model with its weights: build_model() gives one on "
                             "the meta device")
        if len(indices) != 1:
            raise SystemExit(f"tensor parallelism here runs one stage a pipeline rank; {{SCHEDULE}} runs several")
        if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and SPLIT_POINTS:
            raise SystemExit("the model ties its head to its embedding (tie_word_embeddings), which different "
                             "stages hold: their gradients are summed between pipeline ranks, which this script "
                             "does not do beside tensor parallelism; untie them or plan tp=1")
        stage_names = MODULE_FQNS_PER_MODEL_PART[indices[0]]
        part = cut_stage(model, stage_names, indices[0] == 0, indices[0] == len(SPLIT_POINTS))
        tensor_parallel(part.to(device), mesh["tp"], TP_PLAN)
        stages = [PipelineStage(part, indices[0], len(SPLIT_POINTS) + 1, device, group=mesh["pp"].get_group())]
        num_stages, tied = len(SPLIT_POINTS) + 1, {{}}
        kept = getattr(part, "output_type", None)  # a causal LM's output class (an nn.Sequential's is a tensor)
        output_of = (lambda output: kept["type"](logits=output)) if kept is not None else (lambda output: output)
    else:
        stages, num_stages, output_spec, tied = traced_stages(
            model, args, model_kwargs, indices, stages_of, ranks, pp_rank, rank, device,
            mesh["pp"].get_group() if mesh else None, meta, hooks)
        output_of = lambda output: model_output(output, output_spec)  # noqa: E731
    if mesh and tied and (MESH["dp"] > 1 or MESH["tp"] > 1):
        raise SystemExit("the model ties parameters across stages (an embedding and its head): their gradients are "
                         "summed between pipeline ranks, which this script does not do beside tensor or data "
                         "parallelism; untie them (tie_word_embeddings=False) or plan dp=1 and tp=1")
    to_device = lambda value: value.to(device) if torch.is_tensor(value) else value  # noqa: E731
    args, model_kwargs = tuple(map(to_device, args)), {{k: to_device(v) for k, v in model_kwargs.items()}}
    for stage in stages:
        if mesh and MESH["dp"] > 1:  # the replicas share the stage as DATA_PARALLEL says
            data_parallel(stage.submod, mesh["dp"], DATA_PARALLEL, RESHARD_AFTER_FORWARD)
        checkpoint_stage(stage, CHUNKS, CHECKPOINT)
    # loss_fn sees the model's output as the model returns it (a ModelOutput: out.logits, out["logits"])
    loss_fn = lambda output, target: hooks.loss_fn(output_of(output), target)  # noqa: E731
    schedule = {schedule_class}({stage_arg}, n_microbatches=CHUNKS, loss_fn=loss_fn){csv_load}
    build_optimizer = getattr(hooks, "build_optimizer", None) or (lambda params: torch.optim.SGD(params, lr=0.01))
    # One optimizer per stage, as each stage owns its parameters.
    # (a tensor two stages of this rank share, tied, is stepped by the first one's optimizer only)
    optimizers = [build_optimizer(params) if params else None
                  for params in own_parameters([list(stage.submod.parameters()) for stage in stages])]
    zero1 = bool(mesh) and DATA_PARALLEL == "zero1" and MESH["dp"] > 1
    if zero1:  # each replica steps its share of the optimizer state (ZeRO-1)
        optimizers = [zero1_optimizer(list(stage.submod.parameters()), optimizer, mesh["dp"].get_group())
                      if optimizer is not None else None for stage, optimizer in zip(stages, optimizers)]
    recorder = None
    if options.record:
        from pipexplore.runs.record import RankRecorder

        recorder = RankRecorder(options.record, stages, device, warmup=warmup,
                                coordinates=dict(pp=pp_rank, dp=dp_rank, tp=tp_rank) if mesh else None, plan=dict(
            split_points=SPLIT_POINTS, layers=LAYERS, chunks=CHUNKS, schedule=SCHEDULE,
            schedule_csv=globals().get("SCHEDULE_CSV"),  # a CSV schedule's text: the run holds what it ran
            schedule_class="{schedule_class}", stages=num_stages, model=type(model).__name__, hooks=HOOKS,
            checkpoint=CHECKPOINT, mesh=MESH, data_parallel=globals().get("DATA_PARALLEL"),
            steps=options.steps, optimizer=type(next(filter(None, optimizers), None)).__name__))
    last = num_stages - 1 in indices
    profiler = None
    for step in range(options.steps):
        if options.profile and step == warmup:  # traced from here: one ProfilerStep#N a step
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities)
            profiler.start()
        for optimizer in filter(None, optimizers):
            optimizer.zero_grad(set_to_none=True)
        losses = []
        kwargs = dict(target=target.to(device), losses=losses) if last else {{}}
        began = time.perf_counter()
        if recorder is not None:
            recorder.begin_step(step)
        if 0 in indices:
            schedule.step(*args, **model_kwargs, **kwargs)
        else:
            schedule.step(**kwargs)
        sum_tied_grads(tied, {{s: stage.submod for s, stage in zip(indices, stages)}})
        if zero1:  # ZeRO-1: the gradients averaged over the replicas before each steps its share
            reduce_gradients([p for stage in stages for p in stage.submod.parameters()], mesh["dp"].get_group(),
                             MESH["dp"])
        if recorder is not None:
            recorder.optimizer_steps(zip(stages, optimizers))
            recorder.end_step(step, losses)
        else:
            for optimizer in filter(None, optimizers):
                optimizer.step()
        if last:
            loss = sum(l.item() for l in losses) / len(losses)
            if mesh and MESH["dp"] > 1:  # the global batch's loss: the replicas' averaged
                total = torch.tensor([loss], dtype=torch.float64, device=device)
                dist.all_reduce(total, group=mesh["dp"].get_group())
                loss = total.item() / MESH["dp"]
            if dp_rank == 0 and tp_rank == 0:
                print(f"step {{step}} loss={{loss:.9g}} time={{(time.perf_counter() - began) * 1e3:.3f}}ms", flush=True)
        if profiler is not None:
            profiler.step()
    if recorder is not None:
        recorder.finish()
    if profiler is not None:
        profiler.stop()
        os.makedirs(options.profile, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(options.profile, f"trace_rank{{rank}}.json"))
    if options.save:  # every rank of a stage gathers its shards; one writes them, by the model's names
        for index, stage in zip(indices, stages):
            state = full_state(stage.submod)
            if dp_rank == 0 and tp_rank == 0:
                os.makedirs(options.save, exist_ok=True)
                torch.save(state, os.path.join(options.save, f"stage{{index}}.pt"))
    dist.barrier()  # no rank leaves while another still sends to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


_RUN_GENERATED_CODE = textwrap.indent(RUN_GENERATED_CODE, "    ")
#: Every value a stage sends or receives laid out contiguously
#: (:func:`pipexplore.models.trace.split.contiguous_boundaries`; a value of ``format``, taken as it is).
_CONTIGUOUS = CONTIGUOUS_SOURCE
#: What the script imports to trace the split and rebuild the model's output from the last stage's.
_TRACING_IMPORTS = ("\nfrom torch.distributed.pipelining._IR import annotate_split_points"
                    "\nfrom torch.utils._pytree import tree_unflatten")

#: The exported script's activation checkpointing (also run by the tests, as it stands here).
CHECKPOINT_SOURCE = '''def checkpoint_stage(stage, chunks, mode):
    """Activation checkpointing as the plan has it (torch.utils.checkpoint, non-reentrant): a
    micro-batch's forward through the stage keeps only its inputs and runs again in its backward,
    for every micro-batch ("always") or all but a step's last ("except_last": its backward comes
    at once in GPipe); "never" keeps every activation. A zero-bubble schedule's split backward
    runs the forward again for its input gradient and again for its weight gradient."""
    if mode == "never":
        return
    from torch.utils.checkpoint import checkpoint

    inner, calls = stage.submod.forward, [0]

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        index = calls[0] % chunks  # a stage runs its micro-batches' forwards in order, once a step
        calls[0] += 1
        if mode == "except_last" and index == chunks - 1:
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    stage.submod.forward = forward
'''

#: The exported script's device fix for traced stages (also run by the tests, as it stands here).
GRAPH_DEVICES_SOURCE = '''def place_graph_devices(module, traced, device) -> None:
    """The device the model was traced on, burned into the stage's graphs, set to this rank's:
    torch's build_stage moves an op's keyword device only, not one passed positionally (a rotary
    embedding's inv_freq.to(x.device) traces as aten.to.device(inv_freq, <traced>, ...)), which
    would pull a buffer back to the CPU (or the meta device) on every forward."""
    traced, device = torch.device(traced), torch.device(device)
    if traced == device:
        return
    for sub in module.modules():
        owner = getattr(sub, "graph_module", sub)  # an unflattened module runs its graph from there
        graph = getattr(owner, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        moved = [False]

        def place(value):
            if isinstance(value, torch.device) and value == traced:
                moved[0] = True
                return device
            return value

        for node in graph.nodes:
            node.args = torch.fx.node.map_aggregate(node.args, place)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, place)
        if moved[0] and hasattr(owner, "recompile"):
            owner.recompile()
'''

_STAGE_SOURCE = "\n\n".join((CHECKPOINT_SOURCE, GRAPH_DEVICES_SOURCE, TIED_SOURCE, inspect.getsource(full_state)))

# torch 2.13 warms a traced stage's links up by sending to its neighbours' ranks, its own too where
# they share it (a V's middle stages), which gloo cannot do: the script leaves those sends out.
_V_WARMUP = """
    for stage in stages:  # no warm-up send to this rank itself (torch 2.13, traced stages in a V)
        warmup = stage._get_init_p2p_neighbors_ops
        stage._get_init_p2p_neighbors_ops = lambda warmup=warmup: [op for op in warmup() if op.peer != rank]"""


# A CSV schedule: the file's text, which torch's runtime loads from a temporary file on each rank.
_CSV_BLOCK = """
SCHEDULE_CSV = {text!r}  # each rank's actions, one row a rank (torch's CSV schedule format)
SCHEDULE_CSV_FORMAT = {format!r}
STAGES_OF_RANK = {rank_stages!r}


def load_schedule_csv(schedule) -> None:
    \"\"\"torch's _PipelineScheduleRuntime reads its order from a file: SCHEDULE_CSV, written to a temporary one.\"\"\"
    import tempfile

    handle, path = tempfile.mkstemp(suffix=".csv")
    try:
        with os.fdopen(handle, "w", newline="") as file:
            file.write(SCHEDULE_CSV)
        schedule._load_csv(path, format=SCHEDULE_CSV_FORMAT)
    finally:
        os.unlink(path)

"""


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
    (:data:`CHECKPOINT_SOURCE`).

    ``mesh`` (``{"pp": …, "dp": …, "tp": …}``): the script runs the whole mesh
    (:mod:`pipexplore.export.mesh_parts`): a ``DeviceMesh`` of pp × dp × tp ranks, each stage's
    modules sharded over tp by ``parallelize_module`` with ``tp_plan`` (the stages then cut from
    the model by their modules, one a pipeline rank), shared by the dp replicas as
    ``data_parallel`` says (``fsdp`` with ``reshard_after_forward``, ``ddp``, ``zero1``), torch's
    schedule running FSDP's actions; each replica trains on its share of the global batch where
    ``get_batch`` takes ``replica=`` and ``replicas=``, and the loss printed is the global batch's.

    Raises:
        ValueError: what the script cannot run, by name (a schedule, a mesh with context parallelism,
            tensor parallelism without a plan, or beside several stages a rank).
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device is 'cuda' or 'cpu', got {device!r}")
    validate.checkpoint(checkpoint)
    if not hooks or not all(part.isidentifier() for part in hooks.split(".")):
        raise ValueError(f"hooks must name an importable module (e.g. 'mypackage.train_hooks'), got {hooks!r}")
    mesh_fields = _mesh_fields(mesh, data_parallel, reshard_after_forward, tp_plan, schedule)
    names = [str(n) for n in table["name"]]
    common = dict(chunks=chunks, split_points=[names[s] for s in splits], filename=filename, hooks=hooks,
                  steps=steps, layers=names, fqns=module_fqns_per_model_part(table, splits), cache_off=EXPORT_SOURCE,
                  contiguous_source=_CONTIGUOUS, device=device, checkpoint=checkpoint,
                  checkpoint_source=_STAGE_SOURCE, run_generated_code=_RUN_GENERATED_CODE, schedule=schedule,
                  **mesh_fields)
    cut = "from torch.distributed.pipelining import PipelineStage\n" if mesh and mesh.get("tp", 1) > 1 else ""
    replicas = mesh.get("dp", 1) * mesh.get("tp", 1) if mesh else 1
    if is_csv(schedule):
        return _csv_script(table, splits, devices=devices, replicas=replicas, cut=cut, **common)
    if schedule not in SCHEDULE_CLASSES:
        raise ValueError(f"the torchrun export knows {', '.join(SCHEDULE_CLASSES)} and CSV schedule files; not "
                         f"{schedule!r}")
    schedule_class = SCHEDULE_CLASSES[schedule]
    stages = len(splits) + 1
    world = (devices or (stages // 2 if is_v_shaped(schedule) else stages)) * replicas
    return _SCRIPT.format(
        stages=stages, world=world, schedule_class=schedule_class, csv_block="", csv_load="",
        schedule_import=cut + f"from torch.distributed.pipelining import SplitPoint, pipeline, {schedule_class}"
                        + _TRACING_IMPORTS,
        stage_arg="stages" if schedule_class in MULTI_STAGE else "stages[0]",
        stage_indices="[rank, 2 * ranks - 1 - rank]  # a V: two stages per rank" if is_v_shaped(schedule)
        else "list(range(rank, len(SPLIT_POINTS) + 1, ranks))", v_warmup=_V_WARMUP if is_v_shaped(schedule) else "",
        **common)


_KINDS = {"ddp": "DDP (torch's replicate: gradients all-reduced)",
          "zero1": "ZeRO-1 (gradients all-reduced, the optimizer state sharded)",
          "fsdp": "FSDP2 (fully_shard: parameters, gradients and optimizer state sharded)"}


def _mesh_fields(mesh: Optional[Mapping[str, int]], data_parallel: str, reshard_after_forward: bool,
                 tp_plan: Optional[Mapping[str, str]], schedule: str) -> dict[str, str]:
    """The script's mesh: its docstring's line, its constants and the source it runs (none without a mesh)."""
    if not mesh:
        return dict(mesh_doc="", mesh_source="",
                    mesh_constants="MESH = None  # pipeline ranks alone: every rank a pipeline rank")
    shape = {d: int(mesh.get(d, 1)) for d in ("pp", "dp", "tp")}
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
    constants = (
        "# The device mesh: pp x dp x tp ranks (tensor-parallel ranks numbered fastest, then data-parallel);\n"
        "# torchrun starts their product.\n"
        f"MESH = {shape!r}\n"
        "# How the replicas share a stage: \"ddp\" (gradients all-reduced), \"zero1\" (the optimizer state sharded\n"
        "# too), \"fsdp\" (FSDP2: parameters, gradients and optimizer state sharded).\n"
        f"DATA_PARALLEL = {data_parallel!r}\n"
        f"RESHARD_AFTER_FORWARD = {bool(reshard_after_forward)!r}  # FSDP2's: gather again for the backward\n"
        "# Tensor parallelism: the plan the explorer counted (module-name patterns, * an index, to styles).\n"
        f"TP_PLAN = {dict(tp_plan or {})!r}\n")
    return dict(mesh_doc=doc, mesh_constants=constants, mesh_source=MESH_SOURCE + "\n")


def _csv_script(table: pd.DataFrame, splits: Sequence[int], *, devices: int, replicas: int, cut: str,
                **common: object) -> str:
    """:func:`torchrun_script` for a CSV schedule file (checked against the split and chunks first)."""
    chunks = common["chunks"]
    assert isinstance(chunks, int)
    file = csv_schedule(str(common["schedule"])).check_fits(stages=len(splits) + 1, microbatches=chunks,
                                                              ranks=devices or None)
    ranks = file.rank_stages
    adjacent = any(s + 1 in stages for stages in ranks for s in stages)  # passed within a rank: no self warm-up
    return _SCRIPT.format(
        stages=file.stages, world=file.ranks * replicas, schedule_class="_PipelineScheduleRuntime",
        csv_block=_CSV_BLOCK.format(text=file.text, format=file.format, rank_stages=ranks),
        csv_load="\n    load_schedule_csv(schedule)  # the order of every rank, from SCHEDULE_CSV",
        schedule_import=(cut + "from torch.distributed.pipelining import SplitPoint, pipeline\n"
                         "from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime"
                         + _TRACING_IMPORTS),
        stage_arg="stages", stage_indices="STAGES_OF_RANK[rank]  # the stages the schedule file gives this rank",
        v_warmup=_V_WARMUP if adjacent else "", **common)
