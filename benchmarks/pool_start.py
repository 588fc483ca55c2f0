"""Starting a pool of rank processes: forked by the fork server vs started as new interpreters.

A pool is started when the first processes run begins and again after every failure, timeout,
interrupt or cancel (the pool is discarded then). Each round starts a pool of ``--ranks`` ranks,
runs one trivial job on it, and discards it, the two ways interleaved (server, interpreters,
server, …): wall seconds from the start to the job's replies, and the CPU seconds the ranks spent
getting there (read from each rank just before it is stopped). The fork server's own start (one
per session: it imports torch once) is reported apart.

``--first-step`` (on unless ``--no-first-step``) times a fresh pool's first training step (an
``nn.Sequential`` in 2 stages, 1F1B), the fork server preloading ``torch.distributed.pipelining``
(as it does) against not (each rank then imports it on its first job), the two interleaved, each
server started before the clock; and a tiny GPT-2's (traced, 2 stages) with its ``transformers``
modules imported by the server on the run's request (as it does) against by each rank.

``--traced-rerun`` (on unless ``--no-traced-rerun``) also times a traced model's rerun in
processes: its split checked here once (the executor keeps it) against traced here again before
the ranks start.

Usage::

    python benchmarks/pool_start.py --rounds 5 --ranks 2     # --no-first-step, --no-traced-rerun: pools only
"""
from __future__ import annotations

import argparse
import statistics
import time

import psutil

from common import machine
from pipexplore.executors import forkserver, pool


def _job(rank: int, world: int) -> int:
    return rank


def one_pool(world: int, fork_server: bool) -> tuple[float, float]:
    """(wall seconds to a started pool's first replies, CPU seconds its ranks spent), then discarded."""
    pool.FORK_SERVER = fork_server
    started = time.perf_counter()
    with pool.warm_pool(world, ["cpu"] * world) as (running, _):
        running.run([pool.pack_job(_job, {}) for _ in range(world)], timeout=120.0)
        wall = time.perf_counter() - started
        cpu = sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in running.pids)
    pool._pool.close(kill=True)  # discarded, as after a failure
    pool._pool = None
    return wall, cpu


def first_step(rounds: int) -> None:
    """A fresh pool's first step, ranks forked from a server that preloaded torch's pipelining or not."""
    import torch
    from torch import nn

    from pipexplore.profiling.sequential import profile
    from pipexplore.executors import distributed
    from pipexplore.plan import Plan

    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)])
    sample = torch.randn(32, 64)
    plan = Plan(profile(model, sample, repeats=1), (4,), ("cpu", "cpu"), chunks=4, schedule="1f1b",
                executor="processes")
    variants = {"preloaded": forkserver.PRELOAD,
                "imported by each rank": tuple(m for m in forkserver.PRELOAD if m != "torch.distributed.pipelining")}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    try:
        for _ in range(rounds):
            for name, preload in variants.items():
                forkserver.PRELOAD = preload
                pool.shutdown_pool()
                one_pool(2, True)  # the server starts, off the clock
                started = time.perf_counter()
                distributed.run_processes(model, sample, plan, warmup=0)
                wall = time.perf_counter() - started
                running = pool._pool
                cpu = sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in running.pids)
                times[name].append((wall, cpu))
    finally:
        forkserver.PRELOAD = variants["preloaded"]
        pool.shutdown_pool()
    (pw, pc), (iw, ic) = ([statistics.median(v) for v in zip(*times[name])] for name in variants)
    print(f"a fresh pool's first step (2 ranks, 1F1B), median of {rounds}: pipelining preloaded by the server "
          f"{pw:.2f} s wall, {pc:.2f} CPU s in the ranks; imported by each rank {iw:.2f} s, {ic:.2f} CPU s "
          f"({iw / pw:.1f}x wall, {ic / max(pc, 1e-3):.1f}x CPU)")
    first_hf_step(rounds)


def tiny_gpt2():  # type: ignore[no-untyped-def]
    """A tiny GPT-2 (4 blocks of 128, vocabulary 512, batch 8 × 32), its loss, and its plan: traced,
    split at ``transformer.h.2`` into 2 processes, GPipe, 4 micro-batches."""
    import copy
    import warnings

    import torch
    import transformers

    from pipexplore.models import trace
    from pipexplore.plan import Plan

    warnings.simplefilter("ignore")
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (8, 32))

    def loss(out, target):  # type: ignore[no-untyped-def]
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    table = trace.candidates(copy.deepcopy(model), {"input_ids": ids}, repeats=1)
    plan = Plan(table, (list(table["name"]).index("transformer.h.2"),), ("cpu", "cpu"), chunks=4, schedule="gpipe",
                executor="processes")
    return model, ids, loss, plan


