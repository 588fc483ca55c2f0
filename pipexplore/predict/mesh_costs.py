"""What a mesh adds to a pipeline rank's step: data parallelism's collectives, FSDP's gathers, sends.

The layer table of a plan with a mesh is one tensor-parallel rank's (its compute and its
tensor-parallel collectives: :mod:`pipexplore.models.sharded`). What the other dimensions add is
costed here over each group's links (:mod:`pipexplore.predict.collectives`), where torch's runtime
puts it:

=================  ===========================================================================================
``ddp``            gradients all-reduced over the data-parallel group at the step's end (after each stage's
                   last backward, before its optimizer step; exposed, as in torch's pipelining runtime,
                   which reduces a stage's gradients once its micro-batches are done)
``zero1``          gradients reduce-scattered, the optimizer steps its ``1/dp`` shard, the updated
                   parameters all-gathered (Megatron-LM's distributed optimizer)
``fsdp``           ``REDUCE_GRAD``: gradients reduce-scattered after the stage's last backward; ``UNSHARD``:
                   parameters all-gathered. Both placed as torch's own lowering places them
                   (:mod:`pipexplore.predict.fsdp_actions`: ``unshard_seconds``, ``reduce_grad_seconds``).
                   With ``reshard_after_forward=False`` (torchtitan's choice under a pipeline) a stage is
                   gathered when torch's runtime issues its ``UNSHARD`` (once a step for ranks of up to
                   three stages); with ``True`` every micro-batch's forward gathers each layer again,
                   and a backward where a forward resharded the stage since its last backward (torch's
                   stage keeps it unsharded from one backward to the next: GPipe's backwards gather
                   once, 1F1B's each), prefetched behind the layer before (FSDP2 overlaps them): only
                   what a gather takes beyond its layer's compute is exposed
=================  ===========================================================================================

A mixture of experts' routed experts are folded over the same GPUs (:class:`~pipexplore.devices.mesh.Mesh`:
``etp × ep × edp`` a stage): a GPU holds ``1/(ep·etp)`` of each layer's experts (the table's
``expert_param_bytes``) where the dense layers hold ``1/tp``, and computes its own tokens' share of
the routed work whatever ``ep`` is (the count's: :mod:`pipexplore.models.experts`); its grouped
GEMMs read and write ``1/(ep·etp)`` of the experts' weights and their gradients, which the table's
``attrs['expert_shares']`` takes off its layers' seconds (the roofline of the experts' own kernels at
that share: :func:`pipexplore.models.experts.share_costs`). Its experts'
gradients are reduced, and under ``zero1``/``fsdp`` their state sharded, over the ``edp`` ranks
holding the same experts (Megatron-Core's expert data-parallel group, torchtitan's ``efsdp``), the
dense rest's over ``dp · cp``. Each layer's routed tokens (``top_k`` copies of a rank's
``1/(tp·cp)`` of the tokens) are exchanged over the ``ep`` group to the experts' ranks and back by
the all-to-alls torch ran counting the layer as an expert-parallel rank
(:func:`pipexplore.models.expert_parallel.count_exchange`, the table's ``attrs['expert_shares']``
``exchange_bytes`` and ``exchange_calls``: forward the split counts, the dispatch and the combine,
backward their gradients; a table without them, two each way of its ``dispatch_bytes``), with
``etp`` gathered over and scattered back across the ``etp`` group too, each costed as the cluster's
collectives are (:func:`pipexplore.predict.collectives.linear_cost`: ``all_to_all``, NVLink inside
a node, the node's network across) and exposed (``ep_seconds``, drawn as ``ep all_to_all`` on the
collectives lane; each phase's part of a layer's ``forward_a`` … ``backward_b`` is its ``ep_forward_a``
… ``ep_backward_b``), unless the plan's ``moe_overlap`` hides them behind another micro-batch's
compute where the schedule pairs a forward and a backward (:mod:`pipexplore.predict.moe_overlap`:
drawn hidden and exposed). Routing is balanced unless ``capacity_factor`` makes the rank the busiest of its
group: its experts' token-bound kernels and its all-to-alls' bytes scale by it.

How the tokens travel is the plan's ``moe_dispatcher``: each routed copy by the all-to-all above
(``alltoall``, the default), or once a destination node and GPU (``hybridep``, ``deepep``), costed as
:mod:`pipexplore.predict.moe_dispatch` says.

Context parallelism (``cp`` ranks splitting each sequence, its chunks balanced across them as
Llama 3 and torchtitan balance causal attention) leaves a rank ``1/cp`` of every layer's work that
grows with the tokens (the fitted per-row seconds, the activations, the tensor-parallel
collectives' bytes) and adds, in each attention layer, Llama 3's all-gather of the keys and values
over the ``cp`` group forward and the reduce-scatter of their gradients backward (``cp_seconds``),
exposed. Gradients are then reduced, and ``zero1``/``fsdp`` state sharded, over the ``dp · cp``
ranks that hold the same parameters.

Every collective is costed as NCCL runs it over the group's devices
(:func:`pipexplore.predict.collectives.collective_cost`: ring or tree, channels over every NIC the
group has on a node). A step-end collective runs in buckets of 25 MiB (DDP's and Megatron-LM's
bucket size; the whole gradient where it is smaller), each costed so; a layer's share is its bytes'
share, so a step-end collective is not charged a layer's worth of latencies. Context parallelism's
gathers are costed at a micro-batch's keys and values, their fixed part once a layer and the rest
by the row (:func:`~pipexplore.predict.collectives.linear_cost`). With sequence parallelism a rank
keeps ``1/tp`` of every activation (Korthikanti et al. 2022, Table 2: ``34/t`` a layer): the rank
table's ``saved_bytes`` and
``output_bytes`` (the sends between stages) are divided so, and the predicted timeline's
``memory`` is one GPU's activations (:func:`pipexplore.predict.memory.activation_peaks`).

:func:`mesh_layer_table` turns a rank's table into one the simulator reads as it reads any: the
step-end collectives join each stage's ``optimizer`` action, the exposed gathers its forward and
backward, and the columns ``dp_seconds``/``gather_seconds`` say which is which.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd

from pipexplore import validate
from pipexplore.devices.mesh import Mesh
from pipexplore.predict.collectives import collective_seconds, linear_cost
from pipexplore.predict.moe_dispatch import check_dispatcher, dispatch_cost

__all__ = ["BUCKET_BYTES", "mesh_layer_table", "MESH_COLUMNS", "collective_rows", "with_collective_rows",
           "collective_layers", "COLLECTIVE_LANE"]

#: Bytes a gradient bucket holds (DDP's ``bucket_cap_mb=25``): a step-end collective's latency is paid per bucket.
BUCKET_BYTES = 25 * 2**20
#: The columns :func:`mesh_layer_table` adds, seconds per layer: step-end data-parallel collectives
#: (``dp_seconds``), FSDP's gathers a micro-batch (``gather_seconds``), context parallelism's
#: gathers of keys and values, forward and backward, for the whole batch (``cp_seconds``); FSDP's
#: gather of the layer where torch's runtime issues ``UNSHARD`` (``unshard_seconds``) and the part of
#: ``dp_seconds`` that is its ``REDUCE_GRAD`` (``reduce_grad_seconds``): the simulator places both.
#: The experts' all-to-all (and, with ``etp``, their gathers and scatters) for the whole batch, forward
#: and backward, is ``ep_seconds``.
MESH_COLUMNS = ["dp_seconds", "gather_seconds", "cp_seconds", "unshard_seconds", "reduce_grad_seconds",
                "ep_seconds"]


def _ring(kind: str, nbytes: np.ndarray, devices: Sequence[str], gpus_per_node: int) -> np.ndarray:
    """Seconds of ``kind`` for each layer's ``nbytes`` over the group ``devices``: the collective runs
    in buckets of :data:`BUCKET_BYTES` (the whole, where smaller), each as NCCL runs it; a layer's
    share is its bytes'."""
    nbytes = np.asarray(nbytes, dtype=float)
    total = float(nbytes.sum())
    if len(devices) < 2 or total <= 0:
        return np.zeros(len(nbytes))
    bucket = min(float(BUCKET_BYTES), total)
    return nbytes * (collective_seconds(kind, bucket, devices, gpus_per_node) / bucket)


