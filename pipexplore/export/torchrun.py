"""Export a split as a standalone ``torchrun`` script (``torch.distributed.pipelining``), and as
torchtitan's ``module_fqns_per_model_part``."""
from __future__ import annotations

from typing import Sequence

import pandas as pd

from pipexplore.models.hf import EXPORT_SOURCE
from pipexplore.models.trace import MULTI_STAGE, SCHEDULE_CLASSES

__all__ = ["torchrun_script", "module_fqns_per_model_part"]


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


{cache_off}

def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hooks = importlib.import_module(HOOKS)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model = without_kv_cache(hooks.build_model())
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
    schedule and trains with the model, data and loss of the ``hooks`` module (a Hugging Face
    model's KV cache off, as in the explorer: :mod:`pipexplore.models.hf`)."""
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
        fqns=module_fqns_per_model_part(table, splits), cache_off=EXPORT_SOURCE,
        stage_arg="stages" if schedule_class in MULTI_STAGE else "stages[0]")
