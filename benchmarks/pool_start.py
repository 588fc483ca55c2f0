"""Starting a pool of rank processes: forked by the fork server vs started as new interpreters.

A pool is started when the first processes run begins and again after every failure, timeout,
interrupt or cancel (the pool is discarded then). Each round starts a pool of ``--ranks`` ranks,
runs one trivial job on it, and discards it, the two ways interleaved (server, interpreters,
server, …): wall seconds from the start to the job's replies, and the CPU seconds the ranks spent
getting there (read from each rank just before it is stopped). The fork server's own start (one
per session: it imports torch once) is reported apart.

Usage::

    python benchmarks/pool_start.py --rounds 5 --ranks 2
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--devices", default="", help="ignored (the other benchmarks' option)")
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


if __name__ == "__main__":
    main()
