"""The hooks of tests/test_torchrun_experts.py's exported scripts: a tiny mixture of experts, its data and loss.

A Mixtral (``MOE_HOOKS_MODEL=mixtral``, the default) or a Qwen3-MoE (``qwen3_moe``) of 2 layers,
4 experts, top 2; each replica takes its share of one global batch (``get_batch(replica=, replicas=)``)."""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
import transformers
from torch import nn

logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB, ROWS, TOKENS, WIDTH, EXPERTS = 64, 4, 8, 32, 4


def kind() -> str:
    return os.environ.get("MOE_HOOKS_MODEL", "mixtral")


def build_model() -> nn.Module:
    torch.manual_seed(0)
    shape = dict(num_hidden_layers=2, hidden_size=WIDTH, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=VOCAB, max_position_embeddings=32, num_experts_per_tok=2, tie_word_embeddings=False)
    if kind() == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_experts=EXPERTS, moe_intermediate_size=48, intermediate_size=64,
                                             head_dim=8, norm_topk_prob=True, **shape)
        return transformers.Qwen3MoeForCausalLM(config)
    config = transformers.MixtralConfig(num_local_experts=EXPERTS, intermediate_size=48, **shape)
    return transformers.MixtralForCausalLM(config)


def global_batch(replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``replicas`` replicas' batches, one after another."""
    ids = torch.randint(0, VOCAB, (ROWS * replicas, TOKENS), generator=torch.Generator().manual_seed(1))
    return ids, ids


def get_batch(replica: int = 0, replicas: int = 1):
    inputs, target = global_batch(replicas)
    return inputs.chunk(replicas)[replica], target.chunk(replicas)[replica]


def loss_fn(output, target):
    return F.cross_entropy(output["logits"].flatten(0, 1), target.flatten())


def build_optimizer(parameters):
    """SGD with momentum (a parameter's steps follow its gradients, comparable within float error)."""
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)
