"""A plan with a mesh: each pipeline rank a tensor-parallel rank's costs, the data-parallel
collectives and FSDP's gathers where torch's runtime puts them (costed as NCCL runs them over the group),
a GPU's shard of the training state, and every mismatch refused with the plan kept."""
from __future__ import annotations

import logging
import math
import warnings

import numpy as np
import pytest
import torch
import transformers

from models import meta_llama
from pipexplore.devices import Mesh
from pipexplore.models.profile import profile_model
from pipexplore.plan import Plan
from pipexplore.predict.collectives import collective_seconds, linear_cost
from pipexplore.predict.mesh_costs import BUCKET_BYTES
from pipexplore.splits import SplitError
from pipexplore.widgets.state import ExplorerState

logging.getLogger("transformers").setLevel(logging.ERROR)

DEVICES = tuple(f"H100:{i}" for i in range(8))


def llama(layers: int = 4):
    return meta_llama(layers, heads=8)


SAMPLE = torch.zeros(8, 256, dtype=torch.long, device="meta")


@pytest.fixture(scope="module")
def tables():
    model = llama()
    return {tp: profile_model(model, SAMPLE, devices=DEVICES, gpus_per_node=4, chunks=4, tp=tp,
                              optimizer=torch.optim.AdamW) for tp in (1, 2)}


def plan(tables, mesh, **options):
    tp = mesh.get("tp", 1)
    return Plan(tables[tp], splits=(3,), devices=DEVICES, chunks=4, schedule="1f1b", executor="processes", batch=8,
                gpus_per_node=4, mesh=mesh, **options)


def test_each_pipeline_rank_runs_on_its_first_tensor_and_data_parallel_rank(tables):
    p = plan(tables, {"tp": 2, "pp": 2, "dp": 2})
    assert p.mesh == Mesh(tp=2, pp=2, dp=2)
    assert p.pipeline_devices == ["H100:0", "H100:4"] and p.stage_devices == ["H100:0", "H100:4"]
    assert p.nodes == 2
    compute = p.predicted[p.predicted["phase"] != "collective"]
    assert set(compute["device"]) == {"H100:0", "H100:4"}  # the send between them crosses the nodes


def test_a_ranks_collectives_have_a_lane_of_their_own_and_are_said_exposed(tables):
    from pipexplore.predict.costs import stage_sums
    from pipexplore.widgets.timeline_figure import lanes

    p = plan(tables, {"tp": 2, "pp": 2, "dp": 2})
    predicted = p.predicted
    collectives = predicted[predicted["phase"] == "collective"]
    assert set(collectives["device"]) == {"H100:0 · collectives", "H100:4 · collectives"}
    assert lanes(predicted) == ["stage 0 · H100:0", "stage 0 · H100:0 · collectives", "stage 1 · H100:4",
                                "stage 1 · H100:4 · collectives"]
    assert collectives["exposed"].all() and set(collectives["collective"]) == {"tp all_reduce", "dp all_reduce"}
    table, points = p.rank_table, [0, 3, len(p.rank_table)]
    forward = predicted[predicted["phase"] == "forward"].set_index(["stage", "microbatch"])
    tp = collectives[collectives["collective"] == "tp all_reduce"]
    first = tp[(tp["stage"] == 0) & (tp["microbatch"] == 0)].iloc[0]  # the first forward's, at its end
    expected = stage_sums(table["forward_comm"].to_numpy(), points)[0] / table.attrs["batch"] * 2  # 2 rows
    assert first["end"] - first["start"] == pytest.approx(expected)
    assert first["end"] == forward.loc[(0, 0), "end"]
    dp = collectives[collectives["collective"] == "dp all_reduce"].set_index("stage")
    for stage in (0, 1):
        assert dp.loc[stage, "end"] - dp.loc[stage, "start"] == pytest.approx(
            stage_sums(table["dp_seconds"].to_numpy(), points)[stage])
    # a collective is no stage's compute: the bubble and the step are the compute's
    from pipexplore import timeline as tl
    compute = predicted[predicted["phase"] != "collective"]
    assert tl.step_time(predicted) == tl.step_time(compute)
    assert tl.bubble_fraction(predicted) == pytest.approx(tl.bubble_fraction(compute))


