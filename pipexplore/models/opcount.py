"""Counting what one call of a module does, operator by operator, without running it for real.

On meta tensors a call costs no memory and little time, yet every aten operator is dispatched
with its shapes: :class:`OpRecorder` (a ``TorchDispatchMode``) records each one — its FLOPs as
``torch.utils.flop_counter.FlopCounterMode`` counts them, the bytes it reads and writes, whether it
launches a kernel — and :class:`SavedStorageBytes` counts what autograd keeps for backward, each
storage once. :func:`count_call` runs one module's forward and backward so and returns a :class:`Count`::

    count = count_call(block, (hidden,), {"attention_mask": mask}, fixed=storage_keys(block))
    count.flops("forward"), count.saved_bytes, count.frame("forward")

Why one module: recording an operator (its FLOPs, the storages it reads and writes, a GEMM's
shape, a collective's tensor), classifying the records (which bytes are the parameters', which
dimension grows with the rows, which gradient each serves) and the call that drives both are one
pass over a call's operators; each piece reads what the one before it wrote.
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode, sdpa_backward_flop, sdpa_flop

from pipexplore.timeline.saved import storage_key, tensor_bytes

__all__ = ["AsOnGPU", "OpRecorder", "SavedStorageBytes", "Count", "count_call", "storage_keys", "fresh_inputs",
           "flop_counter", "classify", "is_uncounted", "EXTRA_FORMULAS",
           "OP_COLUMNS", "GEMM_OPERANDS", "gemm_shape", "grouped_gemm_shape", "to_meta", "meta_copy"]

aten = torch.ops.aten
OP_COLUMNS = ["kind", "phase", "op", "dtype", "flops", "fixed_bytes", "row_bytes", "grad", "collective",
              "gemm_batch", "gemm_m", "gemm_n", "gemm_k", "gemm_rows"]
#: The operators that are GEMMs (``C[M, N] = A[M, K] · B[K, N]``, ``batch`` of them where batched),
#: with the positions of ``A`` and ``B`` among their arguments: their shapes are recorded
#: (:mod:`pipexplore.predict.kernels` costs a GEMM by its tiles and waves).
GEMM_OPERANDS = {"aten.mm": (0, 1), "aten.addmm": (1, 2), "aten.bmm": (0, 1), "aten.baddbmm": (1, 2),
                 "aten._scaled_mm": (0, 1)}

#: Operators that ask about a tensor rather than compute: never a kernel, not recorded.
_METADATA = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default,
             aten.is_contiguous.default, aten.is_contiguous.memory_format, aten.dim.default, aten.size.default,
             aten.stride.default, aten.numel.default, aten.storage_offset.default, torch.ops.prim.device.default,
             torch.ops.prim.layout.default, aten.is_strides_like_format.default,
             aten.is_non_overlapping_and_dense.default, aten.sym_is_contiguous.default}
#: Operators that allocate or relabel memory without a kernel of their own.
_NO_KERNEL = {"_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd",
              "aten.empty", "aten.empty_strided", "aten.empty_like", "aten.new_empty", "aten.new_empty_strided",
              "aten.empty_permuted", "aten.detach", "aten.lift_fresh", "aten._unsafe_view", "aten._reshape_alias",
              "aten.alias", "aten.set_", "aten.resize_", "aten._local_scalar_dense"}
#: Names of operators that do matmul-like work: without a FLOP formula their cost is unknown, not 0.
_HEAVY = re.compile(r"mm|mv|matmul|conv|attention|einsum|linear|dot|bilinear|lstm|gru|rnn|fft|linalg|cholesky|"
                    r"solve|cdist|gemm|_scaled_|tensordot")
_LIGHT = re.compile(r"upsample|interp|grid_sampler|_conv_indices|convert|norm")


def _raw(formula: Any) -> Any:
    def counted(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return formula(*args, out_val=out_val, **kwargs)

    counted._get_raw = True  # type: ignore[attr-defined]
    return counted


def _grouped_mm_flop(a: Tensor, b: Tensor, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """A grouped GEMM (a mixture of experts' experts at once): every row of ``a`` times its group's
    matrix, 2·rows·k·n; two 2-D operands split along k (the weights' gradient) sum over the groups once."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


def _causal(formula: Any, at: int, query: int = 0) -> Any:
    """``formula`` (torch's attention FLOPs, every query against every key) halved where the call
    is causal (its ``is_causal``: argument ``at``, or by keyword) over as many queries (argument
    ``query``) as keys (the one after it): a causal kernel (FlashAttention's, the memory-efficient one) skips the
    blocks above the diagonal, half of them (FlashAttention-2's count of causal attention)."""
    def counted(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        flops = formula(*args, out_val=out_val, **kwargs)
        causal = kwargs.get("is_causal", args[at] if len(args) > at else False)
        q, k = args[query], args[query + 1]
        square = hasattr(q, "shape") and hasattr(k, "shape") and q.shape[-2] == k.shape[-2]
        return flops // 2 if causal and square else flops

    counted._get_raw = True  # type: ignore[attr-defined]
    return counted


#: FLOP formulas FlopCounterMode lacks or counts otherwise: PyTorch's CPU flash attention, counted as
#: its CUDA kin; causal attention as its kernels compute it (half the square, :func:`_causal`); the
#: grouped GEMM of mixture-of-experts layers.
EXTRA_FORMULAS = {aten._scaled_dot_product_flash_attention_for_cpu: _causal(sdpa_flop, 4),
                  aten._scaled_dot_product_flash_attention_for_cpu_backward: _causal(sdpa_backward_flop, 7, 1),
                  aten._scaled_dot_product_efficient_attention: _causal(sdpa_flop, 6),
                  aten._scaled_dot_product_efficient_attention_backward: _causal(sdpa_backward_flop, 11, 1),
                  aten._scaled_dot_product_flash_attention: _causal(sdpa_flop, 4),
                  aten._scaled_dot_product_flash_attention_backward: _causal(sdpa_backward_flop, 11, 1),
                  **({aten._grouped_mm: _raw(_grouped_mm_flop)} if hasattr(aten, "_grouped_mm") else {})}


def is_distributed(types: Any) -> bool:
    """Whether an operator is dispatched on a distributed tensor (``DTensor``): left to its own
    dispatch, whose operators on each rank's local shard are the ones counted (a tensor-parallel
    rank's work, not the whole tensor's)."""
    return any(getattr(t, "__module__", "").startswith("torch.distributed.tensor") for t in types)


def is_shape_propagation(types: Any) -> bool:
    """Whether an operator runs on fake tensors: ``DTensor``'s sharding propagation runs the whole
    operator so, for its output's shape only (no rank's work: run, not counted)."""
    return any(getattr(t, "__module__", "") == "torch._subclasses.fake_tensor" for t in types)


#: The collectives torch's functional collectives run (``torch.distributed.tensor`` and FSDP2 call
#: them), by the name :mod:`pipexplore.predict.collectives` costs them under, with the argument whose
#: bytes are the collective's whole tensor: the gathered output of an all-gather, the scattered input
#: of a reduce-scatter, the tensor of an all-reduce.
COLLECTIVES = {"_c10d_functional.all_reduce": ("all_reduce", "input"),
               "_c10d_functional.all_reduce_coalesced": ("all_reduce", "input"),
               "_c10d_functional.all_gather_into_tensor": ("all_gather", "output"),
               "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", "output"),
               "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", "input"),
               "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", "input"),
               "_c10d_functional.all_to_all_single": ("all_to_all", "input")}


