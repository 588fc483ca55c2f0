"""Run one real training step of a Plan and measure it: picks the executor (``pipexplore.executors``)."""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from pipexplore.executors import autograd, backends, processes, threads
from pipexplore.executors.base import RunResult, StepJob
from pipexplore import background, validate
from pipexplore.samples import Sample, batch_size
from pipexplore.plan import Plan
from pipexplore.training import LossFn, OptimizerFactory, Training

__all__ = ["RunResult", "run_step", "executor_for"]


def executor_for(model: nn.Module, plan: Plan) -> Any:
    """The executor module that runs ``plan`` for ``model``."""
    if plan.schedule == "async-backends" and plan.executor != "processes":
        return backends
    if not isinstance(model, nn.Sequential) and plan.executor != "processes":
        try:
            from pipexplore.executors import traced as traced_executor
        except ImportError:
            raise ValueError(f"{type(model).__name__} is not an nn.Sequential: it runs split by torch's tracer in "
                             "processes; choose executor='processes'") from None
        return traced_executor
    return {"threads": threads, "autograd": autograd, "processes": processes}[plan.executor]


def run_step(model: nn.Module, sample: Sample, plan: Plan, *, target: Any = None,
             loss_fn: Optional[LossFn] = None, optimizer: Optional[OptimizerFactory] = None,
             warmup: int = 1, run: Any = 0, repeats: int = 3, timeout: Optional[float] = None) -> RunResult:
    """Train a copy of ``model`` for ``warmup`` steps as ``plan`` says, then measure ``repeats``
    more and keep the step of median time.

    ``plan.executor`` picks how: ``threads`` (the schedule executor, any schedule), ``autograd``
    (the ``GPipe`` module) or ``processes`` (one process per stage, ``torch.distributed.pipelining``);
    schedule ``async-backends`` serves the stages as expert backends. The user's model is never
    changed: the step runs on a deep copy placed on the plan's devices. ``loss_fn(output, target)``
    defines the loss (default: :func:`pipexplore.training.synthetic_loss`); ``optimizer(parameters)``
    makes the optimizer (default: :data:`pipexplore.training.default_optimizer`, SGD with lr 0.01):
    resolved here, once, into the :class:`~pipexplore.training.Training` every executor reads.
    ``timeout`` (seconds, executor ``processes`` only) bounds the steps in the worker processes; by
    default :func:`pipexplore.executors.distributed.default_timeout` derives it from the predicted step.

    ``result.loss`` is the first step's (at the model's weights, before any optimizer step: the
    unsplit model's loss on this batch), ``result.measured_losses`` the measured steps'. Under
    :func:`pipexplore.cancel.cancel_scope`, a cancelled token stops the run (worker threads after
    their current action, worker processes terminated) and raises
    :class:`~pipexplore.cancel.Cancelled`; a KeyboardInterrupt gets the same cleanup before it propagates.

    Example::

        result = run_step(model, sample, Plan(table, splits=(4,), chunks=4, executor="threads"))
        result.metrics["step_time"], result.timeline
    """
    # Every executor runs exactly the plan's micro-batches, or none: the same refusal for all of them.
    validate.chunks_for_batch(plan.chunks, batch_size(validate.sample(sample)))
    training = Training.of(loss_fn, optimizer, target)
    background.wait()  # nothing is timed beside pipexplore's background imports
    job = StepJob(model, sample, plan, training, warmup=warmup, run=run, repeats=repeats, timeout=timeout)
    executor = executor_for(model, plan)
    if timeout is not None and executor is not processes:
        raise ValueError(f"timeout={timeout!r} bounds runs in worker processes (executor='processes'); executor "
                         f"{plan.executor!r} runs in this process: leave timeout out, or choose executor='processes'")
    return executor.run(job)  # type: ignore[no-any-return]
