"""The synthetic loss: what a step is trained on when the user gives no ``loss_fn``.

Timing a step needs a scalar to differentiate, not a meaningful objective: the mean square of
every floating tensor the model returns, however nested (tuples, lists, dicts: a Hugging Face
``ModelOutput`` too). The profile, the meta-device count, the block timing of a traced model and
every executor use this one function, so a step's loss is the same wherever it runs.

Example::

    loss = synthetic_loss(model(batch))   # model(batch).logits.float().pow(2).mean() for a causal LM
    loss.backward()
"""
from __future__ import annotations

from typing import Any

import torch

from pipexplore.microbatch import tensors_in

__all__ = ["synthetic_loss"]


def synthetic_loss(output: Any, target: Any = None) -> torch.Tensor:
    """Sum over the floating tensors of ``output`` of each one's mean square (``target`` is
    ignored: the signature is a ``loss_fn``'s).

    Raises:
        TypeError: the output holds no floating tensor to make a loss of.
    """
    floating = [t for t in tensors_in(output) if t.is_floating_point()]
    if not floating:
        raise TypeError(f"the synthetic loss (no loss_fn given) needs a floating tensor in the model's output, got "
                        f"{type(output).__name__}: pass loss_fn=..., e.g. lambda output, target: output.loss")
    return sum(t.float().pow(2).mean() for t in floating)  # type: ignore[return-value]
