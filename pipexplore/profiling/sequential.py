"""Layer profiles: what each layer of an ``nn.Sequential`` costs, as a DataFrame."""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from pipexplore import background
from pipexplore.devices import as_device, is_planned
from pipexplore.host import as_stage_worker, host_cores, sharing_cores, stage_worker_matters
from pipexplore.microbatch import Batch
from pipexplore.samples import TensorOrTensors, batch_size, tensors_in
from pipexplore.timeline.saved import SavedBytes
from pipexplore.skip.skippable import Skippable
from pipexplore.profiling.calibration import calibrate_to_whole_model
from pipexplore.profiling.optimizer_step import optimizer_seconds
from pipexplore.profiling.ratios import checkpointed_ratio as _checkpointed_ratio
from pipexplore.profiling.ratios import contended_slowdown as _contended_slowdown
from pipexplore.profiling.ratios import split_backward as _split_backward
from pipexplore.profiling.timing import CacheFlush
from pipexplore.profiling.timing import Timer as _Timer
from pipexplore.profiling.timing import detach as _detach
from pipexplore.profiling.timing import nbytes as _bytes
from pipexplore.profiling.timing import first_rows as _rows
from pipexplore.profiling.timing import fit_columns, popping as _popping, spent as _spent, spread as _spread
from pipexplore.skip.tracker import use_skip_tracker
from pipexplore.training import OptimizerFactory

__all__ = ["profile", "profiling_device", "backward_split", "fit_columns", "LAYER_COLUMNS", "FIT_COLUMNS"]

LAYER_COLUMNS = ["name", "type", "param_bytes", "output_bytes", "forward", "backward", "stash", "pop",
                 "stash_keys", "pop_keys"]
#: Cost as a function of the rows ``n`` of a micro-batch: ``t(n) = a + b·n`` per phase, bytes per
#: row, the share of its device (the host's cores, or a GPU) a phase keeps busy when it runs
#: alone, what the zero-bubble input- and weight-gradient passes cost as fractions of the backward
#: (together often 1.2–1.5×: two passes over the graph), what a forward without autograd (a
#: checkpointed micro-batch's) costs as a fraction of the forward, and how repeatable the timings were.
FIT_COLUMNS = ["forward_a", "forward_b", "backward_a", "backward_b", "output_bytes_per_row",
               "saved_bytes_per_row", "share_forward", "share_backward", "input_grad_ratio", "weight_grad_ratio",
               "checkpointed_ratio", "fresh_grads", "spread"]

#: Stop repeating a layer's timing once the interquartile range is this fraction of the median.
TARGET_SPREAD = 0.05


def _keys(pairs: Any) -> str:
    """Skip names qualified by namespace (``name@id``), so that isolated names pair up right."""
    return ",".join(f"{name}@{'' if ns is None else ns.id.hex[:12]}" for ns, name in pairs)


_PLAIN = (int, float, str, bool, type(None))


def _plain(value: Any) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value))


def _signature(layer: nn.Module, value: TensorOrTensors, skips: dict[Any, Tensor]) -> Optional[tuple]:
    """What makes two layers the same work: the module tree's types, plain settings (``in_features``,
    a sleep's seconds, …) and ``repr``, its parameters' and buffers' shapes, dtypes and devices, and
    its inputs' (with the skip tensors it pops). ``None`` when it cannot be told."""
    try:
        settings = tuple((type(m).__qualname__, tuple((k, v) for k, v in sorted(vars(m).items())
                                                      if not k.startswith("_") and _plain(v)))
                         for m in layer.modules())
        tensors = tuple((n, tuple(t.shape), t.dtype, str(t.device), t.requires_grad)
                        for n, t in [*layer.named_parameters(), *layer.named_buffers()])
        inputs = tuple((tuple(t.shape), t.dtype, str(t.device)) for t in tensors_in(value))
        popped = tuple(sorted((str(k), tuple(t.shape), t.dtype) for k, t in skips.items())) \
            if isinstance(layer, Skippable) else ()
        return repr(layer), settings, tensors, inputs, popped
    except Exception:  # a module whose repr or attributes cannot be read: measured on its own
        return None


