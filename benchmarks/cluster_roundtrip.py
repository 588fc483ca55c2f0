"""Export → two torchrun node agents → load, for two model kinds (issue 24's goals).

Sections (``--sections roundtrip,overhead``):

- ``roundtrip``: per model and per world of ``--ranks`` (default 2 and 4: 2 agents of 1 rank, the
  machine's 2 cores one a rank, and 2 agents of 2 ranks, oversubscribed), ``explore(...)`` then
  ``explorer.run(executor="torchrun", nodes=2)`` ``--runs`` times on the same plan (c10d on
  loopback, gloo, CPU): the wall
  time of each (export, agents, load), the measured and predicted step, the prediction error of
  the loaded run as ``explorer.runs`` shows it (the first: before any run taught the cost model;
  the later ones: after learning from the ones before).
- ``overhead``: per model, recording on and off step by step in one process (world 1, the model
  as one stage of 16 micro-batches); the exported script launched the same way ``--pairs`` times
  without and with ``--record`` (alternately, ``--steps`` steps each: the median step the last
  rank printed, its first two steps left out); and the recorder's own cost per recorded action
  (a wrapped call against a plain one) times the actions a rank records per step, over the step:
  a bound the machine's noise does not blur.

- ``executors``: per model, the same 2-rank 1F1B plan run alternately by the ``processes``
  executor and through torchrun (2 agents of one rank), ``--pairs`` pairs: each run's median step
  and the ratio of the medians, torchrun over processes.
- ``stages``: one traced stage (the MLP's first half, split by torch's tracer) forward and
  backward as torch leaves it (its modules interpreted by ``torch.fx.Interpreter``), running its
  generated code (``trace.run_generated_code``), and as the ``nn.Sequential`` slice itself; side
  by side, one thread, the median of 5 rounds of 200 calls.

Run: ``.venv/bin/python benchmarks/cluster_roundtrip.py`` (``--sections executors,stages`` for the
last two).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import pipexplore  # noqa: E402
from common import machine  # noqa: E402
from pipexplore.examples import build_model as build_transformer, get_batch as transformer_batch  # noqa: E402
from pipexplore.examples import loss_fn as transformer_loss  # noqa: E402
from pipexplore.runs.launch import STEP_LINE, launch, write_hooks  # noqa: E402


def mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(512, 512), nn.GELU()]
    model = nn.Sequential(*layers)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 512, generator=generator), torch.randn(64, 512, generator=generator)
    return model, x, y, lambda out, target: ((out - target) ** 2).mean()


def transformer():
    tokens, target = transformer_batch(16)
    return build_transformer(), tokens, target, transformer_loss


MODELS = {"MLP 8 × (Linear 512 + GELU), batch 64": mlp, "TinyTransformer (traced), batch 16": transformer}


def explorer_for(make, ranks: int = 4):
    model, x, y, loss = make()
    return pipexplore.explore(model, x, target=y, loss_fn=loss, chunks=4, schedule="1f1b",
                              devices=["cpu"] * ranks, executor="processes")


def roundtrip(runs: int, worlds: list[int]) -> list[float]:
    errors = []
    for world in worlds:
        errors += roundtrip_of(runs, world)
    return errors


def roundtrip_of(runs: int, world: int) -> list[float]:
    print(f"\n## roundtrip: explorer.run(executor='torchrun', nodes=2), 1F1B, {world} ranks "
          f"(2 agents × {world // 2}), chunks 4\n")
    print("| model | run | wall s | agents s | step ms | predicted ms | error | clock residual µs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    errors = []
    for name, make in MODELS.items():
        explorer = explorer_for(make, world)
        for k in range(runs):
            began = time.perf_counter()
            row = explorer.run(executor="torchrun", nodes=2)
            wall = time.perf_counter() - began
            result = explorer.state.log.result_of(row["run"])
            errors.append(float(row["prediction_error"]))
            print(f"| {name} | {k + 1}{' (first)' if k == 0 else ''} | {wall:.1f} | "
                  f"{result.metrics['wall_seconds']:.1f} | {row['step_time'] * 1e3:.1f} | "
                  f"{row['predicted_step_time'] * 1e3:.1f} | {row['prediction_error'] * 100:+.1f} % | "
                  f"{result.metrics['clock_residual'] * 1e6:.0f} |", flush=True)
    first = [abs(e) for e in errors[::runs]]
    later = [abs(e) for i, e in enumerate(errors) if i % runs]
    print(f"\nmedian |error|: first runs {statistics.median(first) * 100:.1f} %"
          + (f", after learning {statistics.median(later) * 100:.1f} %" if later else "")
          + f", all {statistics.median(map(abs, errors)) * 100:.1f} %")
    return errors


def _step_times(stdout: list[str]) -> list[float]:
    times = []
    for text in stdout:
        for line in text.splitlines():
            match = STEP_LINE.match(line)
            if match and "time=" in line:
                times.append((int(match["step"]), float(line.rsplit("time=", 1)[1].rstrip("ms"))))
    return [t for step, t in sorted(times) if step >= 2]


def in_process(make, steps: int = 80, chunks: int = 16) -> tuple[float, float, int]:
    """Median seconds of a step without and with recording, the two alternating step by step in
    one process (world 1, gloo): the whole model as one stage of ``chunks`` micro-batches, so that
    an action is about as long as a rank's in the 4-rank run. Also the actions recorded a step."""
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleGPipe, pipeline

    from pipexplore.runs.launch import free_port
    from pipexplore.runs.record import RankRecorder

    model, x, y, loss = make()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    folder = pathlib.Path(tempfile.mkdtemp())
    try:
        stage = pipeline(model, mb_args=(x.chunk(chunks)[0],)).build_stage(0, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=chunks, loss_fn=loss)
        optimizer = torch.optim.SGD(stage.submod.parameters(), lr=1e-3)
        recorder = RankRecorder(folder, [stage], "cpu", warmup=0, plan={"stages": 1})
        times: dict[bool, list[float]] = {False: [], True: []}
        for step in range(steps + 4):
            record = step % 2 == 1
            optimizer.zero_grad(set_to_none=True)
            began = time.perf_counter()
            recorder.begin_step(step, record=record)
            schedule.step(x, target=y, losses=[])
            recorder.optimizer_steps([(stage, optimizer)])
            recorder.end_step(step)
            if step >= 4:
                times[record].append(time.perf_counter() - began)
        recorder.finish()
        actions = len(recorder_events(folder)) // max(1, len(times[True]))
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)
    return statistics.median(times[False]), statistics.median(times[True]), actions


