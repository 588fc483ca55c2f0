"""Small models for the notebooks, the tests and exported scripts: importable, so that spawned
processes (and ``torchrun``) can rebuild them.

- :class:`TinyTransformer`: embedding, blocks with a residual stream, final norm, a head that may
  be tied to the embedding; :func:`build_model`, :func:`get_batch` and :func:`loss_fn` are the hooks
  an exported torchrun script imports.
- :class:`BranchyTransformer`: data-dependent control flow, which cannot be traced.
- :func:`unet`: a U-Net-like ``nn.Sequential`` with nested skip connections.
- :class:`SleepLayer`: sleeps known times in forward, on the input-gradient path and on the
  weight-gradient path, so schedules can be measured against their formulas on any laptop.
"""
from __future__ import annotations

import time
from typing import cast

import torch
from torch import nn

from pipexplore.skip import Namespace, Skippable, pop, skippable, stash

__all__ = ["TinyTransformer", "BranchyTransformer", "build_model", "get_batch", "loss_fn", "unet", "SleepLayer",
           "RowCostLayer", "VOCAB", "WIDTH", "DEPTH", "SEQ"]

VOCAB, WIDTH, DEPTH, SEQ = 64, 32, 4, 8


class Block(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = DEPTH, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class BranchyTransformer(TinyTransformer):
    """Takes a branch on a tensor's value: torch's tracer cannot capture it as one graph."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if x.sum() > 0:
            x = self.layers[0](x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyTransformer(tied=False)


def get_batch(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=generator)
    return tokens, torch.roll(tokens, -1, dims=1)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


@skippable(stash=["skip"])
class Down(nn.Module):
    """A linear layer whose activation is also stashed for the matching :class:`Up`."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        y = torch.relu(self.linear(x))
        yield stash("skip", y)
        return y


@skippable(pop=["skip"])
class Up(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        skip = yield pop("skip")
        return torch.relu(self.linear(x)) + skip


def unet(width: int = 64, depth: int = 3, features: int = 16) -> nn.Sequential:
    """``Linear, Down×depth, Linear, Up×depth, Linear``: skips nested like a U-Net's."""
    spaces = [Namespace() for _ in range(depth)]
    # cast: @skippable makes Down and Up Skippables, which mypy cannot see (it keeps a decorated class as written)
    return nn.Sequential(
        nn.Linear(features, width),
        *[cast(Skippable, Down(width)).isolate(ns) for ns in spaces],
        nn.Linear(width, width),
        *[cast(Skippable, Up(width)).isolate(ns) for ns in reversed(spaces)],
        nn.Linear(width, features),
    )


class _SleepIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):  # type: ignore[override]
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


class SleepLayer(nn.Module):
    """Sleeps ``forward`` seconds in forward, ``input_grad`` on the input's gradient path and
    ``weight_grad`` on the weight's: a layer of known cost, like a GPU kernel that leaves the host free."""

    def __init__(self, forward: float, input_grad: float, weight_grad: float) -> None:
        super().__init__()
        self.seconds = (forward, input_grad, weight_grad)
        self.gain = nn.Parameter(torch.ones(()))  # keeps the input path in backward on the first stage too
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        forward, input_grad, weight_grad = self.seconds
        time.sleep(forward)
        return _SleepIdentity.apply(x * self.gain, input_grad) * _SleepIdentity.apply(self.scale, weight_grad)


class RowCostLayer(nn.Module):
    """Sleeps ``per_call + per_row · n`` seconds in forward and twice that in backward on a
    micro-batch of ``n`` rows: a layer whose cost is a known line in the micro-batch size."""

    def __init__(self, per_call: float, per_row: float) -> None:
        super().__init__()
        self.per_call, self.per_row = per_call, per_row
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seconds = self.per_call + self.per_row * x.size(0)
        time.sleep(seconds)
        return _SleepIdentity.apply(x * self.gain, 2 * seconds)