class _LayerRun:
    """One layer's input (and the skip tensors it pops), ready to be called again and again."""

    def __init__(self, name: str, layer: nn.Module, value: TensorOrTensors, skips: dict[Any, Tensor],
                 target: torch.device, flush: Optional[Callable[[], None]] = None) -> None:
        self.name, self.layer, self.value, self.skips = name, layer, value, dict(skips)
        self.forward, self.backward = _Timer(target, flush), _Timer(target, flush)
        self.saved = SavedBytes(layer)
        self.output: Any = None
        self.stashed: dict[Any, Optional[Tensor]] = {}

    def call(self, timed: bool) -> None:
        tracker = _popping(self.skips)
        memory = SavedBytes(self.layer) if timed else self.saved

        def run_forward() -> Any:
            with use_skip_tracker(tracker), torch.enable_grad(), memory.hooks():
                return self.layer(self.value)

        output = self.forward(run_forward) if timed else run_forward()
        stashed = {key: t for key, t in tracker.tensors.items() if key not in self.skips}
        # (a layer may stash None: nothing to differentiate there)
        outs = [t for t in tensors_in(output) + list(stashed.values()) if t is not None and t.requires_grad]

        def run_backward() -> None:
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

        self.backward(run_backward) if timed else run_backward()
        self.layer.zero_grad(set_to_none=True)
        if not timed:
            self.output, self.stashed = output, stashed


class _Kind:
    """The layers of one profile that do the same work (see :func:`_signature`; a layer whose work
    cannot be told is a kind of its own): their timings are pooled, so a model's repeated blocks
    reach a reliable median in fewer rounds, and share it."""

    def __init__(self) -> None:
        self.runs: list[_LayerRun] = []

    def walls(self, phase: str) -> list[float]:
        return [w for run in self.runs for w in getattr(run, phase).wall]

    def median(self, phase: str) -> float:
        walls = self.walls(phase)
        return statistics.median(walls) if walls else 0.0

    def cores(self, phase: str) -> float:
        total = sum(self.walls(phase))
        return sum(getattr(run, phase).cpu for run in self.runs) / total if total > 0 else 0.0

    @property
    def spread(self) -> float:
        """The interquartile range over the median of the pooled calls (the worse phase)."""
        return max(_spread(self.walls("forward")), _spread(self.walls("backward")))

    @property
    def settled(self) -> bool:
        """Whether the pooled median is known to :data:`TARGET_SPREAD`: the spread of one call,
        narrowed by the square root of the layers that share it (one layer: its own spread)."""
        return self.spread / math.sqrt(len(self.runs)) <= TARGET_SPREAD


def _chain(module: nn.Sequential, value: TensorOrTensors, target: torch.device,
           same_work_once: bool, flush: Optional[Callable[[], None]] = None) -> list[tuple[_LayerRun, Any]]:
    """Every layer ready to be called on its own input from the chain (each called once, untimed:
    the first call pays allocation, kernel selection and dispatch caches, and gives the next layer
    its input, with the skip tensors stashed before it), with its kind: what makes two layers the
    same work (:func:`_signature`; with ``same_work_once=False``, or where that cannot be told, a
    kind of its own)."""
    skips: dict[Any, Tensor] = {}
    chain = []
    for index, (name, layer) in enumerate(module.named_children()):
        run = _LayerRun(name, layer, value, skips, target, flush)
        signature = _signature(layer, value, run.skips) if same_work_once else None
        chain.append((run, signature if signature is not None else ("alone", index)))
        run.call(timed=False)
        if isinstance(layer, Skippable):
            for ns_name in layer.poppable():
                skips.pop(ns_name, None)
        skips.update({key: None if t is None else t.detach() for key, t in run.stashed.items()})
        value = _detach(run.output)
    return chain


def _on_device(sample: TensorOrTensors, target: torch.device) -> TensorOrTensors:
    """The sample's tensors (a tensor, or a tuple of them) on ``target``."""
    value: TensorOrTensors = Batch(sample).call(lambda v: v).tensor_or_tensors
    return tuple(t.to(target) for t in value) if isinstance(value, tuple) else value.to(target)


