"""The explorer's layer table: profiled as the plan will run, measured again on demand, balanced.

Functions of a model and its sample; the explorer's state calls them and keeps the table.
"""
from __future__ import annotations

import copy
import itertools
from typing import Any, Mapping, Sequence

import pandas as pd
import torch
from torch import nn

from pipexplore import validate
from pipexplore.balance import optimal_splits
from pipexplore.devices import as_device
from pipexplore.host import sharing_cores, stage_threads
from pipexplore.microbatch import TensorOrTensors, batch_size, to_device
from pipexplore.plan import Plan
from pipexplore.predict.profiler import backward_split, profile
from pipexplore.splits import first_runnable_layer
from pipexplore.widgets.progress import profile_progress

__all__ = ["profile_layers", "profile_device", "with_backward_split", "balanced_splits",
           "thread_note", "on_meta", "planned_layers", "planned_note"]


def on_meta(model: nn.Module) -> bool:
    """Whether ``model`` (any of its parameters or buffers) is on the meta device: built without weights."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _rows(batch: int, chunks: int) -> list[int]:
    """The micro-batch sizes a table is costed at: a micro-batch of ``chunks`` and the whole batch."""
    return sorted({max(1, -(-batch // chunks)) if chunks > 1 else max(1, batch // 2), batch})


def planned_layers(model: nn.Module, sample: TensorOrTensors, options: Mapping[str, Any], *, chunks: int,
                   devices: Sequence[str], loss_fn: Any = None, target: Any = None, optimizer: Any = None,
                   mixed_precision: bool = False) -> pd.DataFrame:
    """The layer table of ``model`` on planned ``devices`` (catalogue names, one kind): every
    layer's FLOPs, bytes and kernels counted on the meta device (no weights materialised, each
    kind of identical layer once) and costed as the catalogue's roofline of the device; the
    ``optimizer`` column is the step's bytes (:func:`pipexplore.predict.memory.optimizer_traffic`)
    over the device's memory bandwidth.

    Raises:
        ValueError: the devices are of several kinds (a plan costs one kind at a time).
    """
    from pipexplore.devices import device_spec
    from pipexplore.models.meta import count_layers
    from pipexplore.predict.memory import optimizer_traffic
    from pipexplore.predict.roofline import Efficiency, planned_layer_costs

    kinds = list(dict.fromkeys(device_spec(d).name for d in devices))
    if len(kinds) > 1:
        raise ValueError(f"devices: a plan is costed for one kind of device, got {', '.join(kinds)}: plan each kind "
                         "in an explorer of its own")
    batch = batch_size(sample)
    rows = _rows(batch, chunks)
    counted = count_layers(model, sample, granularity=options["granularity"], microbatch_rows=rows[0],
                           loss_fn=loss_fn, target=target)
    ops = counted.attrs["ops"]
    unknown = ops["flops"].isna()
    if unknown.any():  # timed by their bytes and launches only: a lower bound, said so, never zero
        ops = ops.assign(flops=ops["flops"].fillna(0.0))
    efficiency, learnt = _learnt_efficiency(model, sample, options, counted, ops, kinds[0], rows, loss_fn, target,
                                            optimizer)
    table = planned_layer_costs(counted, ops, kinds[0], batch=batch, microbatch_rows=rows[0], efficiency=efficiency)
    spec = device_spec(kinds[0])
    table["optimizer"] = optimizer_traffic(table, optimizer=optimizer, mixed_precision=mixed_precision) / (
        spec.memory_bandwidth * (efficiency or Efficiency()).optimizer_for(spec))
    notes = list(counted.attrs.get("notes", [])) + ([learnt] if learnt else [])
    lower = [f"{k} ({name})" for k, (name, missing) in enumerate(zip(table["name"], table["uncounted"])) if missing]
    if lower:
        notes.append(f"Layer{'s' if len(lower) > 1 else ''} {', '.join(lower)}: FLOPs unknown (an operator without a "
                     "FLOP formula); their planned time counts bytes and kernel launches only, a lower bound.")
    table.attrs["notes"] = notes
    return table


def _learnt_efficiency(model: nn.Module, sample: TensorOrTensors, options: Mapping[str, Any], counted: pd.DataFrame,
                       ops: pd.DataFrame, kind: str, rows: Sequence[int], loss_fn: Any, target: Any,
                       optimizer: Any = None) -> tuple[Any, str]:
    """Where a device of the planned kind is here: the model's blocks timed on it one at a time, its
    caches flushed before each call (:func:`pipexplore.models.blockwise.profile_blockwise`), teach
    the roofline its efficiency, and the optimizer stepping the largest block made real there the
    bandwidth an optimizer step reaches (:func:`pipexplore.predict.planned_optimizer.optimizer_bandwidth`);
    a note says what it learnt. Elsewhere the catalogue's documented defaults stand: ``(None, '')``."""
    import dataclasses

    from pipexplore.devices import device_spec, present_device
    from pipexplore.models.blockwise import materialise, profile_blockwise
    from pipexplore.predict.planned_optimizer import optimizer_bandwidth
    from pipexplore.predict.roofline import fit_efficiency

    here = present_device(kind)
    if here is None:
        return None, ""
    timed = profile_blockwise(model, sample, device=here, microbatch_rows=list(rows), repeats=options["repeats"],
                              granularity=options["granularity"], loss_fn=loss_fn, target=target, cold_cache=True)
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
            real = materialise(largest, here)
            try:
                learnt = dataclasses.replace(learnt, optimizer=min(2.0, optimizer_bandwidth(real, optimizer, spec)))
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
    return learnt, (f"The roofline's efficiency was learnt on {here} here, a {spec.name}: "
                    f"{learnt.flops_for('bfloat16', spec):.0%} of peak FLOP/s and {learnt.bandwidth_for(spec):.0%} "
                    f"of memory bandwidth{stepped} (the catalogue's defaults: {spec.flops_efficiency:.0%}, "
                    f"{spec.bandwidth_efficiency:.0%}).")


