"""Models that are not nn.Sequential: candidates, splits through torch's tracer, processes, torchrun export."""
from __future__ import annotations

import copy


import pytest
import torch
from torch import nn

from pipexplore.export.torchrun import torchrun_script
from pipexplore.models import trace
from pipexplore.plan import Plan
from tiny_transformer import Branchy, TinyTransformer, build_model, get_batch, loss_fn
from ranks import assert_equals_unsplit


def test_candidates_in_execution_order_with_costs_and_tied_weights():
    tokens, _ = get_batch()
    table = trace.candidates(TinyTransformer(tied=True), (tokens,), repeats=2)
    assert table["name"].tolist() == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]
    assert table.loc[0, "param_bytes"] == 64 * 32 * 4 and table.loc[5, "param_bytes"] == 2 * 32 * 4
    assert table.loc[1, "output_bytes"] == 8 * 8 * 32 * 4
    assert (table["forward"] > 0).all() and (table.loc[1:, "backward"] > 0).all()
    assert table["shared"].tolist() == ["head.weight", "", "", "", "", "", "head.weight"]


def test_a_tied_heads_backward_is_its_own_not_the_rest_of_the_pass():
    """The tied weight accumulates once, after the embedding's backward (the last): the head that
    shares it ends with its own backward, not there. Timed as the whole rest of the backward pass,
    GPT-2's head took 57 ms of a ~110 ms step (1 ms on its own), and its first prediction was 40 %
    long. The embedding, where the weight's gradient is summed, keeps the accumulation."""
    tokens, _ = get_batch()
    table = trace.candidates(TinyTransformer(tied=True), (tokens,), repeats=3).set_index("name")
    blocks = sum(table.loc[f"layers.{k}", "backward"] for k in range(4))
    assert table.loc["head", "backward"] < 0.5 * blocks  # ~5 % of them: one Linear's backward; the bug gave > 100 %
    assert table.loc["embed", "backward"] > 0


