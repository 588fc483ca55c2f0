"""Layer tables for models that do not fit: counted on meta tensors, never run for real.

Build the model under ``torch.device("meta")`` (no weights are allocated, ever) and give a meta
sample; :func:`count_layers` returns one row per layer (an ``nn.Sequential``'s layers, else the
candidate blocks of :func:`pipexplore.models.trace.candidate_modules`, in execution order) with
what each does — FLOPs, kernels, bytes of parameters, outputs and saved activations — and a
per-operator frame (``table.attrs["ops"]``) from which a device model turns counts into seconds::

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.empty(32, 4096, dtype=torch.long, device="meta")
    table = count_layers(model, {"input_ids": ids}, microbatch_rows=4)
    table[["name", "kind", "forward_flops", "saved_bytes"]]

One meta forward of the whole model (:func:`capture`) hooks every candidate to take its inputs
(keyword inputs too: attention masks, position embeddings); on meta a candidate whose kind was
already seen is not run again (its output's shapes are known), and each distinct kind is counted
once (:func:`pipexplore.models.opcount.count_call`), its counts shared by the identical layers.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import pandas as pd
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from pipexplore.samples import tensors_in
from pipexplore.models import experts, sharded
from pipexplore.models.hf import cache_off
from pipexplore.models.inputs import call_inputs, sample_rows
from pipexplore.models.opcount import (OP_COLUMNS, AsOnGPU, Count, OpRecorder, SavedStorageBytes, classify, count_call,
                                       flop_counter, storage_keys, to_meta)
from pipexplore.models.trace.candidates import candidate_modules
from pipexplore.timeline.saved import storage_key, tensor_bytes
from pipexplore.training import LossFn, Training

__all__ = ["count_layers", "capture", "Captured", "Call", "blocks_of", "rows_of", "layout", "COUNT_COLUMNS",
           "RANK_COLUMNS", "EXPERT_COLUMNS"]

COUNT_COLUMNS = ["name", "type", "kind", "params", "param_bytes", "grad_bytes", "output_bytes", "saved_bytes",
                 "forward_flops", "backward_flops", "forward_kernels", "backward_kernels", "uncounted", "stash", "pop",
                 "stash_keys", "pop_keys", "shared", "order"]
_PLAIN = (int, float, str, bool, type(None))
#: Attributes that number a layer rather than shape its work (``layer_idx``): not part of its kind.
_INDEX = re.compile(r"^((layer|block)_?)?(idx|index|id|number)$")


def blocks_of(model: nn.Module, granularity: str = "blocks") -> list[tuple[str, nn.Module]]:
    """The layers of a table: an ``nn.Sequential``'s children, else :func:`candidate_modules`."""
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    return candidate_modules(model, granularity)


def module_signature(module: nn.Module) -> tuple:
    """What makes two modules the same work: types, plain settings (not layer numbers), ``repr``,
    and parameters' and buffers' shapes, dtypes, devices and ``requires_grad``."""
    settings = tuple((type(m).__qualname__, tuple((k, v) for k, v in sorted(vars(m).items())
                                                  if not k.startswith("_") and not _INDEX.match(k)
                                                  and (isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(
                                                      isinstance(x, _PLAIN) for x in v)))))
                     for m in module.modules())
    tensors = tuple((n, tuple(t.shape), t.dtype, str(t.device), t.requires_grad)
                    for n, t in [*module.named_parameters(), *module.named_buffers()])
    return type(module).__qualname__, repr(module), settings, tensors


def input_signature(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """The inputs' structure, tensors' shapes, strides, dtypes, devices and ``requires_grad``, and
    plain values (other objects by type)."""
    leaves, spec = tree_flatten((args, kwargs))
    return str(spec), tuple(
        (tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), t.requires_grad) if isinstance(t, Tensor)
        else t if isinstance(t, _PLAIN) else type(t).__qualname__ for t in leaves)


def rows_of(value: Any, batch: int, rows: int) -> Any:
    """``value`` (a sample or a target) cut to its first ``rows`` rows: tensors whose dim 0 is the
    ``batch``, as fresh tensors (clones; on meta, free)."""
    def cut(t: Tensor) -> Tensor:
        return t[:rows].detach().clone() if t.dim() > 0 and t.size(0) == batch else t

    return tree_map_only(Tensor, cut, value)


@dataclass
class Call:
    """A candidate's first call in the captured forward: its inputs, kind and output bytes."""
    index: int
    args: tuple
    kwargs: dict[str, Any]
    signature: tuple
    output_bytes: int
    calls: int = 1