def mesh_layer_table(table: pd.DataFrame, mesh: Mesh, devices: Sequence[str], *, gpus_per_node: int = 8,
                     data_parallel: str = "ddp", sequence_parallel: bool = True, reshard_after_forward: bool = False,
                     mixed_precision: bool = False, capacity_factor: float = 1.0,
                     moe_dispatcher: str = "alltoall") -> pd.DataFrame:
    """``table`` (one tensor-parallel rank's layers; its ``rank_param_bytes`` where counted so) as the
    pipeline rank of ``mesh`` over ``devices`` (all of the mesh's, rank order) runs them (the module
    docstring): ``optimizer`` (seconds at the step's end) plus the data-parallel collectives and the
    optimizer's ``1/dp`` share where its state is sharded; ``forward_a``/``backward_a`` plus FSDP's
    exposed gathers; ``output_bytes`` and ``saved_bytes`` divided by ``tp`` with sequence parallelism
    (and by ``cp``), so that the timeline's ``memory`` is one GPU's; and the columns of
    :data:`MESH_COLUMNS`. Gradients move in the parameters' dtype, in fp32 with ``mixed_precision``.
    ``capacity_factor``: the rank is the busiest of its ``ep`` group, its experts receiving that many
    times their balanced share of the tokens (1, the default: balanced routing, as NVIDIA's published
    benchmarks force it): its experts' kernels that grow with the tokens (the table's
    ``attrs['expert_shares']`` ``expert_b``) and its all-to-alls' bytes scale so. ``moe_dispatcher``:
    how the routed tokens travel (:data:`~pipexplore.predict.moe_dispatch.MOE_DISPATCHERS`).
    """
    from pipexplore.predict.memory import check_data_parallel

    check_data_parallel(data_parallel)
    check_dispatcher(moe_dispatcher)
    capacity_factor = validate.capacity_factor(capacity_factor, ep=mesh.ep)
    out = table.copy()
    out.attrs = {key: table.attrs[key] for key in ("batch", "rows") if key in table.attrs}  # (each column read
    n = len(out)  # copies the attrs: the table's whole come back at the end)
    whole = out["param_bytes"].to_numpy(dtype=float) if "param_bytes" in out else np.zeros(n)
    counted = out["rank_param_bytes"].to_numpy(dtype=float) if "rank_param_bytes" in out else whole / mesh.tp
    experts = out["expert_param_bytes"].to_numpy(dtype=float) if "expert_param_bytes" in out else np.zeros(n)
    counted_experts = (out["rank_expert_param_bytes"].to_numpy(dtype=float) if "rank_expert_param_bytes" in out
                       else experts if "rank_param_bytes" in out else experts / mesh.tp)
    trained = (out["grad_bytes"].to_numpy(dtype=float) / np.maximum(whole, 1.0)) if "grad_bytes" in out else 1.0
    # a GPU's parameters: the dense ones as the tensor-parallel rank holds them, its 1/(ep·etp) of the experts
    dense_params = counted - counted_experts
    expert_params = experts / (mesh.ep * mesh.etp)
    fp32 = 2.0 if mixed_precision else 1.0  # fp32 gradients, 16-bit parameters
    step_end = np.zeros(n)
    gathers = np.zeros(n)
    unshard = np.zeros(n)
    context = np.zeros(n)
    moved = np.zeros(n)
    held = np.zeros(n)  # the bytes of parameters whose state the optimizer steps on this GPU
    shares = table.attrs.get("expert_shares") or {}
    at = np.flatnonzero(np.asarray(shares.get("shares", ()), dtype=int) == mesh.ep * mesh.etp)
    if len(at) and mesh.ep * mesh.etp > 1 and all(column in out for column in shares["columns"]):
        for column, change in zip(shares["columns"], shares["changes"][at[0]]):  # a GPU's 1/(ep·etp) of the experts
            out[column] = out[column].to_numpy(dtype=float) + change
        for phase in ("forward", "backward"):
            out[phase] = out[f"{phase}_a"] + out[f"{phase}_b"] * float(table.attrs.get("batch") or 1)
    hot = np.asarray(shares.get("expert_b", ()), dtype=float)
    if capacity_factor > 1 and hot.shape == (2, n):  # the busiest rank's experts compute more tokens
        for i, phase in enumerate(("forward", "backward")):
            out[f"{phase}_b"] = out[f"{phase}_b"].to_numpy(dtype=float) + (capacity_factor - 1) * hot[i]
            if phase in out:
                out[phase] = out[f"{phase}_a"] + out[f"{phase}_b"] * float(table.attrs.get("batch") or 1)
    if mesh.cp > 1:
        out, context = _context_parallel(out, mesh, devices, gpus_per_node)
    if "dispatch_bytes" in out and mesh.size > 1:
        out, moved = _expert_exchange(out, mesh, devices, gpus_per_node, float(capacity_factor), shares,
                                      moe_dispatcher, table.attrs.get("experts"))
    dp_group = [devices[r] for r in range(mesh.size)
                if mesh.coordinates(r)["tp"] == 0 and mesh.coordinates(r)["pp"] == 0]
    edp_group = [devices[r] for r in mesh.group("edp", 0)]
    for params, group in ((dense_params, dp_group), (expert_params, edp_group)):
        replicas = len(group)  # the ranks holding the same parameters: dp · cp, or edp for the experts
        grads = params * trained * fp32
        sharded = data_parallel in ("zero1", "fsdp") and replicas > 1
        held = held + (params / replicas if sharded else params)
        if replicas < 2 or not params.any():
            continue
        if data_parallel == "ddp":
            step_end = step_end + _ring("all_reduce", grads, group, gpus_per_node)
            continue
        # the gradients reduce-scattered; zero1 then gathers the updated parameters, FSDP its next unshard
        step_end = step_end + _ring("reduce_scatter", grads, group, gpus_per_node)
        gather = _ring("all_gather", params, group, gpus_per_node)
        if data_parallel == "zero1":
            step_end = step_end + gather
        elif reshard_after_forward:
            gathers = gathers + gather
        else:
            unshard = unshard + gather
    if "optimizer" in out:  # the optimizer steps the shard this GPU holds (the table's: the counted rank's)
        out["optimizer"] = out["optimizer"].to_numpy(dtype=float) * np.where(counted > 0, held / np.maximum(
            counted, 1.0), 1.0)
    if "optimizer" in out:
        out["optimizer"] = out["optimizer"].to_numpy(dtype=float) + step_end
    if gathers.any():  # each layer gathered again, behind the layer before: every forward, and a backward
        for phase in ("forward", "backward"):  # where a forward resharded it since (placed by the simulator)
            compute = out[f"{phase}_a"].to_numpy(dtype=float) + out[f"{phase}_b"].to_numpy(dtype=float) * (
                float(table.attrs.get("rows", (1,))[0]))
            exposed = np.maximum(0.0, gathers - np.roll(compute, 1))
            exposed[0] = gathers[0]
            if phase == "forward":
                out["forward_a"] = out["forward_a"].to_numpy(dtype=float) + exposed
            out[f"{phase}_gather_exposed"] = exposed
    if sequence_parallel and mesh.tp > 1:  # a rank keeps 1/tp of every activation (the counts are the model's)
        for column in ("output_bytes", "saved_bytes"):
            if column in out:
                out[column] = out[column].to_numpy(dtype=float) / mesh.tp
    out["dp_seconds"] = step_end
    out["gather_seconds"] = gathers
    out["cp_seconds"] = context
    out["unshard_seconds"] = unshard
    out["reduce_grad_seconds"] = step_end if data_parallel == "fsdp" else np.zeros(n)
    out["ep_seconds"] = moved
    out.attrs = dict(table.attrs)
    return out


