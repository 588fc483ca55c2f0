"""A mesh of this machine's devices: pipeline × data × tensor parallelism planned on the CPU (each
stage's replicas sharing its cores, a tensor-parallel rank the measured layers at its share of their
work), run as the exported torchrun script's ranks, loaded back beside its prediction; context
parallelism here refused by name."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import mesh_hooks
from pipexplore import explore


def explored(mesh: dict, data_parallel: str = "ddp", **options):
    model = mesh_hooks.build_model()
    inputs, target = mesh_hooks.get_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return explore(model, inputs, devices=["cpu"] * 4, chunks=2, schedule="1f1b", executor="processes",
                       mesh=mesh, data_parallel=data_parallel, loss_fn=mesh_hooks.loss_fn, target=target,
                       optimizer=torch.optim.SGD, **options)


def test_each_stages_replicas_share_this_machines_cores():
    from pipexplore.plan import Plan
    from pipexplore.predict.costs import Corrections

    ex = explored({"pp": 2, "dp": 2})
    # (both without the executor costs probed here: a hand-over measured long, as where four ranks
    # wait for two cores, keeps the stages' actions apart, and with them what they share)
    plan = ex.plan.with_options(corrections=Corrections())
    assert plan.pipeline_devices == ["cpu", "cpu"] and plan.simulate_options()["replicas"] == 2
    alone = Plan(plan.layer_table, splits=plan.splits, devices=("cpu", "cpu"), chunks=2, schedule="1f1b",
                 executor="processes", batch=plan.batch)
    predicted = ex.plan.predicted
    compute = plan.predicted[plan.predicted["phase"] != "collective"]
    forward = lambda frame: frame[frame["phase"] == "forward"].eval("end - start").sum()  # noqa: E731
    # two replicas of each stage, one rank a core each on two cores: an action that runs beside the
    # other stage's runs at half speed (it ran at full speed alone on the core it had)
    assert forward(compute) > forward(alone.predicted) * 1.2
    dp = predicted[predicted["phase"] == "collective"]
    assert set(dp["collective"]) == {"dp all_reduce"} and dp["exposed"].all()


def test_a_mesh_here_runs_as_the_exported_scripts_ranks_and_comes_back_beside_its_prediction():
    ex = explored({"pp": 2, "dp": 2}, data_parallel="fsdp")
    before = ex.plan.predicted["end"].max()
    row = ex.run()  # a mesh's ranks are the exported script's processes, forked here as torchrun would start them
    assert row["executor"] == "torchrun" and row["ranks"] == 4
    model = mesh_hooks.build_model()
    inputs, target = mesh_hooks.get_batch()
    first = torch.stack([mesh_hooks.loss_fn(model(x), y) for x, y in zip(inputs.chunk(2), target.chunk(2))]).mean()
    assert row["loss"] == pytest.approx(first.item(), rel=1e-5)  # every replica on the sample: its loss
    assert row["predicted_step_time"] == pytest.approx(before)
    result = ex.state.log.shown_result()
    assert result.plan.mesh == ex.plan.mesh and result.plan.data_parallel == "fsdp"
    assert "replica_spread" in result.timeline and result.timeline["replica_spread"].notna().all()
    assert set(result.timeline["rank"]) == {0, 2}  # the first replica's pipeline ranks
    assert ex.plan.mesh is not None and ex.plan.mesh.dp == 2  # the plan it teaches keeps the mesh


def test_a_tensor_parallel_rank_here_is_the_measured_layers_at_its_share_of_their_work():
    """pp 2 × tp 2 here: each layer's time scaled by the FLOPs a rank does of it (torch's
    parallelize_module counted on a fake group), its all-reduces on the phase's path over gloo's
    ring, the parameters a rank holds; run as the exported script's ranks, its loss the model's."""
    ex = explored({"pp": 2, "tp": 2})
    rank = ex.plan.layer_table
    assert rank.attrs["tp"] == 2 and ex.plan.simulate_options()["replicas"] == 2
    model = mesh_hooks.build_model()
    inputs, target = mesh_hooks.get_batch()
    blocks = rank["name"].str.startswith("model.layers.").to_numpy()
    # a block's attention and MLP projections are sharded, its norms whole: a rank holds about half of it
    held = (rank["rank_param_bytes"] / rank["param_bytes"])[blocks]
    assert ((held > 0.45) & (held < 0.55)).all()
    assert (rank["forward_comm"][blocks] > 0).all() and (rank["backward_comm"][blocks] > 0).all()
    assert rank.loc[~blocks & (rank["param_bytes"] == 0), "forward_comm"].eq(0).all()
    tp_rows = ex.plan.predicted[ex.plan.predicted["collective"] == "tp all_reduce"]
    assert len(tp_rows) and tp_rows["exposed"].all()
    row = ex.run()
    first = torch.stack([mesh_hooks.loss_fn(model(x), y) for x, y in zip(inputs.chunk(2), target.chunk(2))]).mean()
    assert row["executor"] == "torchrun" and row["ranks"] == 4
    assert row["loss"] == pytest.approx(first.item(), rel=1e-5)
    assert ex.state.log.shown_result().plan.mesh.tp == 2


def test_context_parallelism_here_is_refused_by_name_and_the_plan_kept():
    with pytest.raises(ValueError, match=r"context parallelism is planned for devices from the catalogue"):
        explored({"pp": 2, "cp": 2})
    ex = explored({"pp": 2, "dp": 2})
    before = ex.plan
    with pytest.raises(ValueError, match=r"on this machine's devices a mesh is pipeline, data and tensor parallelism"):
        ex.set_mesh({"pp": 2, "cp": 2})  # the explorer's own method, as the guide shows it
    assert ex.plan is before and ex.mesh == before.mesh
    changed = ex.set_mesh({"pp": 2, "tp": 2})
    assert ex.plan is changed and ex.mesh.tp == 2 and ex.mesh.dp == 1 and changed.num_stages == 2


def test_a_head_tied_to_its_embedding_is_refused_before_any_rank_starts(monkeypatch):
    """Beside data (or tensor) parallelism the script does not sum a tied parameter's gradients
    between pipeline ranks: ex.run() refuses such a model by name before it launches anything
    (the ranks refused it too, once started: ~15 s later), the plan and runs kept."""
    from pipexplore.runs import forked, roundtrip

    monkeypatch.setenv("MESH_HOOKS_MODEL", "llama-tied")
    ex = explored({"pp": 2, "dp": 2})
    before = ex.plan
    with monkeypatch.context() as patched:
        patched.setattr(roundtrip, "launch", lambda *a, **k: pytest.fail("a rank was started"))
        patched.setattr(forked, "launch_forked", lambda *a, **k: pytest.fail("a rank was started"))
        with pytest.raises(ValueError, match=r"LlamaForCausalLM ties lm_head.weight \(stages 0, 1\) across stages "
                                             r".* untie them \(tie_word_embeddings=False\) or plan dp=1"):
            ex.run()
    assert ex.plan is before and ex.runs.empty
    monkeypatch.setenv("MESH_HOOKS_MODEL", "llama")
    untied = explored({"pp": 2, "dp": 2})  # the same model untied: nothing refused before the launch
    assert untied.shared_parameters() == {}


def dies_on_rank_3(output, target):
    """The hooks' loss, except on rank 3 (the last stage's second replica), which dies in its first step."""
    import os

    if os.environ.get("RANK") == "3":
        os._exit(3)
    return mesh_hooks.loss_fn(output, target)


def test_a_rank_that_dies_is_named_with_its_place_in_the_mesh_and_every_rank_is_reaped(monkeypatch):
    from pipexplore.runs.launch import TorchrunError
    from ranks import script_ranks_left

    monkeypatch.setenv("MESH_HOOKS_MODEL", "sequential")
    ex = explored({"pp": 2, "dp": 2})
    ex.state.training = dataclasses.replace(ex.state.training, loss_fn=dies_on_rank_3)
    before = ex.plan
    with pytest.raises(TorchrunError, match=r"rank 3 \(pp 1, dp 1, tp 0\) on host \S+ exited with code 3") as caught:
        ex.run()  # the four ranks forked here (a node agent's failing rank: test_cluster_roundtrip.py)
    assert caught.value.rank == 3
    assert ex.runs.empty and ex.plan is before
    assert not script_ranks_left()


def test_a_mesh_is_probed_through_its_exported_script_before_its_first_run(monkeypatch):
    """Its runs are the exported script's ranks forked here, so that is what the first prediction's
    executor costs are measured on: the script's ranks run busy stages (as many parameter tensors a
    stage as the model's stages hold) trained by the explorer's optimizer, no pool of the processes
    executor is started for it, nothing is left running, and what the probe measured is what the
    first prediction holds."""
    import importlib

    from ranks import script_ranks_left

    script = importlib.import_module("pipexplore.runs.script_probe")
    probing = importlib.import_module("pipexplore.executors.probe")
    roundtrip = importlib.import_module("pipexplore.runs.roundtrip")
    real_run, real_probe, runs, pooled = roundtrip.torchrun_result, script.script_probe, [], []

    def run(model, sample, plan, **options):
        runs.append((model, plan, options))
        return real_run(model, sample, plan, **options)

    def probed(plan, **options):
        runs.append((options, real_probe(plan, **options)))
        return runs[-1][1]

    monkeypatch.setattr(roundtrip, "torchrun_result", run)
    monkeypatch.setattr(script, "script_probe", probed)
    monkeypatch.setattr(probing, "_probe_step", lambda *args, **kwargs: pooled.append(args))
    ex = explored({"pp": 2, "dp": 2}, data_parallel="fsdp")
    (busy, plan, options), (given, (overhead, gap, transfer)) = runs
    assert ex.state.status.text == ""  # what it said while the ranks ran: gone
    assert not pooled and not script_ranks_left()
    assert options["forked"] and plan.mesh == ex.plan.mesh and plan.data_parallel == "fsdp"
    tensors = -(-sum(1 for _ in mesh_hooks.build_model().parameters()) // ex.plan.num_stages)
    assert given["tensors"] == tensors and all(sum(1 for _ in layer.parameters()) == tensors for layer in busy)
    assert given["optimizer"] is torch.optim.SGD
    assert {"forward", "backward", "all"} <= set(overhead) and min(overhead.values()) >= 0 and transfer > 0
    corrections = ex.plan.corrections
    assert corrections.overheads["processes"] == overhead
    assert (corrections.gap("processes"), corrections.transfer("processes")) == (gap, transfer)


def test_a_mesh_whose_script_cannot_be_probed_takes_the_processes_probe_and_says_why(monkeypatch):
    import importlib

    script = importlib.import_module("pipexplore.runs.script_probe")

    def refused(plan, **options):
        raise RuntimeError("no fork server here")

    monkeypatch.setattr(script, "script_probe", refused)
    model = mesh_hooks.build_model()
    inputs, target = mesh_hooks.get_batch()
    with pytest.warns(RuntimeWarning, match="exported script's ranks were not probed .*no fork server here"):
        ex = explore(model, inputs, devices=["cpu"] * 4, chunks=2, schedule="1f1b", executor="processes",
                     mesh={"pp": 2, "dp": 2}, loss_fn=mesh_hooks.loss_fn, target=target)
    assert ex.plan.corrections.overheads["processes"]["forward"] > 0  # the processes probe's


def test_a_busy_layer_holds_the_parameter_tensors_it_is_given():
    from pipexplore.executors.probe import BusyLayer

    assert [sum(1 for _ in BusyLayer(0.0, 0.0, tensors=n).parameters()) for n in (1, 2, 3, 8)] == [2, 2, 2, 8]
    out = BusyLayer(0.0, 0.0, tensors=8)(torch.ones(3, 1, requires_grad=True))
    out.sum().backward()
    assert out.shape == (3, 1)