def _profile_rows(module: nn.Sequential, value: TensorOrTensors, target: torch.device, repeats: int,
                  max_repeats: int, deadline: Optional[float], progress: Optional[Callable[[int, int], None]],
                  done_before: int, total: int, contend: bool, same_work_once: bool = True,
                  split_backward: bool = True, flush: Optional[Callable[[], None]] = None) -> list[dict[str, Any]]:
    """Time every layer on one micro-batch ``value``, each on its own input from the chain.

    First one untimed call per layer (the first call pays allocation, kernel selection and
    dispatch caches, and gives the next layer its input); then rounds that time every layer once,
    until each layer's spread is small: a disturbance of the machine lands on one round of every
    layer rather than on all the samples of one layer. Layers that do the same work pool their
    calls (``same_work_once``): a kind of layer whose pooled median is settled after ``repeats``
    rounds sits the later rounds out. Past ``deadline`` no more calls are timed once the first
    round is done (every layer timed once), and a kind's ratios are measured only while time is
    left (else NaN, as at the other sizes).
    """
    layers: list[_LayerRun] = []
    kinds: dict[Any, _Kind] = {}
    kind_of: list[_Kind] = []
    for run, key in _chain(module, value, target, same_work_once, flush):
        kind = kinds.setdefault(key, _Kind())
        kind.runs.append(run)
        kind_of.append(kind)
        layers.append(run)
    settled: set[int] = set()  # the kinds whose times already agree (after ``repeats`` rounds)
    for k in range(1, max_repeats + 1):
        for index, run in enumerate(layers):
            if id(kind_of[index]) in settled:
                continue  # this kind of layer's times already agree: rounds go on for the others
            if k > 1 and _spent(deadline):
                break  # the timeout is spent, and every layer has been timed once
            run.call(timed=True)
            if k == 1 and progress is not None:
                progress(done_before + index + 1, total)
        if _spent(deadline):
            break
        if k >= repeats:
            settled = {id(kind) for kind in kinds.values() if kind.settled}
            if len(settled) == len(kinds):
                break
    rows = []
    # Each kind's pooled times, once; its ratios (slowdown beside a twin, input- and weight-gradient
    # over backward) measured on its first layer.
    times = {id(kind): (kind.median("forward"), kind.median("backward"), kind.cores("forward"),
                        kind.cores("backward"), kind.spread, any(kind.walls("backward"))) for kind in kinds.values()}
    ratios: dict[int, tuple[float, float, float, float, float]] = {}
    for run, kind in zip(layers, kind_of):
        layer = run.layer
        forward, backward, cpu_forward, cpu_backward, spread, backward_ran = times[id(kind)]
        slow_forward = slow_backward = input_ratio = weight_ratio = checkpointed = math.nan
        if contend:
            known = ratios.get(id(kind))
            if known is None and _spent(deadline):
                known = ratios[id(kind)] = (math.nan,) * 5  # no time left to measure them
            if known is None:
                slow_forward, slow_backward = _contended_slowdown(layer, run.value, run.skips, target, repeats,
                                                                  forward + backward)
                input_ratio, weight_ratio = (_split_backward(layer, run.value, run.skips, target, repeats, backward)
                                             if split_backward else (math.nan, math.nan))
                checkpointed = _checkpointed_ratio(layer, run.value, run.skips, target, repeats)
                ratios[id(kind)] = (slow_forward, slow_backward, input_ratio, weight_ratio, checkpointed)
            else:
                slow_forward, slow_backward, input_ratio, weight_ratio, checkpointed = known
        rows.append({
            "name": run.name,
            "type": type(layer).__name__,
            "param_bytes": _bytes(list(layer.parameters())),
            "output_bytes": _bytes(tensors_in(run.output)) + _bytes([t for t in run.stashed.values() if t is not None]),
            "saved_bytes": run.saved.total,
            "forward": forward,
            "backward": backward if backward_ran else 0.0,
            "cpu_forward": cpu_forward,
            "cpu_backward": cpu_backward,
            "slow_forward": slow_forward,
            "slow_backward": slow_backward,
            "input_grad_ratio": input_ratio,
            "weight_grad_ratio": weight_ratio,
            "checkpointed_ratio": checkpointed,
            "spread": spread,
            "stash": ",".join(n for _, n in layer.stashable()) if isinstance(layer, Skippable) else "",
            "pop": ",".join(n for _, n in layer.poppable()) if isinstance(layer, Skippable) else "",
            "stash_keys": _keys(layer.stashable()) if isinstance(layer, Skippable) else "",
            "pop_keys": _keys(layer.poppable()) if isinstance(layer, Skippable) else "",
        })
    return rows


