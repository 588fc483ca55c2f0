"""The exported torchrun script of a plan with a mesh runs the whole mesh: pp × dp (FSDP2, DDP,
ZeRO-1) and pp × tp (torch's parallelize_module with the plan the explorer counted), here on four
gloo ranks on the CPU. Three steps each: every loss the unsplit model's on the global batch, and
every parameter after them the unsplit model's after three steps of the same optimizer."""
from __future__ import annotations

import re
import sys
import warnings

import pytest
import torch

import mesh_hooks
from pipexplore import explore
from pipexplore.export.torchrun import torchrun_script
from ranks import run_ranks

TESTS = str(__import__("pathlib").Path(__file__).parent)
STEPS, CHUNKS = 3, 2


def reference(replicas: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit model's loss on the global batch (its micro-batches' mean) at each step, and its
    parameters after the steps."""
    model = mesh_hooks.build_model()
    inputs, target = mesh_hooks.global_batch(replicas)
    optimizer = mesh_hooks.build_optimizer(model.parameters())
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = torch.stack([mesh_hooks.loss_fn(model(x), y) for x, y in
                            zip(inputs.chunk(replicas * CHUNKS), target.chunk(replicas * CHUNKS))]).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def plan_for_the_cluster(mesh: dict, data_parallel: str):
    """The explorer's plan of the hooks' model for four H100s with ``mesh``."""
    model = mesh_hooks.build_model()
    inputs, target = mesh_hooks.get_batch()
    options = dict(tp_plan=mesh_hooks.SEQUENTIAL_TP_PLAN) if mesh_hooks.kind() == "sequential" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return explore(model, inputs, devices=["H100"] * 4, gpus_per_node=8, chunks=CHUNKS, schedule="1f1b",
                       mesh=mesh, data_parallel=data_parallel, loss_fn=mesh_hooks.loss_fn, target=target,
                       optimizer=torch.optim.SGD, **options)


CASES = {
    "llama pp 2 x dp 2, fsdp": ("llama", {"pp": 2, "dp": 2}, "fsdp"),
    "llama pp 2 x dp 2, ddp": ("llama", {"pp": 2, "dp": 2}, "ddp"),
    "llama pp 2 x tp 2": ("llama", {"pp": 2, "tp": 2}, "ddp"),
    "sequential pp 2 x dp 2, fsdp": ("sequential", {"pp": 2, "dp": 2}, "fsdp"),
    "sequential pp 2 x dp 2, ddp": ("sequential", {"pp": 2, "dp": 2}, "ddp"),
    "sequential pp 2 x dp 2, zero1": ("sequential", {"pp": 2, "dp": 2}, "zero1"),
    "sequential pp 2 x tp 2": ("sequential", {"pp": 2, "tp": 2}, "ddp"),
}


_RUNS: dict[str, tuple] = {}


def run_case(case: str, folder) -> tuple[str, object, object]:
    """Run ``case``'s exported script on four gloo ranks (once a session): its stdout, the folder
    of its trained parameters and the directory it recorded into."""
    if case not in _RUNS:
        model, mesh, data_parallel = CASES[case]
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MESH_HOOKS_MODEL", model)
            ex = plan_for_the_cluster(mesh, data_parallel)
            script = ex.export("torchrun", hooks="mesh_hooks", steps=STEPS)
            assert f"MESH = {{'pp': 2, 'dp': {mesh.get('dp', 1)}, 'tp': {mesh.get('tp', 1)}}}" in script
            assert f"DATA_PARALLEL = {data_parallel!r}" in script
            path = folder / "train_mesh.py"
            path.write_text(script)
            saved, record = folder / "trained", folder / "run"
            stdout = "".join(run_ranks(path, ["--device", "cpu", "--save", saved, "--record", record, "--warmup", "1"],
                                       ranks=4, pythonpath=TESTS))
        _RUNS[case] = (stdout, saved, record)
    return _RUNS[case]


@pytest.mark.parametrize("case", list(CASES))
def test_the_exported_script_trains_the_mesh_as_the_unsplit_model(case, tmp_path_factory, monkeypatch):
    model, mesh, data_parallel = CASES[case]
    monkeypatch.setenv("MESH_HOOKS_MODEL", model)
    stdout, saved, _ = run_case(case, tmp_path_factory.mktemp("mesh"))
    losses = [float(v) for v in re.findall(r"step \d+ loss=([0-9.]+)", stdout)]
    expected, parameters = reference(mesh.get("dp", 1))
    assert losses == pytest.approx(expected, rel=1e-5), stdout
    trained = {}
    for stage in range(2):
        trained.update(torch.load(saved / f"stage{stage}.pt"))
    assert sorted(trained) == sorted(parameters)
    initial = dict(mesh_hooks.build_model().named_parameters())
    assert max((parameters[n] - initial[n]).abs().max().item() for n in parameters) > 1e-2  # the steps moved them
    for name, value in parameters.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=lambda text: f"{name}: {text}")


@pytest.mark.parametrize("case", ["llama pp 2 x dp 2, fsdp", "sequential pp 2 x tp 2"])
def test_every_rank_is_brought_back_one_timeline_a_pipeline_rank_and_the_replicas_spread(case, tmp_path_factory,
                                                                                         monkeypatch):
    from pipexplore.runs.load import read_run

    model, mesh, _ = CASES[case]
    monkeypatch.setenv("MESH_HOOKS_MODEL", model)
    _, _, record = run_case(case, tmp_path_factory.mktemp("mesh"))
    run = read_run(record)
    assert run.world == 4 and run.plan["mesh"] == {"pp": 2, "dp": mesh.get("dp", 1), "tp": mesh.get("tp", 1)}
    places = [(r["coordinates"]["pp"], r["coordinates"]["dp"], r["coordinates"]["tp"]) for r in run.ranks]
    assert places == sorted(places, key=lambda p: (p[0], p[1], p[2]))  # tensor-parallel ranks numbered fastest
    for step in run.steps:  # the first replica's pipeline ranks, each stage's actions once
        assert set(step["rank"]) == {0, 2}
        assert len(step[step["phase"] == "forward"]) == 2 * CHUNKS
        assert (step["replica_spread"] >= 0).all() and step["replica_spread"].notna().all()
    expected, _ = reference(mesh.get("dp", 1))
    assert run.measured_losses == pytest.approx(expected[1:], rel=1e-5)  # the global batch's, after --warmup 1


def test_a_run_directory_missing_a_rank_or_from_another_mesh_is_refused_by_name(tmp_path_factory, monkeypatch):
    import json
    import shutil

    from pipexplore.runs.load import RunDirectoryError, read_run

    monkeypatch.setenv("MESH_HOOKS_MODEL", "sequential")
    _, _, record = run_case("sequential pp 2 x tp 2", tmp_path_factory.mktemp("mesh"))
    partial = tmp_path_factory.mktemp("partial") / "run"
    shutil.copytree(record, partial)
    (partial / "rank-3.json").unlink()
    with pytest.raises(RunDirectoryError, match=r"lacks rank-3.json \(pp 1, dp 0, tp 1\) of the 4 ranks' files"):
        read_run(partial)
    other = tmp_path_factory.mktemp("other") / "run"
    shutil.copytree(record, other)
    payload = json.loads((other / "rank-1.json").read_text())
    payload["coordinates"] = {"pp": 1, "dp": 0, "tp": 0}
    (other / "rank-1.json").write_text(json.dumps(payload))
    with pytest.raises(RunDirectoryError, match=r"rank-1.json was recorded at .*'pp': 1.*, but rank 1 of the run's "
                                                r"mesh \(tp 2 · pp 2 · dp 1\) is at pp 0, dp 0, tp 1: the file is "
                                                r"from another mesh"):
        read_run(other)


def test_a_script_started_with_another_world_size_is_refused_with_the_ranks_to_start(tmp_path, monkeypatch):
    monkeypatch.setenv("MESH_HOOKS_MODEL", "sequential")
    table = plan_for_the_cluster({"pp": 2, "dp": 2}, "ddp").layer_table
    path = tmp_path / "train_mesh.py"
    path.write_text(torchrun_script(table, [4], hooks="mesh_hooks", chunks=CHUNKS, device="cpu",
                                    mesh={"pp": 2, "dp": 2, "tp": 1}))
    with pytest.raises(AssertionError, match=r"the mesh pp 2 x dp 2 x tp 1 runs on 4 ranks, but torchrun "
                                             r"started 2: start 4"):
        run_ranks(path, ranks=2, pythonpath=TESTS, timeout=120)


def test_a_head_tied_to_its_embedding_across_stages_is_refused_beside_tensor_parallelism(tmp_path, monkeypatch):
    monkeypatch.setenv("MESH_HOOKS_MODEL", "llama-tied")
    path = tmp_path / "train_mesh.py"
    path.write_text(plan_for_the_cluster({"pp": 2, "tp": 2}, "ddp").export("torchrun", hooks="mesh_hooks"))
    with pytest.raises(AssertionError, match=r"the model ties its head to its embedding \(tie_word_embeddings\), "
                                             r"which different stages hold"):
        run_ranks(path, ["--device", "cpu"], ranks=4, pythonpath=TESTS, timeout=120)


def test_what_the_script_cannot_run_is_refused_at_export_by_name():
    table = __import__("pandas").DataFrame({"name": ["a", "b", "c"]})
    with pytest.raises(ValueError, match="cp=2 .context parallelism., which it would drop"):
        torchrun_script(table, [1], hooks="h", chunks=2, mesh={"pp": 2, "dp": 1, "tp": 1, "cp": 2})
    with pytest.raises(ValueError, match="tp=2: the script needs the tensor-parallel plan"):
        torchrun_script(table, [1], hooks="h", chunks=2, mesh={"pp": 2, "dp": 1, "tp": 2})
    with pytest.raises(ValueError, match="runs one stage a pipeline rank, and interleaved runs several"):
        torchrun_script(table, [1], hooks="h", chunks=2, schedule="interleaved", mesh={"pp": 1, "dp": 1, "tp": 2},
                        tp_plan={"a": "colwise"})
    with pytest.raises(ValueError, match="unknown data_parallel 'zero3'"):
        torchrun_script(table, [1], hooks="h", chunks=2, mesh={"pp": 2, "dp": 2, "tp": 1}, data_parallel="zero3")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


def profiled(tmp_path, mesh: dict, **options):
    """The timeline of the traces torch.profiler wrote for the Sequential's ``mesh`` (GPipe, which
    labels each micro-batch's forward and backward) run on four gloo ranks with --profile."""
    from pipexplore.runs.kineto import read_traces

    model = mesh_hooks.build_model()
    inputs, target = mesh_hooks.get_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = explore(model, inputs, devices=["H100"] * 4, gpus_per_node=8, chunks=CHUNKS, schedule="gpipe",
                     mesh=mesh, loss_fn=mesh_hooks.loss_fn, target=target, **options)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "train_mesh.py"
    path.write_text(ex.export("torchrun", hooks="mesh_hooks", steps=2))
    run_ranks(path, ["--device", "cpu", "--profile", tmp_path / "traces"], ranks=4, pythonpath=TESTS)
    return read_traces(tmp_path / "traces", stages={0: 0, 1: 0, 2: 1, 3: 1})  # GPipe labels no stage


