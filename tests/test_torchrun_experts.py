"""The exported torchrun script runs a mixture of experts with expert parallelism, pp 2 × ep 2 on four gloo ranks.

Tiny Mixtral and Qwen3-MoE (``moe_hooks``), 4 experts, top 2: the experts folded over each stage's two
data-parallel ranks (each holds 2 of every layer's experts), the tokens dispatched and combined by
``all_to_all_single``. One launch a model, three SGD steps: every loss the unsplit model's on the
global batch, every parameter after them the unsplit model's (the experts' shards gathered); the
run recorded per rank and loaded back, its all-to-alls on each rank's collectives lane. The parts
themselves (:mod:`pipexplore.export.expert_parts`) run directly on two ranks against the unsplit
experts, a rank given no token among them.
"""
from __future__ import annotations

import pathlib
import re
import warnings

import pandas as pd
import pytest
import torch

import moe_hooks
from pipexplore import explore
from pipexplore.export.torchrun import torchrun_script
from ranks import run_ranks

TESTS = str(pathlib.Path(__file__).parent)
STEPS, CHUNKS, MESH = 3, 2, {"pp": 2, "dp": 2, "ep": 2}
MODELS = ["mixtral", "qwen3_moe"]


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit model's loss on the global batch (its micro-batches' mean) at each step, and its
    parameters after the steps."""
    model = moe_hooks.build_model()
    inputs, target = moe_hooks.global_batch(MESH["dp"])
    optimizer = moe_hooks.build_optimizer(model.parameters())
    losses, parts = [], MESH["dp"] * CHUNKS
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = torch.stack([moe_hooks.loss_fn(model(x), y) for x, y in zip(inputs.chunk(parts), target.chunk(parts))])
        loss.mean().backward()
        optimizer.step()
        losses.append(loss.mean().item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def explorer(name: str):
    """The explorer of the hooks' model, pp 2 × dp 2 with ep 2 (GPipe: torch labels its micro-batches in
    the profiler's traces): Qwen3-MoE planned for the four CPU ranks it runs on here (the whole model
    timed here, each rank holding half the experts, its all-to-alls costed as gloo's over loopback),
    Mixtral for four H100s (its plan checkpoints all micro-batches but the last, so the script's
    recomputation exchanges the tokens again)."""
    model = moe_hooks.build_model()
    inputs, target = moe_hooks.get_batch()
    devices = ["cpu"] * 4 if name == "qwen3_moe" else ["H100"] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return explore(model, inputs, devices=devices, chunks=CHUNKS, schedule="gpipe",
                       mesh=MESH, loss_fn=moe_hooks.loss_fn, target=target, optimizer=torch.optim.SGD)


_RUNS: dict[str, tuple] = {}


def run_model(name: str, folder) -> tuple:
    """Run ``name``'s exported script on four gloo ranks (once a session), recording and profiling
    it: its stdout, the folder of its trained parameters, its run directory and traces, the explorer."""
    if name not in _RUNS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MOE_HOOKS_MODEL", name)
            ex = explorer(name)
            script = ex.export("torchrun", hooks="moe_hooks", steps=STEPS)
            assert "MESH = {'pp': 2, 'dp': 2, 'tp': 1, 'ep': 2}" in script
            path = folder / "train_experts.py"
            path.write_text(script)
            saved, record, traces = folder / "trained", folder / "run", folder / "traces"
            stdout = "".join(run_ranks(path, ["--device", "cpu", "--save", saved, "--record", record, "--profile",
                                              traces, "--warmup", "1"], ranks=4, pythonpath=TESTS))
        _RUNS[name] = (stdout, saved, record, traces, ex)
    return _RUNS[name]


@pytest.mark.parametrize("name", MODELS)
def test_pp_2_by_ep_2_trains_as_the_unsplit_model(name, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MOE_HOOKS_MODEL", name)
    stdout, saved, _, _, _ = run_model(name, tmp_path_factory.mktemp(name))
    losses = [float(v) for v in re.findall(r"step \d+ loss=([0-9.]+)", stdout)]
    expected, parameters = reference()
    assert losses == pytest.approx(expected, rel=1e-5), stdout
    trained = {}
    for stage in range(2):
        trained.update(torch.load(saved / f"stage{stage}.pt"))
    assert sorted(trained) == sorted(parameters)
    assert trained["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == moe_hooks.EXPERTS  # gathered whole
    initial = dict(moe_hooks.build_model().named_parameters())
    moved = {n: (parameters[n] - initial[n]).abs().amax(dim=(1, 2)) for n in parameters if "experts" in n}
    assert all((slices > 1e-5).all() for slices in moved.values()), moved  # every expert of both ranks trained
    for name_, value in parameters.items():
        torch.testing.assert_close(trained[name_], value, rtol=1e-5, atol=1e-6, msg=lambda text: f"{name_}: {text}")


@pytest.mark.parametrize("name", MODELS)
def test_the_run_loads_back_with_its_all_to_alls_on_the_collectives_lane(name, tmp_path_factory, monkeypatch):
    from pipexplore.runs.kineto import read_traces
    from pipexplore.runs.load import read_run

    monkeypatch.setenv("MOE_HOOKS_MODEL", name)
    _, _, record, traces, ex = run_model(name, tmp_path_factory.mktemp(name))
    run = read_run(record)
    assert run.world == 4 and run.plan["mesh"] == {"pp": 2, "dp": 2, "tp": 1, "ep": 2}
    expected, _ = reference()
    assert run.measured_losses == pytest.approx(expected[1:], rel=1e-5)  # the global batch's, after --warmup 1
    row = ex.load_run(record)
    assert row["executor"] == "torchrun" and row["ranks"] == 4
    assert ex.runs.iloc[-1]["run"] == row["run"]
    print(f"{name}: measured {row['step_time'] * 1e3:.1f} ms a step, predicted {row['predicted_step_time'] * 1e3:.1f} "
          f"ms, prediction error {row['prediction_error'] * 100:+.1f} %")
    assert "ep 2" in row["mesh"]  # the plan the run ran keeps its expert parallelism
    # every rank's trace marks its steps (ProfilerStep#N): the reader takes each step's span from them
    files = sorted(pathlib.Path(traces).glob("trace_rank*.json"))
    assert len(files) == 4 and all('"ProfilerStep#1"' in path.read_text() for path in files), files
    timeline = read_traces(traces, stages={0: 0, 1: 0, 2: 1, 3: 1})  # GPipe labels no stage
    lanes = timeline[timeline["phase"] == "collective"]
    assert lanes["device"].str.endswith(" · collectives").all()
    exchanges = lanes[lanes["collective"] == "all_to_all"]
    # each stage holds one mixture-of-experts layer: a micro-batch's forward exchanges its counts, then
    # its tokens there and back (3 all-to-alls), its backward the tokens' gradients back and there (2),
    # after the forward again where the plan checkpoints the micro-batch (the H100s' plan: all but the last;
    # a plan of this machine's devices runs without, as its profile timed no recomputation)
    recomputes = ex.plan.export_checkpoint == "except_last"
    assert recomputes == (name == "mixtral")
    for _, action in timeline[timeline["phase"].isin(["forward", "backward"])].iterrows():
        count = 3 if action["phase"] == "forward" else 2 + 3 * (recomputes and action["microbatch"] < CHUNKS - 1)
        mine = exchanges[(exchanges["rank"] == action["rank"]) & (exchanges["microbatch"] == action["microbatch"])
                         & (exchanges["start"] >= action["cpu_start"]) & (exchanges["start"] <= action["cpu_end"])]
        assert len(mine) == count, (action["phase"], action["rank"], action["microbatch"], len(mine), _seen(
            timeline, action["rank"]))


def _seen(timeline: pd.DataFrame, rank: int) -> str:
    """What the reader made of ``rank``'s step: each action's and collective's times (a failure's context)."""
    rows = timeline[timeline["rank"] == rank]
    return "\n" + rows[["phase", "microbatch", "collective", "start", "end", "cpu_start", "cpu_end"]].to_string()


def test_a_mesh_the_script_cannot_fold_is_refused_at_export_naming_what_would():
    table = pd.DataFrame({"name": ["a", "b", "c"]})
    refusals = {
        "etp=2 .expert-tensor parallelism., which it would drop: export the mesh with etp=1":
            dict(mesh={"pp": 2, "dp": 2, "tp": 1, "ep": 2, "etp": 2}),
        r"not beside tensor parallelism \(tp=2\): plan tp=1 with dp a multiple of ep":
            dict(mesh={"pp": 2, "dp": 1, "tp": 2, "ep": 2}, tp_plan={"a": "colwise"}),
        "ep=2 does not divide dp=3; plan dp a multiple of ep": dict(mesh={"pp": 2, "dp": 3, "tp": 1, "ep": 2}),
        "'fsdp' it would drop: export with data_parallel='ddp'":
            dict(mesh={"pp": 2, "dp": 2, "tp": 1, "ep": 2}, data_parallel="fsdp"),
        "runs one stage a pipeline rank, and interleaved runs several: choose gpipe, 1f1b, or plan ep=1":
            dict(mesh={"pp": 1, "dp": 2, "tp": 1, "ep": 2}, schedule="interleaved"),
    }
    for message, options in refusals.items():
        with pytest.raises(ValueError, match=message):
            torchrun_script(table, [1], hooks="h", chunks=2, **options)


def test_the_expert_shards_dispatch_and_combine_as_the_unsplit_experts():
    """:class:`~pipexplore.export.expert_parts.ExpertShard` on two gloo ranks (``expert_shards_ranks.py``),
    one sending its own experts no token: outputs and every gradient the unsplit experts'."""
    out = run_ranks(pathlib.Path(TESTS) / "expert_shards_ranks.py", ranks=2, pythonpath=TESTS, timeout=120)
    assert out == ["rank 0 ok\n", "rank 1 ok\n"]
