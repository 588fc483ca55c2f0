"""Every prediction says what it rests on: measured here, learnt from runs, or the catalogue's
figures, with the error the benchmarks measured for that kind (``pipexplore.predict.basis``)."""
from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from torch import nn

from pipexplore import explore
from pipexplore.plan import Plan
from pipexplore.predict.basis import BASES, MEASURED_ERROR, TORCHRUN_HERE_ERROR, prediction_basis
from pipexplore.predict.costs import Corrections


def _explorer(**options):
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return explore(model, torch.randn(16, 32), chunks=2, **options)


def test_a_prediction_here_rests_on_what_was_measured_here_until_a_run_teaches_it():
    ex = _explorer(devices=["cpu", "cpu"])
    basis = prediction_basis(ex.plan)
    assert basis.kind == "measured here"
    assert (basis.median, basis.largest) == MEASURED_ERROR["measured here"][:2]
    assert basis.text().startswith("measured here · benchmarks: median 5 %, max 46 % (prediction_accuracy.py")
    first = ex.run()
    assert first["prediction_basis"] == "measured here" and first["benchmark_error"] == pytest.approx(0.046)
    assert prediction_basis(ex.plan).kind == "learnt from runs"
    second = ex.run()
    assert second["prediction_basis"] == "learnt from runs"
    assert list(ex.runs["prediction_basis"]) == ["measured here", "learnt from runs"]


def test_without_calibration_every_run_is_predicted_from_what_was_measured_here():
    ex = _explorer(devices=["cpu", "cpu"], calibrate=False)
    ex.run()
    assert prediction_basis(ex.plan).kind == "measured here"


def test_ranks_run_here_under_torchrun_say_what_their_own_benchmark_measured():
    """Ranks under torchrun on this machine's cores (a mesh's, or a pipeline's under node agents)
    are not what prediction_accuracy.py runs: their prediction carries mesh_here.py's figures,
    first run and after a run taught it."""
    table = _explorer(devices=["cpu", "cpu"]).plan.layer_table
    pipeline = Plan(table, splits=(2,), devices=["cpu"] * 2, chunks=2, executor="processes")
    meshed = Plan(table, splits=(2,), devices=["cpu"] * 4, chunks=2, executor="processes", mesh={"pp": 2, "dp": 2})
    assert prediction_basis(pipeline).source.startswith("prediction_accuracy.py")
    basis = prediction_basis(meshed)
    assert basis.kind == "measured here" and (basis.median, basis.largest) == TORCHRUN_HERE_ERROR["measured here"][:2]
    assert basis.text().startswith("measured here · benchmarks: median") and "(mesh_here.py, first run)" in basis.text()
    taught = dataclasses.replace(meshed, corrections=Corrections(runs=1))
    assert prediction_basis(taught).kind == "learnt from runs"
    assert prediction_basis(taught).source == "mesh_here.py, runs after the first"
    assert prediction_basis(pipeline, executor="torchrun").source == "mesh_here.py, first run"
    assert set(TORCHRUN_HERE_ERROR) == {"measured here", "learnt from runs"}


def test_a_plan_for_catalogue_devices_rests_on_the_catalogue():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    ex = explore(model, torch.empty(64, 1024, device="meta"), devices=["H100"] * 2, chunks=4)
    basis = prediction_basis(ex.plan)
    assert basis.kind == "catalogue" and "Narayanan" in basis.source
    assert basis.median is not None and 0 < basis.median < basis.largest


def test_every_kind_has_its_benchmark_or_says_it_has_none():
    assert set(MEASURED_ERROR) == set(BASES)
    for median, largest, source in [*MEASURED_ERROR.values(), *TORCHRUN_HERE_ERROR.values()]:
        assert source
        if median is None:
            assert largest is None and "no benchmark" in source
        else:
            assert 0 < median <= largest < 1 and math.isfinite(largest)


def test_the_page_says_beside_the_predicted_step_what_it_rests_on():
    ex = _explorer(devices=["cpu", "cpu"])
    figures = ex.state.figures()
    assert figures["prediction_basis"] == prediction_basis(ex.plan).text()
    assert "measured here · benchmarks: median 5 %" in ex.w_header.value
    ex.run()
    assert "learnt from runs · benchmarks: median" in ex.w_header.value


def test_a_mixture_of_experts_on_catalogue_devices_says_what_its_own_benchmark_measured():
    """Narayanan's dense GPTs do not measure a mixture of experts: its catalogue plan carries
    megatron_bridge_moe.py's figures (Megatron-Bridge's MoE rows), a dense one Narayanan's."""
    import transformers

    from pipexplore.predict.basis import EXPERTS_ERROR

    config = transformers.Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                         num_experts_per_tok=2, num_hidden_layers=2, vocab_size=1024)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.Qwen3MoeForCausalLM(config)
        ex = explore(model, torch.zeros(2, 64, dtype=torch.long, device="meta"), devices=["H100"] * 2, chunks=2)
    assert ex.plan.layer_table.attrs["experts"]["count"] == 8
    basis = prediction_basis(ex.plan)
    assert basis.kind == "catalogue" and (basis.median, basis.largest, basis.source) == EXPERTS_ERROR
    assert "(megatron_bridge_moe.py, Megatron-Bridge's MoE rows)" in ex.state.figures()["prediction_basis"]
    median, largest, _ = EXPERTS_ERROR
    assert 0 < median <= largest < 1 and EXPERTS_ERROR != MEASURED_ERROR["catalogue"]