def test_the_profilers_collectives_come_back_on_each_ranks_lane(tmp_path, monkeypatch):
    """--profile: each rank's tensor-parallel and FSDP collectives, as torch.profiler's traces hold
    them, come back as rows of their own (phase 'collective', on the rank's collectives lane), each
    of the action that asked for it: a row-sharded layer's forward all-reduces its output once a
    micro-batch; FSDP resharding after forward gathers each stage in every forward and once for the
    backwards that follow one another (GPipe's), and reduce-scatters its gradients once, after the
    last backward."""
    monkeypatch.setenv("MESH_HOOKS_MODEL", "sequential")
    timeline = profiled(tmp_path / "tp", {"pp": 2, "tp": 2}, tp_plan=mesh_hooks.SEQUENTIAL_TP_PLAN)
    collectives = timeline[timeline["phase"] == "collective"]
    assert set(collectives["collective"]) == {"all_reduce"} and set(collectives["rank"]) == {0, 1, 2, 3}
    assert collectives["device"].str.endswith(" · collectives").all()
    for _, action in timeline[timeline["phase"] == "forward"].iterrows():
        mine = collectives[(collectives["rank"] == action["rank"])
                           & (collectives["microbatch"] == action["microbatch"])]
        assert ((mine["start"] >= action["cpu_start"]) & (mine["start"] <= action["cpu_end"])).sum() >= 1
    actions = timeline[timeline["phase"] != "collective"]
    assert (actions["collective"] == "").all() and not actions["exposed"].any()

    timeline = profiled(tmp_path / "fsdp", {"pp": 2, "dp": 2}, data_parallel="fsdp", reshard_after_forward=True)
    collectives = timeline[timeline["phase"] == "collective"]
    gathers = collectives[collectives["collective"] == "all_gather"]
    for _, action in timeline[timeline["phase"] == "forward"].iterrows():
        mine = gathers[(gathers["rank"] == action["rank"]) & (gathers["microbatch"] == action["microbatch"])]
        assert ((mine["start"] >= action["cpu_start"]) & (mine["start"] <= action["cpu_end"])).sum() >= 1
    # the backwards gather once: torch's stage keeps a stage unsharded from one backward to the next
    # (reshard_after_backward off until the last), whichever asks for it
    forwards = timeline[timeline["phase"] == "forward"].groupby("rank").size()
    assert gathers.groupby("rank").size().to_dict() == (forwards + 1).to_dict()
    scatters = collectives[collectives["collective"] == "reduce_scatter"]
    assert sorted(scatters["rank"]) == [0, 1, 2, 3]  # once a step, each rank its stage's gradients
    last_backward = timeline[timeline["phase"] == "backward"].groupby("rank")["cpu_start"].max()
    asked = scatters.set_index("rank")["start"]
    assert all(asked[rank] >= last_backward[rank] for rank in range(4))
