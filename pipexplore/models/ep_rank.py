"""An experts' module as one expert-parallel rank runs it, its all-to-alls counted by torch on a fake process group."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipexplore import validate
from pipexplore.models.opcount import Count, count_call, meta_copy, on_meta

__all__ = ["Exchange", "ExpertParallel", "fake_meshes", "exchanges", "expert_splits", "count_exchange", "rows_as",
           "Rows", "GROUPED_GEMMS", "EXCHANGE_STEPS"]

#: The operators that are a rank's grouped GEMMs of its local experts (Hugging Face's grouped-GEMM
#: experts run ``torch._grouped_mm``; an eager loop runs one ``mm`` an expert).
GROUPED_GEMMS = ("aten._grouped_mm",)
#: What each all-to-all of a layer is, in the order a rank runs them: forward the split counts
#: (Megatron-Core's ``tokens_per_expert`` exchange), the tokens to their experts and back; backward
#: the gradients of the combine, then of the dispatch.
EXCHANGE_STEPS = {"forward": ("counts", "dispatch", "combine"), "backward": ("combine", "dispatch")}


@dataclass(frozen=True)
class Exchange:
    """One all-to-all a rank runs: its ``phase`` and ``step`` (:data:`EXCHANGE_STEPS`), the
    ``group`` it runs over (``"ep"``) of ``ranks`` ranks, the bytes of its whole input
    (``tensor_bytes``), the bytes that leave this rank for the others (``sent_bytes``) and that
    arrive from them (``received_bytes``): what crosses the links, its own split kept."""

    phase: str
    step: str
    group: str
    ranks: int
    tensor_bytes: int
    sent_bytes: int
    received_bytes: int
    dtype: str = ""

    @property
    def bytes(self) -> int:
        """What the rank's links carry one way at most: the larger of what it sends and receives."""
        return max(self.sent_bytes, self.received_bytes)


class Rows(torch.autograd.Function):
    """``rows`` rows in the shape of ``x`` (no kernel: the rows are another rank's or come back by
    the collectives costed with the mesh), and the gradient in the shape of ``x`` back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.shape = tuple(x.shape)
        return x.new_empty((rows, *x.shape[1:]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad.new_empty(ctx.shape), None


def rows_as(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` rows in the shape of ``x`` (:class:`Rows` where it carries a gradient)."""
    if x.requires_grad and x.is_floating_point():
        return Rows.apply(x, rows)
    return x.new_empty((rows, *x.shape[1:]))


