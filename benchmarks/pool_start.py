"""Starting a pool of rank processes: forked by the fork server vs started as new interpreters.

A pool is started when the first processes run begins and again after every failure, timeout,
interrupt or cancel (the pool is discarded then). Each round starts a pool of ``--ranks`` ranks,
runs one trivial job on it, and discards it, the two ways interleaved (server, interpreters,
server, …): wall seconds from the start to the job's replies, and the CPU seconds the ranks spent
getting there (read from each rank just before it is stopped). The fork server's own start (one
per session: it imports torch once) is reported apart.

``--traced-rerun`` also times a traced model's rerun in processes: its split checked here once
(the executor keeps it) against traced here again before the ranks start.

Usage::

    python benchmarks/pool_start.py --rounds 5 --ranks 2 --traced-rerun
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


def traced_rerun(rounds: int) -> None:
    """A tiny GPT-2 traced in 2 processes: a rerun of the same split (checked here once) against a
    rerun that traces it here again (the check forgotten), interleaved; the warm pool serves both."""
    import copy
    import warnings

    import torch
    import transformers

    from pipexplore import trace
    from pipexplore.executors import distributed
    from pipexplore.plan import Plan

    warnings.simplefilter("ignore")
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (8, 32))

    def loss(out, target):  # type: ignore[no-untyped-def]
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    table = trace.candidates(copy.deepcopy(model), {"input_ids": ids}, repeats=1)
    names = list(table["name"])
    plan = Plan(table, (names.index("transformer.h.2"),), ("cpu", "cpu"), chunks=4, schedule="gpipe",
                executor="processes")

    def run() -> float:
        started = time.perf_counter()
        distributed.run_processes(model, {"input_ids": ids}, plan, target=ids, loss_fn=loss, warmup=0)
        return time.perf_counter() - started

    first = run()
    times: dict[str, list[float]] = {"checked": [], "traced again": []}
    for _ in range(rounds):
        times["checked"].append(run())
        distributed._checked.clear()
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
    parser.add_argument("--traced-rerun", action="store_true",
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
    if args.traced_rerun:
        traced_rerun(args.rounds)


if __name__ == "__main__":
    main()
