"""Corners: options and sizes the predictor and the plan would get silently wrong, refused or fixed."""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from torch import nn

from pipexplore.export import plan_code
from pipexplore.plan import Plan
from pipexplore.profiling.sequential import profile
from pipexplore.predict.simulator import simulate


def fitted(n: int = 4, batch: int = 2) -> pd.DataFrame:
    """A layer table whose costs are a line in the rows (as ``profile(microbatch_rows=[1, 2])``)."""
    table = pd.DataFrame({"name": [str(k) for k in range(n)], "forward_a": 1e-3, "forward_b": 1e-3,
                          "backward_a": 2e-3, "backward_b": 2e-3, "output_bytes": 1000.0, "param_bytes": 10.0},
                         index=range(n))
    table["forward"] = table["forward_a"] + table["forward_b"] * batch
    table["backward"] = table["backward_a"] + table["backward_b"] * batch
    table.attrs.update(rows=(1, batch), batch=batch)
    return table


# ---- chunks beyond what the profile's rows make ----------------------------------------------

def test_chunks_beyond_the_profiled_rows_are_refused_naming_both_numbers():
    table = profile(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3)), torch.randn(2, 3), repeats=1)
    assert table.attrs["batch"] == 2
    with pytest.raises(ValueError, match=r"chunks=4 .* 2 rows.*(profile a sample of at least 4 rows|fewer chunks)"):
        simulate(table, [1], chunks=4)
    micro = simulate(table, [1], chunks=2)["microbatch"]
    assert micro[micro >= 0].nunique() == 2  # what the rows make: predicted (-1: each stage's optimizer step)


def test_chunks_that_torch_chunk_cannot_make_exactly_are_refused_with_the_counts_that_it_can():
    # torch.chunk splits 5 rows into chunks of 2: 3 micro-batches, not 4
    with pytest.raises(ValueError, match=r"chunks=4 .* 5 rows.* 3 micro-batches.*choose chunks among 1, 2, 3, 5"):
        simulate(fitted(batch=5), [1], chunks=4)
    # a batch given to simulate is checked as the profile's own
    with pytest.raises(ValueError, match=r"chunks=8 .*batch=6.*choose chunks among .*6.*or a batch"):
        simulate(fitted(batch=2), [1], chunks=8, batch=6)
    assert simulate(fitted(batch=2), [1], chunks=8, batch=16)["microbatch"].nunique() == 8


def test_a_plan_of_more_chunks_than_the_profiled_rows_cannot_be_predicted():
    plan = Plan(fitted(batch=2), splits=(1,), chunks=4)
    with pytest.raises(ValueError, match=r"chunks=4"):
        plan.predicted


def test_a_table_without_rows_takes_any_chunks():
    whole = fitted().drop(columns=["forward_a", "forward_b", "backward_a", "backward_b"])
    whole.attrs = {}
    assert simulate(whole, [1], chunks=7)["microbatch"].nunique() == 7


# ---- options a fitted table ignores ------------------------------------------------------------

def test_per_microbatch_is_refused_for_a_table_whose_costs_follow_from_the_rows():
    with pytest.raises(ValueError, match=r"per_microbatch=True .*line in the rows.*batch="):
        simulate(fitted(), [1], chunks=2, per_microbatch=True)
    whole = fitted().drop(columns=["forward_a", "forward_b", "backward_a", "backward_b"])
    with pytest.raises(ValueError, match=r"per_microbatch=True .*batch of 2 rows"):
        simulate(whole, [1], chunks=2, per_microbatch=True)  # seconds for its batch: read by the rows too
    whole.attrs = {}
    with pytest.raises(ValueError, match=r"per_microbatch=True .*batch=4"):
        simulate(whole, [1], chunks=2, per_microbatch=True, batch=4)


def test_per_microbatch_takes_a_table_of_seconds_without_rows_as_each_micro_batchs():
    whole = fitted().drop(columns=["forward_a", "forward_b", "backward_a", "backward_b"])
    whole.attrs = {}
    each = simulate(whole, [1], chunks=2, per_microbatch=True, checkpoint="never")
    split = simulate(whole, [1], chunks=2, checkpoint="never")
    forward = lambda t: (t[t.phase == "forward"].end - t[t.phase == "forward"].start).to_numpy()  # noqa: E731
    assert forward(each) == pytest.approx(2 * forward(split))


def test_a_micro_batchs_bytes_are_its_share_of_the_profiled_rows_whatever_batch_is_given():
    from pipexplore.predict.simulator import prepare_step

    # The table's bytes are for its 2 profiled rows: a micro-batch of 2 rows holds all of them,
    # one of 1 row half, however large the mini-batch.
    assert prepare_step(fitted(batch=2), [1], chunks=8, batch=16).fractions == [1.0] * 8
    assert prepare_step(fitted(batch=2), [1], chunks=2).fractions == [0.5, 0.5]
    whole = fitted().drop(columns=["forward_a", "forward_b", "backward_a", "backward_b"])
    whole.attrs = {}
    assert prepare_step(whole, [1], chunks=4, batch=8).fractions == [0.25] * 4  # bytes of the batch given


# ---- the code a plan exports ------------------------------------------------------------------

def test_the_pipelining_code_of_a_one_stage_plan_runs_as_is():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    table = pd.DataFrame({"name": ["0", "1", "2"], "forward": 1.0, "backward": 2.0})
    code = plan_code(Plan(table, chunks=2), "pipelining")
    assert code.startswith("import torch\nfrom torch.distributed.pipelining import SplitPoint, pipeline, ScheduleGPipe")
    namespace = {"model": model, "sample": torch.randn(4, 3)}
    exec(code, namespace)
    assert namespace["pipe"].num_stages == 1 and namespace["split_spec"] == {}


def test_the_pipelining_code_of_an_interleaved_plan_gives_each_rank_its_stages():
    table = pd.DataFrame({"name": ["0", "1", "2", "3"], "forward": 1.0, "backward": 2.0})
    code = plan_code(Plan(table, splits=(1, 2, 3), devices=("cpu", "cpu"), chunks=2, schedule="interleaved"),
                     "pipelining")
    assert "for s in range(rank, pipe.num_stages, world_size)]" in code
    assert "ScheduleInterleaved1F1B(stages, n_microbatches=chunks" in code


# ---- names nothing used ------------------------------------------------------------------------

def test_dead_names_are_gone():
    import importlib

    gone = {"pipexplore.executors.step": ["_result", "_measure", "traced_module"],
            "pipexplore.gpipe": ["CHECKPOINT_MODES"], "pipexplore.widgets.timeline_figure": ["update_timeline_figure"]}
    for module, names in gone.items():
        loaded = importlib.import_module(module)
        assert not [name for name in names if hasattr(loaded, name)], module
        assert not set(names) & set(getattr(loaded, "__all__", ())), module


def test_a_sweep_leaves_out_chunks_the_batch_does_not_split_into_exactly():
    from pipexplore.predict.sweep import sweep
    from pipexplore.validate import splits_exactly

    plan = Plan(fitted(batch=5), (2,), ("cpu", "cpu"), chunks=1, batch=5)
    table = sweep(plan, chunks=[1, 2, 3, 4, 5, 6])
    # 5 rows: 2 chunks of 3+2, 3 of 2+2+1, 5 of 1; 4 would make 3 micro-batches and 6 more than rows
    assert sorted(table["chunks"]) == [1, 2, 3, 5]
    assert [c for c in range(1, 8) if splits_exactly(5, c)] == [1, 2, 3, 5]
