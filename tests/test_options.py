"""The explorer's options are one checked value, and the explorer's methods are written once: every
public method and property of the state is the explorer's, with the same signature and docstring."""
from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch
from torch import nn

from pipexplore.widgets.explorer import Explorer, explore
from pipexplore.widgets.options import ExploreOptions
from pipexplore.widgets.state import ExplorerState


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)])


FAST = dict(devices=["cpu", "cpu"], chunks=2, calibrate=False, profile_repeats=1)


# ---- one definition of each method --------------------------------------------------------

def _public(cls: type) -> dict[str, object]:
    return {name: inspect.getattr_static(cls, name) for name in dir(cls) if not name.startswith("_")}


def _gaps(state_class: type, explorer_class: type) -> list[str]:
    """What of the state's public surface the explorer lacks or has otherwise (kind, signature, setter)."""
    state, explorer = _public(state_class), _public(explorer_class)
    gaps = [f"{name}: missing" for name in sorted(set(state) - set(explorer))]
    for name in sorted(set(state) & set(explorer)):
        member, mine = state[name], explorer[name]
        if isinstance(member, property):
            if not isinstance(mine, property) or (mine.fset is None) != (member.fset is None):
                gaps.append(f"{name}: not the same property")
        elif inspect.isfunction(member):
            if not inspect.isfunction(mine) or inspect.signature(mine) != inspect.signature(member):
                gaps.append(f"{name}: another signature")
            elif not inspect.getdoc(mine):
                gaps.append(f"{name}: no docstring")
    return gaps


def test_every_public_method_and_property_of_the_state_is_the_explorers_with_its_signature():
    assert _gaps(ExplorerState, Explorer) == []
    # the methods users call are among them, each written once (on the state), not forwarded
    for name in ("run", "update", "balance", "set_mesh", "search", "sweep", "apply", "restore", "stage_table",
                 "timeline", "residuals", "cancel", "clear_runs", "load_run", "reprofile", "shared_parameters",
                 "splits", "memory_cap", "runs", "plan", "mesh", "keep_timelines"):
        assert name in _public(ExplorerState) and name not in vars(Explorer), name
    assert "export" in vars(Explorer)  # the one the page adds to: its report among the kinds
    assert Explorer.run.__doc__ == ExplorerState.run.__doc__ and "a real training step" in Explorer.run.__doc__


def test_the_surface_check_sees_a_dropped_or_changed_method():
    class Facade:  # forwards written by hand: one forgotten, one with its own signature
        def update(self, **changes):
            """Change the plan."""

        def run(self, executor=None):
            """Run a step."""

    gaps = _gaps(ExplorerState, Facade)
    assert "set_mesh: missing" in gaps and "run: another signature" in gaps and "plan: missing" in gaps

    class Narrower(Explorer):
        def timeline(self, kind="predicted"):  # run= dropped
            """A timeline."""

    assert _gaps(ExplorerState, Narrower) == ["timeline: another signature"]


# ---- one checked value ----------------------------------------------------------------------

@pytest.mark.parametrize("options,error,message", [
    (dict(chunks=0), ValueError, r"chunks: number of chunks must be a positive integer, got 0"),
    (dict(chunks="4"), TypeError, r"chunks: number of chunks must be a positive integer, got '4' \(str\)"),
    (dict(checkpoint="sometimes"), ValueError, r"checkpoint is not one of 'always', 'except_last', or 'never'"),
    (dict(schedule="zigzag"), ValueError, r"unknown schedule 'zigzag': choose one of gpipe"),
    (dict(executor="gpu"), ValueError, r"unknown executor 'gpu': choose one of"),
    (dict(granularity="leaves"), ValueError, r"granularity must be one of 'blocks', 'children', got 'leaves'"),
    (dict(keep_timelines=-1), ValueError, r"keep_timelines must be an integer ≥ 0, got -1"),
    (dict(profile_repeats=0), ValueError, r"profile_repeats must be an integer ≥ 1, got 0"),
    (dict(gpus_per_node=0), ValueError, r"gpus_per_node must be an integer ≥ 1, got 0"),
    (dict(memory_cap="lots"), ValueError, r"memory_cap must be a number of bytes > 0 or a size such as '2 GiB'"),
    (dict(calibrate="yes"), TypeError, r"calibrate must be True or False, got 'yes' \(str\)"),
    (dict(sequence_parallel=1), TypeError, r"sequence_parallel must be True or False, got 1 \(int\)"),
    (dict(data_parallel="zero3"), ValueError, r"unknown data_parallel 'zero3': ddp, zero1, fsdp"),
    (dict(capacity_factor=0.5), ValueError, r"capacity_factor is how many times .* from 1 \(balanced\) to the "
                                            r"mesh's ep, got 0.5"),
    (dict(capacity_factor=True), TypeError, r"capacity_factor must be a number from 1 \(balanced routing\) to the "
                                            r"mesh's ep, got True \(bool\)"),
    (dict(mesh=8), ValueError, r"mesh is a mapping of tp, pp, dp and cp"),
    (dict(tp_plan=["colwise"]), TypeError, r"tp_plan must map module names to parallel styles"),
    (dict(splits="4"), TypeError, r"splits must be a list of layer indices"),
    (dict(layer_table=[1, 2]), TypeError, r"layer_table must be a pandas DataFrame"),
    (dict(loss_fn=3), TypeError, r"loss_fn must be a callable loss_fn\(output, target\) or None, got 3"),
    (dict(devices=["H9000"]), ValueError, r"devices: 'H9000' is not a device: .*catalogue: H100"),
])
def test_a_bad_option_is_refused_naming_it_and_what_would_do(options, error, message):
    with pytest.raises(error, match=message):
        ExploreOptions.of(**options)


