"""What only a GPU can tell: the catalogue's roofline against a Llama block measured on the card,
a model larger than the card profiled block by block, and the exported script's recorder against
``torch.profiler`` on the same run (issues 23 and 24's GPU sections).

Sections (``--sections block,big,explore,record``):

- ``block``: a Llama block of hidden 4096 (Llama-3-8B's shape: FFN 14336, 32 heads, 8 KV heads,
  bf16, sequences of ``--seq`` tokens), built on meta. Its FLOPs, bytes and kernels counted
  (:func:`pipexplore.models.meta.count_layers`) and costed by the catalogue entry of the card here
  (:func:`pipexplore.devices.catalogue_kind`) with the catalogue's documented efficiency, and again
  with an efficiency learnt on this card from *another* model (a Llama of hidden 2048, FFN 5632:
  :func:`pipexplore.predict.roofline.fit_efficiency`), against the block measured on the card
  (:func:`pipexplore.models.blockwise.profile_blockwise`, CUDA events) per phase: forward,
  backward, and an Adam step over the block's parameters (planned: the bytes torch's foreach Adam
  moves, :func:`pipexplore.predict.memory.optimizer_traffic`, over the memory bandwidth; learnt:
  over the bandwidth an Adam step reached over the other model's block). Goal: ≤ 15 % a phase.
- ``big``: a Llama-3-70B shape (80 blocks, hidden 8192, FFN 28672, vocabulary 128256, bf16:
  141 GB of weights) on meta, profiled block by block on the card: each kind made real alone,
  timed, freed. Reported: the model's bytes, the card's memory, the most the profile allocated,
  the seconds it took, and the same planned-against-measured rows for its block.
- ``explore``: the explorer's own path (``ExplorerState``) for a Llama of hidden 2048 on meta
  planned on two of the card's catalogue kind: the card is found present, the blocks timed on it
  teach the roofline and an Adam step over the largest block the optimizer's bandwidth (its note).
- ``record``: the exported ``torchrun`` script (world 1, the model as one stage, GPipe, 8
  micro-batches) run on the card with ``--record`` and ``--profile`` at once: both loaded
  (:func:`pipexplore.runs.load.read_run`, :func:`pipexplore.runs.kineto.read_traces`) and compared
  action by action (duration, and start from the step's first action). Then the recorder's cost:
  steps alternately recorded and not in one process (CUDA-synchronised). Goal: ≤ 1 % on a GPU.

Run: ``python benchmarks/gpu_checks.py`` (``--device cpu`` runs the same code on the CPU at
small sizes, as the tests' smoke check does).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import pandas as pd
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common import machine  # noqa: E402
from pipexplore.devices import catalogue_kind, device_spec  # noqa: E402
from pipexplore.models.blockwise import materialise, profile_blockwise  # noqa: E402
from pipexplore.models.meta import count_layers  # noqa: E402
from pipexplore.predict.memory import optimizer_traffic  # noqa: E402
from pipexplore.profiling.optimizer_step import optimizer_seconds  # noqa: E402
from pipexplore.predict.planned_optimizer import optimizer_bandwidth  # noqa: E402
from pipexplore.predict.roofline import Efficiency, fit_efficiency, planned_layer_costs  # noqa: E402

GiB = 1024 ** 3


def llama(hidden: int, ffn: int, heads: int, kv_heads: int, layers: int, vocab: int):
    """A Llama causal LM of that shape on meta, bf16, default attention (no weights)."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, num_hidden_layers=layers, vocab_size=vocab,
                                      max_position_embeddings=8192)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _at(table: pd.DataFrame, phase: str, rows: float) -> pd.Series:
    return table[f"{phase}_a"] + table[f"{phase}_b"] * rows


def counted_and_timed(model, batch: int, seq: int, rows: list[int], device: str, repeats: int):
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    counted = count_layers(model, {"input_ids": ids}, microbatch_rows=rows[0])
    began = time.perf_counter()
    timed = profile_blockwise(model, {"input_ids": ids}, device=device, microbatch_rows=rows, repeats=repeats)
    return counted, timed, time.perf_counter() - began


def learn(model, counted: pd.DataFrame, timed: pd.DataFrame, kind: str, rows: list[int], device: str) -> Efficiency:
    """The efficiency the roofline learns from one model measured here (every size profiled), and
    the bandwidth an Adam step reaches over its first block made real here."""
    measured = {}
    for n in rows:
        per_kind = pd.DataFrame({"kind": counted["kind"].to_numpy(), "forward": _at(timed, "forward", n).to_numpy(),
                                 "backward": _at(timed, "backward", n).to_numpy()})
        measured[float(n)] = per_kind.groupby("kind").median()
    learnt = fit_efficiency(counted.attrs["ops"], measured, kind)
    block = materialise(_decoder(model, counted)[1], torch.device(device))
    return dataclasses.replace(learnt, optimizer=optimizer_bandwidth(block, torch.optim.Adam, kind))


