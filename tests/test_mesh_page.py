"""The page for a mesh, as a person uses it through the widgets' Python models: the mesh and data
parallelism fields, devices as a count, a GPU's card (MFU by its formula), the memory a GPU stacked
by kind; a bad mesh named beside its field with the plan kept."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
import transformers

from pipexplore.devices import devices_text, planned_devices
from pipexplore.widgets.explorer import Explorer
from pipexplore.widgets.panels.controls import parse_mesh
from pipexplore.widgets.panels.stages import MEMORY_KINDS, stages_html

logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def explorer():
    config = transformers.LlamaConfig(num_hidden_layers=8, hidden_size=1024, intermediate_size=2816,
                                      num_attention_heads=16, num_key_value_heads=16, vocab_size=4096)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(8, 512, dtype=torch.long, device="meta")
    return Explorer(model, ids, devices=["H100"] * 32, gpus_per_node=8, chunks=4, schedule="1f1b",
                    mesh={"tp": 4, "pp": 4, "dp": 2}, data_parallel="fsdp", optimizer=torch.optim.AdamW)


def test_devices_read_as_a_count():
    assert devices_text(planned_devices(["H100"] * 64, 8), 8) == "64 × H100, 8 nodes"
    assert devices_text(planned_devices(["H100"] * 4, 8), 8) == "4 × H100"
    assert devices_text(["cpu", "cpu"], 8) == "cpu,cpu"


def test_the_fields_show_the_mesh_and_take_a_new_one(explorer):
    controls, fields, state = explorer.view.controls, explorer.view.fields, explorer.state
    assert controls.w_devices.value == "32 × H100, 4 nodes"
    assert controls.w_mesh.value == "tp 4 pp 4 dp 2" and controls.w_data_parallel.value == "fsdp"
    title = explorer.view.status.w_header.value
    assert "32 × H100, 4 nodes" in title and "tp 4 · pp 4 · dp 2 (fsdp)" in title and "H100:1," not in title
    controls.w_mesh.value = "tp 2 pp 8 dp 2"
    assert (state.plan.mesh.tp, state.plan.mesh.pp, state.plan.mesh.dp) == (2, 8, 2) and state.plan.num_stages == 8
    assert controls.w_stage_count.value == 8
    before = state.plan
    controls.w_mesh.value = "tp 2 pp 4"
    assert "mesh tp 2 × pp 4 = 8 ranks, but there are 32 devices: dp=4 would fill them" in fields["mesh"].value
    assert state.plan is before
    controls.w_mesh.value = "tp 16 pp 2 dp 1"  # across two nodes: allowed, flagged beside the field
    assert "tensor parallelism across nodes" in fields["mesh"].value and state.plan.mesh.tp == 16
    controls.w_data_parallel.value = "zero1"
    assert state.plan.data_parallel == "zero1" and state.plan.mesh.tp == 16
    controls.w_mesh.value = "tp 4 pp 4 dp 2"
    assert state.plan.mesh.tp == 4 and state.plan.data_parallel == "zero1"
    with pytest.raises(ValueError, match=r"write its dimensions and sizes"):
        parse_mesh("four by four")


def test_a_gpu_card_says_its_mfu_by_the_formula(explorer):
    state = explorer.state
    state.set_mesh({"tp": 4, "pp": 4, "dp": 2}, data_parallel="fsdp")
    figures = state.figures()
    plan = state.plan
    table = plan.layer_table
    flops = float((table["forward_flops"] + table["backward_flops"]).sum()) * plan.batch / table.attrs["batch"]
    step = figures["predicted_step_time"]
    assert figures["gpus"] == 32
    assert figures["mfu"] == pytest.approx(flops * 2 / step / (989.5e12 * 32))  # bf16 peak of an H100
    assert figures["tokens_per_second_per_gpu"] == pytest.approx(8 * 2 * 512 / step / 32)
    assert figures["peak_bytes_per_gpu"] == pytest.approx(state.stage_table()["peak_bytes"].max())
    header = explorer.view.status.w_header.value
    assert "a GPU of 32" in header and f"MFU {figures['mfu'] * 100:.1f} %" in header


def test_the_stage_view_stacks_a_gpus_memory_by_kind(explorer):
    state = explorer.state
    state.set_mesh({"tp": 4, "pp": 4, "dp": 2}, data_parallel="fsdp")
    page = stages_html(state)
    table = state.stage_table()
    assert "gathered (FSDP)" in page and all(label in page for _, label, _ in MEMORY_KINDS)
    first = table.iloc[0]
    for column, label, _ in MEMORY_KINDS:  # each part titled with its bytes
        if first[column] > 0:
            from pipexplore.widgets.header import format_bytes
            assert f"title='{label} {format_bytes(first[column])}'" in page


def test_a_drag_is_re_timed_on_the_page_with_the_ranks_costs_under_ddp_and_fsdp(explorer):
    from pipexplore.predict.retime import retime_key, retime_model

    state, panel = explorer.state, explorer.view.timelines
    panel.drawn = True  # as once the page has drawn its first picture
    figure = panel.timelines.figure
    controls = explorer.view.controls
    controls.w_data_parallel.value = "ddp"
    panel.send_retime()
    plan = state.plan
    key = retime_key(plan.rank_table, plan.splits, plan.simulate_options())
    assert panel.timelines._retime_key == key and figure.retime["key"] == key
    # the page's model costs the rank as the kernel does: the step-end all-reduce in each update
    options = plan.simulate_options()
    assert figure.retime["seconds"] == retime_model(plan.rank_table, list(plan.splits), **options)["seconds"]
    assert figure.retime["seconds"] != retime_model(plan.layer_table, list(plan.splits), **options)["seconds"]
    state.set_splits([plan.splits[0] + 1, *plan.splits[1:]])
    panel.send_retime()
    assert panel.timelines._retime_key == key  # a moved split keeps the shape: the page re-times it itself
    controls.w_data_parallel.value = "fsdp"
    panel.send_retime()
    # FSDP too: the page gets torch's lowering of each worker and the per-layer gathers once a shape
    fsdp = state.plan
    fsdp_key = retime_key(fsdp.rank_table, fsdp.splits, fsdp.simulate_options())
    assert panel.timelines._retime_key == fsdp_key != key and figure.retime["key"] == fsdp_key
    assert figure.retime["fsdp"] is not None
