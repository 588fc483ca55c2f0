"""The page's re-timing of a drag (widgets/retime.js, run by Node) against the kernel's simulate, FSDP's actions too."""
from __future__ import annotations

import base64
import json
import pathlib
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest

from pipexplore import timeline as tl
from pipexplore.predict.costs import Corrections
from pipexplore.predict.mesh_costs import with_collective_rows
from pipexplore.predict.retime import retime_key, retime_model
from pipexplore.predict.simulator import simulate
from pipexplore.widgets.timeline_figure import PHASES
from pipexplore.widgets.timeline_canvas import block_panel, lane_labels, lane_of, retime_panel

NODE = shutil.which("node")
SOURCE = pathlib.Path(__file__).parents[1] / "pipexplore" / "widgets" / "retime.js"
RUNNER = """
const fs = require("fs");
const source = fs.readFileSync(process.argv[2], "utf8");
const { decodeRetime, retime, actionCosts, shareLoop } = new Function(
  source + "\\nreturn { decodeRetime, retime, actionCosts, shareLoop };")();
const unpack = (v) => (v && v.$b64 !== undefined ? Buffer.from(v.$b64, "base64")
  : Array.isArray(v) ? v.map(unpack) : v && typeof v === "object" ? Object.fromEntries(
      Object.entries(v).map(([k, x]) => [k, unpack(x)])) : v);
const job = unpack(JSON.parse(fs.readFileSync(0, "utf8")));
const model = decodeRetime(job.model);
const out = job.splits.map((splits) => {
  try {
    const r = retime(model, splits, job.panel);
    const b64 = (a) => Buffer.from(a.buffer, a.byteOffset, a.byteLength).toString("base64");
    // each action's start and end in seconds, as the loop has them (float64: the panel's are float32 ms)
    const rows = shareLoop(model, actionCosts(model, [0, ...splits, model.layers]));
    const times = new Float64Array(2 * model.actions);
    for (let k = 0; k < rows.count; k++) {
      if (!rows.copy[k]) { times[2 * rows.action[k]] = rows.start[k]; times[2 * rows.action[k] + 1] = rows.end[k]; }
    }
    return { start: b64(r.start), end: b64(r.end), phase: b64(r.phase), micro: b64(r.micro), offsets: r.offsets,
             step: r.step, bubble: r.bubble, stage_layers: r.stage_layers, times: b64(times) };
  } catch (e) { return { error: String(e.message) }; }
});
process.stdout.write(JSON.stringify(out));
"""

def _encode(value):
    if isinstance(value, (bytes, bytearray)):
        return {"$b64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    return value


def run_page(model: dict, panel: dict, splits: list[list[int]], tmp_path: pathlib.Path) -> list[dict]:
    if NODE is None:  # a declared requirement of the tests, not an optional extra: fail, do not skip
        pytest.fail("the page's re-timing (pipexplore/widgets/retime.js) is run by Node.js, and `node` is not on "
                    "PATH: install Node.js (18 or later) to run these tests")
    runner = tmp_path / "runner.js"
    runner.write_text(RUNNER)
    job = json.dumps(_encode({"model": model, "panel": panel, "splits": splits}))
    done = subprocess.run([NODE, str(runner), str(SOURCE)], input=job, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def assert_actions_as_simulated(page: dict, model: dict, predicted: pd.DataFrame, step: bool = True) -> None:
    """Each action's start and end in the page (float64 seconds) as ``predicted`` (simulate's) has
    them, to 1e-9 of the step; the step (ms) to 1e-9 relative (``step``: where the page draws
    nothing beyond the actions)."""
    times = np.frombuffer(base64.b64decode(page["times"]), np.float64).reshape(-1, 2)
    kinds = np.frombuffer(model["kind"], np.uint8)
    keys = zip(np.frombuffer(model["stage"], np.int32).tolist(), [model["kind_names"][k] for k in kinds],
               np.frombuffer(model["micro"], np.int32).tolist())
    rows = predicted[predicted["phase"] != "copy"].set_index(["stage", "phase", "microbatch"])
    assert len(rows) == len(times) and rows.index.is_unique
    kernel = rows.loc[list(keys), ["start", "end"]].to_numpy(dtype=float)
    span = tl.step_time(predicted)
    np.testing.assert_allclose(times - times.min(), kernel - kernel.min(), rtol=1e-9, atol=1e-9 * span)
    if step:
        assert page["step"] == pytest.approx(span * 1e3, rel=1e-9)


def table(n: int, seed: int = 0, shares: bool = True, fit: bool = True) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"forward": 1e-3 * (0.5 + rng.random(n)), "backward": 2e-3 * (0.5 + rng.random(n)),
                          "output_bytes": 1e6 * rng.random(n), "param_bytes": 1e3, "saved_bytes": 2e6 * rng.random(n)})
    if fit:
        frame["forward_a"], frame["forward_b"] = 1e-4 * rng.random(n), 3e-5 * (0.5 + rng.random(n))
        frame["backward_a"], frame["backward_b"] = 2e-4 * rng.random(n), 6e-5 * (0.5 + rng.random(n))
    if shares:
        frame["share_forward"], frame["share_backward"] = 0.3 + 0.7 * rng.random(n), 0.3 + 0.7 * rng.random(n)
        frame["checkpointed_ratio"] = 0.5 + 0.4 * rng.random(n)  # forwards without autograd cost less
        frame["fresh_grads"] = 3e-4 * rng.random(n)  # a step's first backward allocates the gradients
    frame.attrs["batch"] = 30
    return frame


