"""What every exported ``torchrun`` script runs on each rank: the functions here are the script's
own, its text their source (:func:`pipexplore.export.torchrun.torchrun_script` assembles it), and
the tests import and run them as they stand.

The script imports no pipexplore (but for ``--record``, which loads pipexplore's recorder), so these
functions use torch and the standard library only, and read the plan's values from the module's
constants (:data:`CONSTANTS`): the script sets them at its top from the plan, the defaults here are
a one-stage plan's, which the tests change where they run a function. The functions it shares with
pipexplore (a tied parameter's gradients, the contiguous boundaries, the generated code of a traced
stage, a CSV schedule's loading, the mesh's parts) are imported here and held by the script as
their source too.

Example (the one-rank run of a plan, here; torchrun runs ``main()`` on every rank)::

    script_parts.HOOKS, script_parts.SPLIT_POINTS = "train_hooks", []
    script_parts.main([])
"""
from __future__ import annotations

import argparse
import importlib
import os
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, SplitPoint, pipeline
from torch.distributed.pipelining._IR import annotate_split_points
from torch.distributed.pipelining.schedules import PipelineScheduleMulti
from torch.utils._pytree import tree_unflatten

from pipexplore.executors.distributed import _load_schedule_csv, _no_self_warmup
from pipexplore.executors.tied import own_parameters, sum_tied_grads, tied_groups, tied_parameters
from pipexplore.export.expert_parts import expert_mesh, reduce_expert_gradients, shard_experts
from pipexplore.export.mesh_parts import (cut_stage, data_parallel, full_state, make_mesh, reduce_gradients,
                                          tensor_parallel, zero1_optimizer)
from pipexplore.models.trace.split import contiguous_boundaries, run_generated_code

__all__ = ["CONSTANTS", "without_kv_cache", "checkpoint_stage", "place_graph_devices", "call_inputs", "late_inputs",
           "model_output", "traced", "on_meta", "materialize", "replica_batch", "stages_of", "traced_stages",
           "check_sharded_stage", "tensor_parallel_stage", "expert_parallel_stage", "default_optimizer", "rank_device",
           "parse_options", "main", "FUNCTIONS"]

# ---- the plan's values: the script sets each at its top ----------------------------------------------
HOOKS = "train_hooks"
SPLIT_POINTS: list[str] = []
CHUNKS = 1
STEPS = 1
SCHEDULE = "gpipe"
SCHEDULE_CLASS: type = ScheduleGPipe
V_SHAPED = False
CHECKPOINT = "never"
DEVICE = "cpu"
LAYERS: list[str] = []
MODULE_FQNS_PER_MODEL_PART: list[list[str]] = []
SCHEDULE_CSV: Optional[str] = None
SCHEDULE_CSV_FORMAT: Optional[str] = None
STAGES_OF_RANK: Optional[list[list[int]]] = None
MESH: Optional[dict[str, int]] = None
DATA_PARALLEL = "ddp"
RESHARD_AFTER_FORWARD = False
TP_PLAN: dict[str, str] = {}

#: The constants every script sets; a script with a mesh also sets :data:`MESH_CONSTANTS`.
CONSTANTS = ("HOOKS", "SPLIT_POINTS", "CHUNKS", "STEPS", "SCHEDULE", "SCHEDULE_CLASS", "V_SHAPED", "CHECKPOINT",
             "DEVICE", "LAYERS", "MODULE_FQNS_PER_MODEL_PART", "SCHEDULE_CSV", "SCHEDULE_CSV_FORMAT",
             "STAGES_OF_RANK", "MESH")
MESH_CONSTANTS = ("DATA_PARALLEL", "RESHARD_AFTER_FORWARD", "TP_PLAN")


