"""The co-run probe: the host's shares of CPU stages fitted to a step of the plan's own schedule and executor."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from torch import nn

import pipexplore
from pipexplore.executors import threads
from pipexplore.executors.base import RunResult
from pipexplore.plan import Plan

probe = importlib.import_module("pipexplore.executors.probe")  # (the package's name probe is its function)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(6)])


def _table(model: nn.Sequential, sample: torch.Tensor, share: float):
    table = pipexplore.profile(model, sample, microbatch_rows=[4, 16], repeats=1)
    for column, seconds in (("forward_a", 50e-6), ("forward_b", 2e-6), ("backward_a", 100e-6), ("backward_b", 4e-6)):
        table[column] = seconds  # fixed costs: what is fitted does not depend on this machine's timing
    table["share_forward"] = share
    table["share_backward"] = share
    return table


def _steps_as_if_shares_were(factor: float, monkeypatch: pytest.MonkeyPatch) -> list:
    """threads.run replaced by the simulator's step of the probe's plan with its shares times ``factor``."""
    jobs = []

    def run(job):
        jobs.append(job)
        table = job.plan.layer_table.copy()
        table.attrs.update(job.plan.layer_table.attrs)
        for column in ("share_forward", "share_backward"):
            table[column] = np.clip(table[column] * factor, 0.0, 1.0)
        timeline = job.plan.with_options(layer_table=table).predict()
        return RunResult(job.plan, timeline, 0.0, timeline)

    monkeypatch.setattr(threads, "run", run)
    return jobs


@pytest.mark.parametrize("share,factor,fitted", [(0.3, 2.0, 2.0), (0.9, 0.6, 0.6), (0.3, 0.5, 1.0)])
def test_the_shares_are_scaled_until_the_simulator_gives_the_probe_s_measured_step(monkeypatch, share, factor, fitted):
    """Up where the step ran slower, down where it ran faster; where the shares add up to less than
    the host either way (0.3 · 2 stages, halved: the same step), they stay as profiled."""
    model, sample = _model(), torch.randn(16, 16)
    table = _table(model, sample, share=share)
    plan = Plan(table, splits=(3,), devices=("cpu", "cpu"), chunks=4, schedule="1f1b", batch=16)
    jobs = _steps_as_if_shares_were(factor, monkeypatch)
    shared = probe.co_run_shares(plan, model, sample)
    assert shared is not None and len(jobs) == 1
    assert shared.attrs["co_run_factor"] == pytest.approx(fitted, rel=1e-4)
    assert shared["share_forward"].to_numpy() == pytest.approx(share * fitted, rel=1e-4)
    assert shared["share_backward"].to_numpy() == pytest.approx(share * fitted, rel=1e-4)
    assert (table["share_forward"] == share).all()  # the plan's own table is left as it was
    job = jobs[0]  # the plan's schedule, on copies of its layer kind, as many a stage as the plan's hold
    assert job.plan.schedule == "1f1b" and job.plan.splits == (3,) and job.plan.chunks == 4
    assert len(job.model) == 6 and job.sample.shape == (16, 16)


def test_a_multi_stage_schedule_is_probed_with_its_stages_a_device(monkeypatch):
    model, sample = _model(), torch.randn(16, 16)
    table = _table(model, sample, share=0.4)
    plan = Plan(table, splits=(2, 3, 5), devices=("cpu", "cpu"), chunks=4, schedule="looped-bfs", batch=16)
    jobs = _steps_as_if_shares_were(1.5, monkeypatch)
    shared = probe.co_run_shares(plan, model, sample)
    assert shared is not None and shared.attrs["co_run_factor"] == pytest.approx(1.5, rel=1e-4)
    # 4 stages on 2 devices, two layers a stage (6 layers over 4 stages, rounded)
    assert jobs[0].plan.num_stages == 4 and jobs[0].plan.num_devices == 2 and len(jobs[0].model) == 8


def test_nothing_is_probed_where_stages_do_not_share_the_host_or_it_would_take_too_long(monkeypatch):
    model, sample = _model(), torch.randn(16, 16)
    table = _table(model, sample, share=0.3)
    jobs = _steps_as_if_shares_were(2.0, monkeypatch)
    one = Plan(table, splits=(), devices=("cpu",), chunks=4, batch=16)
    autograd = Plan(table, splits=(3,), devices=("cpu", "cpu"), chunks=4, executor="autograd", batch=16)
    assert probe.co_run_shares(one, model, sample) is None
    assert probe.co_run_shares(autograd, model, sample) is None
    slow = table.copy()
    slow.attrs.update(table.attrs)
    slow["forward_a"] = probe.CO_RUN_SECONDS  # each action alone would take the whole budget
    assert probe.co_run_shares(Plan(slow, splits=(3,), devices=("cpu", "cpu"), chunks=4, batch=16), model,
                               sample) is None
    assert jobs == []


def test_the_explorer_probes_the_table_it_profiled_and_leaves_a_given_one_as_given():
    model, sample = _model(), torch.randn(16, 16)
    ex = pipexplore.explore(model, sample, devices=["cpu", "cpu"], chunks=4)
    factor = ex.layer_table.attrs["co_run_factor"]
    assert probe.CO_RUN_LIMIT ** -1 <= factor <= probe.CO_RUN_LIMIT
    assert ex.plan.layer_table is ex.layer_table  # the first plan predicts with the probed shares
    given = _table(model, sample, share=0.3)
    ex2 = pipexplore.explore(model, sample, devices=["cpu", "cpu"], chunks=4, layer_table=given)
    assert "co_run_factor" not in ex2.layer_table.attrs and (ex2.layer_table["share_forward"] == 0.3).all()


def test_a_model_with_skip_connections_is_not_probed_and_explores_as_before(monkeypatch):
    """Copies of a layer that stashes would stash under one name: the probe leaves such models to the profile."""
    from pipexplore.examples import unet

    torch.manual_seed(0)
    model, sample = unet(width=16, depth=2, features=8), torch.randn(16, 8)
    table = pipexplore.profile(model, sample, microbatch_rows=[4, 16], repeats=1)
    plan = Plan(table, splits=(3,), devices=("cpu", "cpu"), chunks=4, batch=16)
    jobs = _steps_as_if_shares_were(2.0, monkeypatch)
    assert probe.co_run_shares(plan, model, sample) is None and jobs == []
    monkeypatch.undo()
    ex = pipexplore.explore(model, sample, devices=["cpu", "cpu"], chunks=4)
    assert "co_run_factor" not in ex.layer_table.attrs and ex.run()["finite"]


def test_a_probe_that_would_outlast_its_budget_runs_fewer_layers_a_stage_then_fewer_steps():
    """Within :data:`~pipexplore.executors.probe.CO_RUN_SECONDS`: the plan's layers a stage and steps
    where they fit; else fewer layers a stage (a transformer of 3 blocks a stage whose probe would take
    0.55 s runs 2); else one a stage and fewer timed steps, at least 2; else none."""
    budget = probe.CO_RUN_SECONDS
    size = probe._co_run_size
    assert size(budget / 70, 3, 5) == (3, 5)  # 3 layers × 7 steps of budget/70 each: 0.3 of the budget
    assert size(budget / 15, 3, 5) == (2, 5)  # 3 a stage would take 1.4 budgets, 2 take 0.93
    assert size(budget / 5, 3, 5) == (1, 3)  # one a stage, 7 steps: 1.4 budgets; 3 timed + 2: exactly 1
    assert size(budget / 3.5, 3, 5) == (0, 0)  # not even 2 timed steps
    assert size(0.0, 3, 5) == (0, 0)