class Jumper(nn.Module):
    """``h`` from the first block feeds the last one directly: a value that skips blocks."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.d = Joiner()

    def forward(self, x):
        h = self.a(x)
        return self.d(self.c(self.b(h)), h)


class Joiner(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, skip):
        return self.linear(x) + skip


def test_values_that_jump_over_blocks_are_skip_routes():
    x = torch.randn(4, 4)
    table = trace.candidates(Jumper(), (x,), repeats=1)
    assert table["stash"].tolist() == ["v0>3", "", "", ""] and table["pop"].tolist() == ["", "", "", "v0>3"]
    plan = Plan(table, (1, 2, 3), ("cpu",) * 4)
    assert [(r.stash_stage, r.pop_stage, r.crosses) for r in plan.skip_routes] == [(0, 3, True)]
    pipe = trace.split(Jumper(), (x,), ["b", "c", "d"])
    assert pipe.num_stages == 4 and trace.skip_routes_of(pipe) == [(0, 3)]


def test_pipe_split_calls_in_the_model_are_honoured():
    from torch.distributed.pipelining import pipe_split

    class Marked(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x)
            pipe_split()
            return self.b(x)

    assert trace.split(Marked(), (torch.randn(2, 4),), []).num_stages == 2


def test_data_dependent_control_flow_fails_with_a_clear_message():
    tokens, _ = get_batch()
    with pytest.raises(trace.TraceError) as info:
        trace.split(Branchy(), (tokens[:2],), ["layers.0"])
    message = str(info.value)
    assert message.startswith("could not trace BranchyTransformer into one graph to split it")
    assert "data-dependent control flow" in message and "pipe_split()" in message and "PipelineStage" in message


def test_torchrun_export_checks_its_arguments():
    table = trace.candidates(build_model(), (get_batch()[0],), repeats=1)
    with pytest.raises(ValueError, match="hooks must name an importable module"):
        torchrun_script(table, [3], hooks="not a module", chunks=4)
    with pytest.raises(ValueError, match="the torchrun export knows"):
        torchrun_script(table, [3], hooks="m", chunks=4, schedule="async-backends")


@pytest.mark.slow
def test_explorer_takes_a_traced_model():
    from pipexplore.widgets import explore

    tokens, target = get_batch()
    ex = explore(TinyTransformer(tied=True), tokens, target=target, loss_fn=loss_fn, devices=["cpu", "cpu"],
                 chunks=4, splits=[3], executor="processes")
    assert ex.traced and ex.plan.executor == "processes"
    assert [layer["name"] for layer in ex.bar.layers][:2] == ["embed", "layers.0"]
    assert ex.shared_parameters() == {"head.weight": [0, 1]}
    assert "parameters used by several stages: head.weight (stages 0, 1)" in ex.w_stages.value
    ex.splits = [2]
    assert ex.module_fqns_per_model_part == [["embed", "layers.0"],
                                             ["layers.1", "layers.2", "layers.3", "norm", "head"]]
    assert "torchrun --standalone --nproc-per-node 2" in ex.export("torchrun", hooks="tiny_transformer")
    with pytest.raises(ValueError, match="GPipe takes an nn.Sequential"):
        ex.export("gpipe")
    row = ex.run()
    assert row["executor"] == "processes" and set(ex.timeline("measured")["stage"]) == {0, 1}
    row = ex.run(executor="threads")  # the same split, its stages in this process
    assert row["executor"] == "threads" and set(ex.timeline("measured")["stage"]) == {0, 1}
    with pytest.raises(ValueError, match="the autograd executor .* takes an nn.Sequential, not TinyTransformer"):
        ex.run(executor="autograd")
    assert ex.runs["executor"].tolist() == ["processes", "threads"]


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_traced_model_is_profiled_on_its_first_stages_device(monkeypatch, device):
    # As a Sequential's layers are: the model and its inputs as given sit on the CPU, and an H100
    # showed GPT-2 planned from CPU seconds (first predictions 2.5-4x its runs).
    from pipexplore.devices.placement import Placement
    from pipexplore.models import trace as trace_module
    from pipexplore.models.profile import profile_model

    seen = {}

    def fake(model, sample, *, chunks, target=None, **options):
        seen.update(model=next(model.parameters()).device, sample={k: v.device for k, v in sample.items()},
                    target=target.device)
        raise RuntimeError("profiled")

    monkeypatch.setattr(trace_module, "candidates_in_rows", fake)
    stages = [device] * 2
    if device == "meta":  # no GPU here: where the first stage's device is read, it is meta
        monkeypatch.setattr(Placement, "profiling_device", property(lambda self: torch.device("meta")))
        stages = ["cpu"] * 2
    tokens, target = get_batch()
    model = TinyTransformer()
    with pytest.raises(RuntimeError, match="profiled"):
        profile_model(model, {"input_ids": tokens}, devices=stages, chunks=4, repeats=1, target=target)
    where = torch.device(device)
    assert seen == {"model": where, "sample": {"input_ids": where}, "target": where}
    assert next(model.parameters()).device == torch.device("cpu")  # the user's model stays where it was


def test_explorer_stays_usable_when_tracing_fails():
    from pipexplore.widgets import explore

    tokens, target = get_batch()
    with pytest.warns(RuntimeWarning, match="The profile times BranchyTransformer's own modules"):
        ex = explore(Branchy(), tokens, target=target, loss_fn=loss_fn, devices=["cpu", "cpu"], chunks=4, splits=[2])
    assert any(note.startswith("The profile times BranchyTransformer's own modules, not the stages its runs trace "
                               "(TraceError: could not trace") for note in ex.state.notes)  # on the page
    ex.w_run.click()
    ex.state.runner.thread.join(timeout=120)
    assert "TraceError: could not trace BranchyTransformer" in ex.w_status.value
    assert ex.splits == [2] and ex.runs.empty
    ex.splits = [3]  # still usable
    assert ex.plan.balance == [3, len(ex.layer_table) - 3]


# ---- split points at any depth ---------------------------------------------------------------

class Mlp(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Head(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.value = nn.Linear(width, width // 2)

    def forward(self, x):
        return self.value(x)


class Block(nn.Module):
    """A block whose attention heads sit in a ModuleList: a list inside a block stays closed."""

    def __init__(self, width=8):
        super().__init__()
        self.heads = nn.ModuleList(Head(width) for _ in range(2))
        self.mlp = Mlp(width)

    def forward(self, x):
        return self.mlp(x + torch.cat([head(x) for head in self.heads], dim=-1))


class Titan(nn.Module):
    """torchtitan's layout: blocks in a ModuleDict keyed "0", "1", …"""

    def __init__(self, depth=3, width=8):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, width)
        self.layers = nn.ModuleDict({str(k): Block(width) for k in range(depth)})
        self.norm = nn.LayerNorm(width)
        self.output = nn.Linear(width, 16)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