@dataclass
class Captured:
    """One forward (and the backward of what runs outside the candidates) of a whole model."""
    blocks: list[tuple[str, nn.Module]]
    calls: dict[int, Call]
    order: list[int]
    edges: set[tuple[int, int]]
    outside: list[dict[str, Any]] = field(default_factory=list)  # kernels run outside candidates, by segment
    outside_saved: dict[int, int] = field(default_factory=dict)
    meta_reads: int = 0


def _template(output: Any) -> tuple:
    leaves, spec = tree_flatten(output)
    return spec, [("T", tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad) if isinstance(t, Tensor)
                  else ("V", t) for t in leaves]


def _instantiate(template: tuple) -> Any:
    spec, leaves = template
    return tree_unflatten([torch.empty_strided(d[1], d[2], dtype=d[3], device="meta").requires_grad_(d[4])
                           if d[0] == "T" else d[1] for d in leaves], spec)


def _cut(output: Any) -> Any:
    """The output as fresh leaves (``requires_grad`` kept): the outside's backward stops here."""
    return tree_map_only(Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), output)


def without_kv_cache(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function(model, ...)`` with the model's KV cache off (a Hugging Face config's ``use_cache``:
    training never reads it; see :mod:`pipexplore.models.hf`), put back after."""
    @functools.wraps(function)
    def without(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with cache_off(model):
            return function(model, *args, **kwargs)
    return without


def capture(model: nn.Module, sample: Any, training: Training, *, granularity: str = "blocks",
            backward: bool = True) -> Captured:
    """Run ``model`` on ``sample`` once with every candidate (:func:`blocks_of`) hooked: each
    candidate's first call's inputs (positional and keyword), kind and output bytes, the order of
    the calls, values that skip a candidate, and every operator run outside the candidates (mask
    building, the loss ``training.loss_fn(output, training.target)``; an output with nothing
    floating and no loss given: the forward alone) with the segment it runs in: -1 before the
    first candidate, ``k`` after candidate ``k``. With ``backward``, the backward of that outside
    work too (each candidate's output is cut from its inside: only the outside is differentiated).

    On meta (model and inputs), a candidate whose kind (:func:`module_signature` and
    :func:`input_signature`) already ran is not run again: its output is made from the first's
    shapes. Floating inputs of the sample require grad (as a pipeline stage's input does); a
    meta model's real inputs are taken to meta."""
    blocks = blocks_of(model, granularity)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no child modules to count")
    args, kwargs = call_inputs(sample)
    target = training.target
    weights = [*model.parameters(), *model.buffers()]
    if weights and all(t.is_meta for t in weights):  # a meta model takes real inputs as their shapes
        args, kwargs, target = tree_map_only(Tensor, lambda t: t.to("meta"), (args, kwargs, target))
    args, kwargs = tree_map_only(Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point()), (args, kwargs))
    sample_leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.requires_grad]
    fixed = storage_keys(model)
    cap = Captured(blocks, {}, [], set())
    segment = [-1]
    inside: list[int] = []
    transitions: list[tuple[int, int]] = []  # (autograd sequence number, segment that begins there)
    producer: dict[int, int] = {}
    keep: list[Tensor] = []
    templates: dict[tuple, tuple] = {}
    signatures: dict[int, tuple] = {}
    counter = flop_counter()
    recorder = OpRecorder(counter, "forward", where=lambda: segment[0])
    saved = SavedStorageBytes(fixed, where=lambda: segment[0])
    all_meta = {k: all(t.is_meta for t in [*m.parameters(), *m.buffers()]) for k, (_, m) in enumerate(blocks)}

    def wrapped(k: int, module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def counted_forward(*a: Any, **kw: Any) -> Any:
            if inside:  # a candidate called from inside another: part of that one
                return forward(*a, **kw)
            if k in cap.calls:
                cap.calls[k].calls += 1
            else:
                cap.order.append(k)
            position = {j: p for p, j in enumerate(cap.order)}
            tensors = [t for t in tree_flatten((a, kw))[0] if isinstance(t, Tensor)]
            for t in tensors:
                src = producer.get(id(t))
                if src is not None and position[src] < position[k] - 1:
                    cap.edges.add((src, k))
            if k not in signatures:
                signatures[k] = module_signature(module)
            signature = (signatures[k], input_signature(a, kw))
            reuse = all_meta[k] and all(t.is_meta for t in tensors)
            inside.append(k)
            recorder.active = saved.active = False
            try:
                if reuse and signature in templates:
                    output = _instantiate(templates[signature])
                else:
                    output = _cut(forward(*a, **kw))
                    if reuse:
                        templates[signature] = _template(output)
            finally:
                inside.pop()
                recorder.active = saved.active = True
            if k not in cap.calls:
                cap.calls[k] = Call(k, a, kw, signature, tensor_bytes(output))
            for t in tree_flatten(output)[0]:
                if isinstance(t, Tensor):
                    producer[id(t)] = k
                    keep.append(t)  # alive for the pass: an id is not reused
            segment[0] = k
            transitions.append((torch._C._autograd._get_sequence_nr(), k))
            return output
        return counted_forward

    own = []
    for k, (_, module) in enumerate(blocks):
        own.append((module, module.__dict__.get("forward")))
        module.forward = wrapped(k, module, module.forward)  # type: ignore[method-assign]
    try:
        with counter, recorder:
            with saved.hooks(), torch.enable_grad(), AsOnGPU():
                output = model(*args, **kwargs)
                if training.given_loss or any(t.is_floating_point() for t in tensors_in(output)):
                    loss = training.loss_fn(output, target)
                else:  # nothing floating to differentiate (an integer output): the forward alone
                    loss = None
            params = [p for p in model.parameters() if p.requires_grad]
            wrt = [t for t in keep if t.requires_grad] + sample_leaves + params
            grads: tuple = ()
            if backward and torch.is_tensor(loss) and loss.requires_grad and wrt:
                seqs = [s for s, _ in transitions]

                def backward_segment() -> int:
                    node = torch._C._current_autograd_node()
                    if node is None:
                        return segment[0]
                    at = bisect.bisect_right(seqs, node._sequence_nr())
                    return transitions[at - 1][1] if at else -1

                recorder.phase, recorder.where = "backward", backward_segment
                grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    finally:
        for module, forward in own:
            if forward is None:
                del module.forward
            else:
                module.forward = forward
    n_inputs = len(wrt) - len(params) if grads else 0
    cap.outside = classify(recorder.records, fixed, {storage_key(g) for g in grads[n_inputs:] if g is not None},
                           {storage_key(g) for g in grads[:n_inputs] if g is not None})
    for rec in cap.outside:
        rec.pop("keep", None)
    cap.outside_saved = dict(saved.by)
    cap.meta_reads = recorder.meta_reads
    return cap


def layout(cap: Captured) -> tuple[list[int], dict[int, int], dict[int, tuple[list[str], list[str]]]]:
    """The table's order (blocks in execution order, then those never called), each block's
    position, and its ``stash`` and ``pop`` routes (``v{from}>{to}`` by position, as
    :func:`pipexplore.models.trace.candidates` names values that skip a block)."""
    order = cap.order + [k for k in range(len(cap.blocks)) if k not in cap.calls]
    position = {k: p for p, k in enumerate(order)}
    pairs = sorted((position[s], position[d]) for s, d in cap.edges)
    routes = {k: ([f"v{s}>{d}" for s, d in pairs if s == position[k]], [f"v{s}>{d}" for s, d in pairs
                                                                         if d == position[k]]) for k in order}
    return order, position, routes


def _params(module: nn.Module) -> tuple[int, int, int]:
    params = list(module.parameters())
    return (sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params),
            sum(p.numel() * p.element_size() for p in params if p.requires_grad))


