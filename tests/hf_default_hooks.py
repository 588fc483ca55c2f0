"""A Hugging Face GPT-2 from its default config (only the sizes changed: ``use_cache=True`` and
sdpa attention as they come), and the torchrun hooks of tests/test_hf_defaults.py's exported script."""
from __future__ import annotations

import logging

import torch
import transformers

logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 96


def gpt2() -> torch.nn.Module:
    """Default GPT-2, tiny; in eval mode: its default dropout off, so that losses compare."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    return transformers.GPT2LMHeadModel(config).eval()


def logits_loss(output, target):
    """Next-token cross-entropy of the logits, read by key from the model's output."""
    logits = output["logits"]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


# ---- the exported script's hooks -----------------------------------------------------------------
def build_model() -> torch.nn.Module:
    return gpt2()


def get_batch():
    """Keyword inputs, as a Hugging Face model takes them: the ids and their attention mask (the
    last sample's last two tokens padding)."""
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[-1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}, ids


def loss_fn(output, target):
    """The last stage's output as torch's schedule hands it (the flat outputs: the logits first),
    or the model's ModelOutput."""
    logits = output if torch.is_tensor(output) else output[0]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
