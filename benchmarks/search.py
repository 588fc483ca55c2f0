"""The search for the plan that fits (``ex.search``): how long it takes at scale, what the
memory-aware split gains over sweep's balanced one, and whether its ranking holds on real runs.

1. ``scale``: a synthetic table of 1,000 layers (random forward/backward, parameters and saved
   activations; Adam: 4× the parameters' bytes), planned on H100s; stages {8, 16, 32, 64} ×
   chunks {64, 128, 256} × every schedule the simulator knows × three checkpoint modes, with a
   cap of 70 GiB a device. Goal: the whole search ≤ 10 s on a 2-core machine. Timed in one
   process and in two (``workers``), the four original schedules alone too. Then ``sweep`` over the
   same space (balanced splits, memory ignored): its fastest plan that fits the cap (its memory
   counted as the search counts it) against the search's best.
2. ``ranking``: on this CPU, transformer blocks (``nn.TransformerEncoderLayer``, d_model 64) and
   an MLP (12 × Linear 512 + GELU); ``explore`` on 2 CPU stages, 1F1B, 4 chunks, one calibrating
   ``run()``; then ``ex.search`` over stages {2, 3, 4} × chunks {2, 4, 8} × gpipe/1f1b predicts every
   plan once, and every plan is run (``ex.apply(row)``, ``ex.run()``) three times, in alternating
   orders (the measured step: the fastest of them, as other work on the machine only slows a step;
   the slowest over the fastest is the machine's noise; each run waits, up to a minute, until
   others use under a fifth of the CPUs). Reported:
   the Spearman correlation of predicted and measured steps (goal ≥ 0.8 on a CPU, ≥ 0.9 on a GPU),
   where the fastest measured plan sits in the predicted order (goal: top 2), the median
   |error| of the plans never run before the prediction (all but the calibrating one; goal ≤ 10 %),
   and beside it the error of the prediction each run itself showed (which learnt from the runs
   before it); then the same three against each plan's median pass (where passes spread on a
   quiet machine, the fastest is the lucky one).

``python search.py [--sections scale,ranking]``.
"""
from __future__ import annotations

import argparse
import math
import os
import time
import warnings

import numpy as np
import pandas as pd
import torch
from torch import nn

from common import machine

GIB = 2 ** 30
#: Times every plan of the ranking runs (in alternating orders); the fastest is kept.
PASSES = 3
#: Before each run, wait up to this many seconds until others use less than this share of the CPUs
#: (the machine is shared: other work slows a step several times over).
QUIET_WAIT, QUIET_SHARE = 60.0, 0.2