def _shares(per_size: list[pd.DataFrame], phase: str, device: torch.device) -> np.ndarray:
    """The share of its device a phase keeps busy when it runs alone, in 0…1.

    Beside a twin doing the same work, a phase that runs ``s`` times slower asks for ``s/2`` of
    the device (1: the twins serialise; ½ or less: they overlap freely). On the host, the share
    starts from the process CPU time over wall time, over the cores (a sleep asks for nothing, a
    single-threaded layer on 2 cores for ½), times the twins' slowdown where they slow each
    other (the GIL, memory bandwidth: what CPU time cannot show), so that two such stages are
    predicted as slow as the twins ran.
    """
    slow = per_size[0][f"slow_{phase}"].to_numpy(dtype=float)
    contended = np.clip(np.nan_to_num(slow, nan=2.0) / 2.0, 0.0, 1.0)
    if device.type != "cpu":
        return contended
    capacity = float(host_cores())
    cpu = np.clip(np.mean([t[f"cpu_{phase}"].to_numpy() for t in per_size], axis=0) / capacity, 0.0, 1.0)
    return np.where(np.isnan(slow), cpu, np.clip(cpu * np.maximum(np.nan_to_num(slow, nan=1.0), 1.0), 0.0, 1.0))


def profiling_device(device: Union[torch.device, str, int]) -> torch.device:
    """``device`` where it is on this machine.

    Raises:
        ValueError: a planned device (from the catalogue: nothing to time it on here; the
            explorer plans it by the catalogue's roofline) or a device this machine does not have.
    """
    if is_planned(device):
        raise ValueError(f"{device!r} is a planned device from the catalogue, not one of this machine: layers are "
                         f"timed on a device here; plan it with explore(model, sample, devices=[{device!r}] * N), "
                         "which costs them by the catalogue's roofline, and run the plan there "
                         "(ex.export('torchrun'))")
    return as_device(device)