def without_kv_cache(model):
    """Training never uses the KV cache: a Hugging Face config's use_cache=True would make the
    model return a DynamicCache, which the tracer cannot split. Turn it off on every config (the
    model is the script's own: for good, where the explorer puts it back after)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", None) is True:
            config.use_cache = False
    return model


def checkpoint_stage(stage, chunks: int, mode: str) -> None:
    """Activation checkpointing as the plan has it (torch.utils.checkpoint, non-reentrant): a
    micro-batch's forward through the stage keeps only its inputs and runs again in its backward,
    for every micro-batch ("always") or all but a step's last ("except_last": its backward comes
    at once in GPipe); "never" keeps every activation. A zero-bubble schedule's split backward
    runs the forward again for its input gradient and again for its weight gradient. A stage the
    schedule drives by its forward_one_chunk says which micro-batch each forward is (torch's shape
    inference runs one more, with autograd on, which is none: not checkpointed)."""
    if mode == "never":
        return
    from torch.utils.checkpoint import checkpoint

    inner, calls, chunk = stage.submod.forward, [0], [None]
    one_chunk = getattr(stage, "forward_one_chunk", None)
    if one_chunk is not None:

        def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
            chunk[0] = fwd_chunk_id
            try:
                return one_chunk(fwd_chunk_id, *args, **kwargs)
            finally:
                chunk[0] = None

        stage.forward_one_chunk = forward_one_chunk

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled() or (one_chunk is not None and chunk[0] is None):
            return inner(*args, **kwargs)
        index = chunk[0] if one_chunk is not None else calls[0] % chunks  # (else in order, once a step)
        calls[0] += 1
        if mode == "except_last" and index == chunks - 1:
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    stage.submod.forward = forward


def place_graph_devices(module, traced, device) -> None:
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


def call_inputs(inputs):
    """The model's inputs as get_batch() gives them: (positional, keyword)."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    return (tuple(inputs), {}) if isinstance(inputs, (tuple, list)) else ((inputs,), {})


def late_inputs(pipe):
    """The model's inputs a stage after the first reads itself: torch's stages feed them to the first only."""
    return sorted({node.name for node in pipe.split_gm.graph.nodes if node.op == "placeholder" for user in node.users
                   if user.op == "call_module" and str(user.target).startswith("submod_")
                   and int(str(user.target).rsplit("_", 1)[1]) > 0})


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
    annotate_split_points(model, {fqn: SplitPoint.BEGINNING for fqn in SPLIT_POINTS})
    captured = {}

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


def stages_of(rank: int, ranks: int) -> list[int]:
    """The stages pipeline rank ``rank`` of ``ranks`` runs: those the schedule file gives it
    (STAGES_OF_RANK), two in a V (V_SHAPED: the rank's and its mirror's), else every ranks-th from
    its own (one stage a rank where there are as many ranks as stages)."""
    if STAGES_OF_RANK is not None:
        return list(STAGES_OF_RANK[rank])
    if V_SHAPED:
        return [rank, 2 * ranks - 1 - rank]
    return list(range(rank, len(SPLIT_POINTS) + 1, ranks))


def traced_stages(model, args, model_kwargs, indices, ranks, pp_rank, rank, device, group, meta, hooks):
    """This rank's stages of the model traced by torch's pipelining and split at SPLIT_POINTS (the
    model's inputs as given: on the meta device where the model is), the structure of the model's
    output, and the tied parameters its stages share with others."""
    traced_on = next(iter([*model.parameters(), *model.buffers()]), torch.empty(0)).device

    def first(value):  # (a model on the meta device is traced on meta inputs: nothing of it is computed here)
        return value.chunk(CHUNKS)[0].to("meta" if meta else value.device) if torch.is_tensor(value) else value

    pipe, output_spec = traced(model, tuple(first(a) for a in args), {k: first(v) for k, v in model_kwargs.items()})
    contiguous_boundaries(pipe.split_gm)  # gloo sends and receives contiguous tensors only
    late = late_inputs(pipe)
    if late:
        raise SystemExit(f"rank {rank}: later stages read the model's inputs {late} themselves, "
                         "but torch's stages feed them to the first stage only: begin the second stage at a later "
                         "block (SPLIT_POINTS; the explorer's balance does for processes plans), or read them in "
                         "loss_fn")
    run_generated_code(pipe.split_gm)  # the stages' generated code, not torch.fx's interpreter (2x on CPU)
    # A parameter in several stages (a tied embedding and head) trains as one: its copies' gradients summed.
    tied = tied_groups(tied_parameters(pipe), rank=pp_rank,
                       rank_of=lambda s: next(r for r in range(ranks) if s in stages_of(r, ranks)))
    stages = [pipe.build_stage(s, device, group=group) for s in indices]
    for index, stage in zip(indices, stages):
        if {index - 1, index + 1} & set(indices):  # no warm-up send to this rank itself (a V's middle stages)
            _no_self_warmup(stage, rank)
        place_graph_devices(stage.submod, traced_on, device)
        if meta:  # this rank's stages made real, nothing else of the model
            materialize(stage.submod, device, hooks)
    return stages, pipe.num_stages, output_spec, tied