# ---- 1. scale ---------------------------------------------------------------------------------
def synthetic_plan(layers: int = 1000, batch: int = 512):
    """A plan of ``layers`` synthetic layers on planned H100s (the kind of table explorer_responsiveness builds,
    with sizes: ~100 MB of parameters and ~4 GB of saved activations a layer for the whole batch)."""
    from pipexplore.devices import planned_devices
    from pipexplore.plan import Plan

    rng = np.random.default_rng(0)
    table = pd.DataFrame({
        "name": [f"layers.{k}" for k in range(layers)], "type": "Block",
        "forward": rng.uniform(0.2, 1.8, layers) * 1e-2, "backward": rng.uniform(0.4, 3.6, layers) * 1e-2,
        "param_bytes": rng.uniform(0.5, 1.5, layers) * 1e8, "output_bytes": rng.uniform(0.5, 2.0, layers) * 6.4e7,
        "saved_bytes": rng.uniform(0.5, 2.0, layers) * 4e9, "stash": "", "pop": "",
    })
    table.attrs["batch"] = batch
    return Plan(table, splits=(layers // 2,), devices=planned_devices(["H100"] * 2), chunks=64, batch=batch,
                executor="processes")


def sweep_best_that_fits(plan, table: pd.DataFrame, cap: float, optimizer) -> tuple[pd.Series, float]:
    """Sweep's fastest row whose every device holds it within ``cap``, its memory counted as the
    search counts it (stage_memory of its predicted peaks; a device's stages at once: between the
    largest of their peaks and their sum, re-predicted where that does not decide), and that memory."""
    from pipexplore.predict.memory import stage_memory
    from pipexplore.predict.search import _device_activations

    for _, row in table.iterrows():
        n, devices = int(row["stages"]), row["devices"].split(",")
        peaks = np.asarray(row["activation_bytes_per_stage"], dtype=float)  # sweep's: activations per stage
        fixed = stage_memory(plan.layer_table, row["splits"], peak_activations=peaks,
                             optimizer=optimizer)["peak_bytes"].to_numpy() - peaks
        virtual = {"virtual_stages": plan.virtual_stages} if len(devices) < n else {}
        candidate = plan.with_options(splits=tuple(row["splits"]), chunks=int(row["chunks"]),
                                      schedule=row["schedule"], checkpoint=row["checkpoint"], devices=tuple(devices),
                                      **virtual)
        stage_device = candidate.stage_devices
        groups = {d: [s for s in range(n) if stage_device[s] == d] for d in dict.fromkeys(stage_device)}
        low = max(fixed[g].sum() + peaks[g].max() for g in groups.values())
        high = max(fixed[g].sum() + peaks[g].sum() for g in groups.values())
        if low > cap:
            continue
        if high > cap:  # the stages of a device at once: from the timeline
            held = _device_activations(candidate.predict(), stage_device, n)
            high = max(fixed[g].sum() + held[d] for d, g in groups.items())
            if high > cap:
                continue
        return row, high
    return None, math.nan


def scale() -> None:
    from pipexplore.devices import planned_devices
    from pipexplore.plan import Plan
    from pipexplore.predict import search as searching
    from pipexplore.predict.simulator import SCHEDULES
    from pipexplore.predict.sweep import sweep

    plan = synthetic_plan()
    space = dict(stages=[8, 16, 32, 64], chunks=[64, 128, 256], checkpoint=["never", "except_last", "always"])
    devices_for = lambda n: planned_devices(["H100"] * n)  # noqa: E731
    optimizer = torch.optim.Adam
    original = ["gpipe", "1f1b", "interleaved", "zero-bubble"]
    print(f"scale: 1,000 layers on planned H100s, stages {space['stages']} × chunks {space['chunks']} × "
          f"3 checkpoint modes, Adam")
    # What the simulator takes of a search (its graph, timing and frame: prepare_step and Plan.predict), in this process.
    spent = {"simulator": 0.0}
    timed_prepare, timed_predict = searching.prepare_step, Plan.predict

    def timing(fn):
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["simulator"] += time.process_time() - start
        return timed

    tables = {}
    for label, schedules in (("4 schedules", original), (f"{len(SCHEDULES)} schedules", list(SCHEDULES))):
        for workers in (1, 2):
            spent["simulator"] = 0.0
            waited = wait_for_quiet(120.0)
            searching.prepare_step, Plan.predict = timing(timed_prepare), timing(timed_predict)
            try:
                start, cpu = time.perf_counter(), time.process_time()
                table = searching.search(plan, memory_cap=70 * GIB, schedules=schedules, devices_for=devices_for,
                                         optimizer=optimizer, workers=workers, **space)
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            finally:
                searching.prepare_step, Plan.predict = timed_prepare, timed_predict
            tables[schedules == original, workers] = table
            within = (f"; CPU {cpu:.1f} s, of which the simulator {spent['simulator']:.1f} s "
                      f"({spent['simulator'] / cpu * 100:.0f} %)") if workers == 1 else ""
            print(f"  {label} ({', '.join(schedules)}), cap 70 GiB: {len(table)} plans "
                  f"({len(table.attrs['left_out'])} left out), {int(table['fits'].sum())} fit; whole search "
                  f"{seconds:.1f} s in {workers} process{'es' if workers > 1 else ''}{within} (goal ≤ 10 s; "
                  f"{'started on a quiet machine' if waited < math.inf else 'the machine was busy'}, others used "
                  f"{busy_share():.0%} of the CPUs just after)")
    start = time.perf_counter()
    swept = sweep(plan, schedules=list(SCHEDULES), devices_for=devices_for, **space)
    print(f"  sweep of the same {len(swept)} plans (balanced splits, memory ignored): {time.perf_counter() - start:.1f} s")
    for cap in (70 * GIB, 40 * GIB, 24 * GIB):
        try:
            table = tables[False, 1] if cap == 70 * GIB else searching.search(
                plan, memory_cap=cap, schedules=list(SCHEDULES), devices_for=devices_for, optimizer=optimizer,
                workers=1, **space)
        except ValueError as exc:
            print(f"  cap {cap / GIB:.0f} GiB: {exc}")
            continue
        best = table.iloc[0]
        chosen, memory = sweep_best_that_fits(plan, swept, cap, optimizer)
        text = (f"  cap {cap / GIB:.0f} GiB: search's best {best['stages']} stages, {best['chunks']} chunks, "
                f"{best['schedule']}, checkpoint {best['checkpoint']}: {best['step_time']:.3f} s, "
                f"{best['peak_bytes'] / GIB:.1f} GiB ({int(table['fits'].sum())} of {len(table)} fit, "
                f"{int(table['pareto'].sum())} on the front); ")
        if chosen is None:
            print(text + "no plan of sweep's fits")
            continue
        print(text + f"sweep's fastest that fits: {chosen['stages']} stages, {chosen['chunks']} chunks, "
              f"{chosen['schedule']}, checkpoint {chosen['checkpoint']}: {chosen['predicted_step_time']:.3f} s, "
              f"{memory / GIB:.1f} GiB → the memory-aware split is "
              f"{chosen['predicted_step_time'] / best['step_time']:.2f}× as fast")


# ---- 2. ranking ---------------------------------------------------------------------------------
def transformer() -> tuple[nn.Module, torch.Tensor]:
    layers = [nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=256, dropout=0.0, batch_first=True)
              for _ in range(8)]
    return nn.Sequential(*layers), torch.randn(32, 32, 64)