def _expert_exchange(table: pd.DataFrame, mesh: Mesh, devices: Sequence[str], gpus_per_node: int,
                     capacity_factor: float = 1.0, shares: Optional[dict] = None, dispatcher: str = "alltoall",
                     experts: Optional[dict] = None) -> tuple[pd.DataFrame, np.ndarray]:
    """``table`` with each layer's routed tokens exchanged as ``mesh`` folds its experts (the module
    docstring): the all-to-alls over the ``ep`` group that torch ran counting the layer (forward the
    split counts, the dispatch and the combine; backward the combine's and the dispatch's gradients:
    ``shares``, the table's ``attrs['expert_shares']``: ``exchange_bytes`` and ``exchange_calls``), else two each
    way of ``dispatch_bytes``; with ``etp`` the ``etp`` group's gather and scatter of them; exposed,
    a micro-batch's fixed part once an all-to-all, the rest by the row; the busiest rank's at
    ``capacity_factor`` times the tokens; by ``dispatcher`` (``experts``: the table's ``attrs['experts']``,
    :func:`~pipexplore.predict.moe_dispatch.dispatch_cost`). Returns it and each layer's seconds of them
    for the whole batch."""
    out = table.copy()
    n = len(out)
    batch = float(table.attrs.get("batch") or 1)
    rows = float(table.attrs.get("rows", (1,))[0])  # a micro-batch's: what each exchange moves
    shares = shares or {}
    counted = shares.get("exchange_bytes")
    if counted is not None and np.shape(counted) == (2, n):  # a row's bytes a GPU, each phase (the count's rank's)
        moved = np.asarray(counted, dtype=float) / mesh.cp
        calls = np.asarray(shares["exchange_calls"], dtype=float)
    else:  # the dispatch and the combine of top_k copies of a GPU's tokens, each way
        dispatched = out["dispatch_bytes"].to_numpy(dtype=float) / batch / (mesh.tp * mesh.cp)
        moved, calls = np.stack([2 * dispatched] * 2), np.stack([2.0 * (dispatched > 0)] * 2)
    moved = moved * float(capacity_factor)  # the busiest rank receives capacity_factor times its share
    tokens = calls.max(axis=0) if calls.size else np.zeros(n)
    point = float((moved / np.maximum(calls, 1.0)).max()) * rows if moved.size else 0.0  # one all-to-all's tensor
    fixed, per_byte = np.zeros((2, n)), np.zeros((2, n))
    if mesh.ep > 1 and point > 0:
        latency, rate = dispatch_cost(point, [devices[r] for r in mesh.group("ep", 0)], gpus_per_node, dispatcher,
                                      experts)
        fixed, per_byte = fixed + latency * calls, per_byte + rate * moved
    if mesh.etp > 1 and point > 0:
        group = [devices[r] for r in mesh.group("etp", 0)]
        for kind in ("all_gather", "reduce_scatter"):  # the etp group's tokens gathered, their outputs scattered
            latency, rate = linear_cost(kind, point * mesh.etp, group, gpus_per_node)
            fixed, per_byte = fixed + latency * (tokens > 0), per_byte + rate * mesh.etp * moved / 2
    if not fixed.any() and not per_byte.any():
        return out, np.zeros(n)
    for i, phase in enumerate(("forward", "backward")):
        out[f"{phase}_a"] = out[f"{phase}_a"].to_numpy(dtype=float) + fixed[i]
        out[f"{phase}_b"] = out[f"{phase}_b"].to_numpy(dtype=float) + per_byte[i]
        out[f"ep_{phase}_a"], out[f"ep_{phase}_b"] = fixed[i], per_byte[i]  # (what moe_overlap may hide)
        if phase in out:
            out[phase] = out[f"{phase}_a"] + out[f"{phase}_b"] * batch
    return out, (fixed.sum(axis=0) * batch / max(rows, 1.0) + per_byte.sum(axis=0) * batch)


