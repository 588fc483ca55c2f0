"""A mixture of experts planned at scale, on this CPU: how long planning its mesh takes, and how much memory.

Qwen3-235B-A22B (the shape of its config.json on the Hugging Face Hub: hidden 4,096, 94 layers, 64
heads, 4 key-value heads of 128, 128 experts of 1,536, top-8, vocabulary 151,936) on the meta device,
bf16, mixed-precision AdamW, 16 sequences of 4,096 tokens a replica, 1F1B, full recomputation, on
256 planned H100s:

- ``explore`` with ``mesh={"tp": 2, "pp": 8, "dp": 16, "ep": 32}`` and ZeRO-1 (goal ≤ 10 s, ≤ 2 GiB),
  and a moved split re-predicted;
- ``search(mesh="auto")`` over every mesh of the 256 GPUs and every folding of the experts over
  them (``ep`` and ``etp``), ZeRO-1 and FSDP (goal ≤ 30 s).

Each measurement runs in a fresh interpreter (its peak resident memory its own), three times; the
model is built on meta before the clock starts. Run: ``python benchmarks/moe_at_scale.py``.
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
config = transformers.Qwen3MoeConfig(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                                     num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                                     num_experts=128, num_experts_per_tok=8, vocab_size=151936)
with torch.device("meta"), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
ids = torch.zeros(16, 4096, dtype=torch.long, device="meta")
started = time.perf_counter()
ex = pipexplore.explore(model, ids, devices=["H100"] * 256, gpus_per_node=8, chunks=16, schedule="1f1b",
                        checkpoint="always", optimizer=torch.optim.AdamW, mixed_precision=True,
                        mesh={"tp": 2, "pp": 8, "dp": 16, "ep": 32}, data_parallel="zero1")
out = {"explore": time.perf_counter() - started, "step": ex.state.figures()["predicted_step_time"]}
splits = list(ex.plan.splits)
splits[0] += 1
started = time.perf_counter()
ex.update(splits=splits)
ex.state.figures()
out["moved"] = time.perf_counter() - started
started = time.perf_counter()
table = ex.search(mesh="auto", data_parallel=["zero1", "fsdp"], checkpoint=["always"])
out["search"] = time.perf_counter() - started
out["meshes"] = len(table)
out["left_out"] = len(table.attrs["left_out"])
out["folded"] = int((table["ep"] * table["etp"] > 1).sum())
best = table.iloc[0]
out["best"] = f"tp {best['tp']} · pp {best['pp']} · dp {best['dp']} · ep {best['ep']} · etp {best['etp']}, " \
              f"{best['data_parallel']}: {best['predicted_step_time']:.2f} s, {best['peak_bytes'] / 2**30:.1f} GiB"
out["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print(json.dumps(out))
'''


def measure() -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    runs = [measure() for _ in range(3)]
    line = {key: statistics.median(run[key] for run in runs) for key in runs[0] if key != "best"}
    print(f"Qwen3-235B-A22B, 256 H100s, tp 2 · pp 8 · dp 16 · ep 32: explore {line['explore']:.2f} s, "
          f"peak {line['peak_gib']:.2f} GiB, moved split {line['moved'] * 1e3:.0f} ms, predicted step "
          f"{line['step']:.2f} s; search(mesh='auto') {line['search']:.2f} s over {int(line['meshes'])} meshes "
          f"({int(line['folded'])} with ep or etp above 1; {int(line['left_out'])} left out, named), the first "
          f"{runs[0]['best']} (median of 3)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
