"""A traced model's rerun in this process: the kept trace copied with the model's weights
(``pipexplore.models.trace.pipes``) against tracing it again, as every run did before.

Each round runs ``run_traced_step`` (threads executor, one warm-up step and one measured) on the
same split twice, interleaved: once with the split's pipe kept from the round before, once after
``forget_traced()`` (torch.export traces it again). Wall seconds of the whole call, median of the
rounds; and ``traced_pipe`` alone, the same two ways (what a rerun saves, without the steps).

``--new-split``: a split at another block each time (what a drag of a split handle then Run step
asks for): ``traced_pipe`` and ``run_traced_step`` with the model's export kept from the splits
before (``pipexplore.models.trace.markers``: no export, torch's splitter on the kept graph) against
exporting it again (``forget_traced()``), interleaved; the kept pipes are dropped either way.

``--processes``: the same split rerun through the processes executor on a warm pool of 2 ranks
(no warm-up step, one measured): each rank keeps its pipes, so a rerun copies them ("kept"); new
ranks (``shutdown_pool(keep_server=True)``: the next pool's ranks are forked by the fork server in
~0.05 s, with no pipe kept) are sent the split made here (``pipexplore.models.trace.sent``), or,
with sending turned off, trace it themselves, as every first run in new ranks did before.

Usage::

    python benchmarks/traced_rerun.py --rounds 5              # GPT-2 small (124M), 2 stages
    python benchmarks/traced_rerun.py --rounds 5 --tiny       # a tiny GPT-2 (4 blocks of 128)
    python benchmarks/traced_rerun.py --rounds 5 --processes  # reruns in the processes executor
    python benchmarks/traced_rerun.py --rounds 5 --new-split  # a split at another block each time
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

from common import machine
from pipexplore.executors.traced import run_traced_step
from pipexplore.models.inputs import first_microbatch
from pipexplore.models import trace
from pipexplore.models.trace.pipes import forget_traced, traced_pipe
from pipexplore.plan import Plan


def gpt2(tiny: bool):  # type: ignore[no-untyped-def]
    import transformers

    warnings.simplefilter("ignore")
    config = (transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=64) if tiny
              else transformers.GPT2Config())
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (8, 32))
    table = trace.candidates(copy.deepcopy(model), {"input_ids": ids}, repeats=1)
    names = [str(n) for n in table["name"]]
    point = "transformer.h.2" if tiny else "transformer.h.6"
    plan = Plan(table, (names.index(point),), ("cpu", "cpu"), chunks=4, schedule="1f1b", executor="threads")
    return model, ids, plan, point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT-2 rather than GPT-2 small")
    parser.add_argument("--processes", action="store_true", help="reruns in the processes executor's warm pool")
    parser.add_argument("--new-split", action="store_true", help="a split at another block each time")
    parser.add_argument("--devices", default="", help="ignored (the other benchmarks' option)")
    args = parser.parse_args()
    print(machine())
    model, ids, plan, point = gpt2(args.tiny)

    def loss(out, target):  # type: ignore[no-untyped-def]
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    if args.processes:
        processes(model, ids, plan.with_options(executor="processes"), point, loss, args)
        return
    if args.new_split:
        new_split(model, ids, plan, loss, args)
        return

    def step() -> float:
        started = time.perf_counter()
        run_traced_step(model, {"input_ids": ids}, plan, target=ids, loss_fn=loss, warmup=1, repeats=1)
        return time.perf_counter() - started

    def pipe() -> float:
        started = time.perf_counter()
        traced_pipe(model, first_microbatch({"input_ids": ids}, plan.chunks), [point])
        return time.perf_counter() - started

    for name, call in (("run_traced_step", step), ("traced_pipe", pipe)):
        kept, again = interleaved(call, args.rounds, lambda: None)
        print(f"{'tiny GPT-2' if args.tiny else 'GPT-2 small'}, 2 stages split at {point}, {name}, median of "
              f"{args.rounds}: kept {kept:.2f} s, traced again {again:.2f} s ({again / kept:.1f}x)")


def interleaved(call, rounds: int, before_kept) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Median seconds of ``call`` with what the first call kept (after ``before_kept()``) and after
    ``forget_traced()``, the two interleaved over ``rounds``."""
    forget_traced()
    call()  # the first: traced (exported), and kept
    kept: list[float] = []
    again: list[float] = []
    for _ in range(rounds):
        before_kept()
        kept.append(call())
        forget_traced()
        again.append(call())
    return statistics.median(kept), statistics.median(again)


def new_split(model, ids, plan, loss, args) -> None:  # type: ignore[no-untyped-def]
    blocks = [i for i, name in enumerate(plan.layer_table["name"]) if str(name).startswith("transformer.h.")]
    names = [str(n) for n in plan.layer_table["name"]]
    sample = {"input_ids": ids}
    points = iter(blocks[1:] * (4 * args.rounds))  # another block at each call

    def pipe() -> float:
        started = time.perf_counter()
        traced_pipe(model, first_microbatch(sample, plan.chunks), [names[next(points)]])
        return time.perf_counter() - started

    def step() -> float:
        started = time.perf_counter()
        run_traced_step(model, sample, plan.with_options(splits=(next(points),)), target=ids, loss_fn=loss,
                        warmup=1, repeats=1)
        return time.perf_counter() - started

    for name, call in (("traced_pipe", pipe), ("run_traced_step", step)):
        kept, again = interleaved(call, args.rounds, lambda: forget_traced(exports=False))
        print(f"{'tiny GPT-2' if args.tiny else 'GPT-2 small'}, 2 stages, a new split point each call, {name}, "
              f"median of {args.rounds}: export kept {kept:.2f} s, exported again {again:.2f} s ({again / kept:.1f}x)")


def processes(model, ids, plan, point, loss, args) -> None:  # type: ignore[no-untyped-def]
    from pipexplore.executors import distributed
    from pipexplore.executors.distributed import run_processes
    from pipexplore.executors.pool import shutdown_pool

    sending = distributed._sendable

    def rerun(send: bool = True) -> tuple[float, int]:
        distributed._sendable = sending if send else (lambda skeleton: None)  # type: ignore[assignment]
        started = time.perf_counter()
        result = run_processes(model, {"input_ids": ids}, plan, target=ids, loss_fn=loss, warmup=0)
        return time.perf_counter() - started, result.metrics["traced_ranks"]

    rerun()  # the fork server, the pool, the split here
    times: dict[str, list[float]] = {"kept": [], "new ranks, sent": [], "new ranks, traced": []}
    traced: dict[str, set[int]] = {key: set() for key in times}
    for _ in range(args.rounds):
        for key in times:
            if key != "kept":
                shutdown_pool(keep_server=True)  # new ranks: nothing kept
            seconds, ranks = rerun(send=key != "new ranks, traced")
            times[key].append(seconds)
            traced[key].add(ranks)
    distributed._sendable = sending
    shutdown_pool()
    kept, fresh, again = (statistics.median(v) for v in times.values())
    print(f"{'tiny GPT-2' if args.tiny else 'GPT-2 small'}, 2 stages split at {point}, run_processes on 2 "
          f"ranks, median of {args.rounds}: kept {kept:.2f} s; new ranks sent the split {fresh:.2f} s, "
          f"new ranks tracing it {again:.2f} s ({again / fresh:.1f}x); ranks that traced: "
          + ", ".join(f"{key} {sorted(found)}" for key, found in traced.items()))


if __name__ == "__main__":
    main()
