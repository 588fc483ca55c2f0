"""Traced splits kept for the session (``pipexplore.models.trace.pipes``): a rerun is not traced
again, runs the model's weights as they are, and the kept pipes hold no weights."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import pipexplore.models.trace as tracing
from pipexplore.executors.traced import run_traced_step
from pipexplore.models.trace import pipes as traced_pipes
from pipexplore.plan import Plan
from ranks import assert_equals_unsplit, traced_tiny_transformer
from tiny_transformer import loss_fn


@pytest.fixture
def traces(monkeypatch):
    """The splits traced from here on (each call's split points), none kept before (nor any
    export: a split of a kept export is a split traced, without exporting the model again)."""
    traced_pipes.forget_traced()
    calls: list[list[str]] = []
    original = traced_pipes.split_marked

    def counting(model, mb_args, split_points, **kwargs):
        calls.append(list(split_points))
        return original(model, mb_args, split_points, **kwargs)

    monkeypatch.setattr(traced_pipes, "split_marked", counting)
    yield calls
    traced_pipes.forget_traced()


def test_a_rerun_is_not_traced_again_and_runs_the_models_weights_as_they_are(traces):
    model, tokens, target, table, splits = traced_tiny_transformer()
    plan = Plan(table, tuple(splits), ("cpu",) * 4, chunks=4, schedule="1f1b", executor="threads")
    before = copy.deepcopy(model.state_dict())
    run = lambda: run_traced_step(model, tokens, plan, target=target, loss_fn=loss_fn, warmup=0,  # noqa: E731
                                  repeats=1, return_grads=True)
    first = run()
    assert len(traces) == 1
    assert_equals_unsplit(first, model, tokens, target, loss_fn)
    again = run()
    assert len(traces) == 1  # copied from the kept pipe
    assert again.loss == first.loss and again.metrics["grads"].keys() == first.metrics["grads"].keys()
    for name, grad in again.metrics["grads"].items():
        assert torch.equal(grad, first.metrics["grads"][name]), name
    for name, value in model.state_dict().items():  # the runs trained copies
        assert torch.equal(value, before[name]), name

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.5)
    changed = run()
    assert len(traces) == 1 and changed.loss != first.loss
    assert_equals_unsplit(changed, model, tokens, target, loss_fn)  # the weights as they are now
    (skeleton, tensors), = traced_pipes._kept.values()
    assert tensors and all(t.is_meta for t, _ in tensors)  # the kept pipe holds no weights
    assert all(t.is_meta for t in skeleton.split_gm.parameters())

    model.eval()  # traced as it runs: another trace
    run()
    assert len(traces) == 2
    run_traced_step(model, tokens, plan.with_options(splits=tuple(splits[:2]), devices=("cpu",) * 3),
                    target=target, loss_fn=loss_fn, warmup=0, repeats=1)
    assert len(traces) == 3 and len(traced_pipes._kept) == 3  # another split


def test_a_copy_of_a_model_with_a_tied_weight_holds_its_weights_as_the_trace_does(traces):
    import transformers  # the test extra (declared: a missing one fails)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    inputs = {"input_ids": torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))}
    fresh = traced_pipes.traced_pipe(model, inputs, ["transformer.h.1"])
    copied = traced_pipes.traced_pipe(model, inputs, ["transformer.h.1"])
    assert len(traces) == 1

    def sharing(pipe):
        """Names of the stages' parameters grouped by the tensor they are (tied: one group)."""
        groups: dict[int, list[str]] = {}
        for name, parameter in pipe.split_gm.named_parameters(remove_duplicate=False):
            groups.setdefault(id(parameter), []).append(name)
        return sorted(groups.values())

    assert sharing(copied) == sharing(fresh)  # (torch's split gives each stage its own tensor)
    names = {name.split(".", 1)[1] for name, _ in copied.split_gm.named_parameters(remove_duplicate=False)}
    assert {"transformer.wte.weight", "lm_head.weight"} <= names  # the tied pair under both names
    ours = {p.data_ptr() for p in model.parameters()}
    assert not any(p.data_ptr() in ours for p in copied.split_gm.parameters())  # copies, not the model's
    for pipe in (fresh, copied):
        torch.manual_seed(0)  # the same dropout masks
        pipe.outputs = pipe(**inputs)
    torch.testing.assert_close(copied.outputs[0], fresh.outputs[0], rtol=0, atol=0)


