"""Timing a model bigger than one device, block by block: each distinct kind of block is made
real alone on the profiling device, timed, and freed before the next.

The model itself stays where it is (typically on meta: built under ``torch.device("meta")``);
its blocks' inputs come from one meta forward (:func:`pipexplore.models.meta.capture`), made real
as random tensors of the same shapes and dtypes::

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.empty(8, 2048, dtype=torch.long, device="meta")
    table = profile_blockwise(model, {"input_ids": ids}, device="cuda", microbatch_rows=[1, 2])
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from typing import Any, Optional, Sequence, Union

import pandas as pd
import torch
from torch import Tensor, nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from pipexplore.host import host_cores
from pipexplore.models.inputs import sample_rows
from pipexplore.models.meta import Call, capture, layout, rows_of, without_kv_cache
from pipexplore.models.opcount import count_call
from pipexplore.profiling.sequential import FIT_COLUMNS, LAYER_COLUMNS
from pipexplore.profiling.ratios import without_autograd_ratio
from pipexplore.profiling.timing import CacheFlush, Timer, fit_line, spread
from pipexplore.timeline.saved import SavedBytes, tensor_bytes
from pipexplore.training import LossFn, Training

__all__ = ["profile_blockwise", "available_memory", "materialise", "block_inputs", "LONG_KIND"]

#: Seconds of timed calls beyond which a kind is timed once a size, not ``repeats`` times: a
#: block whose forward and backward take seconds (a 50k-word head on a CPU) is not noisy enough
#: to need more, and the profile's time goes to it.
LONG_KIND = 3.0


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes free on ``device`` (CUDA: ``torch.cuda.mem_get_info``; CPU: the host's available
    memory), or None where it cannot be told."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            import psutil

            return int(psutil.virtual_memory().available)
        except ImportError:
            try:
                with open("/proc/meminfo") as info:
                    for line in info:
                        if line.startswith("MemAvailable:"):
                            return int(line.split()[1]) * 1024
            except OSError:
                return None
    return None


def materialise(block: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``block`` with real, finite parameters and buffers on ``device`` (the original is
    left as it is): a real block's own weights; a block on meta ``to_empty``, then floating tensors
    ``normal_(0, 0.02)`` (biases zeros),
    integer ones zeros, boolean ones True, then ``reset_parameters()`` of the submodules that have
    it. Values do not change the timings; they only must not overflow."""
    if not any(t.is_meta for t in [*block.parameters(), *block.buffers()]):
        return copy.deepcopy(block).to(device)  # a real block: its own weights (a router's choices follow them)
    real = copy.deepcopy(block).to_empty(device=device)
    with torch.no_grad():
        for name, t in [*real.named_parameters(), *real.named_buffers()]:
            if t.is_floating_point() or t.is_complex():
                t.zero_() if name.rsplit(".", 1)[-1] == "bias" else t.normal_(0.0, 0.02)
            else:
                t.fill_(True) if t.dtype == torch.bool else t.zero_()
        for module in real.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                try:
                    reset()
                except Exception:  # a reset that needs what the copy lacks: the normal values stand
                    pass
    return real


def _vocabulary(block: nn.Module) -> int:
    sizes = [m.num_embeddings for m in block.modules() if isinstance(m, nn.Embedding)]
    return min(sizes) if sizes else 0


