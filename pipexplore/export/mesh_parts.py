"""What an exported ``torchrun`` script of a mesh runs on each rank, beside the pipeline: the device
mesh, tensor parallelism on a stage, its data parallelism, and a stage cut from the model by its
modules where tensor parallelism needs real modules.

The functions here are the script's own (it holds their source: :data:`SCRIPT_FUNCTIONS`), and are
imported by the tests as they stand. They use torch only.

- :func:`make_mesh`: torch's ``init_device_mesh`` with dimensions ``pp``, ``dp``, ``tp`` (the
  tensor-parallel ranks numbered fastest, as Megatron-LM and torchtitan place them), refusing a world
  size that is not the mesh's.
- :func:`cut_stage`: a stage as the model's own modules (what ``parallelize_module`` shards: torch's
  tracer bakes the whole model's head counts into a traced stage's reshapes, so a traced stage cannot
  be sharded). An ``nn.Sequential`` keeps the layers of its stage under their own names; a Llama-family
  causal LM (a decoder whose forward takes ``inputs_embeds`` and applies nothing between its embedding
  and its first block) keeps its stage's blocks, the others replaced by a pass-through, the embedding
  on the first stage only, the final norm and head on the last (elsewhere identities: a middle
  stage's "logits" are its hidden states).
- :func:`tensor_parallel`: ``parallelize_module`` with the plan the explorer counted (module-name
  patterns, ``*`` for an index, to torch's styles), read by :mod:`pipexplore.models.sharded`'s own
  ``style_of`` and ``_torch_style`` (the script holds their source too).
- :func:`data_parallel`: FSDP2's ``fully_shard`` (its ``reshard_after_forward``), DDP as torch's
  ``replicate`` (FSDP2's replicated sibling, which torch's pipelining stage drives as it drives
  FSDP: gradients reduced once, after the last micro-batch's backward), or ZeRO-1 (gradients
  all-reduced over the replicas by :func:`reduce_gradients`, the optimizer state sharded by torch's
  ``ZeroRedundancyOptimizer``: :func:`zero1_optimizer`).
- expert parallelism's parts (:mod:`pipexplore.export.expert_parts`: a rank's share of a mixture of
  experts' stacked experts, the all-to-alls), held among :data:`SCRIPT_FUNCTIONS`.
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from pipexplore.export import expert_parts
from pipexplore.export.expert_parts import EXPERT_FAMILIES
from pipexplore.models.sharded import STYLES, _pattern, _torch_style, style_of

__all__ = ["make_mesh", "cut_stage", "tensor_parallel", "data_parallel", "reduce_gradients", "zero1_optimizer",
           "full_state", "CUT_FAMILIES", "SCRIPT_CONSTANTS", "SCRIPT_FUNCTIONS"]

#: Causal LMs :func:`cut_stage` cuts by their modules (a decoder that takes ``inputs_embeds`` as they are).
CUT_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def make_mesh(shape: Mapping[str, int], device_type: str, world: int) -> Any:
    """A ``DeviceMesh`` of ``shape`` (``{"pp": …, "dp": …, "tp": …}``) over the ``world`` ranks,
    or ``SystemExit`` naming the ranks to start where ``world`` is not their product."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = [int(shape[d]) for d in ("pp", "dp", "tp")]
    needed = sizes[0] * sizes[1] * sizes[2]
    if world != needed:
        raise SystemExit(f"the mesh pp {sizes[0]} x dp {sizes[1]} x tp {sizes[2]} runs on {needed} ranks, but "
                         f"torchrun started {world}: start {needed} (--nproc-per-node {needed} on one machine, or "
                         f"N nodes of {needed} / N)")
    return init_device_mesh(device_type, tuple(sizes), mesh_dim_names=("pp", "dp", "tp"))


