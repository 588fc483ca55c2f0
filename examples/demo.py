"""Train a small U-Net-like model with skip connections through GPipe on CPU devices.

Run with ``make demo``. Prints the partitions (layers, parameters, skip routes per stage),
then trains a few steps and checks the pipelined gradients against the unsplit model.
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

from pipexplore import GPipe, examples


def unet(width: int = 64) -> nn.Sequential:
    return examples.unet(width=width, depth=2)


def describe(pipe: GPipe) -> None:
    print(f"GPipe: {len(pipe.partitions)} partitions, balance={pipe.balance}, chunks={pipe.chunks}, "
          f"checkpoint={pipe.checkpoint!r}")
    for j, (partition, device) in enumerate(zip(pipe.partitions, pipe.devices)):
        names = ", ".join(f"{name}:{type(layer).__name__}" for name, layer in partition.named_children())
        params = sum(p.numel() for p in partition.parameters())
        print(f"  stage {j} on {device}: [{names}]  {params:,} parameters")
    routes = sorted(pipe._skip_layout.by_ns_name.values())
    for src, dst in routes:
        where = "crosses partitions: a portal copies it" if src != dst else "within one partition: no copy"
        print(f"  skip route: stage {src} -> stage {dst}, {where}")


def main() -> None:
    torch.manual_seed(0)
    model = unet()
    reference = copy.deepcopy(model)
    pipe = GPipe(model, balance=[2, 3, 2], devices=["cpu", "cpu", "cpu"], chunks=4, checkpoint="except_last")
    print("model: Linear, Down, Down, Linear, Up, Up, Linear (two nested skip connections)")
    describe(pipe)

    x, target = torch.randn(64, 16), torch.randn(64, 16)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05)
    for step in range(5):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(pipe(x), target)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}  ({(time.perf_counter() - start) * 1e3:.1f} ms)")

    # The same first step without a pipeline gives the same gradients.
    check = GPipe(copy.deepcopy(reference), balance=[2, 3, 2], devices=["cpu"] * 3, chunks=4)
    nn.functional.mse_loss(check(x), target).backward()
    nn.functional.mse_loss(reference(x), target).backward()
    same = all(torch.allclose(a.grad, b.grad, atol=1e-6) for a, b in zip(check.parameters(), reference.parameters()))
    print(f"pipelined gradients equal the unsplit model's: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
