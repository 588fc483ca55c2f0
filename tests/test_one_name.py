"""One name, one meaning: a figure of a plan reads the same, under the same name and in the same unit
(seconds, bytes), through the sweep, the search, the stage table, the page's figures and the runs; on
a mesh, a GPU's activations the same in the stage table, the figures and the header, and the header's
MFU and HFU each named."""
from __future__ import annotations

import html
import math
import re

import pytest
import torch
from torch import nn

from pipexplore.predict.search import SEARCH_COLUMNS
from pipexplore.predict.sweep import SWEEP_COLUMNS
from pipexplore.widgets.header import format_bytes
from pipexplore.widgets.run_log import RUN_COLUMNS
from pipexplore.widgets.state import ExplorerState


def _state() -> ExplorerState:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(6)])
    return ExplorerState(model, torch.randn(16, 32), devices=["cpu", "cpu"], chunks=4, calibrate=False,
                         profile_repeats=1, schedule="1f1b")


def test_a_plans_figures_are_the_same_through_every_table():
    state = _state()
    choice = dict(stages=[2], chunks=[4], schedules=["1f1b"], checkpoint=[state.plan.checkpoint])
    swept = state.sweep(**choice).iloc[0]
    state.apply(swept)  # the sweep's balanced split becomes the plan
    searched = state.search(**choice).iloc[0]
    figures, stages = state.figures(), state.stage_table()
    assert list(searched["splits"]) == list(swept["splits"]) == list(state.plan.splits)

    # the predicted step, in seconds
    step = figures["predicted_step_time"]
    assert swept["predicted_step_time"] == pytest.approx(step, rel=1e-12)
    assert searched["predicted_step_time"] == pytest.approx(step, rel=1e-12)
    # activation bytes a stage holds at its peak, as the schedule holds them
    held = figures["activation_bytes_per_stage"]
    assert swept["activation_bytes_per_stage"] == pytest.approx(held, rel=1e-12)
    assert searched["activation_bytes_per_stage"] == pytest.approx(held, rel=1e-12)
    assert stages["activation_bytes"].tolist() == pytest.approx(held, rel=1e-12)
    assert swept["activation_bytes"] == searched["activation_bytes"] == pytest.approx(max(held))
    # training bytes a stage holds at its peak (parameters, gradients, optimizer state, activations)
    assert searched["peak_bytes_per_stage"] == pytest.approx(stages["peak_bytes"].tolist(), rel=1e-12)
    assert (stages["peak_bytes"] > stages["activation_bytes"]).all()
    # one micro-batch's activations, never more than the stage's peak
    assert (0 < stages["microbatch_activation_bytes"]).all()
    assert (stages["microbatch_activation_bytes"] <= stages["activation_bytes"]).all()

    # a run: its predicted step is the plan's, under the same name; what it measured beside it
    row = state.runner.run()
    assert row["predicted_step_time"] == pytest.approx(step, rel=1e-12)
    assert 0 < row["step_time"] < 60  # seconds, as the prediction


def test_no_table_names_a_figure_twice_or_by_the_old_ambiguous_name():
    """``peak_memory`` meant activations in the sweep and training memory in the search: gone from
    every table; the search has no second name for its predicted step."""
    for columns in (SWEEP_COLUMNS, SEARCH_COLUMNS, RUN_COLUMNS):
        assert len(set(columns)) == len(columns)
        assert not any(name.startswith("peak_memory") for name in columns)
    assert "step_time" not in SEARCH_COLUMNS and "step_time" not in SWEEP_COLUMNS
    table = _state().stage_table()
    assert not any(" " in name or "+" in name for name in table.columns)  # names, not captions
    assert {"activation_bytes", "peak_bytes", "measured_peak_bytes", "compute_seconds"} <= set(table.columns)


# ---- on a mesh: a GPU's figures, one each ------------------------------------------------------

MESHES = {"tp": ({"tp": 2, "pp": 2}, "ddp"), "fsdp": ({"tp": 2, "pp": 2, "dp": 2}, "fsdp"),
          "cp": ({"tp": 2, "pp": 2, "cp": 2}, "zero1")}