class Stage(nn.Module):
    def __init__(self, width=8, depth=2):
        super().__init__()
        self.downsample = nn.Linear(width, width)
        self.blocks = nn.Sequential(*[Mlp(width) for _ in range(depth)])

    def forward(self, x):
        return self.blocks(self.downsample(x))


class Backbone(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.stem = nn.Linear(4, width)
        self.stages = nn.ModuleList(Stage(width) for _ in range(2))

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return x


class Encoder(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.layer = nn.ModuleList(Mlp(width) for _ in range(2))

    def forward(self, x):
        for layer in self.layer:
            x = layer(x)
        return x


class Nested(nn.Module):
    """``backbone.stages.N.blocks.M`` and ``encoder.layer.N`` under plain attributes."""

    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.encoder = Encoder()
        self.classifier = nn.Linear(8, 3)

    def forward(self, x):
        return self.classifier(self.encoder(self.backbone(x)))


def test_candidates_descend_containers_wherever_they_sit():
    assert [n for n, _ in trace.candidate_modules(Titan())] == [
        "tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"]
    assert [n for n, _ in trace.candidate_modules(Nested())] == [
        "backbone.stem", "backbone.stages.0.downsample", "backbone.stages.0.blocks.0", "backbone.stages.0.blocks.1",
        "backbone.stages.1.downsample", "backbone.stages.1.blocks.0", "backbone.stages.1.blocks.1",
        "encoder.layer.0", "encoder.layer.1", "classifier"]
    # the modules are the model's own, by their FQNs
    modules = dict(Titan().named_modules())
    assert all(type(module) is type(modules[name]) for name, module in trace.candidate_modules(Titan()))


def test_children_granularity_opens_each_block_one_level():
    assert [n for n, _ in trace.candidate_modules(Titan(depth=1), granularity="children")] == [
        "tok_embeddings", "layers.0.heads.0", "layers.0.heads.1", "layers.0.mlp", "norm", "output"]
    with pytest.raises(ValueError, match="granularity must be one of 'blocks', 'children', got 'leaves'"):
        trace.candidate_modules(Titan(), granularity="leaves")


def test_candidates_of_a_module_dict_model_are_profiled_in_execution_order():
    tokens = torch.randint(0, 16, (4, 5))
    table = trace.candidates(Titan(), tokens, repeats=1)
    assert table["name"].tolist() == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"]
    assert (table.loc[1:3, "forward"] > 0).all() and (table.loc[1:3, "backward"] > 0).all()
    assert table.loc[1, "param_bytes"] == sum(p.numel() * 4 for p in Block().parameters())


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.b(self.a(x))


def test_profile_warms_up_before_the_timed_passes():
    model = Counting()
    trace.candidates(model, torch.randn(2, 4), repeats=2, warmup=3)
    assert model.calls == 5
    with pytest.raises(ValueError, match="warmup must be 0 or more passes, got -1"):
        trace.candidates(model, torch.randn(2, 4), warmup=-1)


def test_splits_the_tracer_cannot_make_raise_trace_errors():
    tokens = torch.randint(0, 16, (2, 5))
    with pytest.raises(trace.TraceError, match=r"split point\(s\) \['layers.7'\] name no submodule of Titan"):
        trace.split(Titan(), tokens, ["layers.7"])

    class Unused(Titan):
        def __init__(self):
            super().__init__()
            self.spare = nn.Linear(8, 8)

    with pytest.raises(trace.TraceError, match=r"\['spare'\] did not begin a stage: Unused's forward never calls"):
        trace.split(Unused(), tokens, ["spare"])

    class Twice(Titan):
        def forward(self, tokens):
            h = self.tok_embeddings(tokens)
            h = self.norm(self.layers["0"](h))
            return self.output(self.norm(h))

    with pytest.raises(trace.TraceError,
                       match=r"split point\(s\) \[.norm.\] would begin 2 stages each: forward calls them more than"):
        trace.split(Twice(), tokens, ["norm"])
    with pytest.raises(trace.TraceError, match=r"\['layers.1'\] are given more than once"):
        trace.split(Titan(), tokens, ["layers.1", "layers.1"])


def test_a_split_inside_blocks_traces_and_keeps_the_output():
    tokens = torch.randint(0, 16, (2, 5))
    model = Titan()
    pipe = trace.split(copy.deepcopy(model), tokens, ["layers.1.mlp", "layers.2.heads.1"])
    assert pipe.num_stages == 3
    torch.testing.assert_close(pipe(tokens)[0], model(tokens))


# ---- traced models in this process -----------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("splits,schedule,checkpoint", [((3,), "gpipe", "never"), ((2, 4), "1f1b", "except_last"),
                                                        ((2, 4), "zero-bubble", "always"),
                                                        ((1, 3, 5), "interleaved", "except_last")])