def corrections(n: int) -> Corrections:
    rng = np.random.default_rng(7)
    scales = {(ex, phase): 0.6 + rng.random(n) for ex in ("threads", "autograd", "processes")
              for phase in ("forward", "backward", "recompute", "input_grad", "weight_grad")}
    learnt = Corrections(scales=scales, gaps={"threads": 2e-5, "processes": 1e-4}, runs=1)
    per_phase = {"forward": 3e-5, "backward": 7e-5, "input_grad": 5e-5, "weight_grad": 9e-5, "all": 4e-5}
    return learnt.with_executor_costs("threads", per_phase, 2e-5, 5e-5).with_executor_costs("processes", 1e-4, 1e-4,
                                                                                              4e-4)


CASES = {  # name: (layers, splits before, splits after, simulate options)
    "gpipe autograd, one host": (12, [4, 8], [[3, 8], [5, 9], [1, 2]], dict(chunks=4, schedule="gpipe",
                                                                             devices=["cpu"] * 3)),
    "1f1b threads, crowded host, corrections": (16, [4, 8, 12], [[5, 8, 12], [2, 3, 15]], dict(
        chunks=6, schedule="1f1b", devices=["cpu"] * 4, executor="threads", corrections=corrections(16))),
    "zero-bubble threads, I/W ratios, overheads per phase": (10, [5], [[4], [7], [1]], dict(
        chunks=4, schedule="zero-bubble", devices=["cpu", "cpu"], corrections=corrections(10))),
    "interleaved on two GPUs, copies": (16, [4, 8, 12], [[3, 9, 12], [6, 7, 13]], dict(
        chunks=4, schedule="interleaved", devices=["cuda:0", "cuda:1"])),
    "processes, checkpoint always, uneven micro-batches": (9, [3, 6], [[2, 6], [3, 8]], dict(
        chunks=4, schedule="1f1b", devices=["cpu"] * 3, executor="processes", checkpoint="always",
        corrections=corrections(9))),
    "gpu per stage, gpipe threads, no fit": (8, [4], [[2], [6]], dict(chunks=8, schedule="gpipe", executor="threads",
                                                                      devices=["cuda:0", "cuda:1"])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_page_retimes_a_drag_as_simulate_predicts_it(name, tmp_path):
    layers, before, afters, options = CASES[name]
    frame = table(layers, seed=len(name), fit="no fit" not in name)
    if options["schedule"] == "zero-bubble":
        frame["input_grad_ratio"], frame["weight_grad_ratio"] = 0.6, 0.7
    by = "device" if options["schedule"] == "interleaved" else "stage"
    model = retime_model(frame, before, samples=30, bubble_by=by, **options)
    current = simulate(frame, before, **options)
    panel = retime_panel(lane_of(current)[0], PHASES, model)
    for splits, page in zip(afters, run_page(model, panel, afters, tmp_path), strict=True):
        assert "error" not in page, page
        kernel = block_panel(simulate(frame, splits, **options), PHASES)
        assert page["offsets"] == kernel["offsets"]
        for key, dtype in (("phase", np.uint8), ("micro", np.uint16)):
            assert np.array_equal(np.frombuffer(base64.b64decode(page[key]), dtype),
                                  np.frombuffer(kernel[key], dtype)), (splits, key)
        for key in ("start", "end"):
            np.testing.assert_allclose(np.frombuffer(base64.b64decode(page[key]), np.float32),
                                       np.frombuffer(kernel[key], np.float32), rtol=1e-6, atol=1e-6)
        predicted = simulate(frame, splits, **options)
        assert_actions_as_simulated(page, model, predicted)
        assert page["bubble"] == pytest.approx(tl.bubble_fraction(predicted, by=by), abs=1e-9)
        bounds = [0, *splits, layers]
        assert page["stage_layers"] == [[a, b - 1] for a, b in zip(bounds, bounds[1:])]


@pytest.fixture(scope="module")
def llama_table() -> pd.DataFrame:
    """A small Llama (12 layers) on the meta device, costed on planned H100s: a mesh's FSDP plans."""
    import torch

    from models import meta_llama
    from pipexplore.models.profile import profile_model

    return profile_model(meta_llama(8, heads=8), torch.zeros(8, 256, dtype=torch.long, device="meta"),
                         devices=FSDP_DEVICES, gpus_per_node=8, chunks=4, optimizer=torch.optim.AdamW)


@pytest.fixture(scope="module")
def llama_tp_table() -> pd.DataFrame:
    """The same Llama's tensor-parallel rank of tp 2 (its all-reduces counted)."""
    import torch

    from models import meta_llama
    from pipexplore.models.profile import profile_model

    return profile_model(meta_llama(8, heads=8), torch.zeros(8, 256, dtype=torch.long, device="meta"),
                         devices=FSDP_DEVICES, gpus_per_node=8, chunks=4, optimizer=torch.optim.AdamW, tp=2)


FSDP_DEVICES = tuple(f"H100:{i}" for i in range(4))
FSDP_CASES = {  # name: (splits before, splits after, Plan options): pp 2 · dp 2, FSDP (gathers slowed 40×: SLOW)
    "1f1b, a stage a rank: gathers at the start, reduce-scatters hidden by nothing": (
        (5,), [[3], [7], [10], [1]], dict(schedule="1f1b")),
    "interleaved, four stages a rank: gathers mid-step, evicted and gathered again": (
        (3, 4, 5, 6, 7, 8, 9), [[2, 4, 5, 6, 7, 8, 10], [1, 2, 3, 4, 5, 6, 7]], dict(schedule="interleaved",
                                                                                    virtual_stages=4)),
    "gpipe, resharded after forward: backwards gather again": (
        (5,), [[2], [9]], dict(schedule="gpipe", reshard_after_forward=True)),
    "1f1b, resharded after forward": ((5,), [[2], [9]], dict(schedule="1f1b", reshard_after_forward=True)),
    "zero-bubble: I and W lowered": ((5,), [[3], [8]], dict(schedule="zero-bubble")),
    "interleaved, two stages a rank, checkpointed": ((3, 6, 9), [[2, 5, 10], [4, 7, 8]], dict(
        schedule="interleaved", virtual_stages=2, checkpoint="except_last")),
    "interleaved, four stages a rank, SLOW gathers and reduce-scatters: exposed mid-step": (
        (3, 4, 5, 6, 7, 8, 9), [[2, 4, 5, 6, 7, 8, 10]], dict(schedule="interleaved", virtual_stages=4)),
}


def assert_page_draws(page: dict, kernel: dict, wide: bool, lanes: list[str]) -> None:
    """The page's blocks as the kernel's panel has them: lanes, phases, micro-batches, times.
    ``lanes``: the page's (the plan's before the move); a stage's collectives lane that the moved
    split leaves without a collective (a stage of no parameters) stays, empty, until the kernel's
    scene comes."""
    assert "error" not in page, page
    counts = dict(zip(lanes, np.diff(page["offsets"]).tolist(), strict=True))
    assert set(kernel["lanes"]) <= set(counts) and not any(counts[k] for k in set(counts) - set(kernel["lanes"]))
    assert [counts[k] for k in kernel["lanes"]] == np.diff(kernel["offsets"]).tolist()
    for key, dtype in (("phase", np.uint8), ("micro", np.int32 if wide else np.uint16)):
        assert np.array_equal(np.frombuffer(base64.b64decode(page[key]), dtype), np.frombuffer(kernel[key], dtype)), key
    for key in ("start", "end"):
        np.testing.assert_allclose(np.frombuffer(base64.b64decode(page[key]), np.float32),
                                   np.frombuffer(kernel[key], np.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(FSDP_CASES))
def test_the_page_places_fsdps_gathers_and_reduce_scatters_as_simulate_does(name, llama_table, tmp_path):
    """A mesh plan with FSDP (its rank table costs ``unshard_seconds``, ``reduce_grad_seconds``): the
    page's re-timing of a moved split (FSDP's actions placed from the lowering the model carries)
    gives every action's start and end, the step and the bubble simulate gives, and draws the
    collectives' lanes as the plan's prediction has them."""
    from pipexplore.plan import Plan
    from pipexplore.widgets.protocol import RetimeFsdp

    before, afters, extra = FSDP_CASES[name]
    plan = Plan(llama_table, splits=before, devices=FSDP_DEVICES, chunks=4, executor="processes", batch=8,
                gpus_per_node=8, mesh={"pp": 2, "dp": 2}, data_parallel="fsdp", **extra)
    options, rank = plan.simulate_options(), plan.rank_table
    if "SLOW" in name:
        rank = rank.assign(unshard_seconds=rank["unshard_seconds"] * 40,
                           reduce_grad_seconds=rank["reduce_grad_seconds"] * 40)
    by = tl.bubble_by(plan.schedule)
    model = retime_model(rank, list(before), samples=8, bubble_by=by, collectives=True, **options)
    assert model["fsdp"] is not None and set(model["fsdp"]) == RetimeFsdp.__required_keys__
    current = with_collective_rows(simulate(rank, list(before), **options), rank, list(before), batch=plan.batch,
                                   chunks=plan.chunks, data_parallel=plan.data_parallel)
    panel = retime_panel(lane_of(current)[0], PHASES, model)
    assert min(panel["collective_lane"]) >= 0  # every stage's collectives have a lane
    for splits, page in zip(afters, run_page(model, panel, afters, tmp_path), strict=True):
        predicted = simulate(rank, splits, **options)
        placed = predicted.attrs["fsdp"]
        assert placed  # gathers and reduce-scatters were placed
        if "SLOW" in name:  # a gather issued mid-step that its use waits for, a reduce-scatter not all hidden
            assert any(r[0] == "unshard" and r[4] is None and r[5] > 0 for r in placed)
            assert any(r[0] == "reduce_grad" and r[4] < r[3] for r in placed)
        joined = with_collective_rows(predicted, rank, splits, batch=plan.batch, chunks=plan.chunks,
                                      data_parallel=plan.data_parallel)
        assert (joined["phase"] == "collective").sum() > 0
        assert_page_draws(page, block_panel(joined, PHASES), wide=panel["micro_bytes"] == 4,
                          lanes=lane_labels(lane_of(current)[0]))
        assert_actions_as_simulated(page, model, predicted, step=False)
        assert page["step"] == pytest.approx(tl.step_time(joined) * 1e3, rel=1e-9)
        assert page["bubble"] == pytest.approx(tl.bubble_fraction(joined, by=by), abs=1e-9)
    ddp = Plan(llama_table, splits=before, devices=FSDP_DEVICES, chunks=4, executor="processes", batch=8,
               gpus_per_node=8, mesh={"pp": 2, "dp": 2}, data_parallel="ddp", **extra)
    assert retime_model(ddp.rank_table, list(before), **ddp.simulate_options())["fsdp"] is None


MESH_CASES = {  # name: (mesh, Plan options, splits before, splits after): every collective but FSDP's
    "tp 2 · pp 2, 1f1b: all-reduces close each action": ({"tp": 2, "pp": 2}, dict(schedule="1f1b"), (5,),
                                                        [[3], [8]]),
    "tp 2 · pp 2, zero-bubble, sequence parallel": ({"tp": 2, "pp": 2}, dict(schedule="zero-bubble",
                                                                               sequence_parallel=True), (5,), [[2]]),
    "cp 2 · pp 2, gpipe checkpointed: key-value gathers open each action": (
        {"cp": 2, "pp": 2}, dict(schedule="gpipe", checkpoint="always"), (5,), [[4], [7]]),
    "dp 2 · pp 2, ddp: the step-end all-reduce opens the update": ({"dp": 2, "pp": 2}, dict(data_parallel="ddp"),
                                                                  (5,), [[3]]),
    "dp 2 · pp 2, zero1, interleaved": ({"dp": 2, "pp": 2}, dict(data_parallel="zero1", schedule="interleaved",
                                                                virtual_stages=2), (3, 6, 9), [[2, 5, 8]]),
}


@pytest.mark.parametrize("name", list(MESH_CASES))
def test_the_page_draws_a_meshs_collectives_as_the_plan_predicts_them(name, llama_table, llama_tp_table, tmp_path):
    """A mesh rank's tensor-parallel all-reduces, context-parallel gathers and data-parallel
    collectives, in each stage's collectives lane, after a moved split: the page's blocks are the
    plan's prediction's (``Plan.predict``, laid out by ``block_panel``), lanes, phases and times."""
    from pipexplore.plan import Plan

    mesh, extra, before, afters = MESH_CASES[name]
    llama_table = llama_tp_table if "tp" in mesh else llama_table
    plan = Plan(llama_table, splits=before, devices=FSDP_DEVICES, chunks=4, executor="processes", batch=8,
                gpus_per_node=8, mesh=mesh, **extra)
    options, rank, by = plan.simulate_options(), plan.rank_table, tl.bubble_by(plan.schedule)
    model = retime_model(rank, list(before), samples=8, bubble_by=by, collectives=True, **options)
    panel = retime_panel(lane_of(plan.predicted)[0], PHASES, model)
    assert min(panel["collective_lane"]) >= 0
    for splits, page in zip(afters, run_page(model, panel, afters, tmp_path), strict=True):
        moved = Plan(llama_table, splits=tuple(splits), devices=FSDP_DEVICES, chunks=4, executor="processes",
                     batch=8, gpus_per_node=8, mesh=mesh, **extra)
        assert moved.simulate_options() == options
        joined = moved.predicted
        named = {"tp": "tp all_reduce", "cp": "cp all_gather K,V", "dp": "dp "}[next(iter(mesh))]
        assert joined["collective"].str.startswith(named).any()
        assert_page_draws(page, block_panel(joined, PHASES), wide=panel["micro_bytes"] == 4,
                          lanes=lane_labels(lane_of(plan.predicted)[0]))
        assert page["step"] == pytest.approx(tl.step_time(joined) * 1e3, rel=1e-9)
        assert page["bubble"] == pytest.approx(tl.bubble_fraction(joined, by=by), abs=1e-9)
    without = retime_model(rank, list(before), **options)  # a model that is not told of the mesh draws none
    assert without["collectives"] is None
    bare = run_page(without, panel, [afters[0]], tmp_path)[0]
    phases = np.frombuffer(base64.b64decode(bare["phase"]), np.uint8)
    assert not (phases == panel["collective_code"]).any()


def test_the_page_refuses_splits_of_another_stage_count_or_out_of_order(tmp_path):
    frame = table(8)
    options = dict(chunks=2, schedule="gpipe", devices=["cpu"] * 3)
    model = retime_model(frame, [3, 5], **options)
    panel = retime_panel(lane_of(simulate(frame, [3, 5], **options))[0], PHASES, model)
    pages = run_page(model, panel, [[4], [5, 3], [3, 8]], tmp_path)
    assert "3 stages need 2 splits, got 1" in pages[0]["error"]
    assert "out of order" in pages[1]["error"] and "out of order" in pages[2]["error"]


def test_a_new_model_is_needed_when_the_shape_or_the_costs_change_not_when_a_split_moves():
    frame = table(8)
    options = dict(chunks=4, schedule="1f1b", devices=["cpu"] * 3)
    key = retime_key(frame, [3, 5], options)
    assert retime_key(frame, [2, 6], options) == key
    assert retime_key(frame, [2], {**options, "devices": ["cpu"] * 2}) != key
    assert retime_key(frame, [3, 5], {**options, "chunks": 8}) != key
    assert retime_key(frame, [3, 5], {**options, "corrections": corrections(8)}) != key
    assert retime_key(table(8, seed=3), [3, 5], options) != key


def test_the_explorer_gives_the_page_a_model_once_drawn_and_again_only_when_the_shape_changes(tmp_path):
    import torch
    from torch import nn

    from pipexplore.widgets.explorer import Explorer
    from pipexplore.widgets.timeline_canvas import blocks_of

    frame = table(12).assign(name=[str(k) for k in range(12)], type="Linear", stash="", pop="")
    ex = Explorer(nn.Sequential(*[nn.Identity() for _ in range(12)]), torch.zeros(30, 1), layer_table=frame,
                  devices=["cpu"] * 3, chunks=4, splits=[4, 8])
    scene = ex.figure.scene
    assert scene["retime_key"] and ex.figure.retime == {}  # named, but nothing sent before the first picture
    ex.view.timelines.on_figure_message(ex.figure, {"event": "drawn"}, [])
    model = ex.figure.retime
    assert model["key"] == ex.figure.scene["retime_key"] and model["stages"] == 3
    assert ex.bar.group and ex.bar.group == ex.figure.group

    ex.splits = [5, 8]  # a move: the same model serves, the scene still names it
    assert ex.figure.retime is model and ex.figure.scene["retime_key"] == model["key"]
    page = run_page(model, model["panel"], [[5, 8]], tmp_path)[0]
    kernel = blocks_of(ex.figure.scene["panels"][0])
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(page["start"]), np.float32), kernel["start"], rtol=1e-6)
    assert page["step"] == pytest.approx(tl.step_time(ex.plan.predicted) * 1e3, rel=1e-9)

    ex.update(chunks=6)  # another shape: a new model, named by the new scenes
    assert ex.figure.retime["key"] != model["key"] and ex.figure.retime["key"] == ex.figure.scene["retime_key"]
    assert ex.figure.retime["micro_batches"] == 6


def test_a_meshs_collectives_need_the_batchs_rows():
    frame = table(6)
    frame.attrs = {}
    with pytest.raises(ValueError, match=r"collectives scale with the batch's rows: give batch="):
        retime_model(frame, [3], collectives=True, chunks=2, devices=["cpu"] * 2)
    assert retime_model(frame, [3], collectives=True, chunks=2, batch=4, devices=["cpu"] * 2)["collectives"]["names"]


def test_the_page_draws_the_experts_exchange_as_the_plan_predicts_it(tmp_path):
    """A mixture of experts (Qwen3-MoE's shape, 4 layers, on the meta device) at ep 2: each action's
    routed tokens sent to their experts and back, in its stage's collectives lane, after a moved split."""
    import warnings

    import torch
    import transformers

    import pipexplore

    config = transformers.Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                                         num_experts_per_tok=2, vocab_size=512, num_hidden_layers=4)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.Qwen3MoeForCausalLM(config)
    ex = pipexplore.explore(model, torch.zeros(8, 128, dtype=torch.long, device="meta"), devices=["H100"] * 4,
                            chunks=4, schedule="1f1b", mesh={"pp": 2, "dp": 2, "ep": 2})
    plan = ex.plan
    options, rank = plan.simulate_options(), plan.rank_table
    page_model = retime_model(rank, list(plan.splits), samples=8, collectives=True, **options)
    panel = retime_panel(lane_of(plan.predicted)[0], PHASES, page_model)
    layers = len(plan.layer_table)
    afters = [[s] for s in (2, layers - 3) if s != plan.splits[0]]
    for splits, page in zip(afters, run_page(page_model, panel, afters, tmp_path), strict=True):
        moved = plan.with_options(splits=tuple(splits))
        joined = moved.predicted
        assert joined["collective"].eq("ep all_to_all").any()
        assert_page_draws(page, block_panel(joined, PHASES), wide=panel["micro_bytes"] == 4,
                          lanes=lane_labels(lane_of(plan.predicted)[0]))
        assert page["step"] == pytest.approx(tl.step_time(joined) * 1e3, rel=1e-9)
