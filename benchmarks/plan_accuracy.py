"""How far planned layer costs (the roofline, :mod:`pipexplore.predict.roofline`) are from profiled ones,
on this machine's CPU treated as a device from a catalogue.

1. A ``DeviceSpec`` of this CPU from measurements: peak FLOP/s (the best of large float32
   matmuls), memory bandwidth (a large copy: bytes read + written over its time), the seconds one
   small op costs under autograd (the "kernel overhead" of eager PyTorch on a CPU), and what a view
   op costs beside it. Medians of ``--rounds`` rounds, each also profiling every kind (step 3).
2. Each layer kind's operators counted: ``FlopCounterMode`` (with the CPU attention kernels
   registered: torch's table lacks them) under a ``TorchDispatchMode`` that records every aten
   op's FLOPs, input and output bytes and dtype, in forward and in backward, at two micro-batch
   sizes: bytes that do not change with the rows are ``fixed_bytes`` (weights, weight gradients),
   the rest ``row_bytes`` (a lookup reads the rows it gathers, not its table). Per phase one more
   row: what calling a layer costs beyond its ops (an ``nn.Identity`` profiled: the module call,
   the profiler's hooks, autograd's engine), in launches. The ops frame
   :mod:`pipexplore.predict.roofline` reads.
3. Each kind profiled (``pipexplore.profile(nn.Sequential(layer), sample, microbatch_rows=[32, 128],
   cold_cache=True)``: the caches flushed before every timed call, so that a kind runs from memory
   as a layer between larger neighbours does), and again without the flush (from cache, as it was
   profiled before), learnt from and predicted the same way, for comparison.
4. The efficiency (fraction of peak FLOP/s and of bandwidth, and the small-kernel seconds every
   compute-bound kernel pays beyond its FLOPs) learnt from half the kinds at both sizes
   (``fit_efficiency``), the other half predicted: per kind, phase and size, the planned seconds
   against the profiled ones. Goal: median |error| ≤ 25 %. Beside it, in the same round, the two
   fractions alone (``small_kernel=False``: the roofline before the small-kernel cost).
5. A small pipeline of the predicted kinds (3 × [Linear 512→2048, GELU, Linear 2048→512,
   LayerNorm], 2 stages, 1F1B, 4 micro-batches): the step simulated from the planned table
   against the step simulated from the profiled table, and both against a measured run
   (``run_step``, threads executor). Goal: step within 20 %. The step is planned with both
   efficiencies of step 4.

Each round measures in ``--passes`` passes (default 3), taken in turn: the CPU's rates, every kind,
the pipeline's table, its runs. This machine's speed moves within seconds (a 2048² matmul ran at
60 and at 150 GFLOP/s in consecutive rounds): a calibration profiled in a slow moment and a
pipeline in a fast one (or the reverse) compares two machines. Every figure is the fastest of its
passes: the peak and bandwidth the highest, an op's seconds the lowest, each kind's and the
pipeline's profile from the pass where it was fastest, the run the fastest step.

    python benchmarks/plan_accuracy.py
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import pandas as pd
import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common import machine

import pipexplore
from pipexplore.devices import DeviceSpec, GiB, dtype_name
from pipexplore.executors.step import run_step
from pipexplore.plan import Plan
from pipexplore.predict.roofline import Efficiency, fit_efficiency, kind_seconds, planned_layer_costs
from pipexplore.predict.simulator import simulate
from pipexplore.timeline import step_time

BATCH = 128
SIZES = [32, 128]

# --- 1. the CPU as a device spec --------------------------------------------------------------------


def _median_seconds(work: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rates() -> dict[str, float]:
    """This CPU's rates, measured once: peak FLOP/s (the best of large float32 matmuls), memory
    bandwidth (a large copy), the seconds of a small op under autograd, and of a view op."""
    peak = 0.0
    for n in (1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        peak = max(peak, 2 * n ** 3 / _median_seconds(lambda: a @ b, 5))
    src = torch.randn(64 * 2 ** 20)  # 256 MB: far beyond the caches
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * src.element_size() / _median_seconds(lambda: dst.copy_(src), 7)
    x = torch.ones(4, requires_grad=True)

    def small_ops() -> None:
        for _ in range(200):
            x.mul(2.0)

    def views() -> None:
        for _ in range(200):
            x.view(2, 2)

    return {"peak": peak, "bandwidth": bandwidth, "op": _median_seconds(small_ops, 15) / 200,
            "view": _median_seconds(views, 15) / 200}


def cpu_spec(measured: list[dict[str, float]]) -> tuple[DeviceSpec, float]:
    """This CPU as a device spec from the fastest of several measurements (the highest peak and
    bandwidth, the cheapest op; efficiency 1: the measured rates are what it reaches), and the
    seconds a view op costs as a fraction of a small op's (its ``kernels`` in the ops frame)."""
    best = {"peak": max(m["peak"] for m in measured), "bandwidth": max(m["bandwidth"] for m in measured),
            "op": min(m["op"] for m in measured), "view": min(m["view"] for m in measured)}
    spec = DeviceSpec("ThisCPU", 4 * GiB, best["bandwidth"], {"float32": best["peak"]},
                      kernel_overhead=best["op"], intra_node_bandwidth=best["bandwidth"],
                      inter_node_bandwidth=1e9, pcie_bandwidth=best["bandwidth"],
                      flops_efficiency=1.0, bandwidth_efficiency=1.0, source="measured here")
    return spec, best["view"] / best["op"]