def _context_parallel(table: pd.DataFrame, mesh: Mesh, devices: Sequence[str],
                      gpus_per_node: int) -> tuple[pd.DataFrame, np.ndarray]:
    """``table`` as one of ``mesh.cp`` context-parallel ranks runs it (the module docstring), and
    each layer's seconds of key-value gathers for the whole batch."""
    out = table.copy()
    cp = mesh.cp
    for phase in ("forward", "backward"):
        if f"{phase}_b" in out:
            out[f"{phase}_b"] = out[f"{phase}_b"].to_numpy(dtype=float) / cp
        if f"{phase}_comm" in out:
            out[f"{phase}_comm"] = out[f"{phase}_comm"].to_numpy(dtype=float) / cp
    for column in ("output_bytes", "saved_bytes"):
        if column in out:
            out[column] = out[column].to_numpy(dtype=float) / cp
    batch = float(table.attrs.get("batch") or 1)
    kv = (out["kv_bytes"].to_numpy(dtype=float) / mesh.tp if "kv_bytes" in out else np.zeros(len(out))) / batch
    group = [devices[r] for r in mesh.group("cp", 0)]
    rows = float(table.attrs.get("rows", (1,))[0])  # a micro-batch's: what each gather moves
    point = float(kv.max()) * rows if len(kv) else 0.0
    gather_fixed, gather_per_byte = linear_cost("all_gather", point, group, gpus_per_node)
    scatter_fixed, scatter_per_byte = linear_cost("reduce_scatter", point, group, gpus_per_node)
    gather_row = gather_per_byte * kv  # a row's keys and values, whole
    scatter_row = scatter_per_byte * kv
    attends = kv > 0
    out["forward_b"] = out["forward_b"].to_numpy(dtype=float) + gather_row
    out["backward_b"] = out["backward_b"].to_numpy(dtype=float) + scatter_row
    out["forward_a"] = out["forward_a"].to_numpy(dtype=float) + attends * gather_fixed
    out["backward_a"] = out["backward_a"].to_numpy(dtype=float) + attends * scatter_fixed
    for phase in ("forward", "backward"):
        if phase in out:
            out[phase] = out[f"{phase}_a"] + out[f"{phase}_b"] * batch
    return out, (gather_row + scatter_row) * batch