def test_an_unknown_option_names_the_nearest_one():
    with pytest.raises(TypeError, match=r"explore\(\) has no option 'chunk': did you mean 'chunks'\?"):
        ExploreOptions.of(chunk=4)
    with pytest.raises(TypeError, match=r"explore\(\) has no option 'chunk': did you mean 'chunks'\?"):
        explore(_model(), torch.randn(4, 8), chunk=4)


def test_a_bad_option_is_refused_by_the_explorer_before_anything_is_profiled(monkeypatch):
    import pipexplore.widgets.state as state_module

    def never(*args, **kwargs):
        raise AssertionError("profiled before the options were checked")

    monkeypatch.setattr(state_module, "profile_model", never)
    with pytest.raises(ValueError, match="unknown data_parallel 'zero3'"):
        Explorer(_model(), torch.randn(4, 8), data_parallel="zero3")


def test_options_round_trip_and_hold_the_checked_values():
    options = ExploreOptions.of(devices="H100,H100,H100,H100", gpus_per_node=2, chunks=4, schedule="1f1b",
                                memory_cap="2 GiB", splits=[1, 2], mesh={"pp": 2, "dp": 2}, data_parallel="zero1",
                                tp_plan={"0": "colwise"})
    assert options.devices == ("H100:0", "H100:1", "H100:2", "H100:3") and options.memory_cap == 2 * 2 ** 30
    assert options.splits == (1, 2) and options.mesh == {"pp": 2, "dp": 2}
    assert ExploreOptions.of(**options.keywords()) == options
    assert ExploreOptions(**options.keywords()) == options
    assert set(options.keywords()) == set(ExploreOptions.names()) == set(inspect.signature(ExploreOptions).parameters)
    assert replace(options, chunks=8).chunks == 8 and replace(options, chunks=8) != options
    with pytest.raises(ValueError, match="chunks"):
        replace(options, chunks=0)  # replace checks again
    with pytest.raises(AttributeError):
        options.chunks = 8  # type: ignore[misc]  # frozen


def test_the_state_holds_its_options_made_once_from_a_value_or_keywords():
    model, sample = _model(), torch.randn(4, 8)
    options = ExploreOptions.of(**FAST)
    from_value = ExplorerState(model, sample, options, layer_table=None)
    from_keywords = ExplorerState(model, sample, **FAST)
    assert from_value.options == from_keywords.options == options
    assert from_value.plan.chunks == from_keywords.plan.chunks == 2
    over = ExplorerState(model, sample, options, chunks=4, layer_table=from_value.layer_table)
    assert over.options == replace(options, chunks=4, layer_table=from_value.layer_table) and over.plan.chunks == 4
    assert over.layer_table is from_value.layer_table  # the table given, not profiled again


def test_an_option_a_plan_holds_defaults_to_the_plans_own_default():
    """One default each: an option the plan takes as it is given (checkpoint, schedule, executor,
    nodes, the mesh's data parallelism, the experts' options) starts where a plan made without it
    starts, so an explorer and a plan built by hand agree."""
    from dataclasses import fields

    from pipexplore.plan import Plan

    plan = {f.name: f.default for f in fields(Plan)}
    shared = {f.name for f in fields(ExploreOptions)} & set(plan) - {"devices", "chunks", "splits", "layer_table",
                                                                       "mesh", "batch"}
    assert {"checkpoint", "schedule", "executor", "gpus_per_node", "data_parallel", "sequence_parallel",
            "reshard_after_forward", "moe_overlap", "moe_dispatcher", "capacity_factor"} <= shared
    options = ExploreOptions()
    assert {name: getattr(options, name) for name in shared} == {name: plan[name] for name in shared}
