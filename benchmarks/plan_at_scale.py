"""Planning at scale: models built on the meta device, planned on catalogue devices.

1. A Llama-3-70B shape (80 blocks, hidden 8192, FFN 28672, 64 heads, 8 KV heads, vocabulary
   128256, bf16) on meta, a batch of 32 × 4096 tokens in 32 micro-batches, 1F1B on 16 planned
   H100s (2 nodes of 8): ``explore()`` to the first predicted timeline (goal ≤ 10 s, ≤ 2 GiB
   RSS), then moved splits re-predicted (goal ≤ 200 ms each, median of 10).
2. A Llama-3.1-405B shape (126 blocks, hidden 16384, FFN 53248, 128 heads, 8 KV heads) on 128
   planned H100s (16 nodes of 8), the same batch: ``explore()`` to the first timeline (goal ≤ 30 s).

Each runs in a fresh process (``python plan_at_scale.py 70b`` / ``405b``), so the RSS is the
plan's own: the peak resident set of the process, read from ``resource.getrusage``.
"""
from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import time

SHAPES = {
    "70b": dict(layers=80, hidden=8192, ffn=28672, heads=64, kv=8, devices=16, stages=16),
    "405b": dict(layers=126, hidden=16384, ffn=53248, heads=128, kv=8, devices=128, stages=128),
}


def plan(shape: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipexplore import explore

    s = SHAPES[shape]
    start = time.perf_counter()
    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv"], vocab_size=128256,
                      max_position_embeddings=8192, torch_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        ids = torch.randint(0, cfg.vocab_size, (32, 4096))
    built = time.perf_counter() - start
    start = time.perf_counter()
    ex = explore(model, ids, devices=["H100"] * s["devices"], gpus_per_node=8, chunks=32, schedule="1f1b",
                 optimizer=torch.optim.AdamW, mixed_precision=True)
    step = float(ex.plan.predicted["end"].max())
    first = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB → GiB
    params = float(ex.state.layer_table["params"].sum())
    print(f"{shape}: {params / 1e9:.1f} B parameters, {len(ex.state.layer_table)} layers, {ex.plan.num_stages} stages on "
          f"{s['devices']} planned H100 ({ex.plan.nodes} nodes); model built on meta in {built:.2f} s")
    print(f"  explore() to the first predicted timeline: {first:.2f} s; peak RSS {rss:.2f} GiB; "
          f"predicted step {step:.2f} s")
    mem = ex.stage_table()
    print(f"  peak memory per stage: {mem['peak_bytes'].min() / 2 ** 30:.1f}–{mem['peak_bytes'].max() / 2 ** 30:.1f} GiB"
          f" of {mem['capacity'].iloc[0] / 2 ** 30:.0f} GiB; stages that do not fit: {int((~mem['fits']).sum())}")
    if shape == "70b":
        seconds = []
        splits = list(ex.plan.splits)
        for k in range(10):
            moved = list(splits)
            i = 1 + k % (len(moved) - 2)
            moved[i] += 1 if k % 2 == 0 else -1
            start = time.perf_counter()
            ex.update(splits=moved)
            _ = ex.state.figures()
            seconds.append(time.perf_counter() - start)
        print(f"  a moved split re-predicted: median {statistics.median(seconds) * 1e3:.1f} ms, "
              f"slowest {max(seconds) * 1e3:.1f} ms (10 moves)")


def main() -> None:
    if len(sys.argv) > 1:
        plan(sys.argv[1])
        return
    from common import machine

    print(machine())
    for shape in SHAPES:
        subprocess.run([sys.executable, __file__, shape], check=True)


if __name__ == "__main__":
    main()