def _placed_rows(predicted: pd.DataFrame, placed: tuple) -> list[tuple]:
    """Rows for FSDP's ``UNSHARD``s and ``REDUCE_GRAD``s where the simulator placed them (its
    ``attrs['fsdp']``: :func:`pipexplore.predict.simulator.simulate`): a gather issued at the step's
    start ends at its release time, exposed where its use waited for it; one issued mid-step sits
    before its use, its exposed part at the use's start; a reduce-scatter follows its stage's last
    backward, exposed where its rank's compute did not hide all of it."""
    if not placed:
        return []
    keys = list(zip(predicted["stage"].tolist(), predicted["phase"].tolist(), predicted["microbatch"].tolist()))
    where = {key: i for i, key in enumerate(keys)}
    start, end = predicted["start"].to_numpy(dtype=float), predicted["end"].to_numpy(dtype=float)
    rows: list[tuple] = []
    for record in placed:
        i = where.get(record[2])
        if i is None or record[0] == "regather":  # (drawn with the action's other gathers)
            continue
        seconds = float(record[3])
        if seconds <= 0:  # a stage without parameters gathers nothing
            continue
        if record[0] == "unshard":
            release, exposed = record[4], float(record[5])
            if release is not None:
                waited = bool(start[i] <= release + 1e-12 * max(1.0, release) and release > 0)
                rows.append((i, release - seconds, release, "fsdp all_gather (UNSHARD)", waited))
            else:
                if seconds > exposed:
                    rows.append((i, start[i] - (seconds - exposed), start[i], "fsdp all_gather (UNSHARD)", False))
                if exposed > 0:
                    rows.append((i, start[i], start[i] + exposed, "fsdp all_gather (UNSHARD)", True))
        else:
            hidden = float(record[4])
            exposed = hidden < seconds * (1 - 1e-9)
            rows.append((i, end[i], end[i] + seconds, "fsdp reduce_scatter (REDUCE_GRAD)", exposed))
    return rows


