"""The training parts of a step — its loss, optimizer and target — resolved once, where they enter.

A step trains on ``loss_fn(output, target)`` and ends with ``optimizer(parameters).step()``; the
user may give neither. :meth:`Training.of` fills in what was not given, once, where the user's
choices enter (the explorer, :func:`~pipexplore.executors.step.run_step`, the processes executor,
a torchrun run, the profilers), and every executor, profiler and export reads the one
:class:`Training` value it made. No reader has a default of its own, so a step's loss and
optimizer are the same wherever it runs, is profiled or is exported.

- :func:`synthetic_loss` is the loss without a ``loss_fn``: timing a step needs a scalar to
  differentiate, not a meaningful objective, so it is the mean square of every floating tensor the
  model returns, however nested (tuples, lists, dicts: a Hugging Face ``ModelOutput`` too).
- :data:`default_optimizer` is the optimizer without an ``optimizer``: SGD, lr 0.01.

Example::

    training = Training.of(loss_fn=None, optimizer=None, target=None)   # the defaults
    loss = training.loss_fn(model(batch), training.target)   # model(batch).logits.float().pow(2).mean() for a causal LM
    loss.backward()
    training.optimizer(model.parameters()).step()
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from pipexplore import validate
from pipexplore.samples import tensors_in

__all__ = ["LossFn", "OptimizerFactory", "synthetic_loss", "default_optimizer", "Training"]

#: ``loss_fn(output, target)``: the loss of a step, a scalar tensor to differentiate.
LossFn = Callable[[Any, Any], torch.Tensor]
#: ``optimizer(parameters)``: the optimizer each stage steps over its parameters.
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


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


#: The optimizer a step makes where the user gives none: SGD, lr 0.01 (a ``torch.optim`` class and its
#: keywords, so that what reads an optimizer's kind, e.g. its state per parameter, reads this one too).
default_optimizer: OptimizerFactory = functools.partial(torch.optim.SGD, lr=0.01)


@dataclass(frozen=True, eq=False)
class Training:
    """What a step trains on beside its model and sample: the loss, the optimizer and the target,
    each the user's or the default. Made by :meth:`of` where the user's choices enter (the one
    place a default is filled in); read, never completed, by everything after.

    Example::

        training = Training.of(loss_fn=nn.functional.mse_loss, target=y)
        training.optimizer is default_optimizer and training.given_loss     # True
    """

    #: ``loss_fn(output, target)``: the step's loss (default :func:`synthetic_loss`).
    loss_fn: LossFn
    #: ``optimizer(parameters)``: each stage's optimizer (default :data:`default_optimizer`).
    optimizer: OptimizerFactory
    #: What ``loss_fn`` compares the output with: a tensor of one row per sample row, anything
    #: ``loss_fn`` takes, or None.
    target: Any

    @classmethod
    def of(cls, loss_fn: Optional[LossFn] = None, optimizer: Optional[OptimizerFactory] = None, target: Any = None,
           *, rows: Optional[int] = None) -> Training:
        """The user's parts, checked, with the default for each one not given (None). ``rows``: the
        sample's, which a target tensor must match. The parts of a ``Training`` give it back as it
        was: ``Training.of(t.loss_fn, t.optimizer, t.target)`` has ``t``'s parts.

        Raises:
            TypeError, ValueError: naming the part that is wrong, and what it should be.
        """
        if rows is not None:
            validate.target(target, rows)
        validate.optional_callable(loss_fn, "loss_fn", "loss_fn(output, target)")
        validate.optional_callable(optimizer, "optimizer", "optimizer(parameters) returning a torch.optim.Optimizer")
        return cls(synthetic_loss if loss_fn is None else loss_fn,
                   default_optimizer if optimizer is None else optimizer, target)

    @property
    def given_loss(self) -> bool:
        """Whether the loss is the user's, not the synthetic one (the explorer says which it times)."""
        return self.loss_fn is not synthetic_loss

    def schedule_target(self, rows: int) -> Any:
        """The target as torch's pipelining schedules take it, which always hand the loss one: the
        given target, else a zero per sample row (what the synthetic loss ignores)."""
        return self.target if self.target is not None else torch.zeros(rows, 1)

    def keywords(self) -> dict[str, Any]:
        """The parts as the keywords ``run_step``, ``run_processes`` and ``profile_model`` take."""
        return {"loss_fn": self.loss_fn, "optimizer": self.optimizer, "target": self.target}