def _step_end(p, kind_bytes, kinds):
    """The step-end collectives as NCCL runs them over the data-parallel group, bucket by bucket
    (the whole gradient where it is smaller than one), each layer its bytes' share."""
    group = [p.devices[r] for r in p.mesh.group("dp", 0)]
    bucket = min(BUCKET_BYTES, float(sum(kind_bytes)))
    return sum(b * collective_seconds(kind, bucket, group, p.gpus_per_node) / bucket
               for kind in kinds for b in kind_bytes)


def test_data_parallel_collectives_are_the_ring_over_the_data_parallel_group(tables):
    single = plan(tables, {"tp": 2, "pp": 2, "dp": 2})  # ddp: the gradients all-reduced
    table = tables[2]
    grads = table["rank_param_bytes"].to_numpy(dtype=float)  # every parameter trains
    assert single.rank_table["dp_seconds"].sum() == pytest.approx(_step_end(single, grads, ["all_reduce"]))
    zero1 = plan(tables, {"tp": 2, "pp": 2, "dp": 2}, data_parallel="zero1")  # reduce-scatter, then all-gather
    assert zero1.rank_table["dp_seconds"].sum() == pytest.approx(
        _step_end(zero1, grads, ["reduce_scatter", "all_gather"]))
    assert zero1.rank_table["optimizer"].sum() == pytest.approx(  # a rank steps half the state
        table["optimizer"].sum() / 2 + zero1.rank_table["dp_seconds"].sum())
    # each stage's update holds its layers' step-end collectives, after its last backward
    predicted = single.predicted
    updates = predicted[predicted["phase"] == "optimizer"].sort_values("stage")
    spans = (updates["end"] - updates["start"]).to_numpy()
    stage_sums = [single.rank_table["dp_seconds"].iloc[:3].sum(), single.rank_table["dp_seconds"].iloc[3:].sum()]
    base = [table["optimizer"].iloc[:3].sum(), table["optimizer"].iloc[3:].sum()]
    assert spans == pytest.approx(np.add(base, stage_sums))


def test_fsdp_gathers_behind_the_layer_before_where_it_reshards_after_forward(tables):
    kept = plan(tables, {"tp": 2, "pp": 2, "dp": 2}, data_parallel="fsdp")
    assert (kept.rank_table["gather_seconds"] == 0).all()  # gathered once a step, at its end
    resharded = plan(tables, {"tp": 2, "pp": 2, "dp": 2}, data_parallel="fsdp", reshard_after_forward=True)
    gathers = resharded.rank_table["gather_seconds"].to_numpy()
    assert ((gathers > 0) == (tables[2]["rank_param_bytes"] > 0)).all()
    added = resharded.rank_table["forward_a"].to_numpy() - tables[2]["forward_a"].to_numpy()
    assert added[0] == pytest.approx(gathers[0])  # the first layer's gather has nothing to hide behind
    assert (added >= 0).all() and (added <= gathers + 1e-15).all()


def test_sends_and_kept_activations_are_a_tp_th_with_sequence_parallelism(tables):
    p = plan(tables, {"tp": 2, "pp": 2, "dp": 2})
    assert (p.rank_table["output_bytes"] * 2 == tables[2]["output_bytes"]).all()
    assert (p.rank_table["saved_bytes"] * 2 == tables[2]["saved_bytes"]).all()  # the timeline's memory: a GPU's


def test_a_gpu_holds_its_shard_of_the_training_state(tables):
    from pipexplore.widgets.stage_table import stage_table

    replicated = plan(tables, {"tp": 2, "pp": 2, "dp": 2})
    peaks = [0.0, 0.0]
    ddp = stage_table(replicated, peaks, measured={}, optimizer=torch.optim.AdamW)
    whole = [tables[2]["param_bytes"].iloc[:3].sum(), tables[2]["param_bytes"].iloc[3:].sum()]
    assert ddp["param_bytes"].tolist() == pytest.approx([w / 2 for w in whole])
    assert ddp["optimizer_bytes"].tolist() == pytest.approx([w for w in whole])  # AdamW: 2 states, /tp
    fsdp = stage_table(replicated.with_options(data_parallel="fsdp"), peaks, measured={}, optimizer=torch.optim.AdamW)
    assert fsdp["param_bytes"].tolist() == pytest.approx([w / 4 for w in whole])
    assert (fsdp["gathered_bytes"] == fsdp["param_bytes"] * 2).all()  # the stage kept whole (no reshard)