def check_sharded_stage(model, indices, meta, parallelism, plain):
    """Stop where ``parallelism`` (which shards the stage's own modules) cannot run here: a model on
    the meta device, several stages a pipeline rank, or a head tied to an embedding another stage
    holds; ``plain``: the mesh that would run it (``"tp=1"``)."""
    if meta:
        raise SystemExit(f"{parallelism} here shards a model with its weights: build_model() gives one on "
                         "the meta device")
    if len(indices) != 1:
        raise SystemExit(f"{parallelism} here runs one stage a pipeline rank; {SCHEDULE} runs several")
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and SPLIT_POINTS:
        raise SystemExit("the model ties its head to its embedding (tie_word_embeddings), which different "
                         "stages hold: their gradients are summed between pipeline ranks, which this script "
                         f"does not do beside {parallelism}; untie them or plan {plain}")


def tensor_parallel_stage(model, indices, device, mesh, meta):
    """This rank's stage cut from the model's own modules and sharded over the mesh's tp ranks
    (tensor parallelism shards modules, which a traced stage no longer has), and how the loss sees
    its output."""
    check_sharded_stage(model, indices, meta, "tensor parallelism", "tp=1")
    stage_names = MODULE_FQNS_PER_MODEL_PART[indices[0]]
    part = cut_stage(model, stage_names, indices[0] == 0, indices[0] == len(SPLIT_POINTS))
    tensor_parallel(part.to(device), mesh["tp"], TP_PLAN)
    stage = PipelineStage(part, indices[0], len(SPLIT_POINTS) + 1, device, group=mesh["pp"].get_group())
    kept = getattr(part, "output_type", None)  # a causal LM's output class (an nn.Sequential's is a tensor)
    output_of = (lambda output: kept["type"](logits=output)) if kept is not None else (lambda output: output)
    return [stage], output_of


def expert_parallel_stage(model, indices, device, mesh, experts, meta):
    """This rank's stage cut from the model's own modules (as :func:`tensor_parallel_stage` cuts it),
    each layer's stacked experts sharded over the ``experts`` mesh's ep ranks (each rank its
    ``1/ep`` of them, the tokens dispatched and combined by all-to-alls), and how the loss sees its
    output."""
    check_sharded_stage(model, indices, meta, "expert parallelism", "ep=1")
    stage_names = MODULE_FQNS_PER_MODEL_PART[indices[0]]
    part = cut_stage(model, stage_names, indices[0] == 0, indices[0] == len(SPLIT_POINTS), experts=True).to(device)
    shard_experts(part, experts["ep"])
    stage = PipelineStage(part, indices[0], len(SPLIT_POINTS) + 1, device, group=mesh["pp"].get_group())
    kept = getattr(part, "output_type", None)
    output_of = (lambda output: kept["type"](logits=output)) if kept is not None else (lambda output: output)
    return [stage], output_of


def default_optimizer(params):
    """The optimizer of a hooks module without build_optimizer(parameters): SGD, lr 0.01."""
    return torch.optim.SGD(params, lr=0.01)