def first_hf_step(rounds: int) -> None:
    """A tiny GPT-2's first step in a fresh pool: its transformers modules imported by the server on
    the run's request, or by each rank (the request left out)."""
    from pipexplore.executors import distributed

    model, ids, loss, plan = tiny_gpt2()
    distributed.run_processes(model, {"input_ids": ids}, plan, target=ids, loss_fn=loss, warmup=0)  # the split
    asked = distributed.installed_modules  # checked here (traced once a session), off the clock
    times: dict[str, list[tuple[float, float]]] = {"server": [], "each rank": []}
    try:
        for _ in range(rounds):
            for name in times:
                distributed.installed_modules = asked if name == "server" else (lambda m: [])
                pool.shutdown_pool()
                one_pool(2, True)  # the server starts, off the clock, and imports what it is asked (once
                pool.preload_modules(distributed.installed_modules(model))  # a session: not a pool's cost)
                started = time.perf_counter()
                distributed.run_processes(model, {"input_ids": ids}, plan, target=ids, loss_fn=loss, warmup=0)
                wall = time.perf_counter() - started
                cpu = sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pool._pool.pids)
                times[name].append((wall, cpu))
    finally:
        distributed.installed_modules = asked
        pool.shutdown_pool()
    (sw, sc), (rw, rc) = ([statistics.median(v) for v in zip(*times[name])] for name in times)
    print(f"a tiny GPT-2's first step in a fresh pool (2 ranks, traced, gpipe), median of {rounds}: transformers "
          f"imported by the server {sw:.2f} s wall, {sc:.2f} CPU s in the ranks; by each rank {rw:.2f} s, "
          f"{rc:.2f} CPU s ({rw / sw:.1f}x wall)")


def traced_rerun(rounds: int) -> None:
    """A tiny GPT-2 traced in 2 processes: a rerun of the same split (checked here once) against a
    rerun that traces it here again (the kept traces forgotten), interleaved; the warm pool serves both."""
    from pipexplore.executors import distributed
    from pipexplore.models.trace.pipes import forget_traced

    model, ids, loss, plan = tiny_gpt2()

    def run() -> float:
        started = time.perf_counter()
        distributed.run_processes(model, {"input_ids": ids}, plan, target=ids, loss_fn=loss, warmup=0)
        return time.perf_counter() - started

    first = run()
    times: dict[str, list[float]] = {"checked": [], "traced again": []}
    for _ in range(rounds):
        times["checked"].append(run())
        forget_traced()
        times["traced again"].append(run())
    pool.shutdown_pool()
    checked, again = (statistics.median(v) for v in times.values())
    print(f"tiny GPT-2 (4 blocks of 128) in 2 processes, split at transformer.h.2: first run {first:.2f} s; reruns, "
          f"median of {rounds}: split checked once {checked:.2f} s, traced here again {again:.2f} s "
          f"({again / checked:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--devices", default="", help="ignored (the other benchmarks' option)")
    parser.add_argument("--first-step", action=argparse.BooleanOptionalAction, default=True,
                        help="also time a fresh pool's first step, torch's pipelining preloaded by the server or not")
    parser.add_argument("--traced-rerun", action=argparse.BooleanOptionalAction, default=True,
                        help="also time a traced model's rerun in processes, its split checked once or traced again")
    args = parser.parse_args()
    print(machine())
    if not forkserver.supported():
        print("no fork server on this platform: every pool starts its ranks as interpreters")
        return
    pool.shutdown_pool()
    server_start = time.perf_counter()
    one_pool(args.ranks, True)  # starts the server
    server_seconds = time.perf_counter() - server_start
    server_cpu = sum(psutil.Process(pool.fork_server_pid()).cpu_times()[:2])
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for fork_server in (True, False):
            results[fork_server].append(one_pool(args.ranks, fork_server))
    pool.shutdown_pool()
    forked, started = ([statistics.median(v) for v in zip(*results[k])] for k in (True, False))
    print(f"first pool, fork server started with it: {server_seconds:.2f} s (the server's imports: {server_cpu:.2f} "
          "CPU s, once per session)")
    print(f"pool of {args.ranks} ranks, median of {args.rounds}: forked {forked[0]:.3f} s wall, {forked[1]:.2f} CPU s; "
          f"interpreters {started[0]:.3f} s wall, {started[1]:.2f} CPU s")
    print(f"ratio interpreters / forked: {started[0] / forked[0]:.1f}x wall, "
          f"{started[1] / max(forked[1], 1e-3):.1f}x CPU")
    if args.first_step:
        first_step(args.rounds)
    if args.traced_rerun:
        traced_rerun(args.rounds)


if __name__ == "__main__":
    main()