def expert_splits(rows: int, ranks: int, capacity_factor: float = 1.0) -> tuple[list[int], list[int]]:
    """The dispatch's split sizes for a rank sending ``rows`` routed tokens (its tokens × top_k)
    over ``ranks`` ranks: what it sends each rank (its own first: an even share of ``rows``), and
    what it receives from each, an even share of ``capacity_factor`` × ``rows`` (1: balanced routing,
    as NVIDIA's benchmarks force it; above 1, the busiest rank, which receives that many times its
    balanced share).

    Raises:
        ValueError: a ``capacity_factor`` below 1 or above ``ranks`` (a rank receives at most every
            rank's tokens).
        TypeError: a ``capacity_factor`` that is not a number (:func:`pipexplore.validate.capacity_factor`).
    """
    capacity_factor = validate.capacity_factor(capacity_factor, ep=ranks)

    def even(total: int) -> list[int]:
        return [total // ranks + (1 if r < total % ranks else 0) for r in range(ranks)]

    return even(rows), even(int(round(float(capacity_factor) * rows)))


@contextlib.contextmanager
def fake_meshes(tp: int = 1, ep: int = 1) -> Iterator[tuple[Any, Any]]:
    """A ``tp`` mesh and an ``ep`` mesh over one fake process group (torch's ``fake`` backend, as
    :func:`pipexplore.models.sharded.fake_process_group`) of ``lcm(tp, ep)`` ranks, this process its rank 0:
    ranks numbered as :class:`~pipexplore.devices.mesh.Mesh` numbers them (``tp`` groups and ``ep``
    groups both of neighbouring ranks, the experts folded over the attention's GPUs); each None at 1.
    The group is destroyed on leaving.

    Raises:
        RuntimeError: a process group is already initialised in this process.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from pipexplore.models.sharded import fake_process_group

    for name, value in (("tp", tp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} is a whole number of ranks from 1, got {value!r}")
    world = math.lcm(tp, ep, 2)
    with fake_process_group(world, "an expert-parallel rank"):
        meshes = [init_device_mesh("cpu", (world // n, n), mesh_dim_names=("rest", name))[name] if n > 1 else None
                  for name, n in (("tp", tp), ("ep", ep))]
        yield meshes[0], meshes[1]


class _Exchanges(TorchDispatchMode):
    """Logs each ``all_to_all_single`` dispatched under it as an :class:`Exchange` (its phase from
    autograd: backward while a node runs), over a group ``names`` names (group name: label)."""

    def __init__(self, names: Mapping[str, str]) -> None:
        super().__init__()
        self.names = dict(names)
        self.log: list[Exchange] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if str(func.overloadpacket) == "_c10d_functional.all_to_all_single":
            import torch.distributed as dist
            from torch.distributed.distributed_c10d import _resolve_process_group

            tensor, output_splits, input_splits, group_name = args[:4]
            ranks = dist.get_world_size(_resolve_process_group(group_name))
            per_row = tensor[0].numel() * tensor.element_size() if tensor.dim() and tensor.shape[0] else 0
            given = list(input_splits) if input_splits else [tensor.shape[0] // ranks] * ranks
            taken = list(output_splits) if output_splits else [tensor.shape[0] // ranks] * ranks
            phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
            steps = EXCHANGE_STEPS[phase]
            done = sum(1 for e in self.log if e.phase == phase and e.group == self.names.get(group_name, group_name))
            self.log.append(Exchange(phase, steps[done % len(steps)], self.names.get(group_name, group_name), ranks,
                                     tensor.numel() * tensor.element_size(), (sum(given) - given[0]) * per_row,
                                     (sum(taken) - taken[0]) * per_row, str(tensor.dtype).replace("torch.", "")))
        return func(*args, **kwargs)


def exchanges(names: Mapping[str, str]) -> _Exchanges:
    """A dispatch mode logging the all-to-alls run under it (``.log``: :class:`Exchange` each), the
    groups named by ``names`` (a process group's name: the label, ``"ep"``)."""
    return _Exchanges(names)


def _stacked_names(module: nn.Module, count: int) -> list[str]:
    return [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == count]


class ExpertParallel(nn.Module):
    """A routed experts' module (Hugging Face's, called ``experts(hidden, top_k_index, top_k_weights)``,
    its parameters stacked one slice an expert) as one rank of ``mesh`` (the ``ep`` group) runs it,
    torchtitan's ``ExpertParallel`` with Megatron-Core's all-to-all dispatcher: its stacked weights
    are ``DTensor`` parameters sharded ``Shard(0)`` over the group (the rank's ``count / ep``
    experts); a call permutes its tokens' ``top_k`` routed copies by expert, exchanges the split
    counts (``all_to_all_single`` of the tokens a rank sends each expert), then the tokens (an
    ``all_to_all_single`` at the split sizes :func:`expert_splits` gives: balanced, or the busiest
    rank's at ``capacity_factor``), runs the local experts' grouped GEMMs on the tokens received, sends
    them back by the reverse all-to-all and sums each token's copies weighted by its router's
    scores. ``tp_share``: the rank holds ``1/tp_share`` of the tokens (sequence parallelism)."""

    def __init__(self, module: nn.Module, mesh: Any, *, count: int, tp_share: int = 1,
                 capacity_factor: float = 1.0) -> None:
        from torch.distributed.tensor import DTensor, Shard

        super().__init__()
        ep = mesh.size()
        if count % ep:
            raise ValueError(f"ep {ep} does not divide the {count} routed experts: each expert-parallel rank holds "
                             f"whole experts; ep can be {', '.join(str(d) for d in range(1, count + 1) if count % d == 0)}")
        expert_splits(1, ep, capacity_factor)  # (refused here, not at the first call)
        local = meta_copy(module)
        local._forward_pre_hooks.clear()
        local._forward_hooks.clear()
        names = _stacked_names(local, count)
        if not names:
            raise ValueError(f"{type(module).__name__} holds no parameters stacked one slice an expert "
                             f"(first dimension {count}): expert parallelism shards such stacks")
        for name in names:
            whole = local.get_parameter(name)
            shard = torch.empty((count // ep, *whole.shape[1:]), dtype=whole.dtype, device="meta")
            setattr(local, name, nn.Parameter(DTensor.from_local(shard, mesh, [Shard(0)], run_check=False),
                                              requires_grad=whole.requires_grad))
        for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
            if isinstance(getattr(local, attr, None), int):
                setattr(local, attr, count // ep)
        self.experts = local
        self.mesh, self.count, self.tp_share, self.capacity_factor = mesh, count, int(tp_share), float(capacity_factor)
        self.routed_rows = 0

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *rest: Any, **kwargs: Any) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        tokens = hidden_states.shape[0]
        if self.tp_share > 1:  # the rank's 1/tp of the tokens (the experts' modules of a tensor-parallel rank)
            share = max(1, math.ceil(tokens / self.tp_share))
            hidden_states, top_k_index, top_k_weights = (rows_as(t, share)
                                                         for t in (hidden_states, top_k_index, top_k_weights))
        group = self.mesh.get_group()
        ep = self.mesh.size()
        own, top_k = hidden_states.shape[0], top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the routed copies sorted by expert (Megatron-Core's permute)
        source = torch.div(order, top_k, rounding_mode="floor")
        routed = hidden_states.index_select(0, source)
        scores = top_k_weights.reshape(-1).index_select(0, order)
        per_expert = torch.histc(flat.float(), bins=self.count, min=0, max=self.count - 1).long()
        funcol.all_to_all_single(per_expert, None, None, group)  # (the split counts a rank reads before its tokens)
        send, receive = expert_splits(own * top_k, ep, self.capacity_factor)
        received = funcol.all_to_all_single_autograd(routed, receive, send, group)
        rows = received.shape[0]
        self.routed_rows = rows
        local_index = torch.zeros(rows, 1, dtype=top_k_index.dtype, device=received.device)
        ones = torch.ones(rows, 1, dtype=top_k_weights.dtype, device=received.device)
        held = {name: p.to_local() for name, p in self.experts.named_parameters(recurse=False)
                if hasattr(p, "to_local")}
        computed = torch.func.functional_call(self.experts, held, (received, local_index, ones))
        back = funcol.all_to_all_single_autograd(computed, send, receive, group)
        weighted = back * scores.unsqueeze(-1).to(back.dtype)
        out = torch.zeros_like(hidden_states).index_add(0, source, weighted.to(hidden_states.dtype))
        return rows_as(out, tokens) if out.shape[0] != tokens else out


def count_exchange(module: nn.Module, args: tuple, kwargs: dict, *, ranks: int = 2) -> Optional[Count]:
    """The all-to-alls of an experts' ``module`` called with ``args`` and ``kwargs`` (the tokens a
    rank's experts compute: its share) as one of ``ranks`` expert-parallel ranks runs them, counted
    by torch (:class:`ExpertParallel`, balanced): their records, one a collective, as
    :func:`pipexplore.models.opcount.count_call` gives them (``collective`` ``all_to_all``, their
    whole input's bytes). Under a process group already initialised (a tensor-parallel rank's
    count) its first ``ranks`` ranks are the group, else a fake group of its own is opened. Under
    balanced routing the tensors exchanged do not depend on ``ranks`` (a rank sends its routed
    tokens and receives as many); the links they cross are the mesh's. None where the module is
    not a stacked experts' module."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    own = list(module.parameters(recurse=False))
    if not own or own[0].dim() < 2:
        return None
    count = int(own[0].shape[0])
    if count % ranks:
        return None

    def run(mesh: Any) -> Count:
        counted = count_call(ExpertParallel(module, mesh, count=count), *on_meta((args, kwargs)))
        return Count([r for r in counted.records if r["collective"] == "all_to_all"])

    if dist.is_initialized():
        world = dist.get_world_size()
        if dist.get_backend() != "fake" or world % ranks:  # (a real group's ranks are not ours to group)
            return None
        return run(init_device_mesh("cpu", (world // ranks, ranks), mesh_dim_names=("rest", "ep"))["ep"])
    with fake_meshes(1, ranks) as (_, mesh):
        return run(mesh)