def collective_layers(table: pd.DataFrame, batch: int) -> dict[str, np.ndarray]:
    """Per layer of a mesh rank's table (:func:`mesh_layer_table`), what :func:`collective_rows` sums
    per stage: a micro-batch row's tensor-parallel all-reduces (``tp_forward``, ``tp_backward``), its
    context-parallel key-value gather or scatter (``context``) and its routed tokens' exchange
    (``exchange``); once a step the data-parallel collectives (``step_end``), FSDP's reduce-scatter
    (``reduce_grad``, part of ``step_end``), its gathers (``gather``) and what of them a forward or
    backward waits for (``forward_gather_exposed``, ``backward_gather_exposed``). The page's
    re-timing (:mod:`pipexplore.predict.retime`) draws the same rows from the same arrays."""
    whole = float(table.attrs.get("batch") or batch)
    table = table.copy(deep=False)
    table.attrs = {}  # (each column read copies the attrs)

    def column(name: str) -> np.ndarray:
        return table[name].to_numpy(dtype=float) if name in table else np.zeros(len(table))

    return {"tp_forward": column("forward_comm") / whole, "tp_backward": column("backward_comm") / whole,
            "context": column("cp_seconds") / 2 / whole, "exchange": column("ep_seconds") / 2 / whole,
            "step_end": column("dp_seconds"), "reduce_grad": column("reduce_grad_seconds"),
            "gather": column("gather_seconds"), "forward_gather_exposed": column("forward_gather_exposed"),
            "backward_gather_exposed": column("backward_gather_exposed")}


