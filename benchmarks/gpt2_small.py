"""GPT-2 small as ``GPT2Config()`` gives it (124 M parameters), explored on four CPU stages of this
machine and run: how long ``explore`` takes, how much memory the process peaks at, and how far the
prediction is from the run.

``explore(model, ids, devices=["cpu"] * 4, chunks=4)`` on 8 × 256 tokens; then ``run()`` (a warm-up
and three measured steps, threads). The model's step is 1.5 TFLOP, so it is timed block by block
with its own weights, each kind of identical block once (``pipexplore.models.profile``'s
``BLOCKWISE_STEP_FLOPS``). Each run is a fresh interpreter; ``--runs N`` repeats it.
Run: ``python benchmarks/gpt2_small.py --runs 3``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r'''
import json, resource, time, warnings
warnings.simplefilter("ignore")
import torch, transformers, pipexplore
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
ids = torch.randint(0, 50257, (8, 256))
started = time.perf_counter()
ex = pipexplore.explore(model, ids, devices=["cpu"] * 4, chunks=4)
explore = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
notes = [n for n in ex.state.notes if "each kind once" in n]
row = ex.run()
print(json.dumps({"explore": explore, "peak_gib": peak, "step": row["step_time"],
                  "predicted": row["predicted_step_time"], "error": row["prediction_error"], "note": notes[0]}))
'''


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=1)
    runs = parser.parse_args().runs
    for n in range(runs):
        done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
        out = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"run {n + 1}: explore {out['explore']:.1f} s, peak {out['peak_gib']:.2f} GiB before the run; "
              f"step {out['step']:.2f} s, predicted {out['predicted']:.2f} s ({out['error']:+.1%})", flush=True)
        if n == 0:
            print(f"  {out['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