def _decoder(model, counted: pd.DataFrame) -> tuple[int, torch.nn.Module]:
    index = next(i for i, t in enumerate(counted["type"]) if "DecoderLayer" in str(t))
    return index, dict(model.named_modules())[str(counted["name"].iloc[index])]


def adam_seconds(block: torch.nn.Module, device: str, repeats: int = 10) -> float:
    """Measured seconds of one ``torch.optim.Adam`` step (its default: foreach on a GPU) over
    ``block``'s parameters made real on ``device`` (:func:`pipexplore.profiling.optimizer_step.optimizer_seconds`:
    copies, gradients set, the median of ``repeats`` steps after an untimed one, each synchronised)."""
    real = materialise(block, torch.device(device))
    try:
        return float(optimizer_seconds([real], torch.optim.Adam, repeats=repeats)[0])
    finally:
        real.to_empty(device=torch.device("meta"))
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def compare_block(name: str, counted, timed, kind: str, rows: list[int], batch: int, device: str,
                  efficiencies: dict[str, Efficiency | None], model) -> list[float]:
    """Per phase, the planned seconds of the model's first decoder block against the measured ones, at
    the largest micro-batch; returns the |errors|."""
    at = rows[-1]
    index, block = _decoder(model, counted)
    spec = device_spec(kind)
    measured = {"forward": float(_at(timed, "forward", at).iloc[index]),
                "backward": float(_at(timed, "backward", at).iloc[index])}
    measured["optimizer (Adam)"] = adam_seconds(block, device)
    errors = []
    for label, efficiency in efficiencies.items():
        planned = planned_layer_costs(counted, counted.attrs["ops"], kind, batch=batch, microbatch_rows=rows,
                                      efficiency=efficiency)
        bandwidth = spec.memory_bandwidth * (efficiency or Efficiency()).optimizer_for(spec)
        optimizer = optimizer_traffic(counted.iloc[[index]], optimizer=lambda p: torch.optim.Adam(p))[0] / bandwidth
        predicted = {"forward": float(_at(planned, "forward", at).iloc[index]),
                     "backward": float(_at(planned, "backward", at).iloc[index]), "optimizer (Adam)": optimizer}
        for phase, seconds in measured.items():
            error = predicted[phase] / seconds - 1
            errors.append(abs(error))
            print(f"| {name} | {label} | {phase} | {at} | {seconds * 1e3:.3f} | {predicted[phase] * 1e3:.3f} | "
                  f"{error * 100:+.1f} % |", flush=True)
    return errors


def section_block(device: str, kind: str, small: bool) -> None:
    print(f"\n## block: a Llama block planned on the catalogue's {kind} against the block measured on {device}\n")
    if small:  # the same code at CPU sizes
        target, teacher, batch, seq, rows = (256, 688, 8, 2), (128, 344, 4, 2), 4, 64, [2, 4]
    else:
        target, teacher, batch, seq, rows = (4096, 14336, 32, 8), (2048, 5632, 16, 4), 8, 2048, [2, 8]
    print(f"Sequences of {seq} tokens, micro-batches of {rows} sequences; the efficiency learnt from a Llama of "
          f"hidden {teacher[0]} (FFN {teacher[1]}) profiled on this card.\n")
    teach_model = llama(*teacher, layers=2, vocab=32000 if not small else 1000)
    teach_counted, teach_timed, _ = counted_and_timed(teach_model, batch, seq, rows, device, repeats=5)
    learnt = learn(teach_model, teach_counted, teach_timed, kind, rows, device)
    spec = device_spec(kind)
    print(f"Learnt: {learnt.flops_for('bfloat16', spec):.0%} of peak bf16 FLOP/s, {learnt.bandwidth_for(spec):.0%} of "
          f"memory bandwidth, small kernel {learnt.small_kernel_for(spec) * 1e6:.1f} µs, overlap "
          f"{learnt.overlap_for(spec):.0f}, an Adam step {learnt.optimizer_for(spec):.0%} of memory bandwidth "
          f"(catalogue: {spec.flops_efficiency:.0%}, {spec.bandwidth_efficiency:.0%})\n")
    model = llama(*target, layers=2, vocab=32000 if not small else 1000)
    counted, timed, _ = counted_and_timed(model, batch, seq, rows, device, repeats=5)
    print("| model | efficiency | phase | rows | measured ms | planned ms | error |")
    print("|---|---|---|---:|---:|---:|---:|")
    errors = compare_block(f"Llama hidden {target[0]}", counted, timed, kind, rows, batch, device,
                           {"catalogue": None, f"learnt (hidden {teacher[0]})": learnt}, model)
    n = len(errors) // 2
    print(f"\nmedian |error|: catalogue {statistics.median(errors[:n]) * 100:.1f} % (max "
          f"{max(errors[:n]) * 100:.1f} %), learnt {statistics.median(errors[n:]) * 100:.1f} % (max "
          f"{max(errors[n:]) * 100:.1f} %)")