def planned_note(devices: Sequence[str], gpus_per_node: int) -> str:
    """What the page says of a plan on catalogue devices."""
    from pipexplore.devices import device_spec, node_of

    spec = device_spec(devices[0])
    nodes = len({node_of(d, gpus_per_node) for d in devices})
    where = f"{nodes} node{'s' if nodes > 1 else ''} of {gpus_per_node}" if nodes > 1 else "one node"
    return (f"Planned: {len(set(devices))} × {spec.name} ({where}). Times are the catalogue's roofline of counted "
            f"FLOPs and bytes ({spec.flops_efficiency:.0%} of peak FLOP/s, {spec.bandwidth_efficiency:.0%} of memory "
            "bandwidth, links between stages by node), not measurements: export the plan (ex.export('torchrun')) and "
            "run it there.")


def profile_device(options: Mapping[str, Any]) -> torch.device:
    """Where layers are timed (``options``: ``granularity`` for traced models, ``repeats``, ``device``): the first stage's device, else the first GPU, else the CPU."""
    return as_device(options["device"] or ("cuda:0" if torch.cuda.is_available() else "cpu"))


def profile_layers(model: nn.Module, sample: TensorOrTensors, options: Mapping[str, Any], *, chunks: int,
                   devices: Sequence[Any], split_backward: bool = True, loss_fn: Any = None,
                   target: Any = None, optimizer: Any = None) -> pd.DataFrame:
    """Time every layer (or traced candidate) of a copy of ``model`` on ``sample``, at the
    micro-batch of ``chunks`` and at the whole batch, with the intra-op threads each CPU stage on
    ``devices`` runs with (the host's cores shared among the stages that run at once), so that
    what is predicted is what runs; and ``optimizer`` (the runs' factory, default SGD) stepping
    each layer's parameters (the table's ``optimizer`` column).

    Raises:
        ValueError: the sample does not fit the model (naming the layer that refused it).
    """
    from pipexplore.devices import is_planned

    if any(is_planned(d) for d in devices):
        return planned_layers(model, sample, options, chunks=chunks, devices=devices, loss_fn=loss_fn, target=target,
                              optimizer=optimizer, mixed_precision=options.get("mixed_precision", False))
    if on_meta(model):
        from pipexplore.models.blockwise import profile_blockwise

        return profile_blockwise(model, sample, device=profile_device(options), microbatch_rows=_rows(
            batch_size(sample), chunks), repeats=options["repeats"], granularity=options["granularity"])
    threads = stage_threads(devices)
    if not isinstance(model, nn.Sequential):
        from pipexplore.models.trace import candidates_in_rows

        # on the device the first stage runs on, as a Sequential's layers are (the model as given
        # may sit on the CPU: runs move each stage to its device)
        device = profile_device(options)
        with sharing_cores(threads):
            table = candidates_in_rows(copy.deepcopy(model).to(device), to_device(sample, device), chunks=chunks or 1,
                                       granularity=options["granularity"], loss_fn=loss_fn,
                                       target=to_device(target, device),
                                       repeats=options["repeats"], optimizer=optimizer,
                                       as_stages=options.get("stages", True), owned=True)
        table.attrs["threads"] = threads or torch.get_num_threads()
        return table
    rows = _rows(batch_size(sample), chunks)
    profiled = copy.deepcopy(model)
    with validate.naming_failing_layer(profiled, sample), profile_progress() as progress:
        # a sample that does not fit: which layer says so; in a notebook, a bar counts the layers
        return profile(profiled, sample, repeats=options["repeats"], microbatch_rows=rows,
                       device=profile_device(options), progress=progress, threads=threads,
                       split_backward=split_backward, optimizer=optimizer)


