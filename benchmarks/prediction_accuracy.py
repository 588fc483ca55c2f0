"""How far the explorer's predicted step is from the measured one, through the public path only.

For each config: ``explore(model, sample, chunks=…, schedule=…, devices=…, executor=…)``, then
``run()`` five times, changing the plan between runs as a user would:

1. first run (the profile only), 2. the same plan again (after learning from run 1),
3. chunks changed, 4. the first split moved by one layer, 5. schedule changed; and beside them how
far the second measurement of the plan is from the first (the machine's own noise: a floor for
what any prediction can reach).

Each column prints the median and max |error| of ``predicted_step_time`` against the measured
``step_time`` in ``explorer.runs`` (what the explorer shows). Goal on a 2-core CPU: median ≤ 10 %
and max ≤ 25 % in every column.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings

import torch
from torch import nn

from common import machine

import pipexplore
from pipexplore.examples import Block, SleepLayer

COLUMNS = ["first run", "same plan again", "chunks changed", "split moved", "schedule changed"]
#: Not a prediction: how far the second measurement of the same plan is from the first. No
#: prediction of one run from another can be reliably closer than the machine repeats itself.
NOISE = "measured twice (noise)"


def fixed(device: str) -> tuple[nn.Sequential, torch.Tensor]:
    """Layers of fixed cost (sleeps: the host is free, as with GPU kernels or I/O)."""
    return nn.Sequential(*[SleepLayer(0.002, 0.001, 0.001) for _ in range(8)]), torch.randn(64, 32)


def mlp(device: str) -> tuple[nn.Sequential, torch.Tensor]:
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(12)]), torch.randn(128, 512)


def conv(device: str) -> tuple[nn.Sequential, torch.Tensor]:
    layers = [nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()) for _ in range(8)]
    return nn.Sequential(*layers), torch.randn(32, 16, 24, 24)


def transformer(device: str) -> tuple[nn.Sequential, torch.Tensor]:
    return nn.Sequential(*[Block(128) for _ in range(6)]), torch.randn(32, 16, 128)


MODELS = {"fixed": fixed, "mlp": mlp, "conv": conv, "transformer": transformer}

# (model, schedule, chunks, stages, executor); interleaved: 4 stages on 2 devices.
CONFIGS = [
    ("fixed", "gpipe", 4, 2, "threads"), ("fixed", "1f1b", 8, 3, "threads"),
    ("fixed", "zero-bubble", 4, 2, "threads"), ("fixed", "gpipe", 4, 2, "autograd"),
    ("mlp", "gpipe", 4, 2, "threads"), ("mlp", "1f1b", 8, 3, "threads"),
    ("mlp", "interleaved", 4, 4, "threads"), ("mlp", "gpipe", 4, 3, "autograd"),
    ("conv", "1f1b", 4, 2, "threads"), ("conv", "zero-bubble", 8, 3, "threads"),
    ("conv", "gpipe", 8, 2, "autograd"),
    ("transformer", "gpipe", 4, 3, "threads"), ("transformer", "1f1b", 4, 2, "threads"),
    ("transformer", "zero-bubble", 8, 2, "threads"), ("transformer", "gpipe", 4, 2, "autograd"),
    ("mlp", "interleaved", 8, 4, "threads"),
    ("mlp", "1f1b", 4, 2, "processes"), ("transformer", "gpipe", 4, 2, "processes"),
    # One CPU stage: its worker thread runs with the host's intra-op threads (see pipexplore.host).
    ("transformer", "1f1b", 4, 1, "threads"), ("mlp", "gpipe", 8, 1, "threads"),
]


def _other_schedule(schedule: str) -> str:
    return {"gpipe": "1f1b", "1f1b": "gpipe", "zero-bubble": "1f1b", "interleaved": "1f1b"}[schedule]


def run_config(model_name: str, schedule: str, chunks: int, stages: int, executor: str,
               device: str) -> tuple[list[float], list[str]]:
    torch.manual_seed(0)
    model, sample = MODELS[model_name](device)
    devices = [device] * (stages // 2 if schedule == "interleaved" else stages)
    ex = pipexplore.explore(model, sample, chunks=chunks, schedule=schedule, devices=devices, executor=executor,
                            loss_fn=None)
    errors, notes, measured = [], [], []

    def measure(label: str) -> None:
        row = ex.run()
        measured.append(float(row["step_time"]))
        errors.append(float(row["prediction_error"]))
        notes.append(f"{label}: predicted {row['predicted_step_time'] * 1e3:.1f} ms, "
                     f"measured {row['step_time'] * 1e3:.1f} ms ({row['prediction_error'] * 100:+.0f} %)")

    measure("first")
    measure("again")
    ex.update(chunks=8 if chunks == 4 else 4)
    measure("chunks")
    splits = list(ex.splits)
    layers = len(ex.layer_table)
    if splits:
        moved = splits[0] + 1 if splits[0] + 1 < (splits[1] if len(splits) > 1 else layers) else splits[0] - 1
        ex.splits = [moved, *splits[1:]]
        measure("split")
    else:
        errors.append(math.nan)  # one stage: no split to move
    if executor == "autograd":
        errors.append(math.nan)  # the GPipe module runs only gpipe
    else:
        other = _other_schedule(schedule)
        if schedule == "interleaved":
            ex.update(schedule=other, devices=[device] * ex.plan.num_stages)
        else:
            ex.update(schedule=other)
        measure("schedule")
    errors.append(measured[1] / measured[0] - 1)
    return errors, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", help="the device every stage runs on (cpu, or cuda:0)")
    parser.add_argument("--only", default="", help="comma-separated model names to run (default: all)")
    parser.add_argument("--no-processes", action="store_true", help="skip the configs run in processes")
    parser.add_argument("--devices", default="", help="as the other benchmarks take it: the first device is used")
    parser.add_argument("--repeats", type=int, default=0, help="ignored (the other benchmarks' option)")
    args = parser.parse_args()
    if args.devices:
        args.device = args.devices.split(",")[0]
    warnings.simplefilter("ignore")
    print(f"machine: {machine()}")
    table: list[list[float]] = []
    started = time.perf_counter()
    for model_name, schedule, chunks, stages, executor in CONFIGS:
        if args.only and model_name not in args.only.split(","):
            continue
        if args.no_processes and executor == "processes":
            continue
        errors, notes = run_config(model_name, schedule, chunks, stages, executor, args.device)
        table.append(errors)
        cells = " ".join("   n/a" if math.isnan(e) else f"{e * 100:+5.0f}%" for e in errors)
        print(f"{model_name:12} {schedule:12} chunks {chunks} stages {stages} {executor:9} {cells}")
        print("    " + "; ".join(notes), file=sys.stderr)
    print(f"\n{len(table)} configs in {time.perf_counter() - started:.0f} s; |error| per column:")
    print(f"| {'column':18} | median | max |")
    print("|---|---:|---:|")
    for k, column in enumerate([*COLUMNS, NOISE]):
        values = [abs(row[k]) for row in table if not math.isnan(row[k])]
        if values:
            print(f"| {column:18} | {statistics.median(values) * 100:5.1f} % | {max(values) * 100:5.1f} % |")


if __name__ == "__main__":
    main()
