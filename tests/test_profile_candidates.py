"""A traced model is profiled as the stages its runs execute (pipexplore.models.trace.profile_candidates): each
candidate's traced stage timed beside its own module, the difference added to the profile, once a
session per model shape; a model that cannot be traced keeps its modules' times and says why."""
from __future__ import annotations

import warnings

import pandas as pd
import pytest
import torch
from torch import fx, nn

from pipexplore.models import trace
from pipexplore.models.trace import pipes as traced_pipes, profile_candidates
from tiny_transformer import Branchy, TinyTransformer, get_batch, loss_fn

NAMES = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]


@pytest.fixture(autouse=True)
def fresh_session():
    profile_candidates.forget_measured()
    yield
    profile_candidates.forget_measured()


@pytest.fixture
def stage_clock(monkeypatch):
    """Known seconds: a traced stage (an fx GraphModule) 2 ms forward and 3 ms backward, a
    model's own module 0.5 ms and 3.5 ms; the modules each was timed on, in order."""
    timed = []

    def seconds(module, args, kwargs, *, repeats=3, warmup=1):
        timed.append(module)
        return (2e-3, 3e-3) if isinstance(module, fx.GraphModule) else (0.5e-3, 3.5e-3)

    monkeypatch.setattr(profile_candidates, "isolated_seconds", seconds)
    return timed


@pytest.fixture
def one_ms_candidates(monkeypatch):
    """trace.candidates giving 1 ms forward and backward for every candidate (the hooks' timing
    left out: what the profile adds to it is what these tests check)."""
    real = profile_candidates.candidates

    def candidates(model, sample, **options):
        table = real(model, sample, **{**options, "repeats": 1, "warmup": 0})
        table["forward"] = table["backward"] = 1e-3
        return table

    monkeypatch.setattr(profile_candidates, "candidates", candidates)


def test_each_candidate_gets_what_its_traced_stage_takes_beyond_its_module(stage_clock):
    tokens, _ = get_batch()
    forward, backward, first_split = profile_candidates.traced_extra(TinyTransformer(), tokens[:2], NAMES)
    assert forward == pytest.approx([1.5e-3] * 7) and backward == pytest.approx([-0.5e-3] * 7)
    assert first_split == 1  # only the embedding's stage reads the tokens
    own = [m for m in stage_clock if not isinstance(m, fx.GraphModule)]
    stages = [m for m in stage_clock if isinstance(m, fx.GraphModule)]
    assert [type(m).__name__ for m in own] == ["Embedding", "Block", "Block", "Block", "Block", "LayerNorm", "Linear"]
    assert len(stages) == 7 and len({id(m) for m in stages}) == 7  # a stage a candidate


def test_the_profile_holds_the_stages_seconds_at_both_sizes_never_below_zero(stage_clock, one_ms_candidates,
                                                                              monkeypatch):
    traced = []
    traced_pipes.forget_traced()
    real = traced_pipes.split_marked
    monkeypatch.setattr(traced_pipes, "split_marked", lambda model, mb_args, points, **o: traced.append(mb_args) or real(
        model, mb_args, points, **o))
    tokens, target = get_batch()
    table = trace.candidates_in_rows(TinyTransformer(), tokens, chunks=4, target=target, loss_fn=loss_fn, repeats=1)
    assert table["forward"].tolist() == pytest.approx([2.5e-3] * 7)  # 1 ms + 1.5 ms beyond the module
    assert table["backward"].tolist() == pytest.approx([0.5e-3] * 7)  # 1 ms - 0.5 ms
    assert [t.shape[0] for t in traced] == [2]  # traced once, on the micro-batch (8 rows in 4)
    extra = table.attrs["stage_extra"]
    assert extra["rows"] == 2 and extra["forward"] == pytest.approx([1.5e-3] * 7)
    assert table["forward_b"].tolist() == pytest.approx([0.0] * 7)  # the same seconds at both sizes
    assert table["forward_a"].tolist() == pytest.approx([2.5e-3] * 7)

    def slower(module, args, kwargs, *, repeats=3, warmup=1):
        return (2e-3, 3e-3) if isinstance(module, fx.GraphModule) else (0.5e-3, 5e-3)

    profile_candidates.forget_measured()
    profile_candidates.isolated_seconds = slower  # (the fixture's monkeypatch puts it back)
    table = trace.candidates_in_rows(TinyTransformer(), tokens, chunks=1, target=target, loss_fn=loss_fn, repeats=1)
    assert table["backward"].tolist() == [0.0] * 7  # 1 ms - 2 ms: no block takes less than nothing