class _LocalFlops(_FlopCounterMode):
    """FlopCounterMode's dispatch mode, counting a distributed tensor's operators on its local
    shard only (each rank's FLOPs), as :class:`OpRecorder` records them."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if is_distributed(types):
            return NotImplemented
        if is_shape_propagation(types):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _RankFlopCounter(FlopCounterMode):
    def __enter__(self) -> "_RankFlopCounter":
        self.flop_counts.clear()
        self.mod_tracker.__enter__()
        self.mode = _LocalFlops(self)
        self.mode.__enter__()
        return self


class _Global:
    """FlopCounterMode's module tracker, left out: we attribute operators to modules ourselves, and its
    backward hooks refuse ``torch.autograd.grad`` (\"A leaf node was passed to _will_engine_execute_node\")."""
    parents = ("Global",)

    def __enter__(self) -> "_Global":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` with :data:`EXTRA_FORMULAS`, counting globally (no module tracker), a
    distributed tensor's operators on its local shard (:func:`is_distributed`)."""
    counter = _RankFlopCounter(display=False, custom_mapping=EXTRA_FORMULAS)
    counter.mod_tracker = _Global()  # type: ignore[assignment]
    return counter


def storage_keys(module: nn.Module) -> set[int]:
    """The storages of ``module``'s parameters and buffers (a distributed tensor's local shard too:
    a tensor-parallel rank's operators read that)."""
    keys = set()
    for t in [*module.parameters(), *module.buffers()]:
        keys.add(storage_key(t))
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, Tensor):
            keys.add(storage_key(local))
    return keys


def _extent(t: Tensor) -> int:
    """Bytes a kernel touches reading ``t``: broadcast (stride-0) dims once."""
    if t.numel() == 0:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def is_uncounted(func: Any) -> bool:
    """Whether ``func`` does matmul-like work that no FLOP formula covers (an unknown cost, not 0)."""
    if func.namespace not in ("aten", "prims", "prim"):
        return True
    name = func._opname
    return bool(_HEAVY.search(name)) and not _LIGHT.search(name)


#: Operators whose meta kernel takes bfloat16 only (torch's grouped GEMM, which Hugging Face's
#: mixture-of-experts layers run their experts with): a float32 model is counted as if in bfloat16,
#: then given its own dtype back (the FLOPs and the shapes do not depend on it).
_BF16_ONLY_ON_META = {aten._grouped_mm.default} if hasattr(aten, "_grouped_mm") else set()


def _meta_call(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)``; an operator of :data:`_BF16_ONLY_ON_META` on meta tensors of
    another floating dtype runs in bfloat16 and its output takes their dtype."""
    if func not in _BF16_ONLY_ON_META:  # (every operator passes here: the lookup first, the flattening after)
        return func(*args, **kwargs)
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
    if not tensors or tensors[0].device.type != "meta" or tensors[0].dtype == torch.bfloat16 \
            or not tensors[0].is_floating_point():
        return func(*args, **kwargs)
    dtype = tensors[0].dtype
    as_bf16 = tree_map(lambda v: v.to(torch.bfloat16) if isinstance(v, Tensor) and v.is_floating_point() else v,
                       (args, kwargs))
    out = func(*as_bf16[0], **as_bf16[1])
    return tree_map(lambda v: torch.empty_like(v, dtype=dtype) if isinstance(v, Tensor) else v, out)


def gemm_shape(op: str, args: Any, out: Any = None) -> Optional[tuple]:
    """A GEMM's ``(batch, M, N, K)`` and the storage keys of ``A`` and ``B`` from its arguments
    (:data:`GEMM_OPERANDS`); None for another operator or operands of unexpected ranks. A grouped
    GEMM (``out``: its output) is its groups' GEMMs (:func:`grouped_gemm_shape`)."""
    if op == "aten._grouped_mm":
        return grouped_gemm_shape(args, out)
    where = GEMM_OPERANDS.get(op)
    if where is None or len(args) <= max(where):
        return None
    a, b = args[where[0]], args[where[1]]
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.dim() != b.dim() or a.dim() not in (2, 3):
        return None
    batch = int(a.shape[0]) if a.dim() == 3 else 1
    return batch, int(a.shape[-2]), int(b.shape[-1]), int(a.shape[-1]), storage_key(a), storage_key(b)


def grouped_gemm_shape(args: Any, out: Any) -> Optional[tuple]:
    """A grouped GEMM (``torch._grouped_mm``: a mixture of experts' experts at once) as the batch
    of its groups' GEMMs, each group's rows an even share of the tokens (balanced routing):
    ``(groups, M, N, K, key of A, key of B, the dimension that grows with the rows)``. The
    experts' forward and input gradient (``A`` the tokens ``[T, K]``, ``B`` the groups' weights
    ``[G, K, N]``) are ``G`` GEMMs of ``T/G × N × K``, growing in ``m``; the weights' gradient
    (``A`` ``[K, T]``, ``B`` ``[T, N]``, the output ``[G, K, N]``) ``G`` GEMMs of ``K × N × T/G``,
    growing in ``k``; two 3-D operands are a batched GEMM. None for other ranks."""
    if len(args) < 2 or not all(isinstance(t, Tensor) for t in args[:2]):
        return None
    a, b = args[0], args[1]
    keys = (storage_key(a), storage_key(b))
    if a.dim() == 2 and b.dim() == 3 and b.shape[0]:
        groups = int(b.shape[0])
        return groups, a.shape[0] / groups, int(b.shape[-1]), int(a.shape[-1]), *keys, "m"
    if a.dim() == 2 and b.dim() == 2 and isinstance(out, Tensor) and out.dim() == 3 and out.shape[0]:
        groups = int(out.shape[0])
        return groups, int(a.shape[0]), int(b.shape[-1]), a.shape[-1] / groups, *keys, "k"
    if a.dim() == 3 and b.dim() == 3:
        return int(a.shape[0]), int(a.shape[1]), int(b.shape[-1]), int(a.shape[-1]), *keys, "batch"
    return None


class OpRecorder(TorchDispatchMode):
    """Records each operator dispatched under it: ``phase``, ``op``, ``dtype``, ``flops`` (the
    delta of ``counter``, a ``FlopCounterMode`` entered before it; NaN for an uncounted matmul-like
    operator), the storages read and written with their bytes, and ``segment`` (what
    ``where()`` says, for attributing calls). While ``active`` is false operators pass unrecorded.

    A scalar read from a meta tensor (``.item()``, a Python ``if`` on a tensor) cannot be known:
    it is answered ``True`` (or 1) and counted in ``meta_reads``.
    """

    def __init__(self, counter: Optional[FlopCounterMode], phase: str = "forward", where: Any = None) -> None:
        super().__init__()
        self.counter, self.phase, self.where = counter, phase, where
        self.records: list[dict[str, Any]] = []
        self.active = True
        self.meta_reads = 0

    def _flops(self) -> int:
        return sum(self.counter.flop_counts["Global"].values()) if self.counter is not None else 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if is_distributed(types):
            return NotImplemented  # counted as its local operators
        if is_shape_propagation(types):
            return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default and args[0].device.type == "meta":
            self.meta_reads += 1
            return True if args[0].dtype == torch.bool else (1.0 if args[0].is_floating_point() else 1)
        if not self.active or func in _METADATA:
            return _meta_call(func, args, kwargs)
        before = self._flops()
        out = _meta_call(func, args, kwargs)
        op = str(func.overloadpacket)
        returns = func._schema.returns
        view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        kernel = not view and op not in _NO_KERNEL and bool(outs or any(r.alias_info for r in returns))
        flops = float(self._flops() - before)
        collective = COLLECTIVES.get(op)
        registry = self.counter.flop_registry if self.counter else {}
        uncounted = (collective is None and kernel and flops == 0 and func.overloadpacket not in registry
                     and is_uncounted(func))
        seen: set[int] = set()
        reads = []
        for t in ins:
            if id(t) not in seen:
                seen.add(id(t))
                reads.append((storage_key(t), _extent(t)))
        typed = ins or outs
        if collective is not None and kernel:  # its whole tensor's bytes, costed over its group's links
            whole = (ins if collective[1] == "input" else outs)[:1]
            reads, kernel = [(storage_key(t), t.numel() * t.element_size()) for t in whole], True
            outs = []
        self.records.append({
            "phase": self.phase, "op": op, "dtype": str(typed[0].dtype).replace("torch.", "") if typed else "",
            "flops": math.nan if uncounted else flops, "uncounted": uncounted, "kernel": kernel,
            "reads": reads if kernel else [], "writes": [(storage_key(t), _extent(t)) for t in outs] if kernel else [],
            "segment": self.where() if self.where is not None else None, "keep": outs,
            "collective": collective[0] if collective is not None else "",
            "gemm": gemm_shape(op, args, out) if kernel else None,
        })
        return out


class SavedStorageBytes:
    """Bytes autograd saves for backward while :meth:`hooks` is active: each storage once, whole
    (a saved view keeps its storage alive; :class:`pipexplore.timeline.saved.SavedBytes` counts a
    view for its own elements, as runs here measure), leaving out the storages in ``fixed`` (parameters and
    buffers). ``where()``, if given, says whose the saved bytes are: ``by`` sums them per answer."""

    def __init__(self, fixed: set[int], where: Any = None) -> None:
        self.fixed, self.where = fixed, where
        self.total = 0
        self.by: dict[Any, int] = {}
        self.seen: set[int] = set()
        self.active = True

    def pack(self, t: Tensor) -> Tensor:
        if not self.active or isinstance(t, nn.Parameter):
            return t
        key = storage_key(t)
        if key in self.fixed or key in self.seen:
            return t
        self.seen.add(key)
        size = t.untyped_storage().nbytes() if key != id(t) else t.numel() * t.element_size()
        self.total += size
        if self.where is not None:
            owner = self.where()
            self.by[owner] = self.by.get(owner, 0) + size
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def gemm_rows(batch: int, a_fixed: bool, b_fixed: bool) -> str:
    """Which dimension of a GEMM grows with the rows of the micro-batch (its FLOPs grow with them,
    so one does): ``A`` a parameter, ``N`` (the rows are ``B``'s); ``B`` a parameter, ``M`` (a
    linear layer's forward and input gradient; ``batch`` for a batched one); both computed from the
    rows, ``K`` (a weight's gradient: the rows are summed over) or ``batch`` where batched
    (attention's scores and context, a batch of rows × heads); both parameters, none."""
    if a_fixed and b_fixed:
        return ""
    if a_fixed:
        return "n"
    if b_fixed:
        return "batch" if batch > 1 else "m"
    return "batch" if batch > 1 else "k"


def classify(records: list[dict[str, Any]], fixed: set[int], weight_grads: Iterable[int] = (),
             input_grads: Iterable[int] = ()) -> list[dict[str, Any]]:
    """Each kernel's ``fixed_bytes`` (reads of ``fixed`` storages — parameters, buffers and what
    is computed from them alone — and writes of parameter gradients, ``weight_grads``) and
    ``row_bytes`` (the rest: they scale with the rows), and for backward operators ``grad``:
    ``input`` when an input's gradient (``input_grads``) depends on it, else ``weight`` when a
    parameter's does, else ``""``. A GEMM's shape goes in ``gemm_batch``/``gemm_m``/``gemm_n``/
    ``gemm_k`` (0 for other kernels) and ``gemm_rows`` names the one of them that grows with the rows
    (:func:`gemm_rows`). Returns the kernels' records, in order."""
    fixed = set(fixed)
    weight_grads, input_grads = set(weight_grads), set(input_grads)
    producer: dict[int, int] = {}
    needs: list[set[int]] = []
    for i, rec in enumerate(records):
        shape = rec.get("gemm")
        rec["gemm_batch"], rec["gemm_m"], rec["gemm_n"], rec["gemm_k"] = shape[:4] if shape else (0, 0, 0, 0)
        rec["gemm_rows"] = (shape[6] if len(shape) > 6 else gemm_rows(shape[0], shape[4] in fixed, shape[5] in fixed)
                            ) if shape else ""
        read_keys = [k for k, _ in rec["reads"]]
        needs.append({producer[k] for k in read_keys if k in producer})
        from_fixed = bool(read_keys) and all(k in fixed for k in read_keys)
        rec["fixed_bytes"] = sum(b for k, b in rec["reads"] if k in fixed)
        rec["row_bytes"] = sum(b for k, b in rec["reads"] if k not in fixed)
        for k, b in rec["writes"]:
            if from_fixed or k in weight_grads:
                fixed.add(k)
                rec["fixed_bytes"] += b
            else:
                rec["row_bytes"] += b
            producer[k] = i
    label = [""] * len(records)
    for name, finals in (("weight", weight_grads), ("input", input_grads)):  # input last: it wins
        todo = [producer[k] for k in finals if k in producer]
        reached: set[int] = set()
        while todo:
            i = todo.pop()
            if i not in reached:
                reached.add(i)
                todo.extend(needs[i])
        for i in reached:
            label[i] = name
    kernels = []
    for rec, name in zip(records, label):
        rec["grad"] = name if rec["phase"] == "backward" else ""
        if rec["kernel"]:
            kernels.append(rec)
    return kernels


class AsOnGPU(TorchFunctionMode):
    """On meta tensors, the kernels a GPU runs where PyTorch's composite functions would take their
    CPU path (a meta tensor is no device's): dropout as ``native_dropout`` (it saves a one-byte
    mask, not noise of the input's dtype) and ``scaled_dot_product_attention`` as the
    memory-efficient attention kernel (it saves the output and log-sum-exp, not the s×s scores;
    a boolean mask becomes an additive one, as PyTorch converts it; grouped key/value heads are
    repeated). Real tensors run as they are."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (F.dropout, torch.dropout) and args and isinstance(args[0], Tensor) and args[0].is_meta:
            names = ("p", "training") if func is F.dropout else ("p", "train")
            given = dict(zip(("input",) + names, args), **kwargs)
            p, train = given.get("p", 0.5), given.get(names[1], True)
            if train and 0 < p < 1 and not given.get("inplace", False):
                return torch.native_dropout(args[0], p, True)[0]
        if func is F.scaled_dot_product_attention and args and isinstance(args[0], Tensor) and args[0].is_meta:
            return _efficient_attention(*args, **kwargs)
        return func(*args, **kwargs)


def _efficient_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                         dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                         enable_gqa: bool = False) -> Tensor:
    if query.dim() != 4 or key.dim() != 4:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    heads = query.size(1)
    if key.size(1) != heads:
        key = key.repeat_interleave(heads // key.size(1), dim=1)
        value = value.repeat_interleave(heads // value.size(1), dim=1)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), 0.0).to(query.dtype)
        attn_mask = attn_mask.expand(query.size(0), heads, query.size(2), key.size(2))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, grad, dropout_p, is_causal and attn_mask is None, scale=scale)[0]


def to_meta(value: Any) -> Any:
    """``value`` (any pytree) with every tensor as a meta tensor of its shape, dtype and
    ``requires_grad``: what a count or a capture runs on, costing no memory and no arithmetic."""
    def move(t: Any) -> Any:
        if isinstance(t, Tensor) and t.device.type != "meta":
            return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
        return t

    return tree_map(move, value)


#: The old name of :func:`to_meta`, for the modules still importing it (models/ep_rank.py,
#: models/expert_parallel.py): ``on_meta`` is otherwise :func:`pipexplore.models.profile.on_meta`,
#: whether a model is on meta. Goes with the last of them.
on_meta = to_meta


def meta_copy(model: nn.Module) -> nn.Module:
    """``model``'s structure with every parameter and buffer on the meta device (tied ones still
    tied): a forward of it costs no memory and no arithmetic; the model itself is left as it is,
    and its weights are not copied."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo:
            empty = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = (nn.Parameter(empty, requires_grad=tensor.requires_grad)
                                if isinstance(tensor, nn.Parameter) else empty)
    return copy.deepcopy(model, memo)


def fresh_inputs(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any], list[Tensor]]:
    """Copies of a call's inputs, each a leaf (one copy per tensor object): on meta new empty
    tensors of the same shape and strides, else clones; floating ones require grad where the
    originals did. Returns ``(args, kwargs, leaves that require grad)``."""
    leaves, spec = tree_flatten((args, kwargs))
    copies: dict[int, Tensor] = {}
    wrt: list[Tensor] = []

    def fresh(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        if id(t) not in copies:
            made = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) if t.is_meta \
                else t.detach().clone()
            if t.requires_grad and (t.is_floating_point() or t.is_complex()):
                made.requires_grad_(True)
                wrt.append(made)
            copies[id(t)] = made
        return copies[id(t)]

    new_args, new_kwargs = tree_unflatten([fresh(t) for t in leaves], spec)
    return new_args, new_kwargs, wrt


@dataclass
class Count:
    """One call counted: its kernels' records (forward then backward), saved and output bytes."""
    records: list[dict[str, Any]] = field(default_factory=list)
    saved_bytes: int = 0
    output_bytes: int = 0
    meta_reads: int = 0

    def flops(self, phase: str) -> float:
        return float(sum(r["flops"] for r in self.records if r["phase"] == phase))

    def kernels(self, phase: str) -> int:
        return sum(1 for r in self.records if r["phase"] == phase)

    @property
    def uncounted(self) -> list[str]:
        return sorted({r["op"] for r in self.records if r["uncounted"]})


def count_call(module: nn.Module, args: tuple, kwargs: dict[str, Any], fixed: Optional[set[int]] = None) -> Count:
    """Count one call ``module(*args, **kwargs)`` (on fresh copies of the inputs) and its backward
    (``torch.autograd.grad`` of every output that requires grad, with ones, with respect to the
    inputs that require grad and the parameters that do): every kernel's FLOPs and bytes, and the
    bytes saved for backward (``fixed``: the storages not to count, by default ``module``'s
    parameters and buffers). Gradients are returned by autograd, never accumulated into ``.grad``."""
    fixed = storage_keys(module) if fixed is None else fixed
    args, kwargs, wrt = fresh_inputs(args, kwargs)
    params: list[Tensor] = [p for p in module.parameters() if p.requires_grad]
    counter = flop_counter()
    recorder = OpRecorder(counter, "forward")
    saved = SavedStorageBytes(fixed)
    with counter, recorder:
        with saved.hooks(), torch.enable_grad(), AsOnGPU():
            output = module(*args, **kwargs)
        outs = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
        grads: tuple = ()
        if outs and wrt + params:
            recorder.active = False  # the gradient arriving from the next layer is not this layer's work
            ones = [torch.ones_like(t) for t in outs]
            recorder.active, recorder.phase = True, "backward"
            grads = torch.autograd.grad(outs, wrt + params, ones, allow_unused=True)
    input_grads = {storage_key(g) for g in grads[:len(wrt)] if g is not None}
    weight_grads = {storage_key(g) for g in grads[len(wrt):] if g is not None}
    kernels = classify(recorder.records, fixed, weight_grads, input_grads)
    for rec in kernels:
        rec.pop("keep", None)
    return Count(kernels, saved.total, tensor_bytes(output), recorder.meta_reads)