def block_inputs(call: Call, rows: int, captured_rows: int, device: torch.device,
                 block: nn.Module) -> tuple[tuple, dict[str, Any], list[Tensor]]:
    """The inputs of ``call`` at ``rows`` rows on ``device``: real captured values where they are
    real (cut to the rows), else of the captured shape and dtype: masks (by keyword) and booleans
    ones, other floating ones normal (requiring grad where the captured did), other integers
    (token ids) random within the vocabulary of the block's embeddings (zeros without one). Returns ``(args, kwargs,
    leaves that require grad)``."""
    leaves, spec = tree_flatten((call.args, call.kwargs))
    paths = [keystr(path) for path, _ in tree_flatten_with_path((call.args, call.kwargs))[0]]
    vocabulary = _vocabulary(block)
    made: dict[int, Tensor] = {}
    wrt: list[Tensor] = []

    def make(t: Any, path: str) -> Any:
        if not isinstance(t, Tensor):
            return t
        if id(t) in made:
            return made[id(t)]
        shape = list(t.shape)
        cut = t.dim() > 0 and shape[0] == captured_rows
        if cut:
            shape[0] = rows
        if not t.is_meta:
            value = (t[:rows] if cut else t).detach().to(device).clone()
        elif t.dtype == torch.bool or ("mask" in path.lower() and not t.requires_grad):
            value = torch.ones(shape, dtype=t.dtype, device=device)
        elif t.is_floating_point() or t.is_complex():
            value = torch.randn(shape, dtype=t.dtype, device=device)
        elif vocabulary:
            value = torch.randint(0, vocabulary, shape, dtype=t.dtype, device=device)
        else:
            value = torch.zeros(shape, dtype=t.dtype, device=device)
        if t.requires_grad and value.is_floating_point():
            value.requires_grad_(True)
            wrt.append(value)
        made[id(t)] = value
        return value

    args, kwargs = tree_unflatten([make(t, p) for t, p in zip(leaves, paths)], spec)
    return args, kwargs, wrt


def _time_kind(block: nn.Module, call: Call, sizes: list[int], captured_rows: int, device: torch.device,
               repeats: int, warmup: int, cold_cache: bool = False) -> dict[str, Any]:
    """Forward and backward seconds of ``block`` at each size, and its bytes at the largest."""
    walls: dict[str, list[list[float]]] = {"forward": [], "backward": []}
    long_kind = False  # a call takes seconds (LONG_KIND): timed once a size
    cpu = {"forward": 0.0, "backward": 0.0}
    result: dict[str, Any] = {"finite": True}
    flush = CacheFlush(device) if cold_cache else None
    for rows in sizes:
        args, kwargs, wrt = block_inputs(call, rows, captured_rows, device, block)
        timers = {"forward": Timer(device, flush), "backward": Timer(device, flush)}
        # the first call also measures the bytes; a long kind is warm after its first size
        untimed = 0 if long_kind else max(warmup, 1)
        times = 1 if long_kind else repeats
        step = 0
        while step < untimed + times:
            first, timed = step == 0, step >= untimed
            saved = SavedBytes(block)

            def run_forward() -> Any:
                with torch.enable_grad(), saved.hooks():
                    return block(*args, **kwargs)

            began = time.perf_counter()
            output = timers["forward"](run_forward) if timed else run_forward()
            outs = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
            if first and rows == sizes[-1]:
                result["saved_bytes_per_row"] = saved.total / rows
                result["output_bytes_per_row"] = tensor_bytes(output) / rows
                result["finite"] = all(bool(torch.isfinite(t).all()) for t in tree_flatten(output)[0]
                                       if isinstance(t, Tensor) and t.is_floating_point())

            def run_backward(outs: list[Tensor] = outs) -> None:
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

            timers["backward"](run_backward) if timed else run_backward()
            if first and rows == sizes[0] and (time.perf_counter() - began) * repeats > LONG_KIND:
                long_kind, times = True, 1  # seconds a call: once a size is enough, the time goes to it
            block.zero_grad(set_to_none=True)
            for leaf in wrt:
                leaf.grad = None
            del output, outs
            step += 1
        for phase, timer in timers.items():
            walls[phase].append(timer.wall)
            cpu[phase] += timer.cpu
    for phase in ("forward", "backward"):
        result[phase] = fit_line(sizes, [statistics.median(w) for w in walls[phase]])
        total = sum(sum(w) for w in walls[phase])
        result[f"share_{phase}"] = 1.0 if device.type != "cpu" else \
            min(1.0, cpu[phase] / total / host_cores()) if total > 0 else 0.0
    result["spread"] = max(spread(w) for phase in walls for w in walls[phase])
    # a checkpointed micro-batch's forward runs without autograd: its time over the forward's, at
    # the smallest size (not always less: GPT-2's head on this CPU, 1.09)
    args, kwargs, _ = block_inputs(call, sizes[0], captured_rows, device, block)
    result["checkpointed_ratio"] = without_autograd_ratio(lambda: block(*args, **kwargs), device,
                                                          1 if long_kind else repeats)
    return result


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