# --- 2. counting each kind's operators ------------------------------------------------------------

def _register_cpu_attention() -> None:
    """torch's FLOP table lacks the CPU attention kernels: count them as the other SDPA kernels."""
    aten = torch.ops.aten
    if aten._scaled_dot_product_flash_attention_for_cpu in flop_counter.flop_registry:
        return

    @flop_counter.register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
    def _forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    @flop_counter.register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _nbytes(t: torch.Tensor) -> int:
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


#: Ops whose first input is a table they read only the looked-up rows of.
GATHERS = {torch.ops.aten.embedding, torch.ops.aten.index_select}


class OpRecorder(TorchDispatchMode):
    """Every aten op: its FLOPs (torch's table), bytes read and written, dtype, and whether it is a
    view (no kernel: it moves and computes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.ops: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        in_storages = {t.untyped_storage().data_ptr() for t in ins}
        mutates = func._schema.is_mutable
        view = getattr(func, "is_view", False) or (
            bool(outs) and not mutates and all(o.untyped_storage().data_ptr() in in_storages for o in outs))
        registry = flop_counter.flop_registry
        flops = registry[func._overloadpacket](*args, **kwargs, out_val=out) if func._overloadpacket in registry else 0
        seen, read = set(), 0
        for k, t in enumerate(ins):
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                # A lookup reads the rows it gathers, not its whole table.
                read += _nbytes(outs[0]) if k == 0 and func._overloadpacket in GATHERS and outs else _nbytes(t)
        floating = [t.dtype for t in ins + outs if t.is_floating_point()]
        self.ops.append(dict(phase=self.phase, op=str(func._overloadpacket), view=view,
                             dtype=dtype_name(floating[0] if floating else (ins + outs)[0].dtype if ins + outs
                                              else torch.float32),
                             flops=float(flops), bytes=0.0 if view else float(read + sum(_nbytes(t) for t in outs))))
        return out


def count(layer: nn.Module, sample: torch.Tensor) -> tuple[list[dict[str, Any]], float]:
    """The ops of one forward and backward of ``layer`` on ``sample`` (as the profiler times them:
    the backward from ones), and FlopCounterMode's total for the same calls."""
    x = sample.detach()
    if x.is_floating_point():
        x.requires_grad_()
    recorder = OpRecorder()
    counter = flop_counter.FlopCounterMode(display=False)
    with counter, recorder:
        y = layer(x)
        recorder.phase = "backward"
        torch.autograd.backward([y], [torch.ones_like(y)])
    layer.zero_grad(set_to_none=True)
    return recorder.ops, float(counter.get_total_flops())


