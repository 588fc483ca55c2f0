"""The roofline: planned layer costs from counted operators and a device spec."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
import torch

from pipexplore.devices import DeviceSpec, GiB, device_spec
from pipexplore.predict.costs import has_fit, layer_seconds
from pipexplore.predict.planned_optimizer import (optimizer_bandwidth, optimizer_bytes, planned_optimizer_seconds,
                                                 step_passes)
from pipexplore.predict.roofline import Efficiency, fit_efficiency, kind_seconds, op_seconds, planned_layer_costs

#: The H100's numbers under the plain roofline (a spec no GPUKernels names: the formulas below are the
#: roofline's; how the catalogue's H100 runs kernels, tiles, waves and launch floor, is tests/test_kernels.py's)
H100 = dataclasses.replace(device_spec("H100"), name="H100-roofline")
N = 8192  # a large square matmul: compute-bound by far


def _ops(rows=N) -> pd.DataFrame:
    """A linear kind (matmul, input and weight gradients), an elementwise GELU, and a layer whose
    arithmetic nobody could count."""
    mm = dict(op="aten.mm", dtype="bfloat16", flops=2.0 * rows * N * N, fixed_bytes=2.0 * N * N,
              row_bytes=2.0 * 2 * rows * N)
    frame = pd.DataFrame([
        dict(kind="linear", phase="forward", **mm),
        dict(kind="linear", phase="backward", grad="input", **mm),
        dict(kind="linear", phase="backward", grad="weight", **mm),
        dict(kind="gelu", phase="forward", op="aten.gelu", dtype="bfloat16", flops=8.0 * rows * N, fixed_bytes=0.0,
             row_bytes=2.0 * 2 * rows * N),
        dict(kind="gelu", phase="backward", op="aten.gelu_backward", dtype="bfloat16", flops=8.0 * rows * N,
             fixed_bytes=0.0, row_bytes=3.0 * 2 * rows * N),
        dict(kind="view", phase="forward", op="aten.view", dtype="bfloat16", flops=0.0, fixed_bytes=0.0,
             row_bytes=0.0),
        dict(kind="custom", phase="forward", op="my.op", dtype="bfloat16", flops=math.nan, fixed_bytes=0.0,
             row_bytes=1e6),
    ])
    frame.attrs["rows"] = rows
    return frame


def test_a_large_matmul_is_compute_bound():
    ops = _ops()
    seconds = op_seconds(ops, H100, N)
    flops = 2.0 * N ** 3
    assert seconds[0] == pytest.approx(H100.kernel_overhead + flops / (989.5e12 * H100.flops_efficiency))
    bytes_moved = 2.0 * N * N + 4.0 * N * N
    assert bytes_moved / (H100.memory_bandwidth * H100.bandwidth_efficiency) < 0.1 * seconds[0]
    # At half the rows, the arithmetic halves.
    assert op_seconds(ops, H100, N // 2)[0] - H100.kernel_overhead == pytest.approx(
        (seconds[0] - H100.kernel_overhead) / 2)


def test_an_elementwise_op_is_bandwidth_bound():
    seconds = op_seconds(_ops(), H100, N)
    bytes_moved = 4.0 * N * N
    assert seconds[3] == pytest.approx(H100.kernel_overhead + bytes_moved / (3.35e12 * H100.bandwidth_efficiency))
    assert seconds[5] == 0.0  # a view launches nothing


def test_efficiency_given_overrides_the_spec_per_dtype():
    ops = _ops()
    eff = Efficiency(flops={"bf16": 0.5}, bandwidth=0.5)
    seconds = op_seconds(ops, H100, N, efficiency=eff)
    assert seconds[0] == pytest.approx(H100.kernel_overhead + 2.0 * N ** 3 / (989.5e12 * 0.5))
    assert seconds[3] == pytest.approx(H100.kernel_overhead + 4.0 * N * N / (3.35e12 * 0.5))
    assert eff.flops_for("float32", H100) == H100.flops_efficiency
    with pytest.raises(ValueError, match="fraction of peak"):
        Efficiency(flops=1.5, bandwidth=0.0)


def test_uncountable_flops_cost_nan_not_zero():
    ops = _ops()
    assert math.isnan(op_seconds(ops, H100, N)[6])
    kinds = kind_seconds(ops, H100, N)
    assert math.isnan(kinds.at["custom", "forward"]) and kinds.at["custom", "backward"] == 0.0
    assert list(kinds.index) == ["linear", "gelu", "view", "custom"]
    assert kinds.at["linear", "backward"] == pytest.approx(2 * kinds.at["linear", "forward"])


def test_the_ops_frame_is_checked():
    ops = _ops()
    ops.attrs = {}
    with pytest.raises(ValueError, match=r"attrs\['rows'\]"):
        op_seconds(ops, H100, N)
    with pytest.raises(ValueError, match="lacks columns"):
        op_seconds(_ops().drop(columns="row_bytes"), H100, N)
    fp8 = _ops()
    fp8["dtype"] = "float8_e4m3fn"
    with pytest.raises(ValueError, match="A100-80GB has no float8 peak"):
        op_seconds(fp8, "A100", N)


def _table() -> pd.DataFrame:
    return pd.DataFrame({"name": ["0", "1", "2", "3"], "kind": ["linear", "gelu", "linear", "gelu"],
                         "output_bytes": [1.0, 2.0, 3.0, 4.0]})


@pytest.mark.parametrize("sizes", [512, [512, 2048]])
def test_the_fit_reproduces_the_roofline_at_both_sizes(sizes):
    ops = _ops(rows=1024)
    batch = 4096
    planned = planned_layer_costs(_table(), ops, H100, batch=batch, microbatch_rows=sizes)
    assert has_fit(planned) and planned.attrs["batch"] == batch and planned.attrs["source"] == "planned"
    assert planned.attrs["device_spec"] == H100.name and list(planned["output_bytes"]) == [1.0, 2.0, 3.0, 4.0]
    for rows in [*np.atleast_1d(sizes), batch]:
        roofline = kind_seconds(ops, H100, rows)
        for phase in ("forward", "backward"):
            want = roofline[phase].reindex(planned["kind"]).to_numpy()
            np.testing.assert_allclose(layer_seconds(planned, rows, phase), want, rtol=1e-12)
    np.testing.assert_allclose(planned["forward"], kind_seconds(ops, H100, batch)["forward"].reindex(planned["kind"]))
    assert (planned[["share_forward", "share_backward", "checkpointed_ratio"]] == 1.0).all().all()
    assert (planned["spread"] == 0.0).all()
    # The linear kind's input and weight gradients are one matmul each; GELU's backward is all input gradient.
    assert list(planned["input_grad_ratio"]) == pytest.approx([0.5, 1.0, 0.5, 1.0])
    assert list(planned["weight_grad_ratio"]) == pytest.approx([0.5, 0.0, 0.5, 0.0])


def test_one_size_fits_through_zero_rows_and_unmarked_backward_splits_half():
    ops = _ops(rows=1024).drop(columns="grad")
    planned = planned_layer_costs(_table(), ops, H100, batch=1024, microbatch_rows=[1024])
    np.testing.assert_allclose(layer_seconds(planned, 1024, "forward"),
                               kind_seconds(ops, H100, 1024)["forward"].reindex(planned["kind"]))
    np.testing.assert_allclose(planned["forward_a"], kind_seconds(ops, H100, 0)["forward"].reindex(planned["kind"]))
    assert (planned["input_grad_ratio"] == 0.5).all() and (planned["weight_grad_ratio"] == 0.5).all()


def test_planned_costs_refuse_unknown_kinds_and_carry_nan():
    with pytest.raises(ValueError, match=r"layer kinds \['conv'\] are not in the ops frame"):
        planned_layer_costs(pd.DataFrame({"kind": ["linear", "conv"]}), _ops(), H100, batch=64, microbatch_rows=8)
    planned = planned_layer_costs(pd.DataFrame({"kind": ["linear", "custom"]}), _ops(), H100, batch=64,
                                  microbatch_rows=8)
    assert np.isnan(planned["forward"].iloc[1]) and np.isfinite(planned["forward"].iloc[0])
    with pytest.raises(ValueError, match="microbatch_rows must lie in 1…64"):
        planned_layer_costs(pd.DataFrame({"kind": ["linear"]}), _ops(), H100, batch=64, microbatch_rows=128)


def test_planned_tables_simulate_like_profiled_ones():
    from pipexplore.predict.simulator import simulate

    planned = planned_layer_costs(pd.DataFrame({"kind": ["linear", "gelu"] * 4}), _ops(rows=64), H100, batch=64,
                                  microbatch_rows=16)
    predicted = simulate(planned, [], chunks=4, schedule="1f1b")  # one stage: nothing shares its device
    for phase in ("forward", "backward"):
        spans = predicted[predicted["phase"] == phase]
        assert len(spans) == 4
        np.testing.assert_allclose((spans["end"] - spans["start"]).to_numpy(),
                                   layer_seconds(planned, 16, phase).sum(), rtol=1e-9)


def _mixed_ops() -> pd.DataFrame:
    """Kinds of several shapes: some compute-bound, some bandwidth-bound, some mixed."""
    rows, out = 256, []
    for k, (n, elementwise) in enumerate([(4096, 0), (1024, 0), (256, 0), (64, 0), (4096, 1), (512, 1)]):
        kind = f"k{k}"
        for phase, times in (("forward", 1), ("backward", 2)):
            for _ in range(times):
                out.append(dict(kind=kind, phase=phase, op="aten.mm", dtype="float32", flops=2.0 * rows * n * n,
                                fixed_bytes=4.0 * n * n, row_bytes=4.0 * 2 * rows * n))
            if elementwise:
                out.append(dict(kind=kind, phase=phase, op="aten.add", dtype="float32", flops=1.0 * rows * n * 16,
                                fixed_bytes=0.0, row_bytes=4.0 * 3 * rows * n * 16))
    frame = pd.DataFrame(out)
    frame.attrs["rows"] = rows
    return frame


@pytest.mark.parametrize("truth", [(0.5, 0.6), (0.9, 0.3), (0.25, 0.95)])
def test_fit_efficiency_recovers_known_fractions(truth):
    spec = DeviceSpec("Toy", 16 * GiB, 100e9, {"float32": 2e12}, kernel_overhead=5e-6, flops_efficiency=0.7,
                      bandwidth_efficiency=0.8)
    ops = _mixed_ops()
    measured = kind_seconds(ops, spec, 128, efficiency=Efficiency(*truth))
    learnt = fit_efficiency(ops, measured.iloc[::2], spec, 128)  # learn from half the kinds
    assert learnt.flops == pytest.approx(truth[0], rel=1e-6)
    assert learnt.bandwidth == pytest.approx(truth[1], rel=1e-6)
    # and the other half is then predicted as measured
    np.testing.assert_allclose(kind_seconds(ops, spec, 128, efficiency=learnt).iloc[1::2], measured.iloc[1::2],
                               rtol=1e-6)


def test_fit_efficiency_keeps_the_default_it_cannot_learn():
    spec = device_spec("A100")
    ops = _mixed_ops().query("kind == 'k0'")
    ops.attrs["rows"] = 256
    measured = kind_seconds(ops, spec, 256, efficiency=Efficiency(0.6, 0.5))
    learnt = fit_efficiency(ops, measured, spec, 256)
    assert learnt.flops == pytest.approx(0.6) and learnt.bandwidth == spec.bandwidth_efficiency
    with pytest.raises(ValueError, match="no measured kind"):
        fit_efficiency(ops, measured.rename(index={"k0": "other"}), spec, 256)


def test_optimizer_passes_are_those_of_torch_optims_implementation():
    """Counted on the foreach form a GPU runs, each op's parameter-sized tensors read and written:
    SGD ``p -= lr·g`` (p read and written, g read); momentum ``b *= m`` (2), ``b += g`` (b 2, g 1),
    ``p -= lr·b`` (p 2, b 1); Adam ``m.lerp_(g)`` (m 2, g 1), ``v *= β2`` (2), ``v += g·g`` (v 2, g 2),
    ``t = sqrt(v)`` (2), ``t /= c`` (2), ``t += eps`` (2), ``p += -lr·m/t`` (p 2, m 1, t 1);
    AdamW first ``p *= 1 - lr·wd`` (p 2); fused Adam one kernel over p, g, m, v, each read and written
    (g too: its schema may unscale it) but g written only there."""
    assert step_passes(None) == step_passes("sgd") == (2, 1, 0)
    assert step_passes("momentum") == step_passes(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) == (2, 1, 5)
    assert step_passes("adam") == step_passes(torch.optim.Adam) == (2, 3, 14)
    assert step_passes(torch.optim.AdamW) == (4, 3, 14)
    assert step_passes(lambda ps: torch.optim.Adam(ps, fused=True)) == (2, 2, 4)
    assert step_passes(lambda ps: torch.optim.Adam(ps, foreach=False)) == (2, 3, 14)  # the loop: the same ops
    layer = torch.nn.Linear(2, 2)
    assert step_passes(torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)) == (2, 1, 5)  # an instance

    class Unhashable:  # a factory the cache cannot key: counted each time
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, params):
            return torch.optim.AdamW(params)

    assert step_passes(Unhashable()) == (4, 3, 14)
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        step_passes("lion")
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer, got list"):
        step_passes(lambda ps: list(ps))


def test_optimizer_seconds_are_the_counted_bytes_over_bandwidth():
    params = 1_000_000_000
    assert optimizer_bytes(params, torch.bfloat16, "adam") == (2 + 3 + 14) * 2 * params
    assert planned_optimizer_seconds(params, "bfloat16", "Adam", H100) == pytest.approx(
        38 * params / (3.35e12 * H100.optimizer_efficiency))  # the catalogue's documented fraction
    # fp32 states: p and g in bf16, m, v and the temporaries in fp32.
    assert optimizer_bytes(params, "bf16", "adamw", state_dtype="float32") == (4 * 2 + 3 * 2 + 14 * 4) * params
    assert optimizer_bytes(10, "float32", "sgd") == 3 * 4 * 10
    assert optimizer_bytes(10, "float32", "momentum") == 8 * 4 * 10
    # An optimizer step's own fraction of bandwidth: learnt, else the spec's documented one, else the
    # bandwidth fraction (learnt or the spec's).
    assert planned_optimizer_seconds(params, "float32", "sgd", H100, efficiency=Efficiency(bandwidth=1.0, optimizer=0.5)) \
        == pytest.approx(24 * params / 3.35e12)
    assert planned_optimizer_seconds(params, "float32", "sgd", H100, efficiency=Efficiency(bandwidth=1.0)) == pytest.approx(
        12 * params / (3.35e12 * 0.69))
    undocumented = dataclasses.replace(H100, name="H100-like", optimizer_efficiency=None)
    assert planned_optimizer_seconds(params, "float32", "sgd", undocumented, efficiency=Efficiency(bandwidth=1.0)) \
        == pytest.approx(12 * params / 3.35e12)
    with pytest.raises(ValueError, match="optimizer_efficiency is a fraction of peak"):
        dataclasses.replace(H100, optimizer_efficiency=0.0)
    with pytest.raises(ValueError, match="efficiency optimizer is a fraction"):
        Efficiency(optimizer=0.0)


def test_an_optimizer_steps_bandwidth_is_its_counted_bytes_over_the_time_they_add(monkeypatch):
    from pipexplore.profiling import optimizer_step

    layer = torch.nn.Linear(64, 64)
    elements = 64 * 64 + 64

    def timed(modules, factory, repeats):  # a step: 50 µs whatever its size, then 1 ns an element
        return [50e-6 + 1e-9 * sum(p.numel() for p in modules[0].parameters())]

    monkeypatch.setattr(optimizer_step, "optimizer_seconds", timed)
    moved = elements * 4 * 19  # float32, Adam's 19 passes; the fixed 50 µs left out
    assert optimizer_bandwidth(layer, torch.optim.Adam, H100) == pytest.approx(moved / (1e-9 * elements * 3.35e12))
    monkeypatch.setattr(optimizer_step, "optimizer_seconds", lambda modules, factory, repeats: [2e-6])  # noise
    assert optimizer_bandwidth(layer, torch.optim.Adam, H100) == pytest.approx(moved / (2e-6 * 3.35e12))
    with pytest.raises(ValueError, match="no trained parameters"):
        optimizer_bandwidth(torch.nn.GELU(), torch.optim.Adam, H100)


def test_fit_efficiency_learns_from_several_sizes_and_per_dtype():
    spec = DeviceSpec("Toy", 16 * GiB, 100e9, {"float32": 2e12, "bfloat16": 8e12}, kernel_overhead=5e-6)
    ops = _mixed_ops()
    ops.loc[ops["kind"].isin(["k0", "k2"]), "dtype"] = "bfloat16"
    truth = Efficiency(flops={"float32": 0.8, "bfloat16": 0.4}, bandwidth=0.7)
    measured = {n: kind_seconds(ops, spec, n, efficiency=truth) for n in (32, 256)}
    learnt = fit_efficiency(ops, measured, spec, per_dtype=True)
    assert dict(learnt.flops) == pytest.approx({"float32": 0.8, "bfloat16": 0.4}, rel=1e-6)
    assert learnt.bandwidth == pytest.approx(0.7, rel=1e-6)
    with pytest.raises(ValueError, match="needs the rows"):
        fit_efficiency(ops, measured[32], spec)


def test_the_default_small_kernel_cost_is_zero_and_changes_nothing():
    ops = _ops()
    plain = op_seconds(ops, H100, 512)
    for eff in (Efficiency(), Efficiency(small_kernel=None), Efficiency(small_kernel=0.0)):
        pd.testing.assert_series_equal(op_seconds(ops, H100, 512, efficiency=eff), plain)
        assert eff.small_kernel_for(H100) == 0.0
    # the catalogue H100 as before: launch + max(arithmetic, traffic), nothing more
    assert plain[0] == pytest.approx(H100.kernel_overhead + max(
        2.0 * 512 * N * N / (989.5e12 * H100.flops_efficiency),
        (2.0 * N * N + 4.0 * 512 * N) / (3.35e12 * H100.bandwidth_efficiency)))
    assert hash(Efficiency(0.5, 0.5)) != hash(Efficiency(0.5, 0.5, 1e-6))
    with pytest.raises(ValueError, match="small_kernel is seconds"):
        Efficiency(small_kernel=-1e-6)


def test_the_small_kernel_cost_is_paid_by_computing_ops_where_compute_bound():
    ops = _ops()
    cost = 20e-6
    eff = Efficiency(small_kernel=cost)
    plain, slowed = op_seconds(ops, H100, N), op_seconds(ops, H100, N, efficiency=eff)
    assert slowed[0] == pytest.approx(plain[0] + cost)  # the compute-bound matmul
    assert slowed[3] == plain[3] and slowed[5] == 0.0  # GELU stays bandwidth-bound; a view costs nothing
    # equivalently a FLOP/s fraction rising with the kernel's FLOPs f: eff · f / (f + f½), f½ = cost · peak · eff
    f = 2.0 * N ** 3
    rate = 989.5e12 * H100.flops_efficiency
    f_half = cost * rate
    assert slowed[0] - H100.kernel_overhead == pytest.approx(f / (rate * f / (f + f_half)))
    # An op that turns compute-bound only with the cost pays the max of the two.
    bound = _ops(rows=64).iloc[[3]]
    memory = op_seconds(bound, H100, 64)[3] - H100.kernel_overhead
    assert op_seconds(bound, H100, 64, efficiency=Efficiency(small_kernel=2 * memory))[3] == pytest.approx(
        H100.kernel_overhead + 8.0 * 64 * N / (989.5e12 * H100.flops_efficiency) + 2 * memory)


@pytest.mark.parametrize("truth", [(0.5, 0.6, 30e-6), (0.9, 0.5, 5e-6), (0.25, 0.95, 200e-6)])
def test_fit_efficiency_recovers_a_known_small_kernel_cost_from_two_sizes(truth):
    spec = DeviceSpec("Toy", 16 * GiB, 100e9, {"float32": 2e12}, kernel_overhead=5e-6, flops_efficiency=0.7,
                      bandwidth_efficiency=0.8)
    ops = _mixed_ops()
    eff = Efficiency(*truth)
    measured = {n: kind_seconds(ops, spec, n, efficiency=eff) for n in (32, 256)}
    # half the kinds (some of them compute-bound at both sizes: a single size cannot tell the cost from the fraction)
    learnt = fit_efficiency(ops, {n: m.iloc[::2] for n, m in measured.items()}, spec)
    assert (learnt.flops, learnt.bandwidth, learnt.small_kernel) == pytest.approx(truth, rel=1e-6)
    for n, m in measured.items():  # the other half predicted as measured
        np.testing.assert_allclose(kind_seconds(ops, spec, n, efficiency=learnt).iloc[1::2], m.iloc[1::2], rtol=1e-6)
    # Without the cost the fractions cannot reproduce both sizes; asked not to, it learns none.
    alone = fit_efficiency(ops, measured, spec, small_kernel=False)
    assert alone.small_kernel is None
    assert not np.allclose(kind_seconds(ops, spec, 32, efficiency=alone), measured[32], rtol=1e-3)


def test_fit_efficiency_learns_no_small_kernel_cost_it_cannot_see():
    spec = device_spec("A100")
    ops = _mixed_ops().query("kind == 'k0'")  # one kernel shape at one size: FLOPs ∝ kernels
    ops.attrs["rows"] = 256
    measured = kind_seconds(ops, spec, 256, efficiency=Efficiency(0.6, 0.5, 40e-6))
    learnt = fit_efficiency(ops, measured, spec, 256)
    assert learnt.small_kernel is None  # absorbed into the FLOP/s fraction, as a roofline without it would
    np.testing.assert_allclose(kind_seconds(ops, spec, 256, efficiency=learnt), measured, rtol=1e-9)
    # Measured without one, at two sizes, none is learnt either.
    exact = {n: kind_seconds(_mixed_ops(), spec, n, efficiency=Efficiency(0.6, 0.5)) for n in (32, 256)}
    assert fit_efficiency(_mixed_ops(), exact, spec).small_kernel is None


def test_overlap_says_how_much_of_the_shorter_term_hides():
    ops = _ops(rows=64)
    launch = H100.kernel_overhead
    compute = 2.0 * 64 * N * N / (989.5e12 * H100.flops_efficiency)
    memory = (2.0 * N * N + 4.0 * 64 * N) / (3.35e12 * H100.bandwidth_efficiency)
    roofline = op_seconds(ops, H100, 64)
    pd.testing.assert_series_equal(op_seconds(ops, H100, 64, efficiency=Efficiency(overlap=1.0)), roofline)
    assert roofline[0] == pytest.approx(launch + max(compute, memory))
    assert op_seconds(ops, H100, 64, efficiency=Efficiency(overlap=0.0))[0] == pytest.approx(launch + compute + memory)
    assert op_seconds(ops, H100, 64, efficiency=Efficiency(overlap=0.25))[0] == pytest.approx(
        launch + max(compute, memory) + 0.75 * min(compute, memory))
    # an op that computes nothing has nothing to add: a view still costs nothing
    assert op_seconds(ops, H100, 64, efficiency=Efficiency(overlap=0.0))[5] == 0.0
    assert hash(Efficiency(0.5, 0.5)) != hash(Efficiency(0.5, 0.5, overlap=0.0))
    with pytest.raises(ValueError, match=r"overlap is the fraction of the shorter term hidden \(0 … 1\), got 1.5"):
        Efficiency(overlap=1.5)


@pytest.mark.parametrize("truth", [(0.5, 0.6), (0.9, 0.3)])
def test_fit_efficiency_learns_that_arithmetic_and_traffic_add(truth):
    spec = DeviceSpec("Toy", 16 * GiB, 100e9, {"float32": 2e12}, kernel_overhead=5e-6, flops_efficiency=0.7,
                      bandwidth_efficiency=0.8)
    ops = _mixed_ops()
    measured = {n: kind_seconds(ops, spec, n, efficiency=Efficiency(*truth, overlap=0.0)) for n in (32, 256)}
    learnt = fit_efficiency(ops, {n: m.iloc[::2] for n, m in measured.items()}, spec)
    assert learnt.overlap == 0.0
    assert (learnt.flops, learnt.bandwidth) == pytest.approx(truth, rel=1e-6)
    for n, m in measured.items():  # the other half predicted as measured
        np.testing.assert_allclose(kind_seconds(ops, spec, n, efficiency=learnt).iloc[1::2], m.iloc[1::2], rtol=1e-6)
    # the roofline alone cannot reproduce them
    roofline = fit_efficiency(ops, measured, spec, additive=False)
    assert roofline.overlap is None
    assert not np.allclose(kind_seconds(ops, spec, 32, efficiency=roofline), measured[32], rtol=1e-3)
    # and data made by the roofline keep it
    made = {n: kind_seconds(ops, spec, n, efficiency=Efficiency(*truth)) for n in (32, 256)}
    assert fit_efficiency(ops, made, spec).overlap is None