ROWS, TOKENS, CHUNKS = 8, 256, 4


@pytest.fixture(scope="module")
def mesh_states():
    """A small Llama on the meta device planned on H100s inside each mesh, every block recomputed."""
    from models import meta_llama

    model = meta_llama(4, heads=8)
    ids = torch.zeros(ROWS, TOKENS, dtype=torch.long, device="meta")
    states = {}
    for name, (mesh, data_parallel) in MESHES.items():
        size = math.prod(mesh.values())
        states[name] = ExplorerState(model, ids, devices=["H100"] * size, gpus_per_node=4, chunks=CHUNKS,
                                     schedule="1f1b", checkpoint="always", mesh=mesh, data_parallel=data_parallel,
                                     optimizer=torch.optim.AdamW, mixed_precision=True)
    return states


def _header_text(state: ExplorerState) -> str:
    from pipexplore.widgets.panels.status import header_of

    return html.unescape(re.sub(r"<[^>]+>", " ", header_of(state)))


@pytest.mark.parametrize("name", list(MESHES))
def test_a_gpus_activations_read_the_same_in_the_stage_table_the_figures_and_the_header(mesh_states, name):
    state = mesh_states[name]
    mesh = state.plan.mesh
    figures, stages, text = state.figures(), state.stage_table(), _header_text(state)
    held = figures["activation_bytes_per_stage"]
    assert stages["activation_bytes"].tolist() == held  # one function: the same floats
    assert "peak activations per stage, a GPU" in text
    shown = text[text.index("peak activations per stage"):]
    assert re.match(".*?".join(re.escape(format_bytes(v)) for v in held), shown.split("a GPU", 1)[1].strip()), text
    # a GPU's: one micro-batch keeps the stage's layers' whole-model count over tp · cp (sequence and
    # context parallelism), the replicas (FSDP's too) dividing nothing
    table, splits = state.plan.layer_table, [0, *state.plan.splits, len(state.plan.layer_table)]
    whole = [float(table["saved_bytes"].iloc[a:b].sum()) for a, b in zip(splits, splits[1:])]
    micro = stages["microbatch_activation_bytes"].to_numpy()
    assert micro == pytest.approx([w / CHUNKS / (mesh.tp * mesh.cp) for w in whole], rel=1e-12)
    # one micro-batch's activations never exceed the stage's peak (recomputed before its backward)
    assert (micro <= stages["activation_bytes"].to_numpy()).all() and (micro > 0).all()
    assert (stages["peak_bytes"] > stages["activation_bytes"]).all()


def test_replicas_and_fsdp_shard_no_activation(mesh_states):
    alone, fsdp = mesh_states["tp"].stage_table(), mesh_states["fsdp"].stage_table()
    assert fsdp["microbatch_activation_bytes"].tolist() == pytest.approx(alone["microbatch_activation_bytes"].tolist())
    assert (fsdp["param_bytes"] < alone["param_bytes"]).all()  # where the state is sharded


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_the_header_names_mfu_and_hfu_and_hfu_counts_the_recomputed_forwards(mesh_states, checkpoint):
    from pipexplore.widgets.header import recomputed_share

    state = mesh_states["fsdp"]
    state.update(checkpoint=checkpoint)
    figures, text = state.figures(), _header_text(state)
    table = state.plan.layer_table
    forward, backward = float(table["forward_flops"].sum()), float(table["backward_flops"].sum())
    share = {"always": 1.0, "except_last": (CHUNKS - 1) / CHUNKS, "never": 0.0}[checkpoint]
    assert recomputed_share(state.plan) == share
    assert figures["hfu"] / figures["mfu"] == pytest.approx((forward * (1 + share) + backward) / (forward + backward))
    if checkpoint == "always":  # Megatron-LM's 8/6 where a backward costs two forwards (here attention's more)
        assert figures["hfu"] / figures["mfu"] == pytest.approx(8 / 6, rel=0.03)
    assert f"MFU {figures['mfu'] * 100:.1f} %" in text and f"HFU {figures['hfu'] * 100:.1f} %" in text
    assert ("HFU: with the recomputed forwards" in text) == (checkpoint != "never")
