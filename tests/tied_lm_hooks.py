"""An embedding and an output head sharing one weight, two blocks between (no skips, so every
multi-stage schedule runs it), and the torchrun hooks of tests/test_tied.py's exported script."""
from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH = 32, 16


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def build_model() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM()


def get_batch():
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    return ids, ids


def loss_fn(output, target):
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def build_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
