"""A Hugging Face GPT-2 (tiny config, no download) explored as it is: split between its blocks and
run in this process and in processes, side by side.

Prints: time from ``explore(...)`` to the first predicted timeline; per executor the first run's
and a rerun's step time, the process start-up apart, and the prediction error of each run. Side by
side, ``--pairs`` times alternately: the profile as the traced stages run (``stages``, the
default: :mod:`pipexplore.models.trace.profile_candidates`, measured afresh for each explorer) and as the
model's own modules alone (``modules``, as before it).
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

from common import machine

import pipexplore


def gpt2(layers: int, width: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=width, n_layer=layers, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
                                     use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def logits_loss(output, target):
    logits = output["logits"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def explored(model, ids, devices, stages: bool):
    """``explore()`` of the model, profiled as its traced stages or as its own modules; and its seconds."""
    from pipexplore.models.trace import profile_candidates

    profile_candidates.forget_measured()  # each explorer pays for its own measurement
    started = time.perf_counter()
    ex = pipexplore.explore(model, ids, target=ids, loss_fn=logits_loss, devices=devices, chunks=4,
                            profile_stages=stages)
    return ex, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--devices", default="cpu,cpu", help="one per stage")
    parser.add_argument("--pairs", type=int, default=2, help="explorers of each profile, alternately")
    parser.add_argument("--executors", default="threads,processes", help="which executors run the plan")
    parser.add_argument("--repeats", type=int, default=0, help="ignored (the other benchmarks' option)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"machine: {machine()}")
    devices = args.devices.split(",")
    ids = torch.randint(1, 256, (16, 32), generator=torch.Generator().manual_seed(0))
    print("| pair | profile | explore() s | executor | run | step | start-up | wall | predicted | error |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---:|")
    for pair in range(args.pairs):
        for stages in (True, False) if pair % 2 == 0 else (False, True):
            ex, seconds = explored(gpt2(args.layers, args.width), ids, devices, stages)
            if pair == 0 and stages:
                print(f"GPT-2 ({args.layers} blocks × {args.width}), batch 16 × 32 tokens, {len(devices)} stages, "
                      f"split at {[ex.layer_table['name'][s] for s in ex.splits]}, {len(ex.layer_table)} candidates")
            for executor in args.executors.split(","):
                for label in ("first run", "rerun"):
                    started = time.perf_counter()
                    row = ex.run(executor=executor)
                    wall = time.perf_counter() - started
                    startup = row.get("startup_seconds", 0.0)
                    startup = 0.0 if startup != startup else startup  # NaN for in-process runs
                    print(f"| {pair + 1} | {'stages' if stages else 'modules'} | {seconds:.2f} | {executor} | {label} | "
                          f"{row['step_time'] * 1e3:.1f} ms | {startup:.2f} s | {wall:.2f} s | "
                          f"{row['predicted_step_time'] * 1e3:.1f} ms | {row['prediction_error'] * 100:+.0f} % |",
                          flush=True)
    from pipexplore.executors.distributed import shutdown_pool

    shutdown_pool()


if __name__ == "__main__":
    main()