def test_what_does_not_fit_the_mesh_is_refused_by_name(tables):
    with pytest.raises(ValueError, match=r"the mesh has tp=2 but the layer table counts a rank of tp=1"):
        Plan(tables[1], splits=(3,), devices=DEVICES, chunks=4, mesh={"tp": 2, "pp": 2, "dp": 2})
    with pytest.raises(ValueError, match=r"one tensor-parallel rank's of tp=2: give the plan a mesh with tp=2"):
        Plan(tables[2], splits=(3,), devices=DEVICES[:2], chunks=4)
    with pytest.raises(SplitError, match=r"the mesh has pp=4 pipeline ranks but the plan's 2 stages run on 2: split "
                                         r"the model into 4 stages"):
        plan(tables, {"tp": 2, "pp": 4})
    without = tables[2].drop(columns=["kv_bytes"])
    without.attrs = dict(tables[2].attrs)
    with pytest.raises(ValueError, match=r"cp=2: context parallelism gathers each attention layer's keys and values"):
        Plan(without, splits=(3,), devices=DEVICES, chunks=4, mesh={"tp": 2, "pp": 2, "cp": 2})
    odd = tables[2].copy()
    odd.attrs = {**tables[2].attrs, "tokens_per_sample": 258}
    with pytest.raises(ValueError, match=r"cp=2: each sequence is split into 2·cp = 4 chunks.* 258 tokens"):
        Plan(odd, splits=(3,), devices=DEVICES, chunks=4, mesh={"tp": 2, "pp": 2, "cp": 2})
    with pytest.raises(ValueError, match=r"unknown data_parallel 'zero3': ddp, zero1, fsdp"):
        plan(tables, {"tp": 2, "pp": 2, "dp": 2}, data_parallel="zero3")
    with pytest.raises(ValueError, match=r"without sequence parallelism"):
        plan(tables, {"tp": 2, "pp": 2, "dp": 2}, sequence_parallel=False)
    with pytest.raises(ValueError, match=r"mesh tp 2 × pp 2 = 4 ranks, but there are 8 devices: dp=2 would fill"):
        plan(tables, {"tp": 2, "pp": 2})


def test_the_explorer_plans_a_mesh_and_changes_it_keeping_the_plan_on_bad_input():
    state = ExplorerState(llama(), SAMPLE, devices=["H100"] * 8, gpus_per_node=4, chunks=4, schedule="1f1b",
                          mesh={"tp": 2, "pp": 2, "dp": 2}, data_parallel="fsdp")
    assert state.plan.mesh == Mesh(tp=2, pp=2, dp=2) and state.plan.num_stages == 2
    assert state.layer_table.attrs["tp"] == 2 and state.plan.data_parallel == "fsdp"
    first = state.figures()["predicted_step_time"]
    assert math.isfinite(first) and first > 0
    state.set_mesh({"tp": 1, "pp": 4, "dp": 2}, data_parallel="zero1")
    assert state.plan.num_stages == 4 and state.plan.layer_table.attrs["tp"] == 1
    assert state.plan.data_parallel == "zero1"
    before = state.plan
    with pytest.raises(ValueError, match=r"tp=8 does not divide the model's 4 key-value heads"):
        state.set_mesh({"tp": 8, "pp": 1, "dp": 1})
    with pytest.raises(ValueError, match=r"= 6 ranks, but there are 8 devices"):
        state.set_mesh({"tp": 2, "pp": 3})
    assert state.plan is before
    with pytest.raises(ValueError, match=r"on this machine's devices a mesh is pipeline, data and tensor parallelism"):
        ExplorerState(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), torch.zeros(4, 4),
                      devices=["cpu", "cpu"], mesh={"pp": 1, "cp": 2})