def test_the_kept_splits_are_bounded_and_a_failed_split_is_not_kept(traces, monkeypatch):
    monkeypatch.setattr(traced_pipes, "KEPT_SPLITS", 2)
    model, tokens, _, _, _ = traced_tiny_transformer()
    sample = tokens[:2]
    for points in (["layers.1"], ["layers.2"], ["layers.3"], ["layers.1"]):
        traced_pipes.traced_pipe(model, sample, points)
    assert traces == [["layers.1"], ["layers.2"], ["layers.3"], ["layers.1"]]  # the first had left
    assert len(traced_pipes._kept) == 2
    with pytest.raises(tracing.TraceError, match="name no submodule"):
        traced_pipes.traced_pipe(model, sample, ["layers.9"])
    with pytest.raises(tracing.TraceError, match="name no submodule"):
        traced_pipes.traced_graph(model, sample, ["layers.9"])
    assert len(traced_pipes._kept) == 2


def test_a_tied_model_and_its_untied_twin_are_traced_apart():
    from tiny_transformer import TinyTransformer

    tokens = torch.randint(0, 50, (2, 8))
    tied, untied = TinyTransformer(tied=True), TinyTransformer(tied=False)
    assert [n for n, _ in tied.named_parameters(remove_duplicate=False)] == \
        [n for n, _ in untied.named_parameters(remove_duplicate=False)]
    assert traced_pipes.split_key(tied, tokens, None, ["layers.2"]) != \
        traced_pipes.split_key(untied, tokens, None, ["layers.2"])
    assert traced_pipes.split_key(tied, tokens, None, ["layers.2"]) == \
        traced_pipes.split_key(TinyTransformer(tied=True), tokens, None, ["layers.2"])
    assert traced_pipes.split_key(tied, tokens.to("meta"), None, ["layers.2"]) != \
        traced_pipes.split_key(tied, tokens, None, ["layers.2"])  # the inputs' device too


