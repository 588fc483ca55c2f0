"""Tied weights across ranks (``pipexplore.executors.tied``): an embedding and an output head, one
tensor in the model (GPT-2's ``wte`` and ``lm_head``; the tied LM of ``tied_lm_hooks``), copied by
torch's ``pipeline()`` into the first and the last stage, train as one weight in the processes
executor and in the exported torchrun script — each step's loss the unsplit model's over several
optimizer steps, not only the first."""
from __future__ import annotations

import copy
import pathlib
import re

import pandas as pd
import pytest
import torch
from torch import nn

import tied_lm_hooks as tied_lm
from hf_default_hooks import build_model, get_batch
from pipexplore.executors.tied import own_parameters, tied_parameters
from pipexplore.export.torchrun import torchrun_script
from pipexplore.models import trace
from pipexplore.models.inputs import first_microbatch
from pipexplore.plan import Plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3


def reference_losses(steps: int = STEPS) -> list[float]:
    """The unsplit tied LM trained with its hooks' optimizer (SGD, lr 0.1)."""
    model = tied_lm.build_model()
    ids, target = tied_lm.get_batch()
    optimizer = tied_lm.build_optimizer(model.parameters())
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = tied_lm.loss_fn(model(ids), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_split_names_the_copies_of_a_tied_weight():
    model = build_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    inputs, _ = get_batch()
    pipe = trace.split(copy.deepcopy(model), first_microbatch(inputs, 2), ["transformer.h.1"])
    assert tied_parameters(pipe) == [[(0, "transformer.wte.weight"), (1, "lm_head.weight")]]


def test_a_parameter_two_stages_of_a_rank_share_is_stepped_by_one_optimizer():
    shared = nn.Linear(2, 2)
    first, last = nn.Sequential(shared, nn.Linear(2, 3)), nn.Sequential(nn.Linear(3, 2), shared)
    owned = own_parameters([list(first.parameters()), list(last.parameters())])
    assert [len(params) for params in owned] == [4, 2]
    assert not {id(p) for p in owned[0]} & {id(p) for p in owned[1]}
    assert {id(p) for params in owned for p in params} == {id(p) for p in [*first.parameters(), *last.parameters()]}


def test_the_exported_script_trains_a_tied_lm_as_the_unsplit_model_step_after_step(tmp_path):
    """Before, step 0 agreed and the next did not (a tied GPT-2: 4.151576 against 4.149757): each
    copy took only its own use's gradient. (GPT-2's copies in processes: tests/test_hf.py.)"""
    from ranks import run_ranks

    ids, _ = tied_lm.get_batch()
    table = trace.candidates(tied_lm.build_model(), ids, loss_fn=tied_lm.loss_fn, target=ids, repeats=1)
    assert table["name"].tolist() == ["emb", "blocks.0", "blocks.1", "head"]
    script = tmp_path / "train_pipeline.py"
    script.write_text(torchrun_script(table, [2], hooks="tied_lm_hooks", chunks=2, schedule="1f1b", device="cpu",
                                      steps=STEPS))
    stdout = "".join(run_ranks(script, ["--warmup", "0"], ranks=2, pythonpath=str(ROOT / "tests")))
    losses = [float(v) for v in re.findall(r"step \d+ loss=([0-9.]+)", stdout)]
    assert losses == pytest.approx(reference_losses(), rel=2e-6)


def test_a_frozen_tied_weight_gets_no_gradient():
    """Summing copies must not hand a frozen weight a zero gradient (Adam's weight decay would then
    move it); one rank, so no process group is needed."""
    from pipexplore.executors.tied import sum_tied_grads

    first, last = nn.Linear(2, 2), nn.Linear(2, 2)
    first.weight.requires_grad_(False)
    last.weight.requires_grad_(False)
    groups = [(None, [(0, "weight"), (1, "weight")])]
    sum_tied_grads(groups, {0: first, 1: last})
    assert first.weight.grad is None and last.weight.grad is None
    first.weight.requires_grad_(True)
    last.weight.requires_grad_(True)
    first.weight.grad, last.weight.grad = torch.ones(2, 2), None
    sum_tied_grads(groups, {0: first, 1: last})
    assert torch.equal(first.weight.grad, torch.ones(2, 2)) and torch.equal(last.weight.grad, torch.ones(2, 2))
    assert first.weight.grad is not last.weight.grad


@pytest.mark.parametrize("schedule", ["zbv", "interleaved"])
def test_tied_copies_on_one_rank_or_across_ranks_train_as_one(schedule):
    """ZB-V puts the first and the last stage (embedding, head) on rank 0: their copies are summed
    there; interleaved puts them on ranks 0 and 1: summed over a group of the two."""
    from pipexplore.executors.distributed import run_processes

    ids, _ = tied_lm.get_batch()
    table = trace.candidates(tied_lm.build_model(), ids, loss_fn=tied_lm.loss_fn, target=ids, repeats=1)
    plan = Plan(table, (1, 2, 3), ("cpu", "cpu"), chunks=2, schedule=schedule, checkpoint="never",
                executor="processes")
    result = run_processes(tied_lm.build_model(), ids, plan, target=ids, loss_fn=tied_lm.loss_fn,
                           optimizer=tied_lm.build_optimizer, warmup=0, repeats=STEPS, timeout=120)
    assert result.measured_losses == pytest.approx(reference_losses(), rel=2e-6)


def test_a_weight_two_stages_of_a_sequential_share_trains_as_one_in_processes():
    """An nn.Sequential's stages are sent to their ranks apart, so a weight two of them share
    arrives as two tensors: summed like a traced model's copies."""
    from pipexplore.executors.distributed import run_processes
    from pipexplore.executors.tied import stage_shared_parameters

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        model[4].weight = model[0].weight
        return model

    assert stage_shared_parameters([build()[:2], build()[2:]]) == []  # two models: nothing shared
    model = build()
    assert stage_shared_parameters([model[:2], model[2:]]) == [[(0, "0.weight"), (1, "4.weight")]]
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 8)
    mse = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
    table = pd.DataFrame({"name": [str(k) for k in range(5)], "forward": 1.0, "backward": 2.0})
    plan = Plan(table, (2,), ("cpu", "cpu"), chunks=2, schedule="1f1b", checkpoint="never", executor="processes")
    result = run_processes(build(), x, plan, target=y, loss_fn=mse, warmup=0, repeats=STEPS, timeout=120)
    reference, expected = build(), []
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = mse(reference(x), y)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    assert result.measured_losses == pytest.approx(expected, rel=2e-6)