def test_traced_transformer_in_process_equals_the_unsplit_model(tied, splits, schedule, checkpoint):
    from pipexplore.executors.traced import run_traced_step

    torch.manual_seed(0)
    model = TinyTransformer(tied=tied)
    tokens, target = get_batch()
    table = trace.candidates(copy.deepcopy(model), tokens, repeats=1)
    devices = ("cpu",) * (2 if schedule == "interleaved" else len(splits) + 1)
    plan = Plan(table, splits, devices, chunks=4, schedule=schedule, checkpoint=checkpoint)
    result = run_traced_step(model, tokens, plan, target=target, loss_fn=loss_fn, warmup=0, repeats=1,
                             return_grads=True)
    assert_equals_unsplit(result, model, tokens, target, loss_fn)  # a tied weight under either name
    assert {key.split(".", 1)[0] for key in result.metrics["grads"]} == {str(s) for s in range(len(splits) + 1)}
    measured = result.timeline
    assert set(measured["stage"]) == set(range(len(splits) + 1))
    expected = {"gpipe": {"forward", "backward"}, "1f1b": {"forward", "backward", "recompute"},
                "zero-bubble": {"forward", "input_grad", "weight_grad", "recompute"},
                "interleaved": {"forward", "backward", "recompute"}}[schedule]
    assert set(measured["phase"]) == expected | {"optimizer"}  # each stage's update ends the step
    compute = measured[measured["phase"] != "optimizer"]
    assert (compute.groupby("stage")["microbatch"].nunique() == 4).all()
    assert (measured[measured["phase"] == "optimizer"].groupby("stage").size() == 1).all()


def test_module_dict_model_split_between_its_blocks_trains_in_process():
    from pipexplore.executors.traced import run_traced_step

    model = Titan(depth=3)
    tokens = torch.randint(0, 16, (6, 5))
    target = torch.randint(0, 16, (6, 5))

    def titan_loss(logits, target):
        return nn.functional.cross_entropy(logits.reshape(-1, 16), target.reshape(-1))

    table = trace.candidates(copy.deepcopy(model), tokens, repeats=1)
    plan = Plan(table, (2, 3), ("cpu",) * 3, chunks=3, schedule="1f1b", checkpoint="never")
    assert [table["name"][s] for s in plan.splits] == ["layers.1", "layers.2"]
    result = run_traced_step(model, tokens, plan, target=target, loss_fn=titan_loss, warmup=0, repeats=1,
                             return_grads=True)
    reference = copy.deepcopy(model)
    titan_loss(reference(tokens), target).backward()
    named = dict(reference.named_parameters())
    assert len(result.metrics["grads"]) == len(named)
    for key, grad in result.metrics["grads"].items():
        torch.testing.assert_close(grad, named[key.split(".", 1)[1]].grad, rtol=1e-4, atol=1e-6)