def call_seconds() -> dict[str, float]:
    """Per phase, what calling a layer costs beyond its ops: an ``nn.Identity`` profiled as the
    layers are (the module call, the profiler's hooks, autograd's engine starting a backward)."""
    sample = torch.randn(SIZES[-1], 512)
    table = pipexplore.profile(nn.Sequential(nn.Identity()), sample, microbatch_rows=SIZES, split_backward=False)
    return {phase: float(table[f"{phase}_a"].iloc[0] + table[f"{phase}_b"].iloc[0] * SIZES[0])
            for phase in ("forward", "backward")}


def ops_frame(kinds: dict[str, tuple[nn.Module, torch.Tensor]], view_kernels: float,
              layer_call: dict[str, float]) -> tuple[pd.DataFrame, dict]:
    """The ops frame of every kind, counted at the sizes :data:`SIZES` (its ``attrs['rows']``: the
    last): per op, the bytes that grow with the rows apart from those that do not, and per phase
    one row for the layer's call (``layer_call``: launches). Also, per kind, (our FLOPs,
    FlopCounterMode's) at the last size."""
    r1, r2 = SIZES[0], SIZES[-1]
    rows, checks = [], {}
    for kind, (layer, sample) in kinds.items():
        small, _ = count(layer, sample[:r1])
        large, total = count(layer, sample[:r2])
        checks[kind] = (sum(op["flops"] for op in large), total)
        same = [a["op"] for a in small] == [b["op"] for b in large]
        for k, op in enumerate(large):
            if same:
                slope = (op["bytes"] - small[k]["bytes"]) / (r2 - r1)
                fixed = max(op["bytes"] - slope * r2, 0.0)
            else:  # a different sequence of ops at the two sizes: all bytes taken as growing with the rows
                fixed = 0.0
            rows.append(dict(kind=kind, phase=op["phase"], op=op["op"], dtype=op["dtype"], flops=op["flops"],
                             fixed_bytes=fixed, row_bytes=op["bytes"] - fixed,
                             kernels=view_kernels if op["view"] else 1.0))
        for phase, launches in layer_call.items():
            rows.append(dict(kind=kind, phase=phase, op="(layer call)", dtype="float32", flops=0.0, fixed_bytes=0.0,
                             row_bytes=0.0, kernels=launches))
    frame = pd.DataFrame(rows)
    frame.attrs["rows"] = r2
    return frame, checks


# --- 3. the layer kinds ---------------------------------------------------------------------------

def kinds() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        "linear 256": (nn.Linear(256, 256), torch.randn(BATCH, 256)),
        "linear 512→2048": (nn.Linear(512, 2048), torch.randn(BATCH, 512)),
        "linear 1024": (nn.Linear(1024, 1024), torch.randn(BATCH, 1024)),
        "GELU 2048": (nn.GELU(), torch.randn(BATCH, 2048)),
        "conv 16→32": (nn.Conv2d(16, 32, 3, padding=1), torch.randn(BATCH, 16, 16, 16)),
        "linear 2048→512": (nn.Linear(2048, 512), torch.randn(BATCH, 2048)),
        "ReLU 32×16×16": (nn.ReLU(), torch.randn(BATCH, 32, 16, 16)),
        "LayerNorm 512": (nn.LayerNorm(512), torch.randn(BATCH, 512)),
        "embedding 5000×256": (nn.Embedding(5000, 256), torch.randint(0, 5000, (BATCH, 16))),
        "attention block 128": (nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True),
                                torch.randn(BATCH, 16, 128)),
        "conv 32→32": (nn.Conv2d(32, 32, 3, padding=1), torch.randn(BATCH, 32, 16, 16)),
    }


#: Learnt from these; the others (the pipeline's kinds among them) are predicted.
CALIBRATE = ["linear 256", "linear 1024", "conv 16→32", "ReLU 32×16×16", "embedding 5000×256"]


def profiled(all_kinds: dict[str, tuple[nn.Module, torch.Tensor]], cold_cache: bool = True) -> pd.DataFrame:
    """Per kind: its profiled forward and backward seconds at each size (columns ``(phase, rows)``),
    the caches flushed before each timed call (``cold_cache``) or not."""
    out = {}
    for kind, (layer, sample) in all_kinds.items():
        table = pipexplore.profile(nn.Sequential(layer), sample, microbatch_rows=SIZES, split_backward=False,
                                   cold_cache=cold_cache)
        out[kind] = {(phase, n): float(table[f"{phase}_a"].iloc[0] + table[f"{phase}_b"].iloc[0] * n)
                     for phase in ("forward", "backward") for n in SIZES}
    return pd.DataFrame(out).T


