"""Training memory per stage: what decides whether a plan fits its devices.

A stage holds its parameters, their gradients, the optimizer's state and, at its peak, the
activations the schedule keeps in flight (the predicted timeline's ``memory`` column: in-flight
micro-batches, checkpointed ones holding only their input)::

    stage bytes = params + grads + optimizer state + peak activations

Activation bytes a stage are one figure wherever they are reported (the stage table, the page's
figures and header, the sweep, the searches): :func:`activation_peaks`, the predicted timeline's
``memory`` at its largest. On a mesh that timeline is one GPU's: the plan's rank table
(:func:`pipexplore.predict.mesh_costs.mesh_layer_table`) counts what a rank keeps, ``1/tp`` of
every activation with sequence parallelism and ``1/cp`` of every sequence's with context
parallelism; data parallelism divides none of them (each replica, under FSDP too, runs its own
rows). :func:`microbatch_activations` is one micro-batch's part of it.

Optimizer state is read from the user's optimizer, as ``torch.optim`` allocates it: a step on a
probe parameter counts the state tensors the size of the parameter (SGD 0, SGD with momentum 1×,
Adam/AdamW 2×, Adagrad 1× the parameters, in their dtype). Known classes are read without a step.

``mixed_precision=True`` counts as Megatron-LM does for 16-bit training with fp32 master
weights: 16-bit parameters (2 bytes each), fp32 gradients (4), an fp32 master copy (4) and the
optimizer's state in fp32 (Adam: 8): 18 bytes a parameter (Korthikanti et al. 2022; Megatron-LM's
``theoretical_memory_usage``).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import pandas as pd

from pipexplore import validate

__all__ = ["optimizer_state_ratio", "optimizer_traffic", "stage_memory", "MEMORY_COLUMNS", "activation_peaks",
           "microbatch_activations", "check_data_parallel"]

#: The columns :func:`stage_memory` adds, in bytes (``fits``: whether ``peak_bytes`` is within the capacity).
MEMORY_COLUMNS = ["param_bytes", "grad_bytes", "optimizer_bytes", "gathered_bytes", "activation_bytes", "peak_bytes",
                  "capacity", "fits"]

#: State tensors per parameter of the ``torch.optim`` classes whose state is known without a step.
_KNOWN_STATES = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "RMSprop": 1,
                 "Adadelta": 2, "Rprop": 2}


def _known_ratio(optimizer: Any) -> Optional[float]:
    """State per parameter byte of a ``torch.optim`` class (or a ``functools.partial`` of one)
    read from its name and keywords; None where it cannot be read without a step."""
    keywords: dict[str, Any] = {}
    if isinstance(optimizer, functools.partial):
        keywords, optimizer = dict(optimizer.keywords or {}), optimizer.func
    if not isinstance(optimizer, type) or optimizer.__module__.split(".")[:2] != ["torch", "optim"]:
        return None
    name = optimizer.__name__
    if name == "SGD":
        return 1.0 if keywords.get("momentum", 0) else 0.0
    if name in ("Adam", "AdamW") and keywords.get("amsgrad"):
        return 3.0
    if name == "RMSprop":
        return 1.0 + bool(keywords.get("momentum", 0)) + bool(keywords.get("centered", False))
    return float(_KNOWN_STATES[name]) if name in _KNOWN_STATES else None


def optimizer_state_ratio(optimizer: Optional[Callable[[Any], Any]] = None) -> float:
    """Bytes of optimizer state per byte of parameter: 0 for the runs' default (None:
    :data:`pipexplore.training.default_optimizer`, SGD without momentum).

    ``optimizer`` is what the explorer takes (``optimizer(parameters)`` returning a
    ``torch.optim.Optimizer``). Where it is not a known ``torch.optim`` class, one step on a probe
    parameter of 4,096 float32 elements counts the state tensors of the parameter's size (scalars
    such as Adam's ``step`` are left out).

    Example::

        optimizer_state_ratio(torch.optim.AdamW)                          # 2.0
        optimizer_state_ratio(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))   # 1.0

    Raises:
        TypeError: ``optimizer(parameters)`` does not give an optimizer.
    """
    from pipexplore.training import Training

    optimizer = Training.of(optimizer=optimizer).optimizer
    known = _known_ratio(optimizer)
    if known is not None:
        return known
    import torch

    probe = torch.nn.Parameter(torch.zeros(4096))
    probe.grad = torch.full_like(probe, 1e-3)
    opt = optimizer([probe])
    if not hasattr(opt, "step") or not hasattr(opt, "state"):
        raise TypeError(f"optimizer(parameters) must return a torch.optim.Optimizer, got {type(opt).__name__}")
    opt.step()
    states = opt.state.get(probe, {})
    sized = sum(v.numel() * v.element_size() for v in states.values()
                if isinstance(v, torch.Tensor) and v.numel() == probe.numel())
    return sized / (probe.numel() * probe.element_size())


#: How data-parallel replicas hold the training state: ``ddp`` replicated (gradients all-reduced),
#: ``zero1`` the optimizer's state (and fp32 master weights) sharded across the replicas (Megatron-LM's
#: distributed optimizer), ``fsdp`` parameters, gradients and optimizer state sharded (FSDP2).
DATA_PARALLEL = ("ddp", "zero1", "fsdp")


def check_data_parallel(name: str) -> str:
    """``name`` where it is one of :data:`DATA_PARALLEL`.

    Raises:
        ValueError: another name, the known ones named.
    """
    return validate.one_of(name, "data_parallel", DATA_PARALLEL,
                           "replicated, optimizer state sharded, everything sharded")


def activation_peaks(predicted: pd.DataFrame, stages: int) -> list[float]:
    """Bytes of activations each of ``stages`` stages holds at its peak, on one GPU: the largest of
    the predicted timeline's ``memory`` by stage (what its schedule keeps in flight, checkpointed
    micro-batches holding their input; :func:`pipexplore.predict.frames.held_activations`). On a
    mesh the timeline is a rank's, its bytes divided by ``tp · cp`` (the module docstring). 0 for a
    stage with no memory in the timeline, NaN for every stage where it has no ``memory`` column.

    Example::

        activation_peaks(plan.predicted, plan.num_stages)   # [3.1e9, 2.4e9, ...]
    """
    if "memory" not in predicted:
        return [math.nan] * stages
    peaks = np.zeros(stages)
    np.maximum.at(peaks, predicted["stage"].to_numpy(dtype=int),
                  predicted["memory"].fillna(0.0).to_numpy(dtype=float))
    return [float(v) for v in peaks]


def microbatch_activations(predicted: pd.DataFrame, stages: int) -> list[float]:
    """Bytes one micro-batch's activations take on one GPU of each of ``stages`` stages: what its
    layers keep for backward (the rank table's ``saved_bytes``, else outputs, summed over the
    stage) for the largest micro-batch's rows, as the simulator counts them (the timeline's
    ``attrs['microbatch_activation_bytes']``); NaN where the timeline does not say.

    Never more than the stage's :func:`activation_peaks`: every micro-batch's forward keeps all of
    it (or, checkpointed, its recomputation brings it back before the backward), so the timeline
    holds at least one micro-batch's whole at some moment.

    Example::

        microbatch_activations(plan.predicted, plan.num_stages)   # [1.0e9, 0.8e9, ...]
    """
    given = predicted.attrs.get("microbatch_activation_bytes")
    if given is None or len(given) != stages:
        return [math.nan] * stages
    return [float(v) for v in given]


def stage_memory(table: pd.DataFrame, splits: Sequence[int], *,
                 peak_activations: Union[Sequence[float], np.ndarray],
                 optimizer: Optional[Callable[[Any], Any]] = None, mixed_precision: bool = False,
                 capacity: Sequence[float] = (), tp: int = 1, dp: int = 1, data_parallel: str = "ddp",
                 sequence_parallel: bool = True, reshard_after_forward: bool = True, cp: int = 1, ep: int = 1,
                 etp: int = 1) -> pd.DataFrame:
    """Per stage of ``table`` split at ``splits``, on one GPU of its mesh: parameter, gradient,
    optimizer and peak activation bytes, FSDP's ``gathered_bytes``, their sum ``peak_bytes``, the
    ``capacity`` of the stage's device (NaN: unknown) and whether the stage ``fits`` it (True where
    the capacity is unknown).

    ``peak_activations``: what the schedule holds at its peak per stage, on one GPU
    (:func:`activation_peaks`: on a mesh, the rank table's bytes, already divided by ``tp · cp``),
    taken as given. Gradients are the table's ``grad_bytes`` where it
    has them (parameters that train), else its ``param_bytes``. ``mixed_precision``: 2 bytes a
    parameter, 4 of fp32 gradient, 4 of fp32 master weight and the state in fp32 (the table's
    ``params`` counts, else parameter bytes / 2).

    On a mesh: ``tp`` ranks shard every stage's parameters, gradients and state (with
    ``sequence_parallel``, its activations too, as the rank table counts them: Korthikanti et al.
    2022, Table 2: ``34/t``; without it, which tensors each rank keeps whole depends on the block,
    and is refused here rather than guessed: a share of a GPT block's would miss a Llama's); ``dp`` replicas shard what
    ``data_parallel`` (:data:`DATA_PARALLEL`) says: ``zero1`` the optimizer's state and the fp32
    master weights (Megatron-LM's 6 + 12/d bytes a parameter with mixed-precision Adam), ``fsdp``
    everything, each GPU then gathering the parameters it computes with: one layer at a time with
    ``reshard_after_forward`` (the stage's largest), else the whole stage's. ``cp`` context-parallel
    ranks (each holding ``1/cp`` of every sequence's activations, as the rank table counts them)
    shard the state with the replicas (``zero1``, ``fsdp`` over ``dp · cp`` ranks: they hold the
    same parameters).

    A mixture of experts' routed experts (the table's ``expert_params``, ``expert_param_bytes`` and
    ``expert_grad_bytes``: :data:`pipexplore.models.meta.EXPERT_COLUMNS`) are held as the mesh folds
    them (:class:`pipexplore.devices.mesh.Mesh`): sharded over ``ep × etp`` ranks, not ``tp``, and
    ``data_parallel`` shards their state over the ``edp = tp·cp·dp / (ep·etp)`` ranks holding the same
    experts, as Megatron-Core's distributed optimizer and torchtitan's FSDP over ``efsdp`` do; their
    routers (``router_param_bytes``) are whole on every tensor-parallel rank; the dense rest as above
    (Megatron-LM's ``theoretical_memory_usage`` with its expert fix, #4687).

    Example::

        stage_memory(table, [40], peak_activations=[3e9 / 8, 1e9 / 8], optimizer=torch.optim.AdamW,
                     capacity=[80e9, 80e9], tp=8, dp=4, data_parallel="zero1")
        stage_memory(moe_table, [47], peak_activations=[4e9, 4e9], optimizer=torch.optim.AdamW,
                     mixed_precision=True, tp=2, dp=16, ep=32, data_parallel="zero1")
    """
    from pipexplore.predict.costs import stage_sums  # the same sums the stage costs use

    n = len(table)
    points = [0, *splits, n]
    activations = np.asarray(list(peak_activations), dtype=float)
    if len(activations) != len(points) - 1:
        raise ValueError(f"peak_activations has {len(activations)} values for {len(points) - 1} stages")
    check_data_parallel(data_parallel)
    for value, name in ((tp, "tp"), (dp, "dp"), (cp, "cp"), (ep, "ep"), (etp, "etp")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} is a whole number of ranks from 1, got {value!r}")
    if (tp * cp * dp) % (ep * etp):
        raise ValueError(f"ep {ep} × etp {etp} does not divide tp·cp·dp = {tp * cp * dp}: the experts are folded "
                         "over a stage's tensor-, context- and data-parallel GPUs")
    if tp > 1 and not sequence_parallel:
        raise ValueError("tensor parallelism without sequence parallelism: which activations each rank keeps whole "
                         "is not counted yet; plan it with sequence_parallel=True, as Megatron-LM's large runs do")
    ratio = optimizer_state_ratio(optimizer)
    given = _columns(table, ("param_bytes", "grad_bytes", "params", "expert_param_bytes", "expert_grad_bytes",
                             "expert_params", "router_param_bytes", "router_params"))
    raw = given.get("param_bytes", np.zeros(n))
    grads_raw = given.get("grad_bytes", raw)
    counts_raw = given.get("params", raw / 2.0)
    expert_raw = given.get("expert_param_bytes", np.zeros(n))
    expert_grads_raw = given.get("expert_grad_bytes", expert_raw)
    expert_counts_raw = given.get("expert_params", expert_raw / 2.0)
    router_raw = given.get("router_param_bytes", np.zeros(n))
    router_counts_raw = given.get("router_params", router_raw / 2.0)
    dense_raw = raw - expert_raw
    router_grads_raw = router_raw * (grads_raw - expert_grads_raw) / np.where(dense_raw > 0, dense_raw, 1.0)
    # (dense, tp-sharded, replicas dp·cp), (routers, whole on every rank, replicas dp·cp) and (routed
    # experts, ep·etp-sharded, replicas edp): Megatron-LM's three kinds of parameter (#4687)
    parts = [(dense_raw - router_raw, grads_raw - expert_grads_raw - router_grads_raw,
              counts_raw - expert_counts_raw - router_counts_raw, tp, dp * cp),
             (router_raw, router_grads_raw, router_counts_raw, 1, dp * cp),
             (expert_raw, expert_grads_raw, expert_counts_raw, ep * etp, tp * cp * dp // (ep * etp))]
    zeros = np.zeros(len(points) - 1)
    params, grads, states, gathered = zeros.copy(), zeros.copy(), zeros.copy(), zeros.copy()
    layer_held = np.zeros(n)  # a GPU's bytes of each layer's parameters, before data parallelism
    for part_raw, part_grads, part_counts, shards, replicas in parts:
        if not part_raw.any():
            continue
        p, g = stage_sums(part_raw, points), stage_sums(part_grads, points)
        if mixed_precision:
            c = stage_sums(part_counts, points)
            trained = c * (g / np.where(p > 0, p, 1.0))  # the share of them that trains
            p_held, g_held, s_held = 2.0 * c, 4.0 * trained, 4.0 * trained * (1.0 + ratio)
            layer_held += 2.0 * part_counts / shards
        else:
            p_held, g_held, s_held = p, g, g * ratio
            layer_held += part_raw / shards
        p_held, g_held, s_held = p_held / shards, g_held / shards, s_held / shards
        if data_parallel == "zero1":  # the optimizer's state sharded (with mixed precision: the fp32 master copy too)
            s_held = s_held / replicas
        if data_parallel == "fsdp":
            if not reshard_after_forward:
                gathered = gathered + p_held
            p_held, g_held, s_held = p_held / replicas, g_held / replicas, s_held / replicas
        params, grads, states = params + p_held, grads + g_held, states + s_held
    if data_parallel == "fsdp" and reshard_after_forward and n:  # one layer at a time: the stage's largest
        gathered = np.maximum.reduceat(layer_held, points[:-1])
    peak = params + grads + states + gathered + activations
    caps = np.asarray(list(capacity) if len(capacity) else [math.nan] * len(params), dtype=float)
    return pd.DataFrame({"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": states,
                         "gathered_bytes": gathered, "activation_bytes": activations, "peak_bytes": peak,
                         "capacity": caps, "fits": np.isnan(caps) | (peak <= caps)})


def _column(table: pd.DataFrame, name: str, n: int) -> np.ndarray:
    return table[name].to_numpy(dtype=float) if name in table else np.zeros(n)


def _columns(table: pd.DataFrame, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The columns of ``names`` that ``table`` has, as floats, read at once (each read of a column
    copies the table's ``attrs``)."""
    present = [name for name in names if name in table]
    values = table[present].to_numpy(dtype=float) if present else np.zeros((len(table), 0))
    return {name: values[:, i] for i, name in enumerate(present)}


def optimizer_traffic(table: pd.DataFrame, *, optimizer: Optional[Callable[[Any], Any]] = None,
                      mixed_precision: bool = False) -> np.ndarray:
    """Bytes an optimizer step moves per layer of ``table``: ``torch.optim``'s implementation
    reads and writes the parameter ``p``, the gradient ``g`` and the states and temporaries ``s``
    times (:func:`pipexplore.predict.planned_optimizer.step_passes`: foreach Adam ``(2, 3, 14)``),
    each of the gradients' bytes. Mixed precision: the optimizer steps fp32 master weights with
    fp32 gradients and states (4 bytes each pass) and writes the 16-bit weight (2):
    ``4·(p + g + s) + 2`` bytes a trained parameter. An optimizer step is bound by memory
    bandwidth: seconds are these bytes over it
    (:func:`pipexplore.predict.planned_optimizer.planned_optimizer_seconds` for one layer)."""
    from pipexplore.predict.planned_optimizer import step_passes

    n = len(table)
    passes = sum(step_passes(optimizer))
    grads = _column(table, "grad_bytes", n) if "grad_bytes" in table else _column(table, "param_bytes", n)
    if not mixed_precision:
        return grads * passes
    params = _column(table, "param_bytes", n)
    counts = _column(table, "params", n) if "params" in table else params / 2.0
    trained = counts * (grads / np.where(params > 0, params, 1.0))
    return trained * (4.0 * passes + 2.0)