@without_kv_cache
def count_layers(model: nn.Module, sample: Any, *, granularity: str = "blocks", microbatch_rows: Optional[int] = None,
                 loss_fn: Optional[LossFn] = None, target: Any = None, tp: int = 1,
                 tp_plan: Optional[dict[str, str]] = None) -> pd.DataFrame:
    """Count what each layer of ``model`` does on ``sample`` (one mini-batch as the model takes it:
    a tensor, a tuple of positional inputs or a dict of keyword inputs), without running it for
    real: on a model built under ``torch.device("meta")`` with a meta sample nothing is allocated
    (real tensors work too, and are computed on).

    One row per layer, in execution order: an ``nn.Sequential``'s layers, else the candidate
    blocks of :func:`pipexplore.models.trace.candidate_modules` (``granularity``), named by FQN.
    What runs outside the candidates is the neighbouring rows' (as a split at the candidates puts
    it): before the first candidate (masks, position ids) the first row's, after candidate ``k``
    row ``k``'s — the loss, ``loss_fn(output, target)`` (default: the mean square of the floating
    outputs, :func:`pipexplore.training.synthetic_loss`, as every run and profile), the last row's.

    Columns (for the whole batch, in the model's dtypes): ``name``, ``type``, ``kind`` (shared by
    layers that do the same work: same class, settings, parameter and input shapes and dtypes;
    counted once), ``params``, ``param_bytes``, ``grad_bytes`` (parameters that require grad),
    ``output_bytes``, ``saved_bytes`` (what autograd keeps for backward, each storage once,
    parameters left out), ``forward_flops``, ``backward_flops`` (FlopCounterMode's formulas; NaN
    when an operator with matmul-like work has none: ``uncounted`` names them and
    ``table.attrs["notes"]`` says so), ``forward_kernels``, ``backward_kernels`` (per call),
    ``stash``/``pop``/``stash_keys``/``pop_keys`` (values that skip a layer, as
    :func:`pipexplore.models.trace.candidates` names them), ``shared`` (tied parameters), ``order``.
    The backward differentiates every floating input that requires grad (the sample's floating
    inputs do; masks and other values the model computes without grad do not) and every parameter
    that requires grad.

    A mixture of experts (:func:`pipexplore.models.experts.routed_experts`) adds the columns of
    :data:`EXPERT_COLUMNS`: its routed experts' ``expert_params``, ``expert_param_bytes`` and
    ``expert_grad_bytes`` a layer (part of ``params``, ``param_bytes`` and ``grad_bytes``), its
    routers' ``router_params`` and ``router_param_bytes`` (whole on every tensor-parallel rank), and
    ``dispatch_bytes``, what a layer's token dispatch moves for the whole batch (each token's
    ``top_k`` copies of its hidden state, whole: what the expert-parallel all-to-all exchanges);
    ``table.attrs["experts"]`` says how many experts and ``top_k``. With ``tp > 1`` a rank's
    experts compute its ``1/tp`` of the tokens (:func:`pipexplore.models.experts.share_tokens`), and
    ``rank_expert_param_bytes`` is the part of ``rank_param_bytes`` that is routed experts.

    Each kind is counted at ``microbatch_rows`` rows (default: the whole batch); FLOPs and bytes
    are scaled linearly to the batch. ``table.attrs``: ``batch``, ``rows`` (``(microbatch_rows,)``),
    ``source`` (``"counted"``), ``notes``, and ``ops``: one row per kernel, columns ``kind``,
    ``phase`` (``forward``/``backward``), ``op``, ``dtype``, ``flops``, ``fixed_bytes`` (parameter
    reads and parameter-gradient writes: they do not scale with rows), ``row_bytes`` (other bytes
    read and written: they do), ``grad`` (backward kernels: ``input`` when an input's gradient needs
    it, ``weight`` when only parameters' gradients do), ``outside`` (run outside the block, by the model
    around it: a mask, the loss; a timing of the block alone has none of these), counted at ``ops.attrs["rows"]`` rows.
    """
    batch = sample_rows(sample)
    rows = batch if microbatch_rows is None else int(microbatch_rows)
    if not 1 <= rows <= batch:
        raise ValueError(f"microbatch_rows must lie in 1…{batch} (the sample's rows), got {microbatch_rows}")
    training = Training.of(loss_fn, target=rows_of(target, batch, rows))  # (the rows counted)
    cap = capture(model, rows_of(sample, batch, rows), training, granularity=granularity)
    scale = batch / rows
    notes: list[str] = []
    counts: dict[tuple, tuple[str, Count]] = {}
    # a tensor-parallel rank's count of each kind, its parameter bytes and its routed experts' parameter bytes
    ranks: dict[tuple, tuple[Count, int, int]] = {}
    routed = experts.routed_experts(model)
    kernels_of_experts: dict[tuple, Optional[Count]] = {}  # each kind's routed experts' own kernels (a rank's)
    with _rank_counting(model, tp, tp_plan, routed) as rank_count:
        for k in cap.order:
            call = cap.calls[k]
            if call.signature not in counts:
                name, module = cap.blocks[k]
                with experts.inputs_of(module, name, routed) as seen:
                    counts[call.signature] = (f"{type(module).__name__}-{len(counts)}",
                                              count_call(module, call.args, call.kwargs))
                kernels_of_experts[call.signature] = experts.count_experts(seen) if rank_count is None else None
                if rank_count is not None:
                    ranks[call.signature], kernels_of_experts[call.signature] = rank_count(name, module, call)
    order, position, routes = layout(cap)
    never = [cap.blocks[k][0] for k in order if k not in cap.calls]
    if never:
        notes.append(f"never called in forward, counted as nothing: {', '.join(never)}")
    outside: dict[int, list[dict[str, Any]]] = {}
    for rec in cap.outside:
        row = rec["segment"] if rec["segment"] in position else order[0]
        outside.setdefault(row, []).append(rec)
    outside_saved: dict[int, int] = {}
    for seg, size in cap.outside_saved.items():
        row = seg if seg in position else order[0]
        outside_saved[row] = outside_saved.get(row, 0) + size
    owners: dict[int, list[int]] = {}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for k, (_, module) in enumerate(cap.blocks):
        for p in module.parameters():
            owners.setdefault(id(p), []).append(k)
    ops: list[dict[str, Any]] = []
    expert_ops: list[dict[str, Any]] = []
    done: set[str] = set()
    table = []
    for k in order:
        name, module = cap.blocks[k]
        called = cap.calls.get(k)
        base, count = counts[called.signature] if called is not None else (f"{type(module).__name__}-uncalled", Count())
        calls = called.calls if called is not None else 0
        extra = outside.get(k, [])
        kind = base if calls == 1 else f"{base}x{calls}"
        if extra or outside_saved.get(k):
            kind = f"{kind}+outside:{name}"
        rank, rank_bytes, rank_expert_bytes = (ranks.get(called.signature, (count, None, None)) if called is not None
                                               else (count, None, None))
        records = count.records * calls + extra
        if kind not in done:  # the ops frame: a tensor-parallel rank's operators, where counted so
            done.add(kind)
            counted = rank.records * calls + extra
            ops += [{"kind": kind, **{c: r[c] for c in OP_COLUMNS[1:]}, "outside": n >= len(counted) - len(extra)}
                    for n, r in enumerate(counted)]
            own = kernels_of_experts.get(called.signature) if called is not None else None
            if own is not None:
                expert_ops += [{"kind": kind, **{c: r[c] for c in OP_COLUMNS[1:]}, "outside": False}
                               for r in own.records * calls]
        uncounted = sorted({r["op"] for r in records if r["uncounted"]})
        if uncounted:
            notes.append(f"{name} ({type(module).__name__}): no FLOP formula for {', '.join(uncounted)}: its FLOPs "
                         "are unknown (NaN), not zero")
        params, param_bytes, grad_bytes = _params(module)
        expert_params, expert_bytes, expert_grads = experts.expert_parameters(module, name, routed)
        router_params, router_bytes = experts.router_parameters(module, name, routed)
        stash, pop = routes[k]
        shared = sorted({names.get(id(p), "?") for p in module.parameters() if len(set(owners[id(p)])) > 1})
        table.append({
            "name": name, "type": type(module).__name__, "kind": kind, "params": params, "param_bytes": param_bytes,
            "grad_bytes": grad_bytes, "output_bytes": (called.output_bytes if called else 0) * scale,
            "saved_bytes": (count.saved_bytes * calls + outside_saved.get(k, 0)) * scale,
            **{f"{phase}_flops": sum(r["flops"] for r in records if r["phase"] == phase) * scale
               for phase in ("forward", "backward")},
            **{f"{phase}_kernels": sum(1 for r in records if r["phase"] == phase) for phase in ("forward", "backward")},
            "uncounted": ",".join(uncounted), "stash": ",".join(stash), "pop": ",".join(pop),
            "stash_keys": ",".join(stash), "pop_keys": ",".join(pop), "shared": ",".join(shared),
            "order": position[k],
            **({"rank_forward_flops": (rank.flops("forward") * calls + sum(r["flops"] for r in extra
                                                                            if r["phase"] == "forward")) * scale,
                "rank_backward_flops": (rank.flops("backward") * calls + sum(r["flops"] for r in extra
                                                                              if r["phase"] == "backward")) * scale,
                "rank_param_bytes": rank_bytes if rank_bytes is not None else param_bytes} if ranks else {}),
            **({"expert_params": expert_params, "expert_param_bytes": expert_bytes, "expert_grad_bytes": expert_grads,
                "router_params": router_params, "router_param_bytes": router_bytes,
                "dispatch_bytes": (experts.dispatch_bytes(called.args, called.kwargs, routed.top_k) * scale
                                   if expert_params and called is not None else 0.0)} if routed else {}),
            **({"rank_expert_param_bytes": rank_expert_bytes if rank_expert_bytes is not None else expert_bytes}
               if routed and ranks else {})})
    reads = cap.meta_reads + sum(c.meta_reads for _, c in counts.values())
    if reads:
        notes.append(f"{reads} value(s) read from meta tensors (a Python branch on a tensor, .item()) were taken as "
                     "True/1: data-dependent paths may differ from a real run")
    frame = pd.DataFrame(ops, columns=[*OP_COLUMNS, "outside"]).astype({"outside": bool})
    frame.attrs["rows"] = rows
    # every kind counted, those that ran no operator too (a dropout of p = 0 is the identity): no rows, no cost
    frame.attrs["kinds"] = list(dict.fromkeys(row["kind"] for row in table))
    out = pd.DataFrame(table, columns=COUNT_COLUMNS + (RANK_COLUMNS if ranks else [])
                       + (EXPERT_COLUMNS if routed else []) + (["rank_expert_param_bytes"] if routed and ranks else []))
    out.attrs.update(batch=batch, rows=(rows,), source="counted", ops=frame, notes=notes, granularity=granularity,
                     tp=tp)
    if routed is not None:
        out.attrs["experts"] = routed.as_attrs()
        kernels = pd.DataFrame(expert_ops, columns=[*OP_COLUMNS, "outside"]).astype({"outside": bool})
        kernels.attrs["rows"] = rows
        out.attrs["expert_ops"] = kernels  # the routed experts' own kernels, by their layer's kind (a rank's)
    return out