def with_backward_split(model: nn.Module, sample: TensorOrTensors, table: pd.DataFrame,
                        options: Mapping[str, Any]) -> pd.DataFrame:
    """``table`` with its input/weight-gradient split measured (zero-bubble runs its backward as
    those two passes); ``table`` itself where it has one, or for traced models."""
    if table.attrs.get("backward_split", True) or not isinstance(model, nn.Sequential):
        return table
    profiled = copy.deepcopy(model).to(profile_device(options))
    return backward_split(profiled, sample, table, repeats=options["repeats"])


def balanced_splits(table: pd.DataFrame, stages: int, by: str, executor: str = "threads") -> list[int]:
    """The splits into ``stages`` stages that minimise the most expensive one, ``by`` ``'time'``
    (forward + backward) or ``'size'`` (activations + twice the parameters), among those
    ``executor`` can run (:func:`pipexplore.splits.first_runnable_layer`).

    Raises:
        ValueError: ``by`` is neither.
    """
    if by == "time":
        costs = (table["forward"] + table["backward"]).tolist()
    elif by == "size":
        costs = (table["output_bytes"] + 2.0 * table["param_bytes"]).tolist()
    else:
        raise ValueError(f"balance by 'time' or 'size', not {by!r}")
    return optimal_splits(costs, stages, first=first_runnable_layer(table, executor, stages))


def thread_note(table: pd.DataFrame, plan: Plan) -> str:
    """What to say when the costs were timed with other intra-op threads than the plan's CPU
    stages run with (``''`` when they agree)."""
    profiled = table.attrs.get("threads")
    if profiled is None:
        return ""
    runs_with = stage_threads(plan.devices[: plan.num_devices]) or torch.get_num_threads()
    if runs_with == profiled:
        return ""
    return (f"Costs were timed with {profiled} intra-op thread(s); this plan's CPU stages run with {runs_with} "
            "each (the cores are shared among the stages): ex.reprofile() times them again.")
