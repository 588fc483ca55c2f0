"""Which stages read the model's inputs (pipexplore.models.trace.stage_inputs), and the splits that keep
them in the first stage where a plan runs in processes: torch feeds the inputs to stage 0 only, so
balance, sweep and search propose no split that the processes executor (or the exported torchrun
script) would refuse."""
import copy
import itertools
import logging

import numpy as np
import pandas as pd
import pytest
import torch
import transformers  # the test extra

from pipexplore.balance import optimal_splits
from pipexplore.executors.distributed import _check_traced_split
from pipexplore.models import trace
from pipexplore.models.trace.stage_inputs import first_runnable_split, input_readers, inputs_past_first_stage
from pipexplore.plan import Plan
from pipexplore.predict.search import search
from pipexplore.splits import first_runnable_layer
from pipexplore.predict.sweep import sweep
from pipexplore.widgets import layer_table as layers

logging.getLogger("transformers").setLevel(logging.ERROR)


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(1))
    return model, ids, [name for name, _ in trace.candidate_modules(model)]


@pytest.fixture(scope="module")
def gpt2():
    return _gpt2()


def test_each_input_is_read_where_the_model_reads_it(gpt2):
    """GPT-2 split at every candidate: the ids by the embedding's stage, the attention mask by the
    stage after ``transformer.wpe`` (where the mask is prepared), the labels by the loss's (the last)."""
    model, ids, names = gpt2
    sample = {"input_ids": ids[:2], "attention_mask": torch.ones_like(ids[:2]), "labels": ids[:2]}
    pipe = trace.split(copy.deepcopy(model), sample, names[1:])
    last = len(names) - 1
    assert input_readers(pipe) == {"input_ids": [0], "attention_mask": [1], "labels": [last]}
    assert inputs_past_first_stage(pipe) == {"attention_mask": 1, "labels": last}
    assert first_runnable_split(pipe) == last + 1  # no split runs in processes: the labels' stage is the last
    ids_only = trace.split(copy.deepcopy(model), {"input_ids": ids[:2]}, names[1:])
    assert input_readers(ids_only) == {"input_ids": [0]} and first_runnable_split(ids_only) == 1


def test_a_split_at_the_first_runnable_candidate_runs_in_processes_and_one_before_is_refused(gpt2):
    model, ids, names = gpt2
    sample = {"input_ids": ids[:2], "attention_mask": torch.ones_like(ids[:2])}
    first = first_runnable_split(trace.split(copy.deepcopy(model), sample, names[1:]))
    assert names[first] == "transformer.drop"
    _check_traced_split(model, (), sample, [names[first]])  # no refusal
    with pytest.raises(ValueError, match=r"later stages read 'attention_mask' \(stage 1\)"):
        _check_traced_split(model, (), sample, [names[first - 1]])


def test_the_explorers_profile_says_where_a_processes_stage_may_begin_and_balance_keeps_to_it(gpt2):
    """The traced profile records the first runnable row; a processes plan balances past it, a
    threads plan (which delivers every input to every stage) is free to split before it."""
    model, ids, names = gpt2
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    table = trace.candidates_in_rows(copy.deepcopy(model), sample, chunks=2, repeats=1)
    assert table.attrs["first_split"] == names.index("transformer.drop") == 2
    heavy = table.copy()  # the embedding made the costliest layer: unconstrained, stage 2 begins right after it
    heavy["forward"] = [10.0, *[1.0] * (len(heavy) - 1)]
    heavy["backward"] = 0.0
    assert layers.balanced_splits(heavy, 2, "time", "threads") == [1]
    assert layers.balanced_splits(heavy, 2, "time", "processes") == [2]
    assert layers.balanced_splits(heavy, 3, "time", "processes")[0] >= 2


def test_first_runnable_layer_applies_to_processes_plans_where_enough_layers_follow():
    table = pd.DataFrame({"forward": [1.0] * 6})
    assert first_runnable_layer(table, "processes", 2) == 1  # the table does not say
    table.attrs["first_split"] = 3
    assert first_runnable_layer(table, "processes", 2) == 3
    assert first_runnable_layer(table, "processes", 4) == 3  # layers 3, 4, 5: three more stages
    assert first_runnable_layer(table, "processes", 5) == 1  # too few: the run refuses and names the inputs
    assert [first_runnable_layer(table, e, 2) for e in ("threads", "autograd")] == [1, 1]


def test_optimal_splits_from_a_first_layer_equal_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(40):
        n, stages = int(rng.integers(4, 9)), int(rng.integers(2, 4))
        first = int(rng.integers(1, n - stages + 2))
        costs = rng.uniform(0.1, 3.0, n)
        got = optimal_splits(costs, stages, first=first)
        assert len(got) == stages - 1 and got[0] >= first and got == sorted(set(got)) and got[-1] < n

        def slowest(cuts):
            points = [0, *cuts, n]
            return max(costs[i:j].sum() for i, j in zip(points, points[1:]))

        best = min(slowest(c) for c in itertools.combinations(range(first, n), stages - 1))
        assert slowest(got) == pytest.approx(best, rel=1e-12)


def _plan(executor):
    table = pd.DataFrame({"name": [f"l{k}" for k in range(8)], "type": "Linear",
                          "forward": [8e-3, *[1e-3] * 7], "backward": [8e-3, *[1e-3] * 7],
                          "param_bytes": 1e4, "output_bytes": 1e4, "saved_bytes": 1e4, "stash": "", "pop": ""})
    table.attrs.update(batch=16, first_split=3)
    return Plan(table, splits=(4,), devices=("cpu", "cpu"), chunks=4, schedule="1f1b", executor=executor)


def test_sweep_and_search_split_a_processes_plan_only_where_it_can_run():
    for stages in (2, 3):
        threads, processes = (sweep(_plan(e), stages=[stages])["splits"].iloc[0] for e in ("threads", "processes"))
        assert threads[0] == 1 and processes[0] >= 3, (stages, threads, processes)
        found = search(_plan("processes"), stages=[stages], schedules=["1f1b", "gpipe"], workers=1)
        assert all(splits[0] >= 3 for splits in found["splits"]), found["splits"].tolist()
        assert search(_plan("threads"), stages=[stages], workers=1)["splits"].iloc[0][0] == 1