#: The columns a count of a mixture of experts adds (:func:`count_layers`).
EXPERT_COLUMNS = ["expert_params", "expert_param_bytes", "expert_grad_bytes", "router_params", "router_param_bytes",
                  "dispatch_bytes"]



#: The columns a count for a tensor-parallel rank adds (:func:`count_layers` with ``tp > 1``).
RANK_COLUMNS = ["rank_forward_flops", "rank_backward_flops", "rank_param_bytes"]


@contextlib.contextmanager
def _rank_counting(model: nn.Module, tp: int, tp_plan: Optional[dict[str, str]],
                   routed: Optional[experts.RoutedExperts] = None) -> Iterator[Any]:
    """For ``tp > 1``: a function counting one kind as a tensor-parallel rank computes it (its
    count, its parameter bytes a rank, the part of them that is ``routed`` experts; the experts at
    the rank's share of the tokens), over a fake group of ``tp`` ranks held while counting; None
    for ``tp == 1``. The plan is checked first (:func:`pipexplore.models.sharded.check_plan`)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp is a whole number of ranks from 1, got {tp!r}")
    if tp == 1:
        yield None
        return
    plan = sharded.tensor_parallel_plan(model, tp_plan)
    sharded.check_plan(model, plan, tp)
    with sharded.fake_group(tp) as mesh:
        def counted(rank_module: nn.Module, name: str, args: Any,
                    kwargs: Any) -> tuple[tuple[Count, int, int], Optional[Count]]:
            experts.share_tokens(rank_module, name, routed, tp)
            in_experts = [m for sub, m in rank_module.named_modules()
                          if routed is not None and (f"{name}.{sub}" if sub else name) in routed.modules]
            with experts.inputs_of(rank_module, name, routed) as seen:
                count = count_call(rank_module, args, kwargs)
            held = sum(sharded.rank_param_bytes(m) for m in in_experts)
            return (count, sharded.rank_param_bytes(rank_module), held), experts.count_experts(seen)

        def rank_count(name: str, module: nn.Module, call: Call) -> tuple[tuple[Count, int, int], Optional[Count]]:
            args, kwargs = to_meta((call.args, call.kwargs))
            try:
                return counted(sharded.shard(module, name, plan, mesh), name, args, kwargs)
            except (RuntimeError, TypeError, ValueError):  # a replicated input did not suit it: each projection's own
                pass
            try:
                return counted(sharded.shard(module, name, plan, mesh, gather_once=False), name, args, kwargs)
            except (RuntimeError, TypeError, ValueError) as error:
                raise ValueError(
                    f"{name} ({type(module).__name__}) does not run sharded by the tensor-parallel plan at tp={tp}: "
                    f"{str(error).splitlines()[0][:160]}. Its code does not run on a rank's shard (a rank's copy has its "
                    "head counts divided, so a shape read from elsewhere, or an in-place update of a sharded "
                    "output, say); models whose code runs on a rank's shard carry a base_model_tp_plan in their "
                    "config, or plan tp=1") from None

        yield rank_count
