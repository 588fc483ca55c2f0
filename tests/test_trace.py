"""Models that are not nn.Sequential: candidates, splits through torch's tracer, processes, torchrun export."""
from __future__ import annotations

import copy
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
import torch
from torch import nn

from pipexplore import trace
from pipexplore.distributed import run_processes
from pipexplore.plan import Plan
from tiny_transformer import Branchy, TinyTransformer, build_model, get_batch, loss_fn

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_candidates_in_execution_order_with_costs_and_tied_weights():
    tokens, _ = get_batch()
    table = trace.candidates(TinyTransformer(tied=True), (tokens,), repeats=2)
    assert table["name"].tolist() == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]
    assert table.loc[0, "param_bytes"] == 64 * 32 * 4 and table.loc[5, "param_bytes"] == 2 * 32 * 4
    assert table.loc[1, "output_bytes"] == 8 * 8 * 32 * 4
    assert (table["forward"] > 0).all() and (table.loc[1:, "backward"] > 0).all()
    assert table["shared"].tolist() == ["head.weight", "", "", "", "", "", "head.weight"]


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


@pytest.mark.slow
@pytest.mark.parametrize("splits,ranks,schedule,chunks", [((3,), 2, "gpipe", 4), ((2, 4), 3, "1f1b", 4),
                                                          ((1, 2, 3, 4), 5, "1f1b", 8)])
def test_traced_transformer_in_processes_equals_the_unsplit_model(splits, ranks, schedule, chunks):
    model = build_model()
    tokens, target = get_batch()
    table = trace.candidates(copy.deepcopy(model), (tokens,), repeats=1)
    plan = Plan(table, splits, ("cpu",) * ranks, chunks=chunks, schedule=schedule, executor="processes")
    result = run_processes(model, tokens, plan, target=target, loss_fn=loss_fn, return_grads=True, warmup=0)
    reference = copy.deepcopy(model)
    loss = loss_fn(reference(tokens), target)
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    named = dict(reference.named_parameters())
    assert len(result.metrics["grads"]) == len(named)
    for key, grad in result.metrics["grads"].items():
        torch.testing.assert_close(grad, named[key.split(".", 1)[1]].grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_exported_torchrun_script_trains_one_step_like_a_single_process(tmp_path):
    tokens, target = get_batch()
    table = trace.candidates(build_model(), (tokens,), repeats=1)
    script = trace.torchrun_script(table, [3], hooks="tiny_transformer", chunks=4, schedule="1f1b")
    assert "MODULE_FQNS_PER_MODEL_PART = [['embed', 'layers.0', 'layers.1'], ['layers.2', 'layers.3', 'norm', 'head']]" \
        in script
    path = tmp_path / "train_pipeline.py"
    path.write_text(script)
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    # A rendezvous port of this test's own (``--standalone`` shares one with every parallel test run).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([str(torchrun), "--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                           f"127.0.0.1:{port}", "--rdzv-id", f"pipexplore-test-{port}", "--nproc-per-node", "2",
                           str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    match = re.search(r"step 0 loss=([0-9.]+)", done.stdout)
    assert match, done.stdout
    assert float(match.group(1)) == pytest.approx(loss_fn(build_model()(tokens), target).item(), rel=1e-5)


def test_torchrun_export_checks_its_arguments():
    table = trace.candidates(build_model(), (get_batch()[0],), repeats=1)
    with pytest.raises(ValueError, match="hooks must name an importable module"):
        trace.torchrun_script(table, [3], hooks="not a module", chunks=4)
    with pytest.raises(ValueError, match="the torchrun export knows"):
        trace.torchrun_script(table, [3], hooks="m", chunks=4, schedule="async-backends")


@pytest.mark.slow
def test_explorer_takes_a_traced_model():
    from pipexplore.widgets import explore

    tokens, target = get_batch()
    ex = explore(TinyTransformer(tied=True), tokens, target=target, loss_fn=loss_fn, devices=["cpu", "cpu"],
                 chunks=4, splits=[3])
    assert ex.traced and ex.plan.executor == "processes"
    assert [layer["name"] for layer in ex.bar.layers][:2] == ["embed", "layers.0"]
    assert ex.shared_parameters() == {"head.weight": [0, 1]}
    assert "parameters used by several stages: head.weight (stages 0, 1)" in ex.w_stages.value
    ex.splits = [2]
    assert ex.module_fqns_per_model_part == [["embed", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "head"]]
    assert "torchrun --standalone --nproc-per-node 2" in ex.export("torchrun", hooks="tiny_transformer")
    with pytest.raises(ValueError, match="GPipe takes an nn.Sequential"):
        ex.export("gpipe")
    row = ex.run()
    assert row["executor"] == "processes" and set(ex.timeline("measured")["stage"]) == {0, 1}
    with pytest.raises(ValueError, match="choose executor='processes'"):
        ex.run(executor="threads")


def test_explorer_stays_usable_when_tracing_fails():
    from pipexplore.widgets import explore

    tokens, target = get_batch()
    ex = explore(Branchy(), tokens, target=target, loss_fn=loss_fn, devices=["cpu", "cpu"], chunks=4, splits=[2])
    ex.w_run.click()
    ex._thread.join(timeout=120)
    assert "TraceError: could not trace BranchyTransformer" in ex.w_status.value
    assert ex.splits == [2] and ex.runs.empty
    ex.splits = [3]  # still usable
    assert ex.plan.balance == [3, len(ex.layer_table) - 3]
