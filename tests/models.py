"""Small models the tests share: plain, U-Net-like with nested skips, tuple-in/tuple-out."""
from __future__ import annotations

import time

import torch
from torch import nn

from pipexplore.skip import Namespace, pop, skippable, stash


class StorageRef:
    """A weak reference to a tensor's memory (its storage), not just to the Python object:
    a detached alias or a same-device copy keeps the memory alive, and this sees it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._ref = tensor.untyped_storage()._weak_ref()

    def __call__(self) -> bool | None:
        return None if torch.UntypedStorage._expired(self._ref) else True


@skippable(stash=["skip"])
class StashLinear(nn.Module):
    """A linear layer whose output is also stashed (as a fresh tensor) for a later layer."""

    def __init__(self, width: int, refs: list | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.refs = refs

    def forward(self, x):
        y = self.linear(x)
        skip = y * 2
        if self.refs is not None:
            self.refs.append(StorageRef(skip))
        yield stash("skip", skip)
        return torch.tanh(y)


@skippable(pop=["skip"])
class PopLinear(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        skip = yield pop("skip")
        return self.linear(x) + skip


def plain_model(width: int = 6, depth: int = 8) -> nn.Sequential:
    layers: list[nn.Module] = []
    for k in range(depth):
        layers.append(nn.Linear(width, width))
        if k % 2:
            layers[-1] = nn.Sequential(nn.Linear(width, width), nn.Tanh())
    return nn.Sequential(*layers)


def unet_model(width: int = 6, refs: list | None = None) -> nn.Sequential:
    """Nine layers, two nested skips (outer 1→7, inner 3→5) isolated by namespaces::

        0 Linear · 1 Stash(outer) · 2 Linear · 3 Stash(inner) · 4 Linear ·
        5 Pop(inner) · 6 Linear · 7 Pop(outer) · 8 Linear
    """
    outer, inner = Namespace(), Namespace()
    return nn.Sequential(
        nn.Linear(width, width),
        StashLinear(width, refs).isolate(outer),
        nn.Linear(width, width),
        StashLinear(width, refs).isolate(inner),
        nn.Linear(width, width),
        PopLinear(width).isolate(inner),
        nn.Linear(width, width),
        PopLinear(width).isolate(outer),
        nn.Linear(width, width),
    )


class PairIn(nn.Module):
    """(a, b) → (a + b, a * b, integer labels passed through)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, input):
        a, b, labels = input
        return self.linear(a) + b, a * b, labels


class PairMix(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, input):
        s, p, labels = input
        return torch.tanh(self.linear(s)) * p, s, labels + 1


def tuple_model(width: int = 6) -> nn.Sequential:
    return nn.Sequential(PairIn(width), PairMix(width), PairMix(width), PairMix(width))


class Sleep(nn.Module):
    """Sleeps ``seconds`` in forward and notes (thread, start, end); the output depends on the input."""

    def __init__(self, seconds: float, log: list | None = None, tag: str = "") -> None:
        super().__init__()
        self.seconds = seconds
        self.log = log
        self.tag = tag
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        start = time.perf_counter()
        time.sleep(self.seconds)
        if self.log is not None:
            self.log.append((self.tag, start, time.perf_counter()))
        return x * self.scale


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SleepFB(nn.Module):
    """Sleeps ``forward`` seconds per call in forward and ``backward`` in backward (per micro-batch)."""

    def __init__(self, forward: float, backward: float) -> None:
        super().__init__()
        self.forward_seconds = forward
        self.backward_seconds = backward
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        time.sleep(self.forward_seconds)
        return _SleepBackward.apply(x * self.scale, self.backward_seconds)


from pipexplore.examples import SleepLayer as SleepFIW  # noqa: E402,F401  (layers of known cost)


def meta_llama(layers: int, *, heads: int, kv_heads: int = 4, hidden: int = 1024, ffn: int = 2816,
               vocab: int = 4096) -> nn.Module:
    """A Hugging Face Llama of these widths on the meta device (no weights): the mesh tests' model."""
    import warnings

    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(config)