def mlp() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(12)]), torch.randn(128, 512)


def busy_share(seconds: float = 0.5) -> float:
    """The share of the host's CPU time others used over ``seconds`` (this process waits meanwhile)."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    total, idle = read()
    time.sleep(seconds)
    total2, idle2 = read()
    return 1.0 - (idle2 - idle) / max(1, total2 - total)


def wait_for_quiet(most: float = QUIET_WAIT) -> float:
    """Wait (up to ``most`` seconds) until other work leaves the CPUs nearly idle; the seconds
    waited (infinity: it never did)."""
    start = time.perf_counter()
    while time.perf_counter() - start < most:
        if busy_share() < QUIET_SHARE:
            return time.perf_counter() - start
    return math.inf


def spearman(a, b) -> float:
    ra, rb = pd.Series(a).rank(), pd.Series(b).rank()
    return float(np.corrcoef(ra, rb)[0, 1])


def ranking(name: str, build, device: str = "cpu") -> dict[str, float]:
    import pipexplore

    torch.manual_seed(0)
    model, sample = build()
    ex = pipexplore.explore(model, sample, devices=[device, device], chunks=4, schedule="1f1b")
    quiet = [wait_for_quiet()]
    calibrating = ex.run()  # the one calibrating run
    first = (len(ex.plan.splits) + 1, ex.plan.chunks, ex.plan.schedule, tuple(ex.plan.splits))
    table = ex.search(stages=[2, 3, 4], chunks=[2, 4, 8], schedules=["gpipe", "1f1b"])
    predicted = table["predicted_step_time"].to_numpy()
    measured = np.zeros((PASSES, len(table)))
    at_run = np.zeros((PASSES, len(table)))
    load = os.getloadavg()[0]
    for p in range(PASSES):
        for k in (range(len(table)) if p % 2 == 0 else reversed(range(len(table)))):
            ex.apply(table.iloc[k])
            quiet.append(wait_for_quiet())
            row = ex.run()
            measured[p, k], at_run[p, k] = row["step_time"], row["predicted_step_time"]
    # Other work on the machine only slows a step: each plan's fastest pass is the nearest its own time.
    step = measured.min(axis=0)
    noise = float(np.median(measured.max(axis=0) / step - 1))
    order = np.argsort(predicted, kind="stable")
    fastest = int(np.argmin(step))
    place = int(np.flatnonzero(order == fastest)[0]) + 1
    never = [k for k in range(len(table)) if (table["stages"].iloc[k], table["chunks"].iloc[k],
                                                  table["schedule"].iloc[k], tuple(table["splits"].iloc[k])) != first]
    errors = np.abs(predicted[never] / step[never] - 1)
    signed = predicted[never] / step[never] - 1
    run_errors = np.abs(at_run / measured - 1)
    rho = spearman(predicted, step)
    # Beside the fastest pass, each plan's median pass: where the machine is quiet and passes still
    # spread (threads, the GIL), the fastest is the lucky one, and a run's own step is a median too.
    typical = np.median(measured, axis=0)
    typical_place = int(np.flatnonzero(order == int(np.argmin(typical)))[0]) + 1
    typical_signed = predicted[never] / typical[never] - 1
    print(f"  {name}: calibrating run {calibrating['step_time'] * 1e3:.1f} ms; {len(table)} plans, each run "
          f"{PASSES} times, the fastest kept (the slowest pass over the fastest: median +{noise * 100:.1f} %; load "
          f"average {load:.1f} before, {os.getloadavg()[0]:.1f} after; of {len(quiet)} runs "
          f"{sum(w < 1.0 for w in quiet)} found the machine quiet, {sum(1.0 <= w < math.inf for w in quiet)} waited "
          f"for it, {sum(w == math.inf for w in quiet)} gave up after {QUIET_WAIT:.0f} s)")
    goal = 0.8 if device == "cpu" else 0.9
    print(f"    Spearman(predicted, measured) {rho:.2f} (goal ≥ {goal}); the fastest measured plan "
          f"({table['stages'].iloc[fastest]} stages, {table['chunks'].iloc[fastest]} chunks, "
          f"{table['schedule'].iloc[fastest]}, {step[fastest] * 1e3:.1f} ms) is predicted {place} of {len(table)} "
          f"(goal: top 2)")
    print(f"    against each plan's median pass: Spearman {spearman(predicted, typical):.2f}, the fastest predicted "
          f"{typical_place} of {len(table)}, plans never run median |error| "
          f"{np.median(np.abs(typical_signed)) * 100:.1f} % (signed {np.median(typical_signed) * 100:+.1f} %)")
    print(f"    plans never run before: median |error| {np.median(errors) * 100:.1f} % (goal ≤ 10 %), median signed "
          f"{np.median(signed) * 100:+.1f} %, max |error| {errors.max() * 100:.1f} %; the prediction each run showed "
          f"(learning from the runs before): median |error| {np.median(run_errors) * 100:.1f} %")
    for k in order:
        print(f"      {table['stages'].iloc[k]} stages {table['chunks'].iloc[k]} chunks {table['schedule'].iloc[k]:5} "
              f"splits {str(table['splits'].iloc[k]):10}: predicted {predicted[k] * 1e3:6.1f} ms, measured "
              f"{step[k] * 1e3:6.1f} ms (passes {' / '.join(f'{v * 1e3:.1f}' for v in measured[:, k])})")
    return {"spearman": rho, "place": place, "median_error": float(np.median(errors)), "noise": noise}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sections", default="scale,ranking", help="comma-separated: scale, ranking")
    parser.add_argument("--devices", default="", help="ignored (the other benchmarks' option)")
    parser.add_argument("--device", default="cpu", help="ranking: the device every stage runs on (cpu, or cuda:0)")
    parser.add_argument("--repeats", type=int, default=0, help="ignored (the other benchmarks' option)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    sections = set(args.sections.split(","))
    print(f"machine: {machine()}")
    if "scale" in sections:
        scale()
    if "ranking" in sections:
        print("ranking (stages {2, 3, 4} × chunks {2, 4, 8} × gpipe/1f1b, every stage on "
              f"{args.device}, after one calibrating run):")
        started = time.perf_counter()
        for name, build in (("transformer (8 × TransformerEncoderLayer 64)", transformer),
                            ("MLP (12 × Linear 512 + GELU)", mlp)):
            ranking(name, build, args.device)
        print(f"  ranking took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