def test_the_mesh_search_ranks_every_factorisation_keeping_the_global_batch():
    from pipexplore.predict.mesh_search import factorisations

    state = ExplorerState(llama(), SAMPLE, devices=["H100"] * 8, gpus_per_node=4, chunks=4, schedule="1f1b",
                          mesh={"tp": 2, "pp": 2, "dp": 2}, optimizer=torch.optim.AdamW)
    meshes = factorisations(8, 4, len(state.layer_table))
    assert {(m.tp, m.pp, m.dp) for m in meshes} == {(tp, pp, 8 // tp // pp) for tp in (1, 2, 4)
                                                      for pp in (1, 2, 4, 8) if 8 % (tp * pp) == 0}
    table = state.search(mesh="auto", data_parallel=["ddp", "fsdp"], microbatch_rows=[2, 4])
    assert (table["tp"] * table["pp"] * table["dp"] == 8).all()
    assert ((table["chunks"] * table["microbatch_rows"] * table["dp"]) == 16).all()  # 2 replicas of 8 rows
    assert table["fits"].iloc[0] and table["rank"].tolist() == list(range(1, len(table) + 1))
    fitting = table[table["fits"]]
    assert fitting["predicted_step_time"].is_monotonic_increasing
    assert table["pareto"].any() and not table.loc[table["pareto"]].duplicated(["predicted_step_time"]).all()
    assert any("2 rows a replica do not split into micro-batches of 4" in why  # dp=8: 2 rows each
               for why in table.attrs["left_out"])
    # a row's prediction is the plan's own, once applied
    best = table.iloc[0]
    state.apply(best)
    assert (state.plan.mesh.tp, state.plan.mesh.pp, state.plan.mesh.dp) == (best["tp"], best["pp"], best["dp"])
    assert state.figures()["predicted_step_time"] == pytest.approx(best["predicted_step_time"])
    with pytest.raises(ValueError, match=r"mesh='auto'"):
        state.search(mesh="tp4")


@pytest.mark.parametrize("reshard", [False, True])
def test_fsdp_bytes_are_what_fully_shard_moves_on_a_fake_group(reshard):
    """FSDP2's ``fully_shard`` on torch's fake process group (4 replicas, a tiny Llama's blocks on
    the CPU): each layer's parameters all-gathered whole once a step (twice, forward and backward,
    where it reshards after forward) and its gradients reduce-scattered once: the bytes
    :func:`pipexplore.predict.mesh_costs.mesh_layer_table` costs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    blocks = list(model.model.layers)
    block_bytes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
    moved: dict[str, list[int]] = {"all_gather": [], "reduce_scatter": []}

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name == "c10d._allgather_base_":
                moved["all_gather"].append(args[0].numel() * args[0].element_size())  # the gathered whole
            elif name == "c10d._reduce_scatter_base_":
                moved["reduce_scatter"].append(args[1].numel() * args[1].element_size())  # the whole, scattered
            return func(*args, **(kwargs or {}))

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        ids = torch.randint(0, 128, (2, 16))
        with Collectives(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hidden = model.model.embed_tokens(ids)
            position = model.model.rotary_emb(hidden, torch.arange(16)[None])
            for block in blocks:
                hidden = block(hidden, position_embeddings=position, attention_mask=None)
            hidden.sum().backward()
    finally:
        dist.destroy_process_group()
    gathers = 2 if reshard else 1
    assert sorted(moved["all_gather"]) == sorted(block_bytes * gathers)
    assert sorted(moved["reduce_scatter"]) == sorted(block_bytes)


def test_an_export_that_would_drop_the_mesh_is_refused_by_name(tables):
    from pipexplore.export import plan_code

    p = plan(tables, {"tp": 2, "pp": 2, "dp": 2})
    for kind in ("pipelining", "gpipe"):
        with pytest.raises(ValueError, match=r"mesh \(tp 2 · pp 2 · dp 2\) is planned, but the .* export writes "
                                             r"pipeline ranks only"):
            plan_code(p, kind, traced=True)
    assert "0F0" in plan_code(p, "schedule-csv")  # the pipeline's schedule is the mesh's
    # the torchrun script runs the whole mesh (tests/test_mesh_torchrun.py), its context parallelism refused
    assert "MESH = {'pp': 2, 'dp': 2, 'tp': 2}" in plan_code(p, "torchrun", traced=True, tp_plan={"x": "colwise"})
    with pytest.raises(ValueError, match=r"cp=2 \(context parallelism\), which it would drop"):
        plan_code(plan(tables, {"tp": 2, "pp": 2, "cp": 2}), "torchrun", traced=True, tp_plan={"x": "colwise"})


def test_context_parallelism_leaves_a_rank_a_cp_th_of_the_tokens_and_gathers_keys_and_values(tables):
    from pipexplore.widgets.stage_table import stage_table

    whole = plan(tables, {"tp": 2, "pp": 2, "dp": 2})
    split = plan(tables, {"tp": 2, "pp": 2, "cp": 2})
    ours, theirs = split.rank_table, whole.rank_table
    attends = tables[2]["kv_bytes"].to_numpy() > 0
    assert attends.sum() == 4  # the four decoder layers
    batch = tables[2].attrs["batch"]
    kv_row = tables[2]["kv_bytes"].to_numpy() / 2 / batch  # a row's keys and values, a tensor-parallel rank's
    group = [split.devices[r] for r in split.mesh.group("cp", 0)]
    at = kv_row.max() * tables[2].attrs["rows"][0]  # a micro-batch's keys and values: each gather's size
    latency, per_byte = linear_cost("all_gather", at, group, split.gpus_per_node)
    assert latency + per_byte * at == pytest.approx(collective_seconds("all_gather", at, group, split.gpus_per_node))
    gather = per_byte * kv_row
    assert ours["forward_b"].to_numpy() == pytest.approx(tables[2]["forward_b"].to_numpy() / 2 + gather)
    assert ours["backward_b"].to_numpy() == pytest.approx(tables[2]["backward_b"].to_numpy() / 2 + gather)
    assert ours["forward_a"].to_numpy() == pytest.approx(tables[2]["forward_a"].to_numpy() + attends * latency)
    assert (ours["saved_bytes"] * 4 == tables[2]["saved_bytes"]).all()  # a rank keeps 1/(tp·cp) of them
    assert ours["cp_seconds"].to_numpy() == pytest.approx(2 * gather * batch)
    # the gradients are reduced over the dp · cp ranks holding the same parameters: here the cp pair
    assert ours["dp_seconds"].sum() == pytest.approx(theirs["dp_seconds"].sum())
    names = set(split.predicted["collective"])
    assert {"cp all_gather K,V", "cp reduce_scatter dK,dV", "tp all_reduce", "dp all_reduce"} <= names
    peaks = [1e9, 1e9]  # one GPU's, as the rank table's timeline gives them: taken as they are
    memory = stage_table(split.with_options(data_parallel="zero1"), peaks, measured={}, optimizer=torch.optim.AdamW)
    replicated = stage_table(whole.with_options(data_parallel="zero1"), peaks, measured={},
                             optimizer=torch.optim.AdamW)
    assert memory["activation_bytes"].tolist() == pytest.approx(peaks)
    assert memory["optimizer_bytes"].tolist() == pytest.approx(replicated["optimizer_bytes"].tolist())  # / (dp·cp)


def test_the_mesh_search_adds_context_parallelism_where_asked():
    from pipexplore.predict.mesh_search import factorisations

    plain = factorisations(8, 4, 10)
    assert all(m.cp == 1 for m in plain)
    both = factorisations(8, 4, 10, cp=(1, 2))
    assert set(both) == set(plain) | {Mesh(tp=tp, pp=pp, dp=8 // (tp * pp * 2), cp=2) for tp in (1, 2, 4)
                                      for pp in (1, 2, 4) if 8 % (tp * pp * 2) == 0}
    state = ExplorerState(llama(), SAMPLE, devices=["H100"] * 8, gpus_per_node=4, chunks=4, schedule="1f1b",
                          mesh={"tp": 2, "pp": 2, "dp": 2})
    table = state.search(mesh="auto", cp=[1, 2])
    assert set(table["cp"]) == {1, 2} and (table["tp"] * table["pp"] * table["dp"] * table["cp"] == 8).all()
    with_cp = table[table["cp"] == 2].iloc[0]
    state.apply(with_cp)
    assert state.plan.mesh.cp == 2
    assert state.figures()["predicted_step_time"] == pytest.approx(with_cp["predicted_step_time"])
