"""pipexplore.GPipe vs torchgpipe 0.0.7: the same model, balance, chunks and devices, interleaved.

torchgpipe is not a dependency: run ``make bench`` (it builds ``.venv-bench`` with torchgpipe 0.0.7)
or install it yourself. Prints one line per case: median step time (forward + backward) of each
and the ratio torchgpipe / pipexplore (> 1: pipexplore is faster).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
from torch import nn

from common import interleaved, machine

try:
    import torchgpipe
except ImportError:
    sys.exit("torchgpipe is not installed: `make bench` sets up .venv-bench with torchgpipe==0.0.7")

import pipexplore


class Sleep(nn.Module):
    """A layer that takes a known time (like a kernel that leaves the host free)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        time.sleep(self.seconds)
        return x * self.scale


def mlp(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def cases(devices: list[str]):
    n = len(devices)
    yield "sleep 4 layers x 10 ms", nn.Sequential(*[Sleep(0.010) for _ in range(4)]), [4 // n] * n, 8, torch.ones(32, 1)
    yield "MLP 8x(1024 Linear+GELU)", mlp(1024, 8), [16 // n] * n, 4, torch.randn(256, 1024)
    yield "MLP 16x(256 Linear+GELU)", mlp(256, 16), [32 // n] * n, 8, torch.randn(512, 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", default="cpu,cpu", help="comma-separated, one per partition")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--checkpoint", default="except_last")
    args = parser.parse_args()
    devices = args.devices.split(",")
    print(f"machine: {machine()}; torchgpipe {torchgpipe.__version__}")
    print(f"devices={devices} checkpoint={args.checkpoint} repeats={args.repeats} (median, interleaved)")
    print(f"{'case':28} {'pipexplore':>11} {'torchgpipe':>11} {'ratio':>7}")
    for name, model, balance, chunks, x in cases(devices):
        ours = pipexplore.GPipe(copy.deepcopy(model), balance, devices=devices, chunks=chunks,
                                checkpoint=args.checkpoint)
        theirs = torchgpipe.GPipe(copy.deepcopy(model), balance, devices=devices, chunks=chunks,
                                  checkpoint=args.checkpoint)
        x = x.to(ours.devices[0])

        def step(pipe):
            return lambda: pipe(x).sum().backward()

        t = interleaved({"ours": step(ours), "theirs": step(theirs)}, args.repeats)
        print(f"{name:28} {t['ours'] * 1e3:9.1f}ms {t['theirs'] * 1e3:9.1f}ms {t['theirs'] / t['ours']:7.2f}")


if __name__ == "__main__":
    main()