def recorder_events(folder: pathlib.Path) -> list:
    import json

    payload = json.loads((folder / "rank-0.json").read_text())
    return [event for step in payload["steps"] for event in step["events"]]


def action_cost(calls: int = 20000) -> float:
    """Seconds the recorder adds to one recorded action (a wrapped no-op against a plain one)."""
    import torch.distributed as dist

    from pipexplore.runs.launch import free_port
    from pipexplore.runs.record import RankRecorder

    class Stage:
        stage_index = 0

        def forward_one_chunk(self, chunk, *args, **kwargs):
            return chunk

        def backward_one_chunk(self, chunk, *args, **kwargs):
            return chunk

        def backward_weight_one_chunk(self, chunk, *args, **kwargs):
            return chunk

        def get_fwd_recv_ops(self, chunk):
            return []

        get_bwd_recv_ops = get_fwd_send_ops = get_bwd_send_ops = get_fwd_recv_ops

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    folder = pathlib.Path(tempfile.mkdtemp())
    try:
        plain, stage = Stage(), Stage()
        recorder = RankRecorder(folder, [stage], "cpu", warmup=0, plan={"stages": 1})
        recorder.begin_step(0)
        rounds = []
        for _ in range(5):
            began = time.perf_counter()
            for i in range(calls):
                plain.forward_one_chunk(i)
            middle = time.perf_counter()
            for i in range(calls):
                stage.forward_one_chunk(i)
            rounds.append(((time.perf_counter() - middle) - (middle - began)) / calls)
        recorder.end_step(0)
        recorder.finish()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)
    return statistics.median(rounds)


