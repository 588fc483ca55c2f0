"""A mesh of this machine's CPUs, predicted and run: pipeline × data parallelism (pp 2 × dp 2, four
ranks on this machine's cores) of a Llama-shaped model, for each way the replicas share a stage
(DDP, ZeRO-1, FSDP2), and pipeline × tensor parallelism (pp 2 × tp 2); and, where the actions are
small enough for the ranks' own costs to weigh, notebook 07's FSDP2 mesh (eight ``Linear(64)`` +
GELU, 32 rows) and its pipeline alone under two node agents (``ex.run(executor="torchrun",
nodes=2)``). Each is run three times as ``ex.run()`` runs it (the exported script's ranks, forked
here with torchrun's environment for a mesh, under the agents for the pipeline; a warm-up and ten
measured steps, the median kept): the first run teaches the prediction, the next two are held
against it. Printed: each run's measured and predicted step and the error, the spread of the
measured steps between the held runs (this machine's run-to-run noise), and the first and the held
runs' median and largest |error| (what ``pipexplore.predict.basis.TORCHRUN_HERE_ERROR`` says beside
the prediction of the exported script's ranks run here).

Run: ``python benchmarks/mesh_here.py``.
"""
from __future__ import annotations

import statistics
import warnings

import torch
import transformers

import pipexplore
from common import machine


def model_and_batch():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1000)
    return transformers.LlamaForCausalLM(config), torch.randint(0, 1000, (8, 128))


def small_model_and_batch():
    """Notebook 07's mesh: eight ``Linear(64)`` + GELU, 32 rows, its target and loss."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(8)])
    sample, target = torch.randn(32, 64), torch.randn(32, 64)
    return model, sample, dict(target=target, loss_fn=torch.nn.functional.mse_loss)


def main() -> None:
    print(machine())
    first, errors = [], []
    for name, mesh, data_parallel in (("pp 2 x dp 2", {"pp": 2, "dp": 2}, "ddp"),
                                      ("pp 2 x dp 2", {"pp": 2, "dp": 2}, "zero1"),
                                      ("pp 2 x dp 2", {"pp": 2, "dp": 2}, "fsdp"),
                                      ("pp 2 x tp 2", {"pp": 2, "tp": 2}, "ddp"),
                                      ("notebook 07's pp 2 x dp 2", {"pp": 2, "dp": 2}, "fsdp"),
                                      ("notebook 07's pipeline, two node agents", None, "ddp")):
        if name.startswith("notebook"):
            model, ids, options = small_model_and_batch()
        else:
            model, ids = model_and_batch()
            options = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mesh is None:  # the pipeline alone, its two ranks under two torchrun node agents
                ex = pipexplore.explore(model, ids, devices=["cpu"] * 2, chunks=4, schedule="1f1b", **options)
            else:
                ex = pipexplore.explore(model, ids, devices=["cpu"] * 4, chunks=4, schedule="1f1b",
                                        executor="processes", mesh=mesh, data_parallel=data_parallel, **options)
        rows = [ex.run(executor="torchrun", nodes=2) if mesh is None else ex.run() for _ in range(3)]
        held = rows[1:]
        first.append(abs(rows[0]["prediction_error"]))
        errors += [abs(r["prediction_error"]) for r in held]
        steps = [r["step_time"] for r in held]
        spread = (max(steps) - min(steps)) / statistics.mean(steps)
        kind = "no mesh" if mesh is None else data_parallel if mesh.get("dp", 1) > 1 else "no replicas"
        print(f"{name}, {kind}: " + "; ".join(
            f"run {i + 1} measured {r['step_time'] * 1e3:.1f} ms, predicted {r['predicted_step_time'] * 1e3:.1f} ms "
            f"({r['prediction_error']:+.1%})" for i, r in enumerate(rows)) + f"; held runs' spread {spread:.1%}",
            flush=True)
    print(f"first runs: median |error| {statistics.median(first):.1%}, max {max(first):.1%}")
    print(f"held runs: median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}")


if __name__ == "__main__":
    main()