#: What a collective row's device says after the rank's device: its lane of its own, under the rank's.
COLLECTIVE_LANE = " · collectives"
_TP_PHASE = {"forward": "tp_forward", "recompute": "tp_forward", "backward": "tp_backward",
             "input_grad": "tp_backward"}  # each phase's all-reduces (collective_layers' names)


def collective_rows(predicted: pd.DataFrame, table: pd.DataFrame, splits: Sequence[int], *, batch: int,
                    chunks: int, data_parallel: str) -> pd.DataFrame:
    """The collectives of a predicted step of a mesh's pipeline rank, one row each (phase
    ``collective``, on the device ``'<device> · collectives'``: a lane of its own under the rank's),
    ``collective`` naming it and ``exposed`` whether the step waits for it: the tensor-parallel
    all-reduces sit inside their action, at its end, as Megatron-LM's and torch's run them on the
    critical path; context parallelism's key-value gathers open their action, the experts' token
    exchange follows them (with ``moe_overlap``, a paired action's exposed part there and its hidden
    part under its partner's compute, not exposed: the timeline's ``attrs['moe_overlap']``); the step-end
    data-parallel collectives open the stage's update; FSDP's gathers are split into the part the
    layer before did not hide (exposed) and the part it did (not exposed). ``table``: the rank's
    (:func:`mesh_layer_table`); seconds a micro-batch scale with its rows."""
    from pipexplore.predict.costs import microbatch_rows, stage_sums

    points = [0, *splits, len(table)]
    rows = np.asarray(microbatch_rows(int(batch), int(chunks)), dtype=float)
    per_stage = {name: stage_sums(values, points) for name, values in collective_layers(table, batch).items()}
    dp_name = {"ddp": "dp all_reduce", "zero1": "dp reduce_scatter + all_gather",
               "fsdp": "fsdp reduce_scatter"}[data_parallel]
    placed = predicted.attrs.get("fsdp") or ()
    overlapped = {tuple(r[:3]): (float(r[3]), float(r[4]), tuple(r[5]))
                  for r in predicted.attrs.get("moe_overlap") or ()}  # paired actions' all-to-alls, what is exposed
    regathered = {(r[1], r[2][2]) for r in placed if r[0] == "regather"}  # backwards that gather again
    # (with FSDP placed, its REDUCE_GRAD is drawn where the lowering put it, below, not at the update)
    step_end = per_stage["step_end"] - (per_stage["reduce_grad"] if placed else 0.0)
    # Every action's collectives at once, by kind (a step of hundreds of stages and micro-batches,
    # and a search predicts hundreds of meshes): a row's index in the step, its order among that
    # action's rows, start, end, name and whether the step waits for it; sorted as the actions run.
    stage = predicted["stage"].to_numpy(dtype=np.int64)
    micro = predicted["microbatch"].to_numpy(dtype=np.int64)
    start = predicted["start"].to_numpy(dtype=float)
    end = predicted["end"].to_numpy(dtype=float)
    codes, names = pd.factorize(predicted["phase"], sort=False)

    def phase_in(*wanted: str) -> np.ndarray:  # (each distinct phase compared once, not each row's)
        return np.isin(codes, [k for k, name in enumerate(names) if name in wanted])

    forward, backward = phase_in("forward"), phase_in("backward")
    tp_forward = phase_in(*(p for p, kind in _TP_PHASE.items() if kind == "tp_forward"))
    acting = phase_in(*_TP_PHASE) & (micro >= 0)  # the actions whose layers run (all-reduces, gathers, exchanges)
    size = np.where(acting, rows[np.where(micro >= 0, micro, 0) % len(rows)], 0.0)
    context = per_stage["context"][stage] * size
    parts: list[tuple] = []

    def add(mask: np.ndarray, order: int, begin: np.ndarray, finish: np.ndarray, name: Union[str, np.ndarray],
            exposed: bool) -> None:
        index = np.flatnonzero(mask)
        if len(index):
            parts.append((index, np.full(len(index), order), begin[index], finish[index],
                          np.full(len(index), name, dtype=object) if isinstance(name, str) else name[index],
                          np.full(len(index), exposed), index))

    tp = np.where(acting, np.where(tp_forward, per_stage["tp_forward"][stage], per_stage["tp_backward"][stage]) * size,
                  0.0)
    add(tp > 0, 0, np.maximum(start, end - tp), end, "tp all_reduce", True)
    add(acting & (per_stage["context"][stage] > 0), 1, start, np.minimum(end, start + context),
        np.where(tp_forward, "cp all_gather K,V", "cp reduce_scatter dK,dV").astype(object), True)
    paired = np.zeros(len(stage), dtype=bool)
    if overlapped:  # exposed inside its action, hidden under its partner's compute (a few pairs: one by one)
        phase = predicted["phase"].tolist()
        where = {(int(stage[i]), str(phase[i]), int(micro[i])): i for i in range(len(stage))}
        for (s, p, m), (seconds, shown, partner) in overlapped.items():
            i = where.get((s, p, m))
            if i is None or not acting[i]:
                continue
            paired[i] = True
            begin = start[i] + context[i]
            if shown > 0:
                parts.append(([i], [2], [begin], [min(end[i], begin + shown)], ["ep all_to_all"], [True], [i]))
            j = where.get(partner)
            if seconds > shown and j is not None:
                after = (start[j] + per_stage["context"][stage[j]] * rows[int(micro[j]) % len(rows)]
                         + overlapped[partner][1])
                parts.append(([i], [3], [after], [min(end[j], after + seconds - shown)], ["ep all_to_all"], [False],
                              [j]))
    exchange = per_stage["exchange"][stage]
    add(acting & ~paired & (exchange > 0), 4, start + context, np.minimum(end, start + context + exchange * size),
        "ep all_to_all", True)
    gathers = per_stage["gather"][stage]
    gathering = acting & (gathers > 0) & forward
    if regathered:
        again = np.flatnonzero(acting & (gathers > 0) & backward)
        gathering[again] = [(int(stage[i]), int(micro[i])) in regathered for i in again]
    shown = np.minimum(np.where(forward, per_stage["forward_gather_exposed"][stage],
                                per_stage["backward_gather_exposed"][stage]), gathers)
    add(gathering & (shown > 0), 5, start, np.minimum(end, start + shown), "fsdp all_gather", True)
    add(gathering & (gathers > shown), 6, start + shown, np.minimum(end, start + gathers), "fsdp all_gather", False)
    ending = step_end[stage]
    add(phase_in("optimizer") & (ending > 0), 7, start, np.minimum(end, start + ending), dp_name, True)
    placed_rows = _placed_rows(predicted, placed)
    if placed_rows:  # after every action's own rows, in the order the lowering placed them
        rows_at, begins, finishes, named, shows = (list(column) for column in zip(*placed_rows))
        parts.append((np.full(len(rows_at), len(stage)), np.full(len(rows_at), 8), begins, finishes,
                      np.array(named, dtype=object), shows, rows_at))
    if not parts:
        return predicted.iloc[:0].assign(collective=pd.Series(dtype=object), exposed=pd.Series(dtype=bool))
    action, order, begin, finish, collective, exposed, at = (np.concatenate([np.asarray(part[k]) for part in parts])
                                                             for k in range(7))
    ranked = np.lexsort((np.arange(len(order)), order, action))
    frame = predicted.iloc[at[ranked]].copy()
    frame["device"] = frame["device"].astype(str) + COLLECTIVE_LANE
    frame["phase"] = "collective"
    frame["start"] = begin[ranked].astype(float)
    frame["end"] = finish[ranked].astype(float)
    frame["collective"] = collective[ranked].astype(object)
    frame["exposed"] = exposed[ranked].astype(bool)
    if "memory" in frame:
        frame["memory"] = np.nan
    return frame.reset_index(drop=True)


def with_collective_rows(predicted: pd.DataFrame, table: pd.DataFrame, splits: Sequence[int], *, batch: int,
                         chunks: int, data_parallel: str) -> pd.DataFrame:
    """``predicted`` (a mesh rank's simulated step) with its :func:`collective_rows` after its own
    rows (theirs ``collective=''``, ``exposed=False``), its attrs kept: what
    :meth:`pipexplore.Plan.predict` gives for a mesh."""
    extra = collective_rows(predicted, table, splits, batch=batch, chunks=chunks, data_parallel=data_parallel)
    joined = pd.concat([predicted.assign(collective="", exposed=False), extra], ignore_index=True)
    joined.attrs = predicted.attrs
    return joined
