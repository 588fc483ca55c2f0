"""Tied weights across ranks: one parameter of the model (GPT-2's ``wte`` and ``lm_head``) that
torch's ``pipeline()`` copies into every stage using it (``pipe.replicated_params``), trained
as the one weight it is.

The unsplit model adds both uses' gradients into its one tensor. Split, each stage's copy gets
only its own use's, so after the first update the copies (and the losses) drift apart. As
Megatron-LM does for its embedding group, after each step's backward every copy gets the sum of
all copies' gradients: summed on the rank (a V schedule puts the first and last stage on one rank),
then over the ranks that hold one, in a process group of just those ranks. A parameter two stages
of one rank (or one process) share is stepped by one optimizer only (:func:`own_parameters`, which
the in-process executors' ``StageOptimizers`` use too).

The processes executor calls these in its ranks (for an ``nn.Sequential`` too, whose stages are
sent apart: :func:`stage_shared_parameters`); the exported torchrun script holds their source
(:data:`SOURCE`), so the two run the same code (which is why their annotations are builtins only:
the script runs them without this module's imports).

Example (every rank, in the same order: ``new_group`` is collective)::

    tied = tied_parameters(pipe)
    groups = tied_groups(tied, rank_of=lambda s: s % world, rank=rank)
    schedule.step(...)
    sum_tied_grads(groups, {s: stage.submod for s, stage in zip(indices, stages)})
"""
from __future__ import annotations

import inspect

import torch

__all__ = ["tied_parameters", "stage_shared_parameters", "tied_groups", "sum_tied_grads", "own_parameters", "SOURCE"]

#: Process groups of the ranks that hold a tied parameter, kept for the default group they were
#: made in (a warm pool's ranks run many steps and plans in one default group).
_GROUPS: dict = {}


def tied_parameters(pipe) -> list:
    """Parameters ``pipe`` (torch's split) holds a copy of in more than one stage, as its
    ``replicated_params`` records them: for each, ``[(stage, name in that stage), ...]``."""
    return [sorted((int(name.rsplit("_", 1)[1]), qualname) for name, qualname in mapping.items())
            for mapping in getattr(pipe, "replicated_params", []) if len(mapping) > 1]


def stage_shared_parameters(stage_modules: list) -> list:
    """Parameters one tensor of which several of ``stage_modules`` hold (an ``nn.Sequential``'s
    stages cut from one model, sent to their ranks apart): as :func:`tied_parameters` gives them."""
    holders: dict = {}
    for stage, module in enumerate(stage_modules):
        for name, param in module.named_parameters(remove_duplicate=False):
            holders.setdefault(id(param), []).append((stage, name))
    return [sorted(set(found)) for found in holders.values() if len({s for s, _ in found}) > 1]


def tied_groups(tied: list, rank_of, rank: int) -> list:
    """For each tied parameter: the process group of the ranks holding a copy (None where one rank
    holds them all) and this rank's copies. Every rank calls it with the same ``tied``."""
    import torch.distributed as dist

    groups = []
    for holders in tied:
        ranks = tuple(sorted({rank_of(s) for s, _ in holders}))
        group = None
        if len(ranks) > 1:
            key = (id(dist.group.WORLD), ranks)
            if key not in _GROUPS:
                _GROUPS[key] = dist.new_group(list(ranks))
            group = _GROUPS[key]
        groups.append((group, [(s, n) for s, n in holders if rank_of(s) == rank]))
    return groups


def sum_tied_grads(groups: list, modules: dict) -> None:
    """Give every copy of each tied parameter the sum of all copies' gradients (``modules``: this
    rank's stage modules by stage index), before any optimizer steps."""
    import torch.distributed as dist

    for group, mine in groups:
        if not mine:  # this rank holds no copy (nor is in its group)
            continue
        copies = list({id(p): p for p in (modules[s].get_parameter(n) for s, n in mine)}.values())
        if not copies[0].requires_grad:  # frozen (on every rank alike): no gradient, none to give
            continue
        total = torch.zeros_like(copies[0])
        for p in copies:
            if p.grad is not None:
                total += p.grad
        if group is not None:
            dist.all_reduce(total, group=group)
        for p in copies:
            p.grad = total if len(copies) == 1 else total.clone()


def own_parameters(stage_parameters: list) -> list:
    """Each stage's parameters less those an earlier stage holds (one tensor, tied, in two stages
    of one rank or one process): one optimizer steps each parameter once."""
    seen: set = set()
    owned = []
    for params in stage_parameters:
        mine = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in mine)
        owned.append(mine)
    return owned


#: The functions above as source, for the exported script (which needs nothing of pipexplore).
SOURCE = "_GROUPS: dict = {}\n\n\n" + "\n\n".join(
    inspect.getsource(f) for f in (tied_parameters, tied_groups, sum_tied_grads, own_parameters))