def rank_device(choice: str, rank: int):
    """Where this rank runs: with choice "cuda", its node's GPU of its local rank (the CPU where the
    node has none; a local rank beyond its GPUs refused by name); with "cpu", the CPU."""
    if choice == "cuda" and torch.cuda.is_available():
        local, gpus = int(os.environ.get("LOCAL_RANK", rank)), torch.cuda.device_count()
        if local >= gpus:
            raise SystemExit(f"rank {rank}: local rank {local}, but this node has {gpus} GPU(s): start at most "
                             f"{gpus} rank(s) a node (--nproc-per-node), or pass --device cpu")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def parse_options(argv: Optional[Sequence[str]] = None):
    """The script's command line (``argv``: sys.argv's, where None)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--record", metavar="DIR", help="record every rank's actions into DIR (needs pipexplore)")
    parser.add_argument("--profile", metavar="DIR", help="trace every rank's steps with torch.profiler into DIR")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=DEVICE, help="where ranks run (default: DEVICE)")
    parser.add_argument("--warmup", type=int, default=None, help="steps not recorded (default 1 of 2 or more)")
    parser.add_argument("--save", metavar="DIR", help="write the trained parameters into DIR, a file a stage "
                        "(stage{N}.pt: the model's names to whole tensors)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    options = parse_options(argv)
    warmup = options.warmup if options.warmup is not None else min(1, options.steps - 1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Ranks that share one machine's CPU cores (pipexplore's launcher says which): each keeps to its own.
    rank_cores = os.environ.get("PIPEXPLORE_RANK_CORES", "").split(";")
    if rank < len(rank_cores) and rank_cores[rank] and options.device == "cpu" and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [int(core) for core in rank_cores[rank].split(",")])
    hooks: Any = importlib.import_module(HOOKS)
    device = rank_device(options.device, rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # The device mesh (pp x dp x tp; a world that is not the mesh's refused), or pipeline ranks alone.
    shape = MESH or {"pp": world, "dp": 1, "tp": 1}
    mesh: Any = make_mesh(shape, device.type, world) if MESH else None
    ep = shape.get("ep", 1)  # expert parallelism: the experts folded over each stage's dp ranks (ep fastest)
    experts: Any = expert_mesh(mesh, ep) if ep > 1 else None
    ranks, pp_rank = (shape["pp"], mesh["pp"].get_local_rank()) if mesh else (world, rank)
    dp_rank, tp_rank = (mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()) if mesh else (0, 0)
    model = without_kv_cache(hooks.build_model())
    meta = on_meta(model)
    if meta and not callable(getattr(hooks, "init_stage", None)):
        raise SystemExit(f"rank {rank}: build_model() gave a model on the meta device, so each rank makes only its "
                         f"own stages real: {HOOKS} must define init_stage(module), which fills a stage's parameters "
                         "and buffers by name")
    inputs, target = replica_batch(hooks.get_batch, dp_rank, shape["dp"])
    args, model_kwargs = call_inputs(inputs)
    indices = stages_of(pp_rank, ranks)
    tied: list = []
    if mesh and shape["tp"] > 1:  # tensor parallelism shards the model's own modules: each stage cut from them
        stages, output_of = tensor_parallel_stage(model, indices, device, mesh, meta)
        num_stages = len(SPLIT_POINTS) + 1
    elif experts is not None:  # so does expert parallelism
        stages, output_of = expert_parallel_stage(model, indices, device, mesh, experts, meta)
        num_stages = len(SPLIT_POINTS) + 1
    else:
        stages, num_stages, output_spec, tied = traced_stages(
            model, args, model_kwargs, indices, ranks, pp_rank, rank, device,
            mesh["pp"].get_group() if mesh else None, meta, hooks)
        output_of = lambda output: model_output(output, output_spec)  # noqa: E731
    if mesh and tied and (shape["dp"] > 1 or shape["tp"] > 1):
        raise SystemExit("the model ties parameters across stages (an embedding and its head): their gradients are "
                         "summed between pipeline ranks, which this script does not do beside tensor or data "
                         "parallelism; untie them (tie_word_embeddings=False) or plan dp=1 and tp=1")
    to_device = lambda value: value.to(device) if torch.is_tensor(value) else value  # noqa: E731
    args, model_kwargs = tuple(map(to_device, args)), {k: to_device(v) for k, v in model_kwargs.items()}
    for stage in stages:
        if mesh and shape["dp"] > 1 and experts is None:  # the replicas share the stage as DATA_PARALLEL says
            data_parallel(stage.submod, mesh["dp"], DATA_PARALLEL, RESHARD_AFTER_FORWARD)
        checkpoint_stage(stage, CHUNKS, CHECKPOINT)
    # loss_fn sees the model's output as the model returns it (a ModelOutput: out.logits, out["logits"])
    loss_fn = lambda output, target: hooks.loss_fn(output_of(output), target)  # noqa: E731
    multi = issubclass(SCHEDULE_CLASS, PipelineScheduleMulti)  # a list of stages a rank, else one
    schedule = SCHEDULE_CLASS(stages if multi else stages[0], n_microbatches=CHUNKS, loss_fn=loss_fn)
    if SCHEDULE_CSV is not None:  # the order of every rank, from the schedule file
        _load_schedule_csv(schedule, SCHEDULE_CSV, str(SCHEDULE_CSV_FORMAT))
    build_optimizer = getattr(hooks, "build_optimizer", None) or default_optimizer
    # One optimizer per stage, as each stage owns its parameters.
    # (a tensor two stages of this rank share, tied, is stepped by the first one's optimizer only)
    optimizers = [build_optimizer(params) if params else None
                  for params in own_parameters([list(stage.submod.parameters()) for stage in stages])]
    zero1 = bool(mesh) and DATA_PARALLEL == "zero1" and shape["dp"] > 1
    if zero1:  # each replica steps its share of the optimizer state (ZeRO-1)
        optimizers = [zero1_optimizer(list(stage.submod.parameters()), optimizer, mesh["dp"].get_group())
                      if optimizer is not None else None for stage, optimizer in zip(stages, optimizers)]
    recorder = None
    if options.record:
        from pipexplore.runs.record import RankRecorder

        recorder = RankRecorder(options.record, stages, device, warmup=warmup,
                                coordinates=dict(pp=pp_rank, dp=dp_rank, tp=tp_rank) if mesh else None, plan=dict(
            split_points=SPLIT_POINTS, layers=LAYERS, chunks=CHUNKS, schedule=SCHEDULE,
            schedule_csv=SCHEDULE_CSV,  # a CSV schedule's text: the run holds what it ran
            schedule_class=SCHEDULE_CLASS.__name__, stages=num_stages, model=type(model).__name__, hooks=HOOKS,
            checkpoint=CHECKPOINT, mesh=MESH, data_parallel=DATA_PARALLEL if MESH else None,
            steps=options.steps, optimizer=type(next(filter(None, optimizers), None)).__name__))
    last = num_stages - 1 in indices
    profiler = None
    for step in range(options.steps):
        if options.profile and step == warmup:  # traced from here: one ProfilerStep#N a step
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # a schedule (every step recorded) makes the profiler mark each step ProfilerStep#N
            profiler = torch.profiler.profile(activities=activities,
                                              schedule=lambda _: torch.profiler.ProfilerAction.RECORD)
            profiler.start()
        for optimizer in filter(None, optimizers):
            optimizer.zero_grad(set_to_none=True)
        losses: list = []
        kwargs = dict(target=target.to(device), losses=losses) if last else {}
        began = time.perf_counter()
        if recorder is not None:
            recorder.begin_step(step)
        if 0 in indices:
            schedule.step(*args, **model_kwargs, **kwargs)
        else:
            schedule.step(**kwargs)
        sum_tied_grads(tied, {s: stage.submod for s, stage in zip(indices, stages)})
        if experts is not None:  # the dense gradients averaged over the replicas, each expert's summed
            for stage in stages:
                reduce_expert_gradients(stage.submod, mesh["dp"].get_group(),
                                        experts["edp"].get_group() if shape["dp"] > ep else None, shape["dp"])
        if zero1:  # ZeRO-1: the gradients averaged over the replicas before each steps its share
            reduce_gradients([p for stage in stages for p in stage.submod.parameters()], mesh["dp"].get_group(),
                             shape["dp"])
        if recorder is not None:
            recorder.optimizer_steps(zip(stages, optimizers))
            recorder.end_step(step, losses)
        else:
            for optimizer in filter(None, optimizers):
                optimizer.step()
        if last:
            loss = sum(value.item() for value in losses) / len(losses)
            if mesh and shape["dp"] > 1:  # the global batch's loss: the replicas' averaged
                total = torch.tensor([loss], dtype=torch.float64, device=device)
                dist.all_reduce(total, group=mesh["dp"].get_group())
                loss = total.item() / shape["dp"]
            if dp_rank == 0 and tp_rank == 0:
                print(f"step {step} loss={loss:.9g} time={(time.perf_counter() - began) * 1e3:.3f}ms", flush=True)
        if profiler is not None:
            profiler.step()
    if recorder is not None:
        recorder.finish()
    if profiler is not None:
        profiler.stop()
        os.makedirs(options.profile, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(options.profile, f"trace_rank{rank}.json"))
    if options.save:  # every rank of a stage gathers its shards; one writes them, by the model's names
        for index, stage in zip(indices, stages):
            state = full_state(stage.submod)
            if dp_rank == 0 and tp_rank == 0:
                os.makedirs(options.save, exist_ok=True)
                torch.save(state, os.path.join(options.save, f"stage{index}.pt"))
    dist.barrier()  # no rank leaves while another still sends to it
    dist.destroy_process_group()


#: The script's own functions, in the order it holds them.
FUNCTIONS: tuple[Callable[..., Any], ...] = (
    without_kv_cache, checkpoint_stage, place_graph_devices, call_inputs, late_inputs, model_output, traced, on_meta,
    materialize, replica_batch, stages_of, traced_stages, check_sharded_stage, tensor_parallel_stage,
    expert_parallel_stage, default_optimizer, rank_device, parse_options, main)