def overhead(pairs: int, steps: int) -> list[float]:
    cost = action_cost()
    print("\n## overhead: recording on and off, step by step in one process (world 1, the model as one stage, "
          "16 micro-batches)\n")
    print("| model | step ms without | step ms with | overhead | actions/step |")
    print("|---|---:|---:|---:|---:|")
    found = []
    for name, make in MODELS.items():
        plain, recorded, actions = in_process(make)
        found.append(recorded / plain - 1)
        print(f"| {name} | {plain * 1e3:.2f} | {recorded * 1e3:.2f} | {(recorded / plain - 1) * 100:+.2f} % | "
              f"{actions} |", flush=True)
    print("\n## overhead: the exported script without and with --record (2 agents × 2 ranks, 1F1B, chunks 4)\n")
    print(f"The recorder's cost per recorded action: {cost * 1e6:.2f} µs (a wrapped call against a plain one).\n")
    print("| model | step ms without | step ms with --record | overhead (medians) | actions/rank/step | "
          "bound from the cost per action |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, make in MODELS.items():
        explorer = explorer_for(make)
        model, x, y, loss = make()
        folder = pathlib.Path(tempfile.mkdtemp(prefix="pipexplore-overhead-"))
        try:
            hooks = write_hooks(folder, model, x, y, loss, None)
            script = folder / "train_pipeline.py"
            script.write_text(explorer.export("torchrun", hooks=hooks, steps=steps))
            without, with_ = [], []
            for k in range(pairs):
                without += _step_times(launch(script, nodes=2, nproc_per_node=2, timeout=600).stdout)
                record = folder / f"run{k}"
                with_ += _step_times(launch(script, nodes=2, nproc_per_node=2, timeout=600,
                                            args=["--record", str(record), "--warmup", "2"]).stdout)
            row = explorer.load_run(folder / "run0")
            timeline = explorer.timeline("measured", row["run"])
            actions = len(timeline) / row["ranks"]
            a, b = statistics.median(without), statistics.median(with_)
            print(f"| {name} | {a:.2f} | {b:.2f} | {(b / a - 1) * 100:+.1f} % | {actions:.0f} | "
                  f"{actions * cost / (a / 1e3) * 100:.2f} % |", flush=True)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return found


def executors(pairs: int) -> list[float]:
    print(f"\n## executors: the same plan (1F1B, 2 ranks, chunks 4), processes and torchrun alternately, "
          f"{pairs} pairs\n")
    print("| model | processes step ms | torchrun step ms | torchrun / processes |")
    print("|---|---|---|---:|")
    ratios = []
    for name, make in MODELS.items():
        explorer = explorer_for(make, 2)
        ours, theirs = [], []
        for _ in range(pairs):
            ours.append(explorer.run(executor="processes")["step_time"] * 1e3)
            theirs.append(explorer.run(executor="torchrun", nodes=2)["step_time"] * 1e3)
        ratios.append(statistics.median(theirs) / statistics.median(ours))
        print(f"| {name} | {' / '.join(f'{t:.1f}' for t in ours)} | {' / '.join(f'{t:.1f}' for t in theirs)} | "
              f"{ratios[-1]:.2f} |", flush=True)
    return ratios


def stages(rounds: int = 5, calls: int = 200) -> dict[str, float]:
    import copy

    from pipexplore.models import trace

    torch.set_num_threads(1)
    model, x, _, _ = mlp()
    chunk = x.chunk(4)[0]
    interpreted = trace.split(copy.deepcopy(model), (chunk,), ["8"]).split_gm.submod_pp_0
    for module in interpreted.modules():  # as torch leaves them
        if getattr(module, "_run_with_interpreter", None) is False:
            module._run_with_interpreter = True
    generated = trace.split(copy.deepcopy(model), (chunk,), ["8"]).split_gm.submod_pp_0
    variants = {"interpreted (torch's default)": interpreted, "generated code (ours)": generated,
                "nn.Sequential slice": nn.Sequential(*list(model)[:8])}
    times: dict[str, list[float]] = {name: [] for name in variants}
    inputs = chunk.clone().requires_grad_()
    for _ in range(rounds):
        for name, module in variants.items():
            for k in range(calls + 20):
                if k == 20:
                    began = time.perf_counter()
                out = module(inputs)
                (out[0] if isinstance(out, tuple) else out).sum().backward()
            times[name].append((time.perf_counter() - began) / calls)
    print(f"\n## stages: a traced stage of 4 × (Linear 512 + GELU), forward and backward of {chunk.size(0)} rows, "
          "1 thread\n")
    print("| stage module | ms a call |\n|---|---:|")
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, value in medians.items():
        print(f"| {name} | {value:.3f} |")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="roundtrip,overhead")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--ranks", default="2,4", help="worlds of the roundtrip section, 2 agents each")
    parser.add_argument("--steps", type=int, default=30)
    options, _ = parser.parse_known_args()  # run_all.sh passes every script the same arguments
    print(f"Machine: {machine()}; load average {os.getloadavg()[0]:.1f} at the start")
    began = time.perf_counter()
    sections = options.sections.split(",")
    if "roundtrip" in sections:
        roundtrip(options.runs, [int(w) for w in options.ranks.split(",")])
    if "overhead" in sections:
        overhead(options.pairs, options.steps)
    if "executors" in sections:
        executors(options.pairs)
    if "stages" in sections:
        stages()
    print(f"\n{time.perf_counter() - began:.0f} s in all; load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
