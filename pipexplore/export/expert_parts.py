"""Expert parallelism in an exported ``torchrun`` script: each ep rank's share of the experts, the all-to-alls.

The functions here are the script's own (:mod:`pipexplore.export.mesh_parts` lists them among the
mesh's parts, the script holds their source), and are imported by the tests as they stand. They use
torch only.

The experts are folded over a stage's data-parallel ranks as Megatron-Core and torchtitan fold them
(:mod:`pipexplore.devices.mesh`): ``dp = edp × ep``, ``ep`` fastest. A Hugging Face mixture of experts
holds a layer's routed experts stacked, one slice an expert (``gate_up_proj`` of shape ``(experts,
2·ffn, hidden)``, ``down_proj`` of ``(experts, hidden, ffn)``: Mixtral's, Qwen3-MoE's);
:func:`shard_experts` replaces each such module by an :class:`ExpertShard` holding its rank's
``experts / ep`` of them, the stacked weights sharded on dim 0 as torchtitan's expert-parallel style
shards them (DTensors, ``Shard(0)`` over the ep ranks: the model's names, whole again by
``full_tensor``). Its forward is the token dispatch and combine:

1. the ``top_k`` copies of each token sorted by expert, each ep rank's together;
2. ``all_to_all_single`` of the counts (how many rows each rank sends each of the others' experts);
3. ``all_to_all_single`` of the rows, each rank's experts computing the rows sent to them, from every
   ep rank, an expert at a time; the results sent back by the reverse ``all_to_all_single``;
4. each copy weighted by its router score and summed into its token (the combine).

The backward of each exchange is the reverse exchange (:class:`AllToAll`). Gradients
(:func:`reduce_expert_gradients`): the dense parameters are averaged over the dp replicas; an
expert's gradient already sums what every ep rank's tokens gave it, so it is divided by ``dp`` and
summed over its ``edp`` replicas.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["EXPERT_FAMILIES", "expert_mesh", "AllToAll", "ExpertShard", "shard_experts", "reduce_expert_gradients"]

#: The mixtures of experts whose stages the script cuts by their modules and whose stacked experts it shards.
EXPERT_FAMILIES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


def expert_mesh(mesh: Any, ep: int) -> Any:
    """The experts' mesh of the script's ``DeviceMesh`` (``pp``, ``dp``, ``tp``): its ``dp`` unflattened
    into ``edp`` × ``ep`` (ep ranks numbered fastest), ``mesh["ep"]`` a stage's ep group."""
    dp = mesh["dp"].size()
    if dp % ep:
        raise SystemExit(f"ep {ep} does not divide dp {dp}: the experts are folded over a stage's data-parallel "
                         "ranks")
    return mesh._unflatten("dp", (dp // ep, ep), ("edp", "ep"))


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows (``sent[r]`` rows to rank ``r``, ``received[r]`` from it) over
    ``group``; its backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, received: list[int], sent: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (received, sent), group
        out = rows.new_empty((sum(received), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        received, sent = ctx.splits
        out = grad.new_empty((sum(sent), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), sent, received, group=ctx.group)
        return out, None, None, None


class ExpertShard(nn.Module):
    """A rank's ``experts / ep`` of a layer's stacked experts (``gate_up_proj``, ``down_proj``:
    DTensors sharded on dim 0 over ``ep_mesh``), called as the module it replaces is:
    ``(hidden_states, top_k_index, top_k_weights)`` of this rank's tokens, their output."""

    gate_up_proj: Any
    down_proj: Any
    act_fn: Any

    def __init__(self, experts: nn.Module, ep_mesh: Any) -> None:
        from torch.distributed.tensor import DTensor, Shard

        super().__init__()
        self.ep, self.rank, self.group = ep_mesh.size(), ep_mesh.get_local_rank(), ep_mesh.get_group()
        count = int(getattr(experts, "gate_up_proj").shape[0])
        if count % self.ep:
            raise SystemExit(f"ep {self.ep} does not divide the {count} experts of a layer")
        self.local = count // self.ep
        mine = slice(self.rank * self.local, (self.rank + 1) * self.local)
        for name in ("gate_up_proj", "down_proj"):
            shard = getattr(experts, name).detach()[mine].clone()
            setattr(self, name, nn.Parameter(DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False)))
        self.act_fn = experts.act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        top_k, experts = top_k_index.shape[-1], self.ep * self.local
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # the tokens' copies by expert: each ep rank's together
        tokens = torch.div(order, top_k, rounding_mode="floor")
        counts = torch.bincount(chosen, minlength=experts)
        counts_in = torch.empty_like(counts)  # each rank's rows for each of this rank's experts
        dist.all_to_all_single(counts_in, counts, group=self.group)
        sent = counts.view(self.ep, self.local).sum(1).tolist()
        received = counts_in.view(self.ep, self.local).sum(1).tolist()
        routed = AllToAll.apply(hidden_states[tokens], received, sent, self.group)
        # the rows came by rank, each rank's by expert: regrouped by expert, computed, put back
        expert = torch.arange(self.local, device=routed.device).repeat(self.ep).repeat_interleave(counts_in)
        by_expert = torch.argsort(expert, stable=True)
        sizes = torch.bincount(expert, minlength=self.local).tolist()
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        outputs = []
        for e, rows in enumerate(routed[by_expert].split(sizes)):
            gate, up = nn.functional.linear(rows, gate_up[e]).chunk(2, dim=-1)
            outputs.append(nn.functional.linear(self.act_fn(gate) * up, down[e]))
        computed = torch.cat(outputs)[torch.argsort(by_expert)]
        returned = AllToAll.apply(computed, sent, received, self.group)
        weighted = returned * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add(0, tokens, weighted.to(hidden_states.dtype))


def shard_experts(module: nn.Module, ep_mesh: Any) -> int:
    """Each stacked-experts module of ``module`` (``gate_up_proj`` and ``down_proj`` of one slice an
    expert) replaced by this rank's :class:`ExpertShard` of it, in place; returns how many."""
    def stacked(sub: nn.Module) -> bool:
        weights = [getattr(sub, name, None) for name in ("gate_up_proj", "down_proj")]
        return all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights)

    found = [(name, sub) for name, sub in module.named_modules() if not isinstance(sub, ExpertShard) and stacked(sub)]
    for name, sub in found:
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name), child, ExpertShard(sub, ep_mesh))
    return len(found)


def reduce_expert_gradients(module: nn.Module, dp_group: Any, edp_group: Optional[Any], replicas: int) -> None:
    """The gradients of ``module``'s parameters over the ``replicas`` dp ranks of a stage: the dense
    ones averaged over ``dp_group`` (one flat all-reduce), each :class:`ExpertShard`'s divided by
    ``replicas`` and summed over ``edp_group`` (its replicas; None: it has none)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    experts = {id(p) for sub in module.modules() if isinstance(sub, ExpertShard) for p in sub.parameters()}
    local = lambda grad: grad.to_local() if hasattr(grad, "to_local") else grad  # noqa: E731
    groups: Sequence[tuple[list[torch.Tensor], Any]] = (
        ([p.grad for p in module.parameters() if id(p) not in experts and p.grad is not None], dp_group),
        ([local(p.grad) for p in module.parameters() if id(p) in experts and p.grad is not None], edp_group))
    for grads, group in groups:
        if not grads:
            continue
        flat = _flatten_dense_tensors(grads)
        if group is not None:
            dist.all_reduce(flat, group=group)
        flat /= replicas
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)


#: What the script holds of this module, in this order.
SCRIPT_FUNCTIONS = (expert_mesh, AllToAll, ExpertShard, shard_experts, reduce_expert_gradients)