NET = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)){extra})
"""


def _net_class(extra: str, cell: str) -> type:
    """``Net`` defined by running its source, as a notebook cell defines it (``cell``: the file name
    the cell's code is compiled under)."""
    namespace: dict = {"__name__": "__main__"}
    exec(compile(NET.format(extra=extra), cell, "exec"), namespace)
    return namespace["Net"]


def test_a_class_redefined_with_another_forward_is_traced_again_and_the_same_code_is_not(traces):
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    mse = torch.nn.functional.mse_loss
    table = tracing.candidates(_net_class("", "<cell 1>")(), (x,), repeats=1)
    plan = Plan(table, (1,), ("cpu", "cpu"), chunks=2, schedule="gpipe", executor="threads")

    def run(cls):
        torch.manual_seed(0)
        model = cls()
        result = run_traced_step(model, x, plan, target=target, loss_fn=mse, warmup=0, repeats=1,
                                 return_grads=True)
        assert_equals_unsplit(result, model, x, target, mse)  # what this class's forward computes
        return result

    run(_net_class("", "<cell 1>"))
    run(_net_class("", "<cell 2>"))  # the same code run again in another cell: the kept pipe
    assert len(traces) == 1
    run(_net_class(" * 2", "<cell 3>"))  # forward edited: the old pipe would compute without the "* 2"
    assert len(traces) == 2
    assert traced_pipes.class_code(_net_class("", "<a>")) != traced_pipes.class_code(_net_class(" * 2", "<a>"))


def test_an_owned_model_lends_its_tensors_to_the_pipe_and_a_copy_does_not(traces):
    """``owned=True`` (a processes rank's copy of the model): the pipe holds the model's own
    parameters, traced or copied from the kept pipe (one model's memory in the rank, not two)."""
    model, tokens, _, _, splits = traced_tiny_transformer()
    points = ["layers.1"]
    mb = (tokens[:2],)
    mine = {p.data_ptr() for p in model.parameters()}
    first = traced_pipes.traced_pipe(model, mb, points, owned=True)  # traced: the model itself
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = traced_pipes.traced_pipe(model, mb, points, owned=True)  # copied from the kept pipe
        copied = traced_pipes.traced_pipe(model, mb, points)
    # a copy of the kept pipe says nothing of torch's deprecated internals (LeafSpec)
    assert not [w for w in caught if "LeafSpec" in str(w.message)], [str(w.message) for w in caught]
    assert len(traces) == 1
    for pipe in (first, again):
        assert {p.data_ptr() for p in pipe.split_gm.parameters()} == mine
    assert not {p.data_ptr() for p in copied.split_gm.parameters()} & mine
    torch.testing.assert_close(again.split_gm(*mb), copied.split_gm(*mb))


@pytest.mark.parametrize("tied", [True, False])
def test_a_new_split_of_a_kept_shape_is_split_from_its_kept_export_and_equals_the_unsplit_model(traces, tied):
    """The first split exports the model marked at every candidate (both granularities); a split
    at other points of a model of that shape splits the kept export (no export), holding the
    model's weights as they are, a tied weight tied, the model itself unchanged, owned or not."""
    from tiny_transformer import TinyTransformer, get_batch

    torch.manual_seed(0)
    model = TinyTransformer(tied=tied)
    tokens, target = get_batch()
    exports = traced_pipes.exports
    traced_pipes.traced_pipe(model, tokens[:2], ["layers.2"])  # (one micro-batch of 4, as the runs take it)
    assert traced_pipes.exports == exports + 1
    (_, kept), = traced_pipes._exports.items()
    assert {"layers.1", "layers.1.attn", "layers.3.mlp", "head"} <= set(kept.order)
    assert all(t.is_meta for t in kept.program.state_dict.values())  # it holds no weights
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.9)  # weights of the model as it is now, not as the export saw them
    before = copy.deepcopy(model.state_dict())
    tables = [tracing.candidates(copy.deepcopy(model), (tokens,), granularity=g, repeats=1)
              for g in ("blocks", "children")]
    for points in (["layers.1", "layers.3"], ["layers.0.mlp", "layers.2.attn", "norm"], ["head"]):
        table = next(t for t in tables if set(points) <= set(t["name"]))
        names = table["name"].tolist()
        plan = Plan(table, tuple(names.index(p) for p in points), ("cpu",) * (len(points) + 1), chunks=4,
                    schedule="1f1b", executor="threads")
        result = run_traced_step(model, tokens, plan, target=target, loss_fn=loss_fn, warmup=0, repeats=1,
                                 return_grads=True)
        assert_equals_unsplit(result, model, tokens, target, loss_fn)  # a tied weight tied
    assert traced_pipes.exports == exports + 1 and len(traces) == 4  # four splits, one export
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert "forward" not in vars(model.layers[1]) and "forward" not in vars(model.head)  # no marker left on it
    owned = traced_pipes.traced_pipe(model, tokens[:2], ["layers.0"], owned=True)
    assert traced_pipes.exports == exports + 1
    shared = {p.data_ptr() for p in owned.split_gm.parameters()}
    if not tied:  # (torch's splitter gives each stage of a tied weight a copy of its own, traced or not)
        assert shared == {p.data_ptr() for p in model.parameters()}  # the owned model's own tensors
    torch.testing.assert_close(owned(tokens[:2])[0], model(tokens[:2]))


