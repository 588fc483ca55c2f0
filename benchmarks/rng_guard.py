"""What ``pipexplore.rng_guard.RNGGuard`` costs a forward on the CPU: a two-layer
``nn.TransformerEncoderLayer(128, 4, 256, dropout=p)`` (batch 4 × 64, training mode) at dropout 0.0
and 0.1, each forward timed with and without the guard, interleaved (A B B A …, medians).

The guard is the one a pipeline gives a partition that shares the CPU with another
(``rng_locks``), taught by one forward first, as a pipeline's first micro-batch teaches it:

- ``forward``: with autograd, as a pipeline's forward that is not checkpointed; guarded by
  ``guard.drawing()`` (on a CPU, once the guard knows whether the partition draws, a forward as
  without a guard: nothing swaps a stream's states into the CPU's generator, so no draw takes a lock);
- ``checkpointed``: under ``no_grad``, as a checkpointed forward; guarded by
  ``guard.checkpointed()`` (a stream of its own, seeded from the shared generator).

Each round calls the contenders in turn, in the reverse order every other time, and prints the
medians and their ratio (guarded / plain: 1.00 costs nothing); the summary gives the ratios' min and
median over the rounds, side by side for the two dropouts, and the same of the rounds' fastest
calls (on a machine shared with other work, the fastest call is the one least disturbed).

Usage::

    python benchmarks/rng_guard.py --rounds 5 --repeats 200
    python benchmarks/rng_guard.py --threads 1    # steadier on a machine shared with other work
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import deque
from typing import Callable

import torch
from torch import nn

from common import machine
from pipexplore.rng_guard import RNGGuard, rng_locks

DROPOUTS = (0.0, 0.1)


def encoder(dropout: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.TransformerEncoderLayer(128, 4, 256, dropout=dropout) for _ in range(2)])


def contenders(model: nn.Module, x: torch.Tensor, guard: RNGGuard) -> dict[str, Callable[[], object]]:
    def plain() -> None:
        model(x)

    def drawing() -> None:
        with guard.drawing():
            model(x)

    def plain_nograd() -> None:
        with torch.no_grad():
            model(x)

    def checkpointed() -> None:
        with guard.checkpointed(deque()), torch.no_grad():
            model(x)

    return {"forward": plain, "forward guarded": drawing,
            "checkpointed": plain_nograd, "checkpointed guarded": checkpointed}


def guard_for(model: nn.Module) -> RNGGuard:
    """The guard a pipeline gives ``model`` sharing the CPU with another partition."""
    guard = rng_locks([model, nn.Identity()], [torch.device("cpu")] * 2)[0]
    assert guard is not None
    return guard


def timed(contenders: dict[str, Callable[[], object]], repeats: int, warmup: int = 5) -> dict[str, list[float]]:
    """Seconds of each call of each contender, called in turn (reversed every other time)."""
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else reversed(names):
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    return times


def one_round(repeats: int, make_guard: Callable[[nn.Module], RNGGuard] = guard_for
              ) -> dict[float, dict[str, float]]:
    """Per dropout: each contender's median seconds, and its fastest call's (``… fastest``)."""
    result = {}
    for dropout in DROPOUTS:
        model = encoder(dropout).train()
        x = torch.randn(4, 64, 128)
        guard = make_guard(model)
        with guard.drawing():  # the first forward teaches the guard whether the partition draws
            model(x)
        figures: dict[str, float] = {}
        for name, seconds in timed(contenders(model, x, guard), repeats).items():
            figures[name], figures[f"{name} fastest"] = statistics.median(seconds), min(seconds)
        figures["draws"] = float(bool(guard.draws))
        result[dropout] = figures
    return result


def summarize(rounds: list[dict[float, dict[str, float]]]) -> None:
    print("\nguarded / plain, min and median over the rounds:")
    header = "".join(f"{f'dropout {d}':>24}" for d in DROPOUTS)
    print(f"{'':<30}{header}")
    for phase in ("forward", "checkpointed"):
        for figure, suffix in (("medians", ""), ("fastest calls", " fastest")):
            cells = []
            for dropout in DROPOUTS:
                ratios = [r[dropout][f"{phase} guarded{suffix}"] / r[dropout][f"{phase}{suffix}"] for r in rounds]
                cells.append(f"{min(ratios):>12.3f} {statistics.median(ratios):>11.3f}")
            print(f"{f'{phase} ({figure})':<30}" + "".join(f"{c:>24}" for c in cells))
    for dropout in DROPOUTS:
        def ms(name: str) -> float:
            return statistics.median(r[dropout][name] for r in rounds) * 1e3

        print(f"dropout {dropout}: forward {ms('forward'):.3f} ms, guarded {ms('forward guarded'):.3f} ms "
              f"(fastest {ms('forward fastest'):.3f} / {ms('forward guarded fastest'):.3f} ms; medians of the "
              f"rounds); the guard draws: {bool(rounds[-1][dropout]['draws'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=200, help="calls of each contender a round")
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine(), f"intra-op threads {torch.get_num_threads()}")
    rounds = []
    for i in range(args.rounds):
        result = one_round(args.repeats)
        rounds.append(result)
        for dropout, medians in result.items():
            print(f"round {i + 1} dropout {dropout}: "
                  f"forward {medians['forward'] * 1e3:.3f} / {medians['forward guarded'] * 1e3:.3f} ms "
                  f"({medians['forward guarded'] / medians['forward']:.3f}), "
                  f"checkpointed {medians['checkpointed'] * 1e3:.3f} / {medians['checkpointed guarded'] * 1e3:.3f} ms "
                  f"({medians['checkpointed guarded'] / medians['checkpointed']:.3f})")
    summarize(rounds)


if __name__ == "__main__":
    main()