def section_big(device: str, kind: str, small: bool) -> None:
    shape = (512, 1376, 8, 2, 6, 2000) if small else (8192, 28672, 64, 8, 80, 128256)
    model = llama(*shape[:4], layers=shape[4], vocab=shape[5])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    memory = (torch.cuda.get_device_properties(device).total_memory if device.startswith("cuda")
              else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    print(f"\n## big: {shape[4]} blocks of hidden {shape[0]} on meta ({weights / GiB:.1f} GiB of bf16 weights; "
          f"{device} has {memory / GiB:.1f} GiB), profiled block by block\n")
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    batch, seq, rows = (2, 64, [1, 2]) if small else (2, 2048, [1, 2])
    counted, timed, seconds = counted_and_timed(model, batch, seq, rows, device, repeats=3)
    peak = torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else float("nan")
    print(f"Profiled in {seconds:.1f} s: {len(timed)} layers, {timed['kind'].nunique()} kinds timed; the most "
          f"allocated at once {peak / GiB:.2f} GiB ({peak / weights:.1%} of the model's weights).\n")
    print("| layer kind | layers | forward ms | backward ms (at 2 sequences) |")
    print("|---|---:|---:|---:|")
    for kind_name, rows_of in timed.groupby("kind", sort=False):
        print(f"| {kind_name} | {len(rows_of)} | {_at(rows_of, 'forward', 2).iloc[0] * 1e3:.3f} | "
              f"{_at(rows_of, 'backward', 2).iloc[0] * 1e3:.3f} |")
    print("\n| model | efficiency | phase | rows | measured ms | planned ms | error |")
    print("|---|---|---|---:|---:|---:|---:|")
    compare_block("Llama-3-70B shape" if not small else "small", counted, timed, kind, rows, batch, device,
                  {"catalogue": None}, model)


def section_explore(device: str, kind: str, small: bool) -> None:
    """The explorer's own path: a plan on the catalogue's kind of the card here learns from it."""
    from pipexplore.widgets.state import ExplorerState

    shape = (128, 344, 4, 2) if small else (2048, 5632, 16, 4)
    model = llama(*shape, layers=4, vocab=1000 if small else 32000)
    ids = torch.empty(8, 64 if small else 2048, dtype=torch.long, device="meta")
    began = time.perf_counter()
    state = ExplorerState(model, ids, devices=[kind] * 2, chunks=4, optimizer=torch.optim.Adam)
    print(f"\n## explore: a Llama of hidden {shape[0]} on meta planned on 2 × {kind} in "
          f"{time.perf_counter() - began:.1f} s\n")
    for note in state.all_notes():
        if "learnt" in note or "Planned" in note:
            print(f"- {note}")
    step = state.plan.predicted
    updates = step[step["phase"] == "optimizer"]
    print(f"\npredicted step {step['end'].max() * 1e3:.2f} ms, of it the optimizer "
          f"{(updates['end'] - updates['start']).max() * 1e3:.3f} ms (the longer stage's)")


HOOKS = '''import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    layers = []
    for _ in range({layers}):
        layers += [nn.Linear({width}, {width}), nn.GELU()]
    return nn.Sequential(*layers)

def get_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn({batch}, {width}, generator=generator), torch.randn({batch}, {width}, generator=generator)

def loss_fn(output, target):
    return ((output - target) ** 2).mean()
'''


def section_record(device: str, small: bool) -> None:
    import torch.distributed as dist

    from pipexplore.export.torchrun import torchrun_script
    from pipexplore.runs.kineto import read_traces
    from pipexplore.runs.load import read_run

    width, layers, batch, chunks = (256, 4, 64, 8) if small else (4096, 8, 2048, 8)
    print(f"\n## record: the exported script (world 1, one stage, GPipe, {chunks} micro-batches; "
          f"{layers} × (Linear {width} + GELU), batch {batch}) with --record and --profile in one run\n")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="pipexplore-gpu-"))
    (folder / "gpu_hooks.py").write_text(HOOKS.format(layers=layers, width=width, batch=batch))
    table = pd.DataFrame({"name": [str(i) for i in range(2 * layers)]})
    script = folder / "train_pipeline.py"
    script.write_text(torchrun_script(table, [], hooks="gpu_hooks", chunks=chunks, schedule="gpipe", steps=6))
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", ""),
                                                       str(pathlib.Path(__file__).resolve().parents[1])]))
    if not torch.cuda.is_available() or not device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "1", str(script), "--record",
                           str(folder / "recorded"), "--profile", str(folder / "traces"), "--warmup", "3"],
                          env=env, cwd=folder, capture_output=True, text=True, timeout=300)
    if done.returncode:
        print("the run failed:\n" + done.stderr[-3000:])
        return
    recorded = read_run(folder / "recorded")
    traced = read_traces(folder / "traces")
    ours = recorded.steps[-1]
    key = ["stage", "phase", "microbatch"]
    both = []
    for frame in (ours, traced):
        compute = frame[frame["phase"].isin(["forward", "backward"])].copy()
        compute["duration"] = compute["end"] - compute["start"]
        compute["start"] -= compute["start"].min()
        both.append(compute.set_index(key)[["start", "duration"]])
    joined = both[0].add_suffix("_recorded").join(both[1].add_suffix("_profiler"), how="inner")
    print(f"{len(joined)} actions in both (recorded {len(both[0])}, profiler {len(both[1])}; profiler clock "
          f"{sorted(set(traced['clock']))}).\n")
    print("| phase | micro-batch | recorded ms | profiler ms | difference ms | start difference ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for (stage, phase, mb), row in joined.iterrows():
        print(f"| {phase} | {mb} | {row['duration_recorded'] * 1e3:.3f} | {row['duration_profiler'] * 1e3:.3f} | "
              f"{(row['duration_recorded'] - row['duration_profiler']) * 1e3:+.3f} | "
              f"{(row['start_recorded'] - row['start_profiler']) * 1e3:+.3f} |")
    relative = (joined["duration_recorded"] / joined["duration_profiler"] - 1).abs()
    print(f"\nper action: median |duration difference| {relative.median() * 100:.1f} % (max "
          f"{relative.max() * 100:.1f} %), median |start difference| "
          f"{(joined['start_recorded'] - joined['start_profiler']).abs().median() * 1e6:.0f} µs")

    # The recorder's cost: steps recorded and not, alternately, in one process.
    from torch.distributed.pipelining import ScheduleGPipe, pipeline

    from pipexplore.runs.launch import free_port
    from pipexplore.runs.record import RankRecorder

    namespace: dict = {}
    exec(HOOKS.format(layers=layers, width=width, batch=batch), namespace)
    model, (x, y) = namespace["build_model"]().to(device), namespace["get_batch"]()
    x, y = x.to(device), y.to(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        stage = pipeline(model, mb_args=(x.chunk(chunks)[0],)).build_stage(0, torch.device(device))
        schedule = ScheduleGPipe(stage, n_microbatches=chunks, loss_fn=namespace["loss_fn"])
        optimizer = torch.optim.SGD(stage.submod.parameters(), lr=1e-4)
        recorder = RankRecorder(folder / "overhead", [stage], device, warmup=0, plan={"stages": 1})
        times: dict[bool, list[float]] = {False: [], True: []}
        for step in range(84):
            record = step % 2 == 1
            optimizer.zero_grad(set_to_none=True)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            began = time.perf_counter()
            recorder.begin_step(step, record=record)
            schedule.step(x, target=y, losses=[])
            recorder.optimizer_steps([(stage, optimizer)])
            recorder.end_step(step)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if step >= 4:
                times[record].append(time.perf_counter() - began)
        recorder.finish()
    finally:
        dist.destroy_process_group()
    plain, with_ = statistics.median(times[False]), statistics.median(times[True])
    print(f"\nrecorder's cost on {device}: step {plain * 1e3:.3f} ms without, {with_ * 1e3:.3f} ms recorded "
          f"({(with_ / plain - 1) * 100:+.2f} %; medians of 40 steps each, alternating)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="block,big,explore,record")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    options, _ = parser.parse_known_args()
    device = options.device
    small = not device.startswith("cuda")
    kind = (catalogue_kind(torch.cuda.get_device_name(torch.device(device))) if not small else None) or "H100"
    print(f"Machine: {machine()}; planned as the catalogue's {kind}")
    for section in options.sections.split(","):
        began = time.perf_counter()
        {"block": lambda: section_block(device, kind, small), "big": lambda: section_big(device, kind, small),
         "explore": lambda: section_explore(device, kind, small),
         "record": lambda: section_record(device, small)}[section]()
        print(f"\n({section}: {time.perf_counter() - began:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