def test_traced_executor_checks_its_arguments():
    from pipexplore.executors.traced import TracedExecutor, run_traced_step

    tokens, target = get_batch()
    pipe = trace.split(build_model(), tokens[:2], ["layers.2"])
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        TracedExecutor(pipe, schedule="pipedream")
    with pytest.raises(ValueError, match=r"2 stages need 2 devices, got 1 \(cpu\)"):
        TracedExecutor(pipe, devices=["cpu"])
    executor = TracedExecutor(pipe, devices=["cpu", "cpu"], chunks=3, loss_fn=loss_fn)
    with pytest.raises(ValueError, match="the batch of 8 rows does not divide into chunks=3"):
        executor.step(tokens, target)
    table = trace.candidates(build_model(), tokens, repeats=1)
    with pytest.raises(ValueError, match="schedule 'async-backends' serves nn.Sequential stages"):
        run_traced_step(build_model(), tokens, Plan(table, (3,), ("cpu", "cpu"), chunks=4, schedule="async-backends"),
                        target=target, loss_fn=loss_fn)


def test_explorer_runs_a_traced_model_in_process_by_default():
    from pipexplore.widgets import explore

    tokens, target = get_batch()
    ex = explore(build_model(), tokens, target=target, loss_fn=loss_fn, devices=["cpu", "cpu"], chunks=4,
                 splits=[3], schedule="1f1b", profile_repeats=1)
    assert ex.traced and ex.plan.executor == "threads"
    first, second = ex.run(), ex.run()
    assert first["executor"] == second["executor"] == "threads"
    assert set(ex.timeline("measured")["stage"]) == {0, 1}
    # both runs train a fresh copy: the same first step, the same loss
    assert second["loss"] == pytest.approx(first["loss"], rel=1e-6)


def test_traced_stages_run_their_generated_code_not_the_fx_interpreter(monkeypatch):
    """torch's unflattened stage modules run through torch.fx.Interpreter by default (node by node
    in Python: twice the time of small CPU layers); the split's stages run their generated code,
    with the same outputs and gradients as the interpreter's."""
    tokens, _ = get_batch()
    pipe = trace.split(build_model(), (tokens[:2],), ["layers.2"])
    interpreted = trace.split(build_model(), (tokens[:2],), ["layers.2"])
    for module in interpreted.split_gm.modules():  # as torch leaves them
        if getattr(module, "_run_with_interpreter", None) is False:
            module._run_with_interpreter = True
    assert trace.run_generated_code(pipe.split_gm) == 0  # done by split already

    runs = []
    original = torch.fx.Interpreter.run
    monkeypatch.setattr(torch.fx.Interpreter, "run", lambda self, *a, **k: runs.append(1) or original(self, *a, **k))
    outputs = []
    for which in (pipe, interpreted):
        runs.clear()
        x = tokens[:2]
        for s in range(which.num_stages):
            x = which.split_gm.get_submodule(f"submod_pp_{s}")(*(x if isinstance(x, tuple) else (x,)))
        out = x[0] if isinstance(x, tuple) else x
        out.float().pow(2).mean().backward()
        grads = [p.grad.clone() for p in which.split_gm.parameters() if p.grad is not None]
        outputs.append((out.detach(), grads, len(runs)))
    (out, grads, runs_generated), (out_i, grads_i, runs_interpreted) = outputs
    assert runs_generated == 0 and runs_interpreted > 0
    assert torch.equal(out, out_i) and len(grads) == len(grads_i) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_i, strict=True))
