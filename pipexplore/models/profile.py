"""Profiling any model: one entry that picks the path its devices and its kind call for.

=======================  ================================================================
planned devices          counted on the meta device and costed by the catalogue's roofline
(``"H100"`` × 16)        (:func:`planned_layers`), its efficiency learnt where a device of
                         the kind is here
a model on meta          timed block by block, each kind of block once
                         (:func:`pipexplore.models.blockwise.profile_blockwise`)
not an ``nn.Sequential`` its candidate blocks timed where they run in the model, as the
                         stages torch's tracer builds (:func:`pipexplore.models.trace.candidates_in_rows`)
an ``nn.Sequential``     each layer timed (:func:`pipexplore.profiling.sequential.profile`)
=======================  ================================================================

The timers, ratios and calibration every path uses, and the ``nn.Sequential`` path itself, are
:mod:`pipexplore.profiling`'s; the paths here are those that need the model's structure.

Every path costs the layers at a micro-batch of ``chunks`` and at the whole batch, with the
intra-op threads each CPU stage runs with, so that what is predicted is what runs. The devices are
resolved once (:class:`pipexplore.devices.placement.Placement`). Progress is a callback
``progress(done, total)``: the explorer gives it a bar in the notebook, a script what it likes.

Example::

    table = profile_model(model, sample, devices=["H100"] * 16, gpus_per_node=8, chunks=8)
    table = profile_model(nn.Sequential(...), torch.randn(64, 128), chunks=4, progress=print)
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional, Sequence, TypedDict, Union, cast

import numpy as np
import pandas as pd
import torch
from torch import nn

from pipexplore import devices as devices_here
from pipexplore import validate
from pipexplore.devices import device_spec, dtype_name
from pipexplore.devices.placement import Placement, place
from pipexplore.host import sharing_cores, stage_threads
from pipexplore.samples import Sample, TensorOrTensors, batch_size, to_device
from pipexplore.models import blockwise, trace
from pipexplore.models import experts, opcount, sharded
from pipexplore.models.opcount import meta_copy
from pipexplore.models.hf import input_refusal
from pipexplore.models.inputs import tokens_per_sample
from pipexplore.models.meta import count_layers
from pipexplore.models.rank_here import with_expert_counts
from pipexplore.predict.memory import optimizer_traffic
from pipexplore.predict import planned_optimizer
from pipexplore.profiling.sequential import backward_split, profile
from pipexplore.predict.roofline import Efficiency, Group, fit_efficiency, planned_layer_costs
from pipexplore.training import LossFn, OptimizerFactory, Training

__all__ = ["profile_model", "ProfileOptions", "planned_layers", "with_backward_split", "on_meta", "costed_rows"]

Progress = Callable[[int, int], None]


class ProfileOptions(TypedDict):
    """How :func:`profile_model` times layers, as an explorer keeps them for every profile it makes."""

    granularity: str
    repeats: int
    profile_stages: bool
    mixed_precision: bool


def on_meta(model: nn.Module) -> bool:
    """Whether ``model`` (any of its parameters or buffers) is on the meta device: built without weights."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def costed_rows(batch: int, chunks: int) -> list[int]:
    """The micro-batch sizes a table is costed at: a micro-batch of ``chunks`` and the whole batch."""
    return sorted({max(1, -(-batch // chunks)) if chunks > 1 else max(1, batch // 2), batch})


def profile_model(model: nn.Module, sample: Sample, *,
                  devices: Union[Placement, Sequence[Any], None] = None, gpus_per_node: int = 8, chunks: int = 1,
                  granularity: str = "blocks", repeats: int = 3, profile_stages: bool = True,
                  split_backward: bool = True, loss_fn: Optional[LossFn] = None, target: Any = None,
                  optimizer: Optional[OptimizerFactory] = None, mixed_precision: bool = False,
                  progress: Optional[Progress] = None, tp: int = 1,
                  tp_plan: Optional[dict[str, str]] = None) -> pd.DataFrame:
    """The layer table of ``model`` on ``sample`` (one row per layer or traced candidate: names,
    forward and backward seconds as ``a + b·n`` in the rows ``n`` of a micro-batch, bytes, skip
    routes), by the path the devices and the model call for (the module docstring).

    ``devices``: the plan's devices (names, or a :class:`~pipexplore.devices.placement.Placement`),
    planned from the catalogue or present here; None: this machine's. ``chunks``: the micro-batches
    the plan runs (the table is costed at that micro-batch and at the whole batch). ``loss_fn``,
    ``target`` and ``optimizer`` (a factory of the runs' optimizer) are resolved here, once
    (:meth:`pipexplore.training.Training.of`), and every path profiles with them: the loss each
    backward starts from, the optimizer stepping each layer's parameters (the ``optimizer`` column).
    ``split_backward``: measure the input/weight-gradient split (zero-bubble schedules run their
    backward as those two passes). ``profile_stages``: a traced model's blocks timed as its traced
    stages too. ``progress(done, total)``: called as layers are timed (an ``nn.Sequential``'s).
    ``tp``: each stage tensor-parallel over ``tp`` ranks: the costs are one rank's, its collectives
    included (:func:`planned_layers`; here, the measured table scaled to a rank's share:
    :func:`pipexplore.models.rank_here.rank_here`).

    Raises:
        ValueError: the sample does not fit the model (naming the layer that refused it, or the input a
            Hugging Face model lacks and its shape), a model on the meta device with no devices named,
            devices of several kinds.
    """
    refusal = input_refusal(model, sample)
    if refusal:
        raise ValueError(refusal)
    placement = devices if isinstance(devices, Placement) else place(devices, gpus_per_node=gpus_per_node)
    chunks = validate.integer(chunks, "chunks")
    training = Training.of(loss_fn, optimizer, target)
    if placement.planned:
        return planned_layers(model, sample, chunks=chunks, devices=placement.devices, granularity=granularity,
                              repeats=repeats, **training.keywords(), mixed_precision=mixed_precision, tp=tp,
                              tp_plan=tp_plan, gpus_per_node=placement.gpus_per_node)
    if tp != 1:  # the whole model timed here, then one rank's share of it (:mod:`pipexplore.models.rank_here`)
        from pipexplore.models.rank_here import rank_here

        whole = profile_model(model, sample, devices=placement, chunks=chunks, granularity=granularity,
                              repeats=repeats, profile_stages=profile_stages, split_backward=split_backward,
                              **training.keywords(), mixed_precision=mixed_precision, progress=progress)
        return rank_here(model, sample, whole, tp=tp, microbatch_rows=costed_rows(batch_size(sample), chunks)[0],
                         tp_plan=tp_plan, loss_fn=training.loss_fn, target=training.target)
    device = placement.profiling_device
    if on_meta(model):
        if not placement.given:
            raise ValueError(f"{type(model).__name__} is on the meta device (no weights): name the devices to plan "
                             "it for, from the catalogue (devices=['H100'] * 16, gpus_per_node=8), or devices here "
                             "to time its blocks one at a time")
        return blockwise.profile_blockwise(model, sample, device=device,
                                           microbatch_rows=costed_rows(batch_size(sample), chunks), repeats=repeats,
                                           granularity=granularity)
    threads = stage_threads(placement.devices)
    if not isinstance(model, nn.Sequential) and step_flops(model, sample) > BLOCKWISE_STEP_FLOPS:
        return with_expert_counts(model, sample,
                                  _each_kind_once(model, sample, training, device=device, chunks=chunks,
                                                  granularity=granularity, repeats=repeats, threads=threads),
                                  microbatch_rows=costed_rows(batch_size(sample), chunks)[0],
                                  loss_fn=training.loss_fn, target=training.target)
    if not isinstance(model, nn.Sequential):
        # on the device the first stage runs on, as a Sequential's layers are (the model as given
        # may sit on the CPU: runs move each stage to its device)
        with sharing_cores(threads):
            table = trace.candidates_in_rows(copy.deepcopy(model).to(device), to_device(sample, device), chunks=chunks,
                                       granularity=granularity, loss_fn=training.loss_fn,
                                       target=to_device(training.target, device), repeats=repeats,
                                       optimizer=training.optimizer, as_stages=profile_stages, owned=True)
        table.attrs["threads"] = threads or torch.get_num_threads()
        return with_expert_counts(model, sample, table, microbatch_rows=costed_rows(batch_size(sample), chunks)[0],
                                  loss_fn=training.loss_fn, target=training.target)
    profiled, layers_input = copy.deepcopy(model), cast(TensorOrTensors, sample)  # (a dict feeds traced models only)
    with validate.naming_failing_layer(profiled, sample):  # a sample that does not fit: which layer says so
        return profile(profiled, layers_input, repeats=repeats, microbatch_rows=costed_rows(batch_size(sample), chunks),
                       device=device, progress=progress, threads=threads, split_backward=split_backward,
                       optimizer=training.optimizer)


#: FLOPs of one training step (6 · parameters · tokens) beyond which a model that is not an
#: ``nn.Sequential`` is timed here block by block, each kind of identical block once
#: (:func:`_each_kind_once`), not in passes of the whole model: GPT-2 small on 8 × 256 tokens
#: (1.5e12) took 188 s and 9.6 GiB in whole passes on a 2-core CPU; tiny models stay whole.
BLOCKWISE_STEP_FLOPS = 2e11


def step_flops(model: nn.Module, sample: Sample) -> float:
    """A training step's FLOPs as 6 · parameters · tokens (rows where the sample is not token ids)."""
    params = sum(p.numel() for p in model.parameters())
    return 6.0 * params * batch_size(sample) * tokens_per_sample(sample)


def _each_kind_once(model: nn.Module, sample: Sample, training: Training, *, device: torch.device, chunks: int,
                    granularity: str, repeats: int, threads: Optional[int]) -> pd.DataFrame:
    """A large model here, timed block by block with its own weights, each kind of identical block
    once (:func:`pipexplore.models.blockwise.profile_blockwise`): its kinds' inputs from one forward
    of a meta copy (random values of their shapes),
    each kind's forward and backward at the micro-batch and the whole batch, the optimizer's step
    over each kind's parameters once; a note says how many blocks shared each timing and its spread."""
    with sharing_cores(threads):  # (its blocks' inputs from a forward on meta: nothing computed, nothing held)
        table = blockwise.profile_blockwise(
            meta_copy(model), opcount.to_meta(sample), device=device,
            microbatch_rows=costed_rows(batch_size(sample), chunks), repeats=repeats, granularity=granularity,
            loss_fn=training.loss_fn, target=opcount.to_meta(training.target), real_model=model,
            cold_cache=True)  # (a step streams every block's weights: none is in cache when it runs)
        modules = dict(model.named_modules())
        from pipexplore.profiling.optimizer_step import optimizer_seconds

        table["optimizer"] = optimizer_seconds([modules[str(name)] for name in table["name"]], training.optimizer,
                                               repeats=repeats)
    counts = table[table["kind"] != ""].groupby("kind", sort=False)
    shared = [f"{len(rows)} × {rows['type'].iloc[0]} (spread {rows['spread'].iloc[0]:.0%})"
              for _, rows in counts if len(rows) > 1]
    if shared:
        table.attrs["notes"] = [*table.attrs.get("notes", []),
                                f"{type(model).__name__} is timed block by block with its own weights, each kind "
                                f"once: {', '.join(shared)} (a step of it is {step_flops(model, sample) / 1e12:.1f} "
                                "TFLOP here: whole passes would take minutes)"]
    table.attrs["threads"] = threads or torch.get_num_threads()
    return table


def planned_layers(model: nn.Module, sample: Sample, *, chunks: int, devices: Sequence[str],
                   granularity: str = "blocks", repeats: int = 3, loss_fn: Optional[LossFn] = None, target: Any = None,
                   optimizer: Optional[OptimizerFactory] = None, mixed_precision: bool = False, tp: int = 1,
                   tp_plan: Optional[dict[str, str]] = None, gpus_per_node: int = 8) -> pd.DataFrame:
    """The layer table of ``model`` on planned ``devices`` (catalogue names, one kind): every
    layer's FLOPs, bytes and kernels counted on the meta device (no weights materialised, each
    kind of identical layer once) and costed as the catalogue's roofline of the device; the
    ``optimizer`` column is the step's bytes (:func:`pipexplore.predict.memory.optimizer_traffic`)
    over the device's memory bandwidth.

    ``tp > 1``: each kind counted as one tensor-parallel rank computes it
    (:func:`pipexplore.models.meta.count_layers`), its collectives costed over the group of the
    first ``tp`` devices (ranks ``0 … tp−1``, placed inside a node first); ``attrs["tp"]``.

    Raises:
        ValueError: the devices are of several kinds (a plan costs one kind at a time), or a
            tensor-parallel plan that cannot shard the model (:func:`pipexplore.models.sharded.check_plan`).
    """
    kinds = list(dict.fromkeys(device_spec(d).name for d in devices))
    if len(kinds) > 1:
        raise ValueError(f"devices: a plan is costed for one kind of device, got {', '.join(kinds)}: plan each kind "
                         "in an explorer of its own")
    training = Training.of(loss_fn, optimizer, target)
    batch = batch_size(sample)
    rows = costed_rows(batch, chunks)
    counted = count_layers(model, sample, granularity=granularity, microbatch_rows=rows[0],
                           loss_fn=training.loss_fn, target=training.target, tp=tp, tp_plan=tp_plan)
    ops = counted.attrs["ops"]
    unknown = ops["flops"].isna()
    if unknown.any():  # timed by their bytes and launches only: a lower bound, said so, never zero
        ops = ops.assign(flops=ops["flops"].fillna(0.0))
    efficiency, learnt = _learnt_efficiency(model, sample, counted, ops, kinds[0], rows, training,
                                            granularity=granularity, repeats=repeats)
    group = None
    if tp > 1:
        if len(devices) < tp:
            raise ValueError(f"tp={tp} needs {tp} devices, got {len(devices)}")
        group = Group.over(list(devices[:tp]), gpus_per_node)  # costed as NCCL runs it
    table = planned_layer_costs(counted, ops, kinds[0], batch=batch, microbatch_rows=rows[0], efficiency=efficiency,
                                group=group)
    routed = counted.attrs.get("experts")
    if routed:  # what holding 1/(ep·etp) of the experts saves their grouped GEMMs, for each such share
        shares = {e * t for e in experts.divisors(routed["count"]) for t in experts.divisors(gpus_per_node)}
        table.attrs["expert_shares"] = experts.share_costs(table.attrs.pop("expert_ops", None), table, kinds[0],
                                                           efficiency=efficiency, group=group, shares=sorted(shares))
    spec = device_spec(kinds[0])
    table["optimizer"] = optimizer_traffic(table, optimizer=training.optimizer, mixed_precision=mixed_precision) / (
        spec.memory_bandwidth * (efficiency or Efficiency()).optimizer_for(spec))
    if tp > 1:  # a rank steps its shard of each layer's parameters
        whole = table["param_bytes"].to_numpy(dtype=float)
        held = table["rank_param_bytes"].to_numpy(dtype=float) / np.maximum(whole, 1)
        table["optimizer"] *= np.where(whole > 0, held, 1.0)
    tokens = tokens_per_sample(sample)
    kv = sharded.key_value_bytes(model, ops, table["kind"], tokens)
    if kv is not None:  # what context parallelism gathers: each attention layer's keys and values, whole batch
        table["kv_bytes"] = kv * batch
    table.attrs["tokens_per_sample"] = tokens
    notes = list(counted.attrs.get("notes", [])) + ([learnt] if learnt else [])
    lower = [f"{k} ({name})" for k, (name, missing) in enumerate(zip(table["name"], table["uncounted"])) if missing]
    if lower:
        notes.append(f"Layer{'s' if len(lower) > 1 else ''} {', '.join(lower)}: FLOPs unknown (an operator without a "
                     "FLOP formula); their planned time counts bytes and kernel launches only, a lower bound.")
    table.attrs["notes"] = notes
    return table


def _learnt_efficiency(model: nn.Module, sample: Sample, counted: pd.DataFrame, ops: pd.DataFrame,
                       kind: str, rows: Sequence[int], training: Training, *, granularity: str,
                       repeats: int) -> tuple[Any, str]:
    """Where a device of the planned kind is here: the model's blocks timed on it one at a time, its
    caches flushed before each call (:func:`pipexplore.models.blockwise.profile_blockwise`), teach
    the roofline its efficiency, and the optimizer stepping the largest block made real there the
    bandwidth an optimizer step reaches (:func:`pipexplore.predict.planned_optimizer.optimizer_bandwidth`);
    a note says what it learnt. Elsewhere the catalogue's documented defaults stand: ``(None, '')``."""
    here = devices_here.present_device(kind)
    if here is None:
        return None, ""
    timed = blockwise.profile_blockwise(model, sample, device=here, microbatch_rows=list(rows), repeats=repeats,
                              granularity=granularity, loss_fn=training.loss_fn, target=training.target,
                              cold_cache=True)
    at = float(ops.attrs["rows"])
    per_kind = pd.DataFrame({"kind": counted["kind"].to_numpy(),
                             "forward": (timed["forward_a"] + timed["forward_b"] * at).to_numpy(),
                             "backward": (timed["backward_a"] + timed["backward_b"] * at).to_numpy()})
    # The blocks were timed alone: a kind's ops run outside its block (the loss after the last) are not in its time.
    learnt = fit_efficiency(ops[~ops["outside"]], per_kind.groupby("kind").median(), kind, at)
    spec = device_spec(kind)
    largest_name = str(counted["name"].iloc[int(counted["grad_bytes"].to_numpy().argmax())])
    largest = dict(model.named_modules()).get(largest_name)
    stepped = ""
    if largest is not None and counted["grad_bytes"].max() > 0:
        try:  # a block, its copy, their gradients and states: where they do not fit, the default stands
            real = blockwise.materialise(largest, here)
            try:
                bandwidth = planned_optimizer.optimizer_bandwidth(real, training.optimizer, spec)
                learnt = dataclasses.replace(learnt, optimizer=min(2.0, bandwidth))
                stepped = f", an optimizer step {learnt.optimizer_for(spec):.0%} of it"
            finally:
                real.to_empty(device=torch.device("meta"))
                del real
        except torch.OutOfMemoryError as error:
            stepped = (f" (an optimizer step over {largest_name} did not fit there, "
                       f"{str(error).splitlines()[0][:80]}: its documented fraction stands)")
        finally:
            if here.type == "cuda":
                torch.cuda.empty_cache()
    computing = ops.loc[ops["flops"].to_numpy(dtype=float) != 0, "dtype"]
    dtype = dtype_name(computing.mode().iloc[0]) if len(computing) else "float32"

    def fraction(value: float, default: float, of: str) -> str:  # (fit_efficiency keeps a default nothing timed needs)
        return f"{value:.0%} of {of}" + (" (kept: no timed operator is bound by it)" if value == default else "")

    return learnt, (f"The roofline's efficiency was learnt on {here} here, a {spec.name}: "
                    f"{fraction(learnt.flops_for(dtype, spec), spec.flops_efficiency, f'peak {dtype} FLOP/s')} and "
                    f"{fraction(learnt.bandwidth_for(spec), spec.bandwidth_efficiency, 'memory bandwidth')}{stepped} "
                    f"(the catalogue's defaults: {spec.flops_efficiency:.0%}, {spec.bandwidth_efficiency:.0%}).")


def with_backward_split(model: nn.Module, sample: Sample, table: pd.DataFrame, *,
                        device: torch.device, repeats: int = 3) -> pd.DataFrame:
    """``table`` with its input/weight-gradient split measured (zero-bubble runs its backward as
    those two passes); ``table`` itself where it has one, or for traced models."""
    if table.attrs.get("backward_split", True) or not isinstance(model, nn.Sequential):
        return table
    profiled = copy.deepcopy(model).to(device)
    # (the sample is not a dict: a Sequential's)
    return backward_split(profiled, cast(TensorOrTensors, sample), table, repeats=repeats)