def test_a_model_shape_is_traced_once_a_session(monkeypatch):
    calls = []
    real = traced_pipes.split_marked

    def counting(model, mb_args, split_points, **options):
        calls.append(tuple(split_points))
        return real(model, mb_args, split_points, **options)

    monkeypatch.setattr(traced_pipes, "split_marked", counting)
    traced_pipes.forget_traced()
    tokens, _ = get_batch()
    first = profile_candidates.traced_extra(TinyTransformer(), tokens[:2], NAMES, repeats=1, warmup=0)
    again = profile_candidates.traced_extra(TinyTransformer(), tokens[:2], NAMES, repeats=1, warmup=0)  # other weights
    assert again == first and calls == [tuple(NAMES[1:])]
    profile_candidates.traced_extra(TinyTransformer(), tokens[:4], NAMES, repeats=1, warmup=0)  # another micro-batch
    profile_candidates.traced_extra(TinyTransformer(tied=False), tokens[:2], NAMES, repeats=1, warmup=0)  # untied head
    assert len(calls) == 3
    profile_candidates.forget_measured()
    profile_candidates.traced_extra(TinyTransformer(), tokens[:2], NAMES, repeats=1, warmup=0)
    assert len(calls) == 3  # measured again, on a copy of the session's kept pipe (traced_pipes)
    traced_pipes.forget_traced()
    profile_candidates.forget_measured()
    profile_candidates.traced_extra(TinyTransformer(), tokens[:2], NAMES, repeats=1, warmup=0)
    assert len(calls) == 4
    # the same shape on another device (a GPU's seconds are not a CPU's): a key of its own
    key = profile_candidates._shape_key(TinyTransformer(), tokens[:2], NAMES)
    assert profile_candidates._shape_key(TinyTransformer().to("meta"), tokens[:2], NAMES) != key
    assert profile_candidates._shape_key(TinyTransformer(), tokens[:2].to("meta"), NAMES) != key


def test_a_model_that_cannot_be_traced_keeps_its_modules_times_and_says_why(one_ms_candidates):
    tokens, target = get_batch()
    with pytest.warns(RuntimeWarning, match=r"The profile times BranchyTransformer's own modules, not the stages its "
                                            r"runs trace \(TraceError: could not trace BranchyTransformer"):
        table = trace.candidates_in_rows(Branchy(), tokens, chunks=4, target=target, loss_fn=loss_fn, repeats=1)
    assert table["forward"].tolist() == [1e-3] * len(table) and "stage_extra" not in table.attrs
    assert table.attrs["notes"][-1].startswith("The profile times BranchyTransformer's own modules")


def test_the_explorer_profiles_a_traced_model_as_its_stages_and_says_so(stage_clock, one_ms_candidates):
    from pipexplore.widgets import explore

    tokens, target = get_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # traced: nothing to warn about
        ex = explore(TinyTransformer(), tokens, target=target, loss_fn=loss_fn, devices=["cpu", "cpu"], chunks=4,
                     executor="threads", calibrate=False)
    assert ex.layer_table["forward"].tolist() == pytest.approx([2.5e-3] * 7)
    assert any(note.endswith("each block is profiled as its traced stage.") for note in ex.state.notes)


def test_isolated_seconds_time_a_forward_and_the_backward_into_its_inputs():
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    forward, backward = profile_candidates.isolated_seconds(layer, (x,), {}, repeats=2, warmup=1)
    assert forward > 0 and backward > 0
    assert layer.weight.grad is not None and x.grad is None  # its inputs were fresh leaves, not the given tensor
    counts = nn.Embedding(5, 2).requires_grad_(False)
    assert profile_candidates.isolated_seconds(counts, (torch.tensor([1, 2]),), {}, repeats=1)[1] == 0.0  # no backward