class PassThrough(nn.Module):
    """A block another stage computes: its first input, unchanged (keeps the block's
    ``attention_type``, which the decoder's loop reads)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        if hasattr(block, "attention_type"):
            self.attention_type = block.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def cut_stage(model: Any, owned: Sequence[str], first: bool, last: bool, experts: bool = False) -> Any:
    """``model`` cut to the layers named ``owned`` (the explorer's layer names, this stage's), in place;
    its parameters keep the model's names. ``first``/``last``: whether the stage is the pipeline's
    first (it takes the model's inputs) or last (it gives the model's outputs). ``experts``: the stage
    of a mixture of experts whose experts will be sharded (one of :data:`EXPERT_FAMILIES`)."""
    mine = set(owned)
    family = type(model).__name__
    if experts and family not in EXPERT_FAMILIES:
        raise SystemExit(f"expert parallelism here shards the stacked experts of {', '.join(EXPERT_FAMILIES)}; not "
                         f"{family}'s: plan ep=1 for it, or export Megatron-LM's arguments")
    if isinstance(model, nn.Sequential):
        for name in [n for n, _ in model.named_children() if n not in mine]:
            delattr(model, name)  # (not del model[i]: that renumbers the layers)
        return model
    if family not in CUT_FAMILIES and not experts:
        raise SystemExit(f"tensor parallelism cuts each stage from the model by its modules: nn.Sequential and "
                         f"{', '.join(CUT_FAMILIES)}; not {family}. Plan tp=1 for it (its stages are traced), or "
                         "export Megatron-LM's arguments")
    decoder: Any = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    prefix = next(n for n, m in model.named_modules() if m is decoder)
    blocks = decoder.layers
    for i, block in enumerate(blocks):
        if f"{prefix}.layers.{i}" not in mine:
            blocks[i] = PassThrough(block)
    if not first:
        decoder.embed_tokens = None  # this stage is given the hidden states as inputs_embeds
    if not last:
        decoder.norm = nn.Identity()
        model.lm_head = nn.Identity()  # a middle stage's "logits" are its hidden states
    output = {}

    def forward(x):
        out = model.__class__.forward(model, **({"input_ids": x} if first else {"inputs_embeds": x}),
                                      use_cache=False)
        output["type"] = type(out)
        return out.logits

    model.forward = forward  # what torch's PipelineStage calls: the model's forward, on a tensor in and out
    model.output_type = output  # the last stage's output class, for the loss (set once it has run)
    return model


def tensor_parallel(module: nn.Module, tp_mesh: Any, plan: Mapping[str, str]) -> nn.Module:
    """``module``'s modules that ``plan`` names (patterns of the model's module names, ``*`` an
    index) sharded over ``tp_mesh`` by ``parallelize_module``, each style read as the explorer
    counted it (:func:`pipexplore.models.sharded.style_of`, whose source the script holds too)."""
    from torch.distributed.tensor.parallel import parallelize_module

    chosen = {}
    for name, sub in module.named_modules():
        style = style_of(plan, name)
        if style and STYLES.get(style) and isinstance(sub, (nn.Linear, nn.Embedding)):
            chosen[name] = _torch_style(style)
    return parallelize_module(module, tp_mesh, chosen) if chosen else module


def data_parallel(module: nn.Module, dp_mesh: Any, kind: str, reshard_after_forward: bool) -> Any:
    """``module`` shared by the ``dp_mesh`` replicas as ``kind`` says: ``fsdp`` (``fully_shard``),
    ``ddp`` (``replicate``); ``zero1`` leaves it as it is (its gradients reduced by
    :func:`reduce_gradients`, its optimizer :func:`zero1_optimizer`)."""
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    if kind == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        return replicate(module, mesh=dp_mesh)
    return module


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel parameter's (or gradient's) own shard; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def reduce_gradients(parameters: Sequence[torch.Tensor], dp_group: Any, replicas: int) -> None:
    """Average the gradients of ``parameters`` over the ``replicas`` of ``dp_group`` (ZeRO-1's
    reduction; one flat all-reduce)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [_local(p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=dp_group)
    flat /= replicas
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


class _LocalShards(torch.optim.Optimizer):
    """ZeRO-1 over tensor-parallel parameters: torch's ``ZeroRedundancyOptimizer`` steps plain tensors,
    so it is given each parameter's own shard, and each step their gradients."""

    def __init__(self, parameters: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], zero: Any) -> None:
        self.parameters, self.shards, self.zero = list(parameters), list(shards), zero
        self.param_groups, self.state, self.defaults = zero.param_groups, zero.state, zero.defaults

    def step(self, closure=None):  # type: ignore[override]
        for parameter, shard in zip(self.parameters, self.shards):
            shard.grad = _local(parameter.grad) if parameter.grad is not None else None
        return self.zero.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for parameter in self.parameters:
            parameter.grad = None


def zero1_optimizer(parameters: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, dp_group: Any) -> Any:
    """``optimizer``'s class and settings, its state sharded over ``dp_group`` by torch's
    ``ZeroRedundancyOptimizer`` (each replica steps its share of the parameters and broadcasts them)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    accepted = inspect.signature(type(optimizer)).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    shards = [_local(p).detach() if hasattr(p, "to_local") else p for p in parameters]
    zero = ZeroRedundancyOptimizer(shards, optimizer_class=type(optimizer), process_group=dp_group, **settings)
    if all(s is p for s, p in zip(shards, parameters)):
        return zero
    return _LocalShards(parameters, shards, zero)


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters by the model's names, whole (a sharded one gathered: ``full_tensor``)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for name, p in module.named_parameters()}


#: What the exported script of a mesh holds beside its own functions: these constants, and the source
#: of these functions, in this order, expert parallelism's last (:mod:`pipexplore.export.expert_parts`;
#: :func:`full_state` every script holds).
SCRIPT_CONSTANTS = {"CUT_FAMILIES": CUT_FAMILIES, "STYLES": STYLES, "EXPERT_FAMILIES": expert_parts.EXPERT_FAMILIES}
SCRIPT_FUNCTIONS = (make_mesh, PassThrough, cut_stage, _pattern, style_of, _torch_style, tensor_parallel, data_parallel,
                    _local, reduce_gradients, _LocalShards, zero1_optimizer, *expert_parts.SCRIPT_FUNCTIONS)
