"""A small transformer for the tracing tests and the exported torchrun script's hooks.

Embedding, blocks with a residual stream, a final norm and a head tied to the embedding.
``build_model``, ``get_batch`` and ``loss_fn`` are the hooks an exported script imports.
"""
from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH, DEPTH, SEQ = 64, 32, 4, 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
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

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class Branchy(TinyTransformer):
    """Data-dependent control flow: cannot be traced."""

    def forward(self, tokens):
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