def profile(module: nn.Sequential, sample: TensorOrTensors, *, device: Optional[Union[torch.device, str]] = None,
            repeats: int = 3, max_repeats: int = 15, timeout: Optional[float] = None, calibrate: bool = True,
            microbatch_rows: Optional[Sequence[int]] = None,
            progress: Optional[Callable[[int, int], None]] = None, threads: Optional[int] = None,
            same_work_once: bool = True, split_backward: bool = True,
            optimizer: Optional[OptimizerFactory] = None,
            cold_cache: bool = False) -> pd.DataFrame:
    """Profile every layer of ``module`` on ``sample`` (one mini-batch), one layer at a time.

    Each layer is called once untimed (the first call pays allocation and dispatch), then timed
    in rounds that call every layer once (so that a disturbance of the machine lands on one round
    of every layer, not on one layer), ``repeats`` rounds or more; after ``repeats`` a layer whose
    interquartile range is within 5 % of its median sits out the later rounds, which go on until
    every layer's is (at most ``max_repeats``). ``timeout`` (seconds) bounds the profile, as
    torchgpipe's ``balance_by_time`` does: once it is spent, nothing more is measured beyond one
    untimed and one timed call of every layer at each size — no further rounds, no ratios of the
    kinds not yet measured (NaN), no calibration (the layers' own times stand).
    ``progress(done, total)`` is called as layers are timed.

    Layers that do the same work — the same type, settings, parameter shapes and input: a
    model's repeated blocks — are one kind: their calls are pooled (a kind's median is settled
    when its spread over the square root of its layers is within 5 %, so 256 identical layers
    need 3 rounds, not 15) and they share one measurement of the first size's ratios (slowdown
    beside a twin thread, input- and weight-gradient passes over the backward, a forward without
    autograd over the forward: ``checkpointed_ratio``, what a checkpointed micro-batch's forward
    costs).
    ``same_work_once=False`` times and measures every layer on its own (for layers whose work
    depends on what their attributes do not show). ``split_backward=False`` leaves the input-
    and weight-gradient split (what zero-bubble schedules run) unmeasured (NaN; it needs
    ``torch.distributed.pipelining``, ~1.5 s to import): :func:`backward_split` measures it later.

    ``cold_cache=True`` flushes the device's caches before every timed forward and backward (and
    the whole model's, with ``calibrate``: :class:`pipexplore.profiling.timing.CacheFlush`, untimed),
    so that a layer is timed as it runs between neighbours that stream more than the cache: how
    layers measured alone teach the roofline (:func:`pipexplore.predict.roofline.fit_efficiency`)
    the efficiency a model reaches.

    ``microbatch_rows`` are the micro-batch sizes to time (default: the whole sample). With two
    or more, each layer's forward and backward become a line ``t(n) = a + b·n`` in the rows ``n``
    of a micro-batch (``forward_a``, ``forward_b``, …), fitted by least squares: a per-call cost
    (``a``: dispatch, small kernels, sleeps) plus a per-row one. With one size the cost is taken
    as proportional to the rows.

    Returns one row per layer: ``name``, ``type``, ``param_bytes``; ``output_bytes`` (outputs and
    stashed skip tensors) and ``saved_bytes`` (what autograd keeps for backward), both for the
    whole ``sample``; ``forward`` and ``backward`` seconds for the whole sample (from the fit);
    the fit columns (:data:`FIT_COLUMNS`: ``share_forward``/``share_backward`` are the share of
    its device a phase keeps busy when it runs alone, measured beside a twin thread doing the same
    work, and on the host capped by CPU time over wall time; ``spread`` is the worst
    interquartile range over the median); ``stash`` and ``pop`` (skip names) and
    ``stash_keys``/``pop_keys`` (qualified by namespace: ``name@id``); ``optimizer``: seconds of
    one step of ``optimizer(parameters)`` (the factory a run uses; default
    :data:`pipexplore.training.default_optimizer`) over the layer's parameters, timed on copies of
    them (:func:`pipexplore.profiling.optimizer_step.optimizer_seconds`: the model is not changed),
    what each stage's update at the end of a step costs.
    ``table.attrs['rows']`` lists the profiled sizes, ``table.attrs['batch']`` the sample's rows.

    ``threads``: the intra-op threads each layer runs with (``torch.set_num_threads`` for the
    profile only; default: torch's current setting), as a CPU stage will run it when several share
    the host (:func:`pipexplore.host.stage_threads`); ``table.attrs['threads']`` says which.

    A layer timed alone runs with its weights and inputs hot in cache, so the per-layer times
    add up to less than a pass through the whole model. With ``calibrate`` (the default) the
    whole model is also timed at each size, and each layer's times are scaled so that the
    layers add up to it: its backward accumulating into the gradients, as a step's micro-batches
    after the first do; what allocating them afresh adds (the first's) is ``fresh_grads``,
    seconds a layer once a step, shared by the layers' gradient bytes (NaN uncalibrated).

    Example::

        table = pipexplore.profile(model, torch.randn(64, 128), microbatch_rows=[16, 64])
        table[["name", "forward_a", "forward_b", "share_forward"]]
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"profile needs an nn.Sequential, got {type(module).__name__}")
    if len(module) == 0:
        raise ValueError("cannot profile an empty module: it has no layers")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    batch = batch_size(sample)
    sizes = sorted({int(n) for n in (microbatch_rows or [batch])})
    if not sizes or sizes[0] < 1 or sizes[-1] > batch:
        raise ValueError(f"microbatch_rows must lie in 1…{batch} (the sample's rows), "
                         f"got {list(microbatch_rows or [])}")
    if device is not None:
        device = profiling_device(device)
        module.to(device)
    first_param = next(module.parameters(), None)
    target = torch.device(device) if device is not None else (first_param.device if first_param is not None
                                                               else tensors_in(sample)[0].device)
    background.wait()  # timed beside a background import, a layer would hold its share of the interpreter
    deadline = None if timeout is None else time.perf_counter() + timeout
    value = _on_device(sample, target)
    training = module.training
    with sharing_cores(threads):
        used_threads = torch.get_num_threads()

        def timed() -> list[pd.DataFrame]:
            return _profile_sizes(module, value, sizes, target, repeats, max_repeats, deadline, progress, calibrate,
                                  same_work_once, split_backward, CacheFlush(target) if cold_cache else None)

        # Where the stages run in worker threads with intra-op threads of their own, so are the layers
        # timed (see pipexplore.host.as_stage_worker: in the main thread they would run faster).
        in_worker = stage_worker_matters(target)
        per_size = as_stage_worker(timed) if in_worker else timed()
        # The update at the end of a step: stepped by the caller's thread (in-process executors)
        # or each rank's, with the threads the stages run with.
        updates = optimizer_seconds(list(module.children()), optimizer,
                                    repeats=1 if _spent(deadline) else repeats, same_work_once=same_work_once)
    module.train(training)

    table = per_size[-1].copy()
    last = sizes[-1]
    fit_columns(table, per_size, sizes)
    for phase in ("forward", "backward"):
        table[phase] = table[f"{phase}_a"] + table[f"{phase}_b"] * batch
        table[f"share_{phase}"] = _shares(per_size, phase, target)
    for column in ("input_grad_ratio", "weight_grad_ratio", "checkpointed_ratio"):  # at the first (smallest) size
        table[column] = per_size[0][column].to_numpy(dtype=float)
    # Allocating a step's gradients does not grow with the rows: its mean over the sizes.
    fresh = np.array([t["fresh_grads"].to_numpy(dtype=float) for t in per_size])
    table["fresh_grads"] = np.nanmean(fresh, axis=0) if np.isfinite(fresh).any() else np.nan
    table["spread"] = np.max([t["spread"].to_numpy() for t in per_size], axis=0)
    table["output_bytes_per_row"] = table["output_bytes"] / last
    table["saved_bytes_per_row"] = table["saved_bytes"] / last
    table["output_bytes"] = table["output_bytes_per_row"] * batch
    table["saved_bytes"] = table["saved_bytes_per_row"] * batch
    table["optimizer"] = updates
    table = table[LAYER_COLUMNS + ["saved_bytes", "optimizer"] + FIT_COLUMNS]
    table.attrs.update(rows=tuple(sizes), batch=batch, device=str(target), threads=used_threads,
                       backward_split=split_backward, timed_in="a worker thread" if in_worker else "this thread")
    return table


def backward_split(module: nn.Sequential, sample: TensorOrTensors, table: pd.DataFrame, *,
                   repeats: int = 3, threads: Optional[int] = None, same_work_once: bool = True) -> pd.DataFrame:
    """``table`` (a :func:`profile` of ``module`` on ``sample``) with its input- and weight-gradient
    split measured: ``input_grad_ratio`` and ``weight_grad_ratio`` over each layer's backward, at
    the table's first micro-batch size, as :func:`profile` measures them (once per kind of layer
    with ``same_work_once``). A copy; the table's other columns are unchanged.

    Example::

        table = profile(model, sample, split_backward=False)   # no zero-bubble plan yet
        table = backward_split(model, sample, table)           # now one is wanted
    """
    if not isinstance(module, nn.Sequential) or len(module) != len(table):
        raise ValueError(f"backward_split needs the nn.Sequential of {len(table)} layers that the table profiles")
    background.wait()
    rows = int(table.attrs.get("rows", (batch_size(sample),))[0])
    first_param = next(module.parameters(), None)
    target = first_param.device if first_param is not None else tensors_in(sample)[0].device
    value = _detach(_rows(_on_device(sample, target), rows))
    measured: dict[Any, tuple[float, float]] = {}
    ratios = []

    def timed() -> None:
        for run, key in _chain(module, value, target, same_work_once):
            if key not in measured:
                for _ in range(repeats + 1):  # the plain backward beside it, as the profile timed it
                    run.call(timed=True)
                plain = statistics.median(run.backward.wall[1:]) if len(run.backward.wall) > 1 else 0.0
                measured[key] = _split_backward(run.layer, run.value, run.skips, target, repeats, plain)
            ratios.append(measured[key])

    with sharing_cores(threads if threads is not None else table.attrs.get("threads")):
        as_stage_worker(timed) if stage_worker_matters(target) else timed()
    out = table.copy()
    out["input_grad_ratio"] = [r[0] for r in ratios]
    out["weight_grad_ratio"] = [r[1] for r in ratios]
    out.attrs["backward_split"] = True
    return out


def _profile_sizes(module: nn.Sequential, value: TensorOrTensors, sizes: list[int], target: torch.device,
                   repeats: int, max_repeats: int, deadline: Optional[float],
                   progress: Optional[Callable[[int, int], None]], calibrate: bool,
                   same_work_once: bool = True, split_backward: bool = True,
                   flush: Optional[Callable[[], None]] = None) -> list[pd.DataFrame]:
    """One table of layer times per micro-batch size (the first also measures contention)."""
    per_size = []
    total = len(module) * len(sizes)
    for k, rows in enumerate(sizes):
        chunk = _detach(_rows(value, rows))
        table = pd.DataFrame(_profile_rows(module, chunk, target, repeats, max(repeats, max_repeats), deadline,
                                           progress, k * len(module), total, contend=k == 0,
                                           same_work_once=same_work_once, split_backward=split_backward, flush=flush))
        table["fresh_grads"] = math.nan
        if calibrate and not _spent(deadline):  # past the timeout, the layers' own times stand
            calibrate_to_whole_model(table, module, chunk, target, repeats, flush)
        per_size.append(table)
    return per_size