def fastest_kinds(passes: list[pd.DataFrame]) -> pd.DataFrame:
    """Each kind's row from the pass where it was fastest (its seconds summed over phases and
    sizes), so that one kind's numbers come from one moment."""
    totals = pd.DataFrame({k: frame.sum(axis=1) for k, frame in enumerate(passes)})
    return pd.DataFrame({kind: passes[int(totals.loc[kind].idxmin())].loc[kind] for kind in passes[0].index}).T


def errors(ops: pd.DataFrame, spec: DeviceSpec, measured: pd.DataFrame, names: list[str],
           efficiency: Efficiency) -> pd.DataFrame:
    rows = []
    for n in SIZES:
        planned = kind_seconds(ops, spec, n, efficiency=efficiency)
        for kind in names:
            for phase in ("forward", "backward"):
                m, p = measured.at[kind, (phase, n)], planned.at[kind, phase]
                rows.append(dict(kind=kind, phase=phase, rows=n, measured_ms=m * 1e3, planned_ms=p * 1e3,
                                 error=p / m - 1))
    return pd.DataFrame(rows)


# --- 5. a small pipeline ---------------------------------------------------------------------------

PIPELINE_NAMES = ["linear 512→2048", "GELU 2048", "linear 2048→512", "LayerNorm 512"] * 3
PIPELINE = dict(splits=[6], chunks=4, schedule="1f1b", executor="threads", devices=["cpu", "cpu"])


def pipeline() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    blocks = [[nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.LayerNorm(512)] for _ in range(3)]
    return nn.Sequential(*[layer for block in blocks for layer in block]), torch.randn(BATCH, 512)


def pipeline_pass(model: nn.Sequential, sample: torch.Tensor, repeats: int) -> tuple[pd.DataFrame, float]:
    """One pass over the pipeline: its profiled table and the fastest of ``repeats`` measured steps."""
    table = pipexplore.profile(model, sample, microbatch_rows=SIZES, split_backward=False)
    plan = Plan(table, splits=(6,), chunks=4, schedule="1f1b", executor="threads", devices=("cpu", "cpu"))
    return table, min(float(run_step(model, sample, plan).metrics["step_time"]) for _ in range(repeats))


def pipeline_step(table: pd.DataFrame, measured: float, ops: pd.DataFrame, spec: DeviceSpec,
                  efficiencies: dict[str, Efficiency]) -> dict[str, float]:
    """The step simulated from the profiled ``table`` and from one planned table per efficiency
    (``planned`` + its key), and the ``measured`` one."""
    result = {"profiled": step_time(simulate(table, **PIPELINE)), "measured": measured}
    for key, efficiency in efficiencies.items():
        planned = planned_layer_costs(table.assign(kind=PIPELINE_NAMES), ops, spec, batch=BATCH,
                                      microbatch_rows=SIZES[0], efficiency=efficiency)
        # How much of the host's cores a phase keeps busy is a property of the CPU the roofline does not
        # model (a GPU kernel holds its device: 1): both predictions take the profile's.
        planned["share_forward"], planned["share_backward"] = table["share_forward"], table["share_backward"]
        result["planned" + key] = step_time(simulate(planned, **PIPELINE))
    return result