def test_the_whole_tables_columns_stay_a_layer_table():
    tokens, target = get_batch()
    table = trace.candidates_in_rows(TinyTransformer(), tokens, chunks=4, target=target, loss_fn=loss_fn, repeats=1)
    assert isinstance(table, pd.DataFrame) and table["name"].tolist() == NAMES
    extra = table.attrs["stage_extra"]
    assert extra["rows"] == 2 and all(len(extra[p]) == 7 for p in ("forward", "backward"))
    assert (table[["forward", "backward"]] >= 0).all().all()


def test_profile_stages_off_times_the_modules_only_and_reprofile_measures_again(stage_clock, one_ms_candidates,
                                                                               monkeypatch):
    from pipexplore.widgets.state import ExplorerState

    tokens, target = get_batch()
    options = dict(target=target, loss_fn=loss_fn, devices=["cpu", "cpu"], chunks=4, calibrate=False)
    with pytest.raises(TypeError, match="profile_stages must be True or False, got 'no'"):
        ExplorerState(TinyTransformer(), tokens, profile_stages="no", **options)
    modules = ExplorerState(TinyTransformer(), tokens, profile_stages=False, **options)
    assert modules.layer_table["forward"].tolist() == [1e-3] * 7 and "stage_extra" not in modules.layer_table.attrs
    assert stage_clock == []  # nothing traced
    state = ExplorerState(TinyTransformer(), tokens, **options)
    assert state.layer_table["forward"].tolist() == pytest.approx([2.5e-3] * 7) and len(stage_clock) == 14
    ExplorerState(TinyTransformer(), tokens, **options)
    assert len(stage_clock) == 14  # the same shape: this session's seconds
    state.reprofile()
    assert len(stage_clock) == 28 and state.layer_table["forward"].tolist() == pytest.approx([2.5e-3] * 7)


def test_the_explorers_copy_is_timed_as_it_is_not_copied_once_more(monkeypatch):
    # Profiled on the first stage's device, every copy of the model sits there too: the explorer's
    # own copy (given away) is the one whose blocks are timed; only the traced one is made here.
    import copy

    from pipexplore.models.profile import profile_model

    copies = []
    real = copy.deepcopy

    def counting(value, memo=None):
        if isinstance(value, nn.Module) and memo is None:  # a whole model, not its parts
            copies.append(type(value).__name__)
        return real(value, memo)

    monkeypatch.setattr(profile_candidates.copy, "deepcopy", counting)
    traced_pipes.forget_traced()  # (a kept pipe of this shape would be copied, not traced on a copy)
    tokens, target = get_batch()
    table = profile_model(TinyTransformer(), tokens, devices=["cpu", "cpu"], chunks=4, repeats=1, target=target,
                          loss_fn=loss_fn)
    assert "stage_extra" in table.attrs
    assert copies == ["TinyTransformer", "TinyTransformer"]  # the explorer's copy, then the one traced
    copies.clear()
    profile_candidates.forget_measured()
    traced_pipes.forget_traced()
    model = TinyTransformer()
    trace.candidates_in_rows(model, tokens, chunks=4, target=target, loss_fn=loss_fn, repeats=1)
    assert copies == ["TinyTransformer", "TinyTransformer"]  # a caller's model: timed on a copy, traced on another


def test_the_first_run_of_an_explored_model_splits_the_export_its_profile_made():
    """The profile traces the model into a stage per candidate (through the session's kept pipes):
    that export of the model is the one the first run's split takes, not a second export."""
    from pipexplore.widgets import explore

    traced_pipes.forget_traced()
    profile_candidates.forget_measured()
    exports, traces = traced_pipes.exports, traced_pipes.traces  # (counts for the whole process)
    tokens, target = get_batch()
    model = TinyTransformer()
    ex = explore(model, tokens, target=target, loss_fn=loss_fn, devices=["cpu", "cpu"], chunks=4, calibrate=False)
    assert "stage_extra" in ex.layer_table.attrs and traced_pipes.exports == exports + 1  # the profile's
    row = ex.run()
    assert traced_pipes.exports == exports + 1 and traced_pipes.traces == traces + 2  # the run's split: from it
    assert row["loss"] == pytest.approx(loss_fn(model(tokens), target).item(), rel=1e-5)
