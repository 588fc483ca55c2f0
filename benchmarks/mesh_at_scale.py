"""The mesh at scale, on this CPU: how long planning a mesh takes, and how much memory.

Each measurement runs in a fresh interpreter (its peak resident memory its own), three times:
- ``explore`` of a Llama-3-70B shape on 64 H100s with ``mesh={"tp": 8, "pp": 4, "dp": 2}``
  (goal ≤ 10 s, ≤ 2 GiB), then ``search(mesh="auto")`` over every mesh of its 64 GPUs with ZeRO-1
  and FSDP (goal ≤ 30 s), and a moved split re-predicted (goal ≤ 200 ms);
- the same for Llama 3 405B on 1,024 H100s (``tp 8 · pp 16 · dp 8``; goal ≤ 60 s for both).

Beside each, the pipeline alone (no mesh, the same devices as pipeline stages where the layers
allow) as the reference a mesh is compared to. Run: ``python benchmarks/mesh_at_scale.py``.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

CHILD = r'''
import json, resource, sys, time, warnings
import torch, transformers
import pipexplore
shape, gpus, mesh, search = json.loads(sys.argv[1])
config = transformers.LlamaConfig(**shape)
with torch.device("meta"), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
ids = torch.zeros(16, 4096, dtype=torch.long, device="meta")
started = time.perf_counter()
options = dict(mesh=mesh, data_parallel="zero1") if mesh else {}
ex = pipexplore.explore(model, ids, devices=["H100"] * gpus, gpus_per_node=8, chunks=16, schedule="1f1b",
                        checkpoint="always", optimizer=torch.optim.AdamW, mixed_precision=True, **options)
out = {"explore": time.perf_counter() - started}
splits = list(ex.plan.splits)
room = [k for k in range(len(splits)) if (splits[k + 1] if k + 1 < len(splits) else len(ex.state.layer_table)) > splits[k] + 1]
splits[room[0]] += 1  # a split moved by one layer where it can move
started = time.perf_counter()
ex.update(splits=splits)
ex.state.figures()
out["moved"] = time.perf_counter() - started
if search:
    started = time.perf_counter()
    table = ex.search(mesh="auto", data_parallel=["zero1", "fsdp"], checkpoint=["always"])
    out["search"] = time.perf_counter() - started
    out["meshes"] = len(table)
out["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps(out))
'''

LLAMA_70B = dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256)
LLAMA_405B = dict(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
                  num_key_value_heads=8, vocab_size=128256)
CASES = [("70B on 64 H100s, tp 8 · pp 4 · dp 2", LLAMA_70B, 64, {"tp": 8, "pp": 4, "dp": 2}),
         ("70B on 64 H100s, pipeline alone (64 stages)", LLAMA_70B, 64, None),
         ("405B on 1,024 H100s, tp 8 · pp 16 · dp 8", LLAMA_405B, 1024, {"tp": 8, "pp": 16, "dp": 8}),
         ("405B on 128 H100s, pipeline alone (128 stages)", LLAMA_405B, 128, None)]


def measure(shape: dict, gpus: int, mesh: dict | None) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps([shape, gpus, mesh, mesh is not None])],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    for name, shape, gpus, mesh in CASES:
        runs = [measure(shape, gpus, mesh) for _ in range(3)]
        line = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        figures = [f"explore {line['explore']:.2f} s", f"peak {line['peak_gib']:.2f} GiB",
                   f"moved split {line['moved'] * 1e3:.0f} ms"]
        if "search" in line:
            figures.append(f"search(mesh='auto') {line['search']:.2f} s over {int(line['meshes'])} meshes")
        print(f"{name}: " + ", ".join(figures) + " (median of 3)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