class _AutocastInside(torch.nn.Module):
    """A module called inside an autocast block: export keeps that block a region of its own."""

    def __init__(self):
        super().__init__()
        self.first, self.half, self.last = (torch.nn.Linear(6, 6) for _ in range(3))

    def forward(self, x):
        x = torch.tanh(self.first(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.half(x)
        return self.last(x + y.float())


def test_where_the_markers_cannot_go_the_split_is_traced_at_its_own_points(traces):
    """Where an export marked everywhere fails (a marker inside an autocast region) or its markers
    do not follow the calls one for one, the split is traced at its points alone (here torch's
    splitter refuses such a region anyway: the error is the one ``trace.split`` gives), and no
    export is kept."""
    model, x = _AutocastInside(), torch.randn(4, 6)
    with pytest.raises(tracing.TraceError, match="could not trace _AutocastInside"):
        traced_pipes.traced_pipe(model, (x,), ["last"])
    assert traces == [["last"], ["last"]]  # marked everywhere: not traced; then at its point
    assert not traced_pipes._exports and not traced_pipes._kept
    with pytest.raises(tracing.TraceError, match="could not trace _AutocastInside"):
        tracing.split(copy.deepcopy(model), (x,), ["last"])


class _ConstantRegion(torch.nn.Module):
    """A module called inside a ``no_grad`` block that needs no gradient (a frozen table of a buffer)."""

    def __init__(self):
        super().__init__()
        self.first, self.table, self.last = (torch.nn.Linear(6, 6) for _ in range(3))
        self.table.requires_grad_(False)
        self.register_buffer("ones", torch.ones(6))

    def forward(self, x):
        with torch.no_grad():
            scale = self.table(self.ones)
        return self.last(torch.tanh(self.first(x)) * scale)


def test_a_marker_in_a_region_that_is_inlined_comes_out_with_it(traces):
    """A constant ``no_grad`` region is inlined before the split (``fx_workarounds``): the marker
    of the module inside it is then in its place, and the export serves every split."""
    model, x = _ConstantRegion(), torch.randn(4, 6)
    exports = traced_pipes.exports
    for points in (["last"], ["first"], ["first", "last"]):
        pipe = traced_pipes.traced_pipe(model, (x,), points)
        torch.testing.assert_close(pipe(x)[0], model(x))
    assert len(traces) == 3 and traced_pipes.exports == exports + 1
    (_, kept), = traced_pipes._exports.items()
    assert kept.order == ("table", "first", "last")


def test_a_point_the_kept_export_did_not_mark_is_exported_again_and_a_refused_point_once(traces):
    """A split at a module the kept export has no marker for (any submodule may begin a stage, not
    only the candidates) exports the model again, marked there too; a point forward never calls
    is refused after one export, not retried."""
    from tiny_transformer import TinyTransformer, get_batch

    torch.manual_seed(0)
    model = TinyTransformer(tied=False)
    tokens, _ = get_batch()
    exports = traced_pipes.exports
    traced_pipes.traced_pipe(model, tokens[:2], ["layers.2"])
    pipe = traced_pipes.traced_pipe(model, tokens[:2], ["layers.1.mlp.2"])  # inside a candidate's children
    assert traced_pipes.exports == exports + 2 and pipe.num_stages == 2
    torch.testing.assert_close(pipe(tokens[:2])[0], model(tokens[:2]))
    (_, kept), = traced_pipes._exports.items()
    assert "layers.1.mlp.2" in kept.marked
    del traces[:]
    with pytest.raises(tracing.TraceError, match=r"\['layers.1.attn.out_proj'\] did not begin a stage"):
        traced_pipes.traced_pipe(model, tokens[:2], ["layers.1.attn.out_proj"])  # MultiheadAttention never calls it
    assert len(traces) == 2  # the kept export has no marker there: exported once more, marked there; refused
