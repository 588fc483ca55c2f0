"""A mesh's rerun on this machine: its ranks forked here (``ex.run()``, :mod:`pipexplore.runs.forked`)
against the same exported script under one torchrun agent (``ex.run(executor="torchrun", nodes=1)``).

Two meshes of four ranks: notebook 07's (eight ``Linear(64)`` + GELU, 32 rows, pp 2 × dp 2 under
FSDP2) and a small Llama at pp 2 × tp 2 (its ranks import ``transformers`` to unpickle it). After
one run of each way (the fork server's start, its import of the model's library), ``--rounds``
reruns of each, interleaved (forked, torchrun, forked, …). Printed per mesh: the median wall
seconds of a rerun each way (export, start, ten steps, load) and their ratio, and the median
measured step each way: the ranks are started differently, the steps they time should not differ
beyond this machine's noise.

Run: ``python benchmarks/mesh_rerun.py --rounds 3``.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import transformers

import pipexplore
from common import machine
from mesh_here import small_model_and_batch


def explorers() -> dict[str, pipexplore.Explorer]:
    small, sample, options = small_model_and_batch()
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128)
    llama = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (8, 16))

    def next_token_loss(output, target):
        return torch.nn.functional.cross_entropy(output["logits"].flatten(0, 1), target.flatten())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "notebook 07's pp 2 x dp 2 (fsdp)": pipexplore.explore(
                small, sample, devices=["cpu"] * 4, chunks=4, schedule="1f1b", executor="processes",
                mesh={"pp": 2, "dp": 2}, data_parallel="fsdp", **options),
            "llama pp 2 x tp 2": pipexplore.explore(
                llama, ids, target=ids, loss_fn=next_token_loss, devices=["cpu"] * 4, chunks=2, schedule="1f1b",
                executor="processes", mesh={"pp": 2, "tp": 2}),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args, _ = parser.parse_known_args()  # (make bench's --devices is not this one's: its meshes run on CPUs)
    print(machine())
    ways = {"forked": lambda ex: ex.run(), "torchrun agent": lambda ex: ex.run(executor="torchrun", nodes=1)}
    for name, ex in explorers().items():
        walls: dict[str, list[float]] = {way: [] for way in ways}
        steps: dict[str, list[float]] = {way: [] for way in ways}
        for round_ in range(args.rounds + 1):
            for way, run in ways.items():
                began = time.perf_counter()
                row = run(ex)
                if round_:  # (the first of each way starts what later reruns find started)
                    walls[way].append(time.perf_counter() - began)
                    steps[way].append(row["step_time"])
        wall = {way: statistics.median(values) for way, values in walls.items()}
        step = {way: statistics.median(values) * 1e3 for way, values in steps.items()}
        print(f"{name}: a rerun {wall['forked']:.2f} s forked, {wall['torchrun agent']:.2f} s under a torchrun agent "
              f"({wall['torchrun agent'] / wall['forked']:.1f}x); measured step {step['forked']:.1f} ms forked, "
              f"{step['torchrun agent']:.1f} ms under the agent (medians of {args.rounds})", flush=True)


if __name__ == "__main__":
    main()
