"""pipexplore.skip: skippable layers, verification, namespaces and layouts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models import PopLinear, StashLinear, unet_model
from pipexplore import GPipe
from pipexplore.skip import Namespace, inspect_skip_layout, pop, skippable, stash, verify_skippables
from pipexplore.skip.tracker import SkipTracker, current_skip_tracker, use_skip_tracker


@skippable(stash=["a"])
class StashA(nn.Module):
    def forward(self, x):
        yield stash("a", x)
        return x


@skippable(pop=["a"])
class PopA(nn.Module):
    def forward(self, x):
        a = yield pop("a")
        return x + a


@skippable(stash=["a"], pop=["a"])
class Both(nn.Module):
    def forward(self, x):
        a = yield pop("a")
        yield stash("a", x)
        return x + a


def test_skippable_works_as_a_plain_module():
    model = unet_model()
    x = torch.randn(5, 6)
    # The same computation written by hand.
    l = list(model)
    h0 = l[0](x)
    y1 = l[1].module.linear(h0)
    outer = y1 * 2
    h = l[2](torch.tanh(y1))
    y3 = l[3].module.linear(h)
    inner = y3 * 2
    h = l[4](torch.tanh(y3))
    h = l[5].module.linear(h) + inner
    h = l[6](h)
    h = l[7].module.linear(h) + outer
    expected = l[8](h)
    torch.testing.assert_close(model(x), expected)


def test_skippable_keeps_class_name_and_repr():
    layer = StashA()
    assert type(layer).__name__ == "StashA"
    assert repr(layer).startswith("@skippable(")
    assert layer.stashable_names == frozenset({"a"})


def test_module_without_yield_returns_directly():
    @skippable()
    class Plain(nn.Module):
        def forward(self, x):
            return x * 3

    assert torch.equal(Plain()(torch.ones(2)), torch.full((2,), 3.0))


def test_undeclared_stash_and_pop_are_refused():
    @skippable(stash=["a"])
    class StashB(nn.Module):
        def forward(self, x):
            yield stash("b", x)
            return x

    @skippable(pop=["a"])
    class PopB(nn.Module):
        def forward(self, x):
            b = yield pop("b")
            return b

    with use_skip_tracker(SkipTracker()):
        with pytest.raises(RuntimeError, match="'b' has not been declared as stashable by StashB"):
            StashB()(torch.ones(1))
    tracker = SkipTracker()
    tracker.tensors[(None, "a")] = torch.ones(1)
    with use_skip_tracker(tracker):
        with pytest.raises(RuntimeError, match="'b' has not been declared as poppable by PopB"):
            PopB()(torch.ones(1))


def test_declared_but_not_stashed_is_refused():
    @skippable(stash=["a"])
    class Lazy(nn.Module):
        def forward(self, x):
            return x
            yield  # unreachable — makes forward a generator

    with use_skip_tracker(SkipTracker()):
        with pytest.raises(RuntimeError, match=r"Lazy must stash \['a'\] but did not"):
            Lazy()(torch.ones(1))


def test_stashing_one_name_twice_in_one_forward_is_refused():
    @skippable(stash=["a"])
    class Twice(nn.Module):
        def forward(self, x):
            yield stash("a", x)
            yield stash("a", x * 2)
            return x

    tracker = SkipTracker()
    with use_skip_tracker(tracker):
        with pytest.raises(RuntimeError, match=r"Twice stashed 'a' twice in one forward: .* a name of its own"):
            Twice()(torch.ones(1))
    assert tracker.tensors == {}
    pipe = GPipe(nn.Sequential(Twice(), PopA()), balance=[1, 1], devices=["cpu", "cpu"])
    with pytest.raises(RuntimeError, match="Twice stashed 'a' twice in one forward"):
        pipe(torch.ones(2, 1))


def test_pop_before_stash_at_run_time():
    with use_skip_tracker(SkipTracker()):
        with pytest.raises(RuntimeError, match="'a' has not been stashed before PopA pops it"):
            PopA()(torch.ones(1))


def test_current_skip_tracker_is_thread_local_default():
    tracker = current_skip_tracker()
    assert type(tracker) is SkipTracker
    mine = SkipTracker()
    with use_skip_tracker(mine):
        assert current_skip_tracker() is mine
    assert current_skip_tracker() is tracker


def test_verify_accepts_matched_and_isolated():
    verify_skippables(unet_model())
    ns1, ns2 = Namespace(), Namespace()
    verify_skippables(nn.Sequential(StashA().isolate(ns1), PopA().isolate(ns1),
                                    StashA().isolate(ns2), PopA().isolate(ns2)))


def test_verify_lists_every_problem_one_line_each():
    model = nn.Sequential(PopA(), StashA(), StashA(), Both(), nn.ReLU())
    with pytest.raises(TypeError) as info:
        verify_skippables(model)
    lines = [l for l in str(info.value).splitlines() if l.startswith("* ")]
    assert str(info.value).startswith("one or more pairs of stash and pop do not match:")
    assert lines == [
        "* '0' declared 'a' as poppable but it was not stashed ('0' (PopA) pops it: stash it in an earlier layer)",
        "* '2' redeclared 'a' as stashable but not isolated by namespace ('1' (StashA) stashes it already: "
        "isolate each stash and its pop with layer.isolate(Namespace()))",
        "* '3' declared 'a' both as stashable and as poppable (a layer cannot pop what it stashes: rename one of them)",
        "* no module declared 'a' as poppable but stashed ('1' (StashA) stashes it: pop it in a later layer)",
    ]


def test_verify_pop_redeclared_without_isolation():
    model = nn.Sequential(StashA(), PopA(), PopA())
    with pytest.raises(TypeError, match=r"\* '2' redeclared 'a' as poppable but not isolated by namespace"):
        verify_skippables(model)


def test_isolate_only_some_names_and_unknown_names():
    @skippable(stash=["a", "b"])
    class Two(nn.Module):
        def forward(self, x):
            yield stash("a", x)
            yield stash("b", x)
            return x

    ns = Namespace()
    layer = Two().isolate(ns, only=["a"])
    assert dict(layer.stashable()) == {ns: "a", None: "b"}
    with pytest.raises(ValueError, match=r"cannot isolate undeclared skip name\(s\) \['c'\]"):
        Two().isolate(ns, only=["c"])


def test_namespaces_compare_by_identity():
    a, b = Namespace(), Namespace()
    assert a != b and a == a and hash(a) == hash(a)
    assert isinstance(None, Namespace)


def test_inspect_skip_layout_routes():
    model = unet_model()
    layers = list(model)
    parts = [nn.Sequential(*layers[:2]), nn.Sequential(*layers[2:6]), nn.Sequential(*layers[6:])]
    layout = inspect_skip_layout(parts)
    routes = {name_ns: route for name_ns, route in layout.by_ns_name.items()}
    outer_ns = layers[1].namespaces["skip"]
    inner_ns = layers[3].namespaces["skip"]
    assert routes == {(outer_ns, "skip"): (0, 2), (inner_ns, "skip"): (1, 1)}
    assert layout.requires_copy(outer_ns, "skip")
    assert not layout.requires_copy(inner_ns, "skip")
    assert list(layout.copy_policy(2)) == [(0, outer_ns, "skip")]
    assert list(layout.copy_policy(1)) == []
    assert layout.by_partition[1] == [(1, inner_ns, "skip")]
    assert layout.crossing() == [(outer_ns, "skip", 0, 2)]


def test_stash_and_pop_layers_have_parameters():
    assert len(list(StashLinear(4).parameters())) == 2
    assert len(list(PopLinear(4).parameters())) == 2


def test_a_layer_that_stashes_none_is_profiled_and_its_backward_split_measured():
    """``stash(name, None)`` is allowed (torchgpipe's tests do it): the profile and the input/weight
    gradient split skip the None, as the pipeline does, rather than failing on ``None.requires_grad``."""
    import pipexplore

    @skippable(stash=["maybe"])
    class StashNone(nn.Module):
        def forward(self, x):
            yield stash("maybe", None)
            return x

    @skippable(pop=["maybe"])
    class PopNone(nn.Module):
        def forward(self, x):
            skip = yield pop("maybe")
            assert skip is None
            return x

    model = nn.Sequential(nn.Linear(4, 4), StashNone(), PopNone(), nn.Linear(4, 4))
    sample = torch.randn(8, 4)
    table = pipexplore.profile(model, sample, repeats=1, max_repeats=1)
    assert len(table) == 4 and (table["forward"] > 0).all()
    assert table["output_bytes"][1] == table["output_bytes"][2]  # the None adds no bytes
    split = pipexplore.backward_split(model, sample, table, repeats=1)
    assert split["input_grad_ratio"].notna().all()
