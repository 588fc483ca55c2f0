"""The models, data and loss of tests/test_mesh_torchrun.py, and the hooks of its exported scripts:
a Llama of tiny width built from its config (``MESH_HOOKS_MODEL=llama``, the default;
``llama-tied``: its head tied to its embedding) or an ``nn.Sequential`` (``sequential``) with its
tensor-parallel plan. Each replica of a mesh takes its
share of one global batch (``get_batch(replica=, replicas=)``)."""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
import transformers
from torch import nn

logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, ROWS, TOKENS, WIDTH = 128, 8, 16, 16
#: The Sequential's tensor-parallel plan (a Llama carries its own: its config's base_model_tp_plan).
SEQUENTIAL_TP_PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}


def kind() -> str:
    return os.environ.get("MESH_HOOKS_MODEL", "llama")


def build_model() -> nn.Module:
    torch.manual_seed(0)
    if kind() == "sequential":
        return nn.Sequential(nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 32),
                             nn.Tanh(), nn.Linear(32, 4))
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64, tie_word_embeddings=kind() == "llama-tied")
    return transformers.LlamaForCausalLM(config)


def global_batch(replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``replicas`` replicas' batches, one after another."""
    generator = torch.Generator().manual_seed(1)
    if kind() == "sequential":
        x = torch.randn(ROWS * replicas, WIDTH, generator=generator)
        return x, torch.randn(ROWS * replicas, 4, generator=generator)
    ids = torch.randint(0, VOCAB, (ROWS * replicas, TOKENS), generator=generator)
    return ids, ids


def get_batch(replica: int = 0, replicas: int = 1):
    inputs, target = global_batch(replicas)
    return inputs.chunk(replicas)[replica], target.chunk(replicas)[replica]


def loss_fn(output, target):
    if kind() == "sequential":
        return F.mse_loss(output, target)
    return F.cross_entropy(output["logits"].flatten(0, 1), target.flatten())


def build_optimizer(parameters):
    """SGD with momentum: a parameter's steps follow its gradients, so three steps compare to the
    unsplit model's within float error (Adam divides by a gradient's running magnitude: where one is
    near zero, the last bits tensor parallelism's summation order changes become whole steps)."""
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)
