"""Models that are not ``nn.Sequential``: candidate split points, costs, and splits through
``torch.distributed.pipelining.pipeline`` (PyTorch's tracer; pipexplore does not trace itself).

::

    table = trace.candidates(model, (tokens,))         # one row per block, in execution order
    pipe = trace.split(model, (tokens[:2],), ["layers.2", "layers.4"])
    trace.skip_routes_of(pipe)                         # values that jump over stages
"""
from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from typing import Any, Optional, Sequence

import pandas as pd
import torch
from torch import nn

from pipexplore.microbatch import tensors_in

__all__ = ["TraceError", "candidate_modules", "candidates", "split", "skip_routes_of", "module_fqns_per_model_part"]


class TraceError(RuntimeError):
    """The model could not be captured as one graph; the message says what to do instead."""


def candidate_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Blocks a pipeline can begin a stage at: the model's children, with ``ModuleList`` and
    ``Sequential`` containers opened one level (``layers.0``, ``layers.1``, …)."""
    found = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) > 0:
            found += [(f"{name}.{k}", sub) for k, sub in child.named_children()]
        else:
            found.append((name, child))
    return found


def _identity(t: torch.Tensor) -> tuple:
    """The same value seen by two blocks: backward hooks hand the caller a view, not the object."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def candidates(model: nn.Module, mb_args: tuple[Any, ...], *, mb_kwargs: Optional[dict[str, Any]] = None,
               loss_fn: Any = None, target: Any = None, repeats: int = 3) -> pd.DataFrame:
    """Profile each candidate block in execution order: the layer table of a traced model.

    Columns as :func:`pipexplore.profile` gives (``name`` is the block's FQN), with ``stash`` and
    ``pop`` naming values that skip over blocks (a block's output consumed by a later,
    non-adjacent block), and ``shared`` naming parameters used by several blocks (tied weights).
    Forward and backward times are medians over ``repeats`` of a real forward and backward.
    """
    blocks = candidate_modules(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no child modules to split between")
    index = {id(module): k for k, (_, module) in enumerate(blocks)}
    order: list[int] = []
    forward: dict[int, list[float]] = {k: [] for k in range(len(blocks))}
    backward: dict[int, list[float]] = {k: [] for k in range(len(blocks))}
    out_bytes: dict[int, int] = {}
    edges: set[tuple[int, int]] = set()
    producer: dict[tuple, int] = {}
    started: dict[int, float] = {}
    bwd_start: dict[int, float] = {}
    bwd_end: dict[int, float] = {}
    handles = []

    def pre(module: nn.Module, args: Any) -> None:
        k = index[id(module)]
        if k not in order:
            order.append(k)
        for t in tensors_in(args):
            source = producer.get(_identity(t))
            if source is not None and source < k - 1:
                edges.add((source, k))
        started[k] = time.perf_counter()

    def post(module: nn.Module, args: Any, output: Any) -> None:
        k = index[id(module)]
        forward[k].append(time.perf_counter() - started[k])
        tensors = tensors_in(output)
        out_bytes[k] = sum(t.numel() * t.element_size() for t in tensors)
        for t in tensors:
            producer[_identity(t)] = k

    def bwd_pre(module: nn.Module, grad_output: Any) -> None:
        bwd_start[index[id(module)]] = time.perf_counter()

    def bwd_post(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        bwd_end[index[id(module)]] = time.perf_counter()

    for _, module in blocks:
        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post),
                    module.register_full_backward_pre_hook(bwd_pre), module.register_full_backward_hook(bwd_post)]
    owners: dict[int, list[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for k, (_, module) in enumerate(blocks):
        for param in module.parameters():
            owners.setdefault(id(param), []).append(k)
            params[id(param)] = param

    def accumulated(blocks_of_param: tuple[int, ...]) -> Any:
        def hook(_: torch.Tensor) -> None:  # a block's backward ends at its weights' last accumulation
            now = time.perf_counter()
            for j in blocks_of_param:
                bwd_end[j] = max(bwd_end.get(j, 0.0), now)
        return hook

    for pid, ks in owners.items():
        if params[pid].requires_grad:
            handles.append(params[pid].register_post_accumulate_grad_hook(accumulated(tuple(ks))))
    try:
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for _ in range(max(1, repeats)):
            producer.clear()
            bwd_start.clear()
            bwd_end.clear()
            output = model(*mb_args, **(mb_kwargs or {}))
            loss = loss_fn(output, target) if loss_fn is not None else sum(
                t.float().pow(2).mean() for t in tensors_in(output) if t.is_floating_point())
            loss.backward()
            for k in range(len(blocks)):
                if k in bwd_start:
                    backward[k].append(max(0.0, bwd_end.get(k, bwd_start[k]) - bwd_start[k]))
            model.zero_grad(set_to_none=True)
    finally:
        for handle in handles:
            handle.remove()
    if len(order) < len(blocks):
        unused = [blocks[k][0] for k in range(len(blocks)) if k not in order]
        order += [k for k in range(len(blocks)) if k not in order]
        warnings.warn(f"blocks not called in forward: {unused}", stacklevel=2)
    shared = {k: [] for k in range(len(blocks))}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for pid, ks in owners.items():
        if len(set(ks)) > 1:
            for k in ks:
                shared[k].append(names.get(pid, "?"))
    rows = []
    position = {k: p for p, k in enumerate(order)}
    for k in order:
        name, module = blocks[k]
        stash = [f"v{src}>{dst}" for src, dst in sorted(edges) if src == k]
        pop = [f"v{src}>{dst}" for src, dst in sorted(edges) if dst == k]
        rows.append({
            "name": name, "type": type(module).__name__,
            "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
            "output_bytes": out_bytes.get(k, 0),
            "forward": sorted(forward[k])[len(forward[k]) // 2] if forward[k] else 0.0,
            "backward": sorted(backward[k])[len(backward[k]) // 2] if backward[k] else 0.0,
            "stash": ",".join(stash), "pop": ",".join(pop), "stash_keys": ",".join(stash), "pop_keys": ",".join(pop),
            "shared": ",".join(sorted(set(shared[k]))), "order": position[k],
        })
    return pd.DataFrame(rows)


def split(model: nn.Module, mb_args: tuple[Any, ...], split_points: Sequence[str], *,
          mb_kwargs: Optional[dict[str, Any]] = None) -> Any:
    """``pipeline(model, mb_args, split_spec={fqn: SplitPoint.BEGINNING for each point})``.

    Raises :class:`TraceError` with what failed and what to do when the model cannot be traced.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = {fqn: SplitPoint.BEGINNING for fqn in split_points}
    noise = io.StringIO()
    logger = logging.getLogger("torch")
    level = logger.level
    try:
        logger.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return pipeline(model, mb_args=tuple(mb_args), mb_kwargs=mb_kwargs, split_spec=spec)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(
            f"could not trace {type(model).__name__} into one graph to split it: {type(exc).__name__}: {first}\n"
            "Typical causes: data-dependent control flow (an `if` on a tensor's value), graph breaks, or "
            "operators without meta kernels. Mark the stage boundaries yourself with "
            "`torch.distributed.pipelining.pipe_split()` inside forward, remove the data-dependent branch, or "
            "build the stages with the manual API (`PipelineStage(stage_module, ...)`).") from exc
    finally:
        logger.setLevel(level)


def skip_routes_of(pipe: Any) -> list[tuple[int, int]]:
    """``(producing stage, consuming stage)`` for every value that jumps over at least one stage."""
    stage_of = {}
    routes = set()
    for node in pipe.split_gm.graph.nodes:
        if node.op == "call_module" and node.target.startswith("submod_pp_"):
            stage = int(node.target.rsplit("_", 1)[1])
            stage_of[node.name] = stage
            for arg in node.all_input_nodes:
                source = arg
                while source.op == "call_function" and source.all_input_nodes:  # getitem of a stage's tuple
                    source = source.all_input_nodes[0]
                if source.name in stage_of and stage_of[source.name] < stage - 1:
                    routes.add((stage_of[source.name], stage))
    return sorted(routes)


def module_fqns_per_model_part(table: pd.DataFrame, splits: Sequence[int]) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part``: the block FQNs of each stage."""
    names = [str(n) for n in table["name"]]
    points = [0, *splits, len(names)]
    return [names[a:b] for a, b in zip(points, points[1:])]


_SCRIPT = '''"""Pipeline training with torch.distributed.pipelining, exported by pipexplore.

{stages} stages ({schedule}, {chunks} micro-batches per step), split at {split_points}.
Run on one machine:   torchrun --standalone --nproc-per-node {world} {filename}
The hooks module ({hooks!r}) provides build_model(), get_batch() -> (inputs, target) and
loss_fn(output, target).
"""
import importlib
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import SplitPoint, pipeline, {schedule_class}

HOOKS = {hooks!r}
SPLIT_POINTS = {split_points!r}
CHUNKS = {chunks}
STEPS = {steps}
# The same split for torchtitan's pipeline config:
MODULE_FQNS_PER_MODEL_PART = {fqns!r}


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hooks = importlib.import_module(HOOKS)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model = hooks.build_model()
    inputs, target = hooks.get_batch()
    pipe = pipeline(model, mb_args=(inputs.chunk(CHUNKS)[0],),
                    split_spec={{fqn: SplitPoint.BEGINNING for fqn in SPLIT_POINTS}})
    indices = list(range(rank, pipe.num_stages, world))
    stages = [pipe.build_stage(s, device) for s in indices]
    schedule = {schedule_class}({stage_arg}, n_microbatches=CHUNKS, loss_fn=hooks.loss_fn)
    optimizer = torch.optim.SGD([p for stage in stages for p in stage.submod.parameters()], lr=0.01)
    last = pipe.num_stages - 1 in indices
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        losses = []
        kwargs = dict(target=target.to(device), losses=losses) if last else {{}}
        if 0 in indices:
            schedule.step(inputs.to(device), **kwargs)
        else:
            schedule.step(**kwargs)
        optimizer.step()
        if last:
            print(f"step {{step}} loss={{sum(l.item() for l in losses) / len(losses):.6f}}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def torchrun_script(table: pd.DataFrame, splits: Sequence[int], *, hooks: str, chunks: int, schedule: str = "1f1b",
                    devices: int = 0, steps: int = 1, filename: str = "train_pipeline.py") -> str:
    """A standalone script for ``torchrun --nproc-per-node N`` that builds the same split and
    schedule and trains with the model, data and loss of the ``hooks`` module."""
    from pipexplore.distributed import MULTI_STAGE, SCHEDULE_CLASSES

    if schedule not in SCHEDULE_CLASSES:
        raise ValueError(f"the torchrun export knows {', '.join(SCHEDULE_CLASSES)}; not {schedule!r}")
    if not hooks or not all(part.isidentifier() for part in hooks.split(".")):
        raise ValueError(f"hooks must name an importable module (e.g. 'mypackage.train_hooks'), got {hooks!r}")
    names = [str(n) for n in table["name"]]
    schedule_class = SCHEDULE_CLASSES[schedule]
    stages = len(splits) + 1
    world = devices or stages
    return _SCRIPT.format(
        stages=stages, schedule=schedule, chunks=chunks, split_points=[names[s] for s in splits], world=world,
        filename=filename, hooks=hooks, schedule_class=schedule_class, steps=steps,
        fqns=module_fqns_per_model_part(table, splits),
        stage_arg="stages" if schedule_class in MULTI_STAGE else "stages[0]")