def one_round(all_kinds: dict[str, tuple[nn.Module, torch.Tensor]], repeats: int, passes: int,
              show: bool) -> dict[str, float]:
    """Measure the CPU, profile every kind and the pipeline (``passes`` times in turn, the fastest
    kept), learn from half the kinds, predict the other half and the pipeline: all within one
    round, so that the calibration sees the machine as the predicted layers do."""
    model, sample = pipeline()
    measurements, kind_passes, warm_passes, pipeline_passes, calls = [], [], [], [], []
    for _ in range(passes):
        measurements.append(rates())
        calls.append(call_seconds())
        kind_passes.append(profiled(all_kinds))
        warm_passes.append(profiled(all_kinds, cold_cache=False))
        pipeline_passes.append(pipeline_pass(model, sample, repeats))
    spec, view_kernels = cpu_spec(measurements)
    layer_call = {phase: min(c[phase] for c in calls) / spec.kernel_overhead for phase in calls[0]}
    ops, checks = ops_frame(all_kinds, view_kernels, layer_call)
    for kind, (ours, theirs) in checks.items():
        assert abs(ours - theirs) <= 1e-9 * max(ours, 1.0), (kind, ours, theirs)
    measured, measured_warm = fastest_kinds(kind_passes), fastest_kinds(warm_passes)
    table = min((t for t, _ in pipeline_passes), key=lambda t: float((t["forward"] + t["backward"]).sum()))
    predict = [k for k in all_kinds if k not in CALIBRATE]

    def learnt_from(names: list[str], small_kernel: bool = True, additive: bool = True,
                    kinds: pd.DataFrame = measured) -> Efficiency:  # from both sizes of these kinds
        tables = {n: pd.DataFrame({phase: [kinds.at[k, (phase, n)] for k in names]
                                   for phase in ("forward", "backward")}, index=names) for n in SIZES}
        return fit_efficiency(ops[ops["kind"].isin(names)], tables, spec, small_kernel=small_kernel,
                              additive=additive)

    # learnt: every parameter the fit may keep; fractions: the two fractions of the plain roofline
    learnt, fractions = learnt_from(CALIBRATE), learnt_from(CALIBRATE, small_kernel=False, additive=False)
    warm = learnt_from(CALIBRATE, kinds=measured_warm)  # the kinds timed with their caches warm, as before
    result = errors(ops, spec, measured, predict, learnt)
    warm_err = errors(ops, spec, measured_warm, predict, warm)["error"].abs()
    alone = errors(ops, spec, measured, predict, fractions)["error"].abs()
    at_peak = errors(ops, spec, measured, predict, Efficiency(1.0, 1.0))["error"].abs()
    swapped = errors(ops, spec, measured, CALIBRATE, learnt_from(predict))["error"].abs()
    step = pipeline_step(table, min(m for _, m in pipeline_passes), ops, spec, {"": learnt, "_fractions": fractions,
                                                                                         "_warm": warm})
    err = result["error"].abs()
    worst = result.loc[err.idxmax()]
    out = {"peak": spec.peak("float32"), "bandwidth": spec.memory_bandwidth, "op": spec.kernel_overhead,
           "eff_flops": float(learnt.flops), "eff_bw": float(learnt.bandwidth),  # type: ignore[arg-type]
           "small_kernel": learnt.small_kernel_for(spec), "overlap": learnt.overlap_for(spec),
           "median": err.median(), "max": err.max(), "fractions": alone.median(), "fractions_max": alone.max(),
           "at_peak": at_peak.median(), "swapped": swapped.median(),
           "swapped_max": swapped.max(), "planned": step["planned"], "planned_fractions": step["planned_fractions"],
           "profiled": step["profiled"], "measured": step["measured"], "warm": warm_err.median(),
           "planned_warm": step["planned_warm"]}
    if show:
        pd.set_option("display.width", 160)
        print(result.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"  CPU: peak {out['peak'] / 1e9:.0f} GFLOP/s, bandwidth {out['bandwidth'] / 1e9:.1f} GB/s, "
          f"{out['op'] * 1e6:.1f} µs per op (a view {view_kernels:.2f} of it), a layer call "
          f"{layer_call['forward'] * out['op'] * 1e6:.0f} / {layer_call['backward'] * out['op'] * 1e6:.0f} µs; "
          f"learnt FLOP/s {out['eff_flops']:.2f}, bandwidth {out['eff_bw']:.2f}, small kernel "
          f"{out['small_kernel'] * 1e6:.0f} µs, overlap {out['overlap']:.0f} (the fractions of the plain roofline: "
          f"{float(fractions.flops):.2f}, "  # type: ignore[arg-type]
          f"{float(fractions.bandwidth):.2f})")
    print(f"  per layer: median |error| {out['median'] * 100:.1f} %, max {out['max'] * 100:.1f} % ({worst['kind']} "
          f"{worst['phase']} at {worst['rows']} rows); the fractions alone {out['fractions'] * 100:.1f} % (max "
          f"{out['fractions_max'] * 100:.1f} %); at the measured peaks {out['at_peak'] * 100:.1f} %; learnt "
          f"the other way round {out['swapped'] * 100:.1f} % (max {out['swapped_max'] * 100:.1f} %)")
    print(f"  step: planned {out['planned'] * 1e3:.1f} ms, profiled {out['profiled'] * 1e3:.1f} ms "
          f"({(out['planned'] / out['profiled'] - 1) * 100:+.1f} %), measured {out['measured'] * 1e3:.1f} ms "
          f"(planned {(out['planned'] / out['measured'] - 1) * 100:+.1f} %, "
          f"profiled {(out['profiled'] / out['measured'] - 1) * 100:+.1f} %); the fractions alone planned "
          f"{out['planned_fractions'] * 1e3:.1f} ms ({(out['planned_fractions'] / out['profiled'] - 1) * 100:+.1f} % "
          f"vs profiled)")
    print(f"  kinds timed warm (no cache flush): per layer median |error| {out['warm'] * 100:.1f} %, step planned "
          f"{out['planned_warm'] * 1e3:.1f} ms ({(out['planned_warm'] / out['profiled'] - 1) * 100:+.1f} % vs "
          "profiled)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="measured pipeline runs a pass (the fastest kept)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each measuring and predicting everything")
    parser.add_argument("--passes", type=int, default=3,
                        help="passes a round, taken in turn, each measuring everything (the fastest kept)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (default 1: a core as the device; threads that wait for each other "
                             "at every op turn a busy machine's noise into stalls)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine(), f"threads={torch.get_num_threads()}")
    _register_cpu_attention()
    all_kinds = kinds()
    print(f"learnt from: {', '.join(CALIBRATE)}; predicted: {', '.join(k for k in all_kinds if k not in CALIBRATE)}")
    rounds = []
    for k in range(args.rounds):
        print(f"round {k + 1}:")
        rounds.append(one_round(all_kinds, args.repeats, args.passes, show=k == 0))
    frame = pd.DataFrame(rounds)
    median = frame.median()
    print(f"over {args.rounds} rounds (median of the rounds' numbers; each round's own range in brackets):")
    print(f"  per layer: median |error| {median['median'] * 100:.1f} % [{frame['median'].min() * 100:.1f}–"
          f"{frame['median'].max() * 100:.1f}], max {median['max'] * 100:.1f} %; the fractions alone "
          f"{median['fractions'] * 100:.1f} % [{frame['fractions'].min() * 100:.1f}–{frame['fractions'].max() * 100:.1f}]"
          f"; small kernel {median['small_kernel'] * 1e6:.0f} µs; at the measured peaks "
          f"{median['at_peak'] * 100:.1f} %; learnt the other way round {median['swapped'] * 100:.1f} %")
    planned_vs_profiled = frame["planned"] / frame["profiled"] - 1
    planned_vs_measured = frame["planned"] / frame["measured"] - 1
    profiled_vs_measured = frame["profiled"] / frame["measured"] - 1
    fractions_vs_profiled = frame["planned_fractions"] / frame["profiled"] - 1
    warm_vs_profiled = frame["planned_warm"] / frame["profiled"] - 1
    print(f"  step, planned vs profiled: {' / '.join(f'{v * 100:+.1f} %' for v in planned_vs_profiled)} (the "
          f"fractions alone {' / '.join(f'{v * 100:+.1f} %' for v in fractions_vs_profiled)}); "
          f"planned vs measured: {' / '.join(f'{v * 100:+.1f} %' for v in planned_vs_measured)}; "
          f"profiled vs measured: {' / '.join(f'{v * 100:+.1f} %' for v in profiled_vs_measured)}")
    print(f"  kinds timed warm: per layer {' / '.join(f'{v * 100:.1f} %' for v in frame['warm'])}; step planned vs "
          f"profiled {' / '.join(f'{v * 100:+.1f} %' for v in warm_vs_profiled)}")


if __name__ == "__main__":
    main()
