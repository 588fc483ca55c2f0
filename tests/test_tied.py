"""Tied weights across ranks (``pipexplore.executors.tied``): GPT-2's embedding and output head,
one tensor in the model, copied by torch's ``pipeline()`` into the first and the last stage, train
as one weight in the processes executor and in the exported torchrun script — each step's loss
the unsplit model's over several optimizer steps, not only the first."""
from __future__ import annotations

import copy
import pathlib
import re

import pandas as pd
import pytest
import torch
from torch import nn

from hf_default_hooks import build_model, get_batch, loss_fn
from pipexplore.executors.tied import own_parameters, tied_parameters
from pipexplore.export.torchrun import torchrun_script
from pipexplore.models import trace
from pipexplore.models.inputs import first_microbatch
from pipexplore.plan import Plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3


def reference_losses(steps: int = STEPS) -> list[float]:
    """The unsplit model trained with SGD (lr 0.01, the executors' and the script's default)."""
    model = build_model()
    inputs, target = get_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(**inputs), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _table_and_split():
    inputs, target = get_batch()
    table = trace.candidates(build_model(), inputs, loss_fn=loss_fn, target=target, repeats=1)
    return table, [table["name"].tolist().index("transformer.h.1")]


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


def test_the_exported_script_trains_a_tied_gpt2_as_the_unsplit_model_step_after_step(tmp_path):
    """Before, step 0 agreed and step 1 did not (4.151576 against 4.149757): each copy took only
    its own use's gradient."""
    from ranks import run_ranks

    table, splits = _table_and_split()
    script = tmp_path / "train_pipeline.py"
    script.write_text(torchrun_script(table, splits, hooks="hf_default_hooks", chunks=2, schedule="1f1b",
                                      device="cpu", steps=STEPS))
    stdout = "".join(run_ranks(script, ["--warmup", "0"], ranks=2, pythonpath=str(ROOT / "tests")))
    losses = [float(v) for v in re.findall(r"step \d+ loss=([0-9.]+)", stdout)]
    assert losses == pytest.approx(reference_losses(), rel=2e-6)


def test_the_processes_executor_trains_a_tied_gpt2_as_the_unsplit_model_step_after_step():
    from pipexplore.distributed import run_processes

    table, splits = _table_and_split()
    plan = Plan(table, tuple(splits), ("cpu", "cpu"), chunks=2, schedule="1f1b", checkpoint="never",
                executor="processes")
    inputs, target = get_batch()
    result = run_processes(build_model(), inputs, plan, target=target, loss_fn=loss_fn, warmup=0, repeats=STEPS,
                           timeout=120)
    assert result.measured_losses == pytest.approx(reference_losses(), rel=2e-6)


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


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight, two blocks between (no skips, so every
    multi-stage schedule runs it)."""

    def __init__(self, vocab: int = 32, width: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _tied_lm() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM()


def _lm_loss(output, target):
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


@pytest.mark.parametrize("schedule", ["zbv", "interleaved"])
def test_tied_copies_on_one_rank_or_across_ranks_train_as_one(schedule):
    """ZB-V puts the first and the last stage (embedding, head) on rank 0: their copies are summed
    there; interleaved puts them on ranks 0 and 1: summed over a group of the two."""
    from pipexplore.distributed import run_processes

    ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(1))
    table = trace.candidates(_tied_lm(), ids, loss_fn=_lm_loss, target=ids, repeats=1)
    assert table["name"].tolist() == ["emb", "blocks.0", "blocks.1", "head"]
    plan = Plan(table, (1, 2, 3), ("cpu", "cpu"), chunks=2, schedule=schedule, checkpoint="never",
                executor="processes")
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    result = run_processes(_tied_lm(), ids, plan, target=ids, loss_fn=_lm_loss, optimizer=sgd, warmup=0,
                           repeats=STEPS, timeout=120)
    model, expected = _tied_lm(), []
    optimizer = sgd(model.parameters())
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = _lm_loss(model(ids), ids)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    assert result.measured_losses == pytest.approx(expected, rel=2e-6)


def test_a_weight_two_stages_of_a_sequential_share_trains_as_one_in_processes():
    """An nn.Sequential's stages are sent to their ranks apart, so a weight two of them share
    arrives as two tensors: summed like a traced model's copies."""
    from pipexplore.distributed import run_processes
    from pipexplore.executors.tied import shared_parameters

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        model[4].weight = model[0].weight
        return model

    assert shared_parameters([build()[:2], build()[2:]]) == []  # two models: nothing shared
    model = build()
    assert shared_parameters([model[:2], model[2:]]) == [[(0, "0.weight"), (1, "4.weight")]]
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