@without_kv_cache
def profile_blockwise(model: nn.Module, sample: Any, *, device: Union[str, torch.device] = "cpu",
                      microbatch_rows: Optional[Sequence[int]] = None, repeats: int = 3, warmup: int = 1,
                      granularity: str = "blocks", loss_fn: Optional[LossFn] = None, target: Any = None,
                      cold_cache: bool = False, real_model: Optional[nn.Module] = None) -> pd.DataFrame:
    """Time each layer of ``model`` (an ``nn.Sequential``'s layers, else the candidate blocks of
    :func:`pipexplore.models.trace.candidate_modules`) on ``device``, one distinct kind at a time,
    for a model bigger than the device or built on meta: the whole model is never on the device.

    One forward of ``model`` on ``sample`` (meta, typically) gives each block's inputs; each kind
    of block (same class, settings, parameter and input shapes: :func:`pipexplore.models.meta.capture`)
    is copied alone to ``device`` (:func:`materialise`), fed random inputs of the captured shapes
    and dtypes (:func:`block_inputs`), timed — ``warmup`` untimed calls, then ``repeats`` timed
    forward and backward calls at each of ``microbatch_rows`` (default: the whole batch) — and
    freed before the next kind (``cold_cache``: the device's caches flushed before every timed call,
    as :func:`pipexplore.profile` does). Before anything is made real, every kind's parameters,
    gradients and (on meta, counted) activations at the largest micro-batch are checked against the device's
    free memory (:func:`available_memory`): a block that does not fit is refused (``ValueError``).

    Returns one row per layer, in execution order, with :func:`pipexplore.profile`'s columns:
    ``forward``/``backward`` (seconds for the whole batch, from the fit ``t(n) = a + b·n`` over the
    sizes: ``forward_a``, ``forward_b``, …), ``output_bytes``/``saved_bytes`` (whole batch) and per
    row, ``share_forward``/``share_backward`` (CPU: CPU time over wall time over the cores; other
    devices 1), ``spread``; ``input_grad_ratio``/``weight_grad_ratio`` NaN (unmeasured),
    ``checkpointed_ratio`` (a forward without autograd over one with it, at the smallest size).
    Plus ``kind`` and ``order``. What runs outside the blocks (masks,
    the loss) is not timed. ``real_model``: the real model ``model`` (then its
    :func:`~pipexplore.models.opcount.meta_copy`) stands
    for: each kind is timed with its first block's own weights, copied to ``device``.
    ``table.attrs``: ``rows``, ``batch``, ``device``, ``source``
    (``"blockwise"``), ``notes``.
    """
    target_device = torch.device(device)
    batch = sample_rows(sample)
    sizes = sorted({int(n) for n in (microbatch_rows or [batch])})
    if not sizes or sizes[0] < 1 or sizes[-1] > batch:
        raise ValueError(f"microbatch_rows must lie in 1…{batch} (the sample's rows), "
                         f"got {list(microbatch_rows or [])}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be at least 1 and warmup 0 or more, got repeats={repeats}, warmup={warmup}")
    largest = sizes[-1]
    training = Training.of(loss_fn, target=rows_of(target, batch, largest))  # (the rows captured)
    cap = capture(model, rows_of(sample, batch, largest), training, granularity=granularity, backward=False)
    order, position, routes = layout(cap)
    kinds: dict[tuple, int] = {}
    for k in cap.order:
        kinds.setdefault(cap.calls[k].signature, k)
    free = available_memory(target_device)
    for k in kinds.values():
        name, module = cap.blocks[k]
        params = list(module.parameters())
        weights = sum(p.numel() * p.element_size() for p in params)
        grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        call = cap.calls[k]
        tensors = [t for t in tree_flatten((call.args, call.kwargs))[0] if isinstance(t, Tensor)]
        activations = 0
        if all(t.is_meta for t in [*params, *module.buffers(), *tensors]):
            counted = count_call(module, call.args, call.kwargs)
            activations = counted.saved_bytes + counted.output_bytes + tensor_bytes(tensors)
        need = weights + grads + activations
        if free is not None and need > free:
            raise ValueError(
                f"block {name!r} ({type(module).__name__}) needs {_gib(need)} on {target_device} (parameters "
                f"{_gib(weights)}, gradients {_gib(grads)}, activations at {largest} rows {_gib(activations)}), more "
                f"than the {_gib(free)} of memory available there: profile it on a larger device, with fewer "
                f"microbatch_rows, or at granularity='children'")
    measured: dict[tuple, dict[str, Any]] = {}
    notes: list[str] = []
    real = dict(real_model.named_modules()) if real_model is not None else {}
    for signature, k in kinds.items():
        name, module = cap.blocks[k]
        block = materialise(real.get(name, module), target_device)
        try:
            measured[signature] = _time_kind(block, cap.calls[k], sizes, largest, target_device, repeats, warmup,
                                             cold_cache)
        finally:
            block.to_empty(device=torch.device("meta"))  # its memory goes now, not when collected
            del block
            if target_device.type == "cuda":
                torch.cuda.empty_cache()
        if not measured[signature]["finite"]:
            notes.append(f"{name}: non-finite outputs with random weights and inputs (timings kept)")
    if any(k not in cap.calls for k in order):
        notes.append("never called in forward, timed as nothing: "
                     + ", ".join(cap.blocks[k][0] for k in order if k not in cap.calls))
    kind_names = {signature: f"{type(cap.blocks[k][1]).__name__}-{n}" for n, (signature, k) in enumerate(kinds.items())}
    rows = []
    for k in order:
        name, module = cap.blocks[k]
        called = cap.calls.get(k)
        m = measured[called.signature] if called is not None else None
        calls = called.calls if called is not None else 0
        (fa, fb), (ba, bb) = (m["forward"], m["backward"]) if m else ((0.0, 0.0), (0.0, 0.0))
        stash, pop = routes[k]
        rows.append({
            "name": name, "type": type(module).__name__,
            "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
            "output_bytes": (m["output_bytes_per_row"] if m else 0.0) * batch,
            "forward": calls * (fa + fb * batch), "backward": calls * (ba + bb * batch),
            "stash": ",".join(stash), "pop": ",".join(pop), "stash_keys": ",".join(stash), "pop_keys": ",".join(pop),
            "saved_bytes": calls * (m["saved_bytes_per_row"] if m else 0.0) * batch,
            "forward_a": calls * fa, "forward_b": calls * fb, "backward_a": calls * ba, "backward_b": calls * bb,
            "output_bytes_per_row": m["output_bytes_per_row"] if m else 0.0,
            "saved_bytes_per_row": calls * (m["saved_bytes_per_row"] if m else 0.0),
            "share_forward": m["share_forward"] if m else 0.0, "share_backward": m["share_backward"] if m else 0.0,
            "input_grad_ratio": math.nan, "weight_grad_ratio": math.nan,
            "checkpointed_ratio": m["checkpointed_ratio"] if m else 1.0,
            "spread": m["spread"] if m else 0.0,
            "kind": kind_names[called.signature] if called is not None else "", "order": position[k]})
    table = pd.DataFrame(rows, columns=LAYER_COLUMNS + ["saved_bytes"] + FIT_COLUMNS + ["kind", "order"])
    table.attrs.update(rows=tuple(sizes), batch=batch, device=str(target_device), source="blockwise", notes=notes,
                       backward_split=False)
    return table

