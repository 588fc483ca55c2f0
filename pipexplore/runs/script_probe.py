"""What a mesh's ranks cost here beyond their layers, measured through the exported script before its first run.

A plan with a mesh runs on this machine as the exported ``torchrun`` script's ranks, forked from the
session's fork server (:mod:`pipexplore.runs.forked`). Beside the layers, a step of theirs pays
torch's pipelining runtime, the data-parallel wrapping (FSDP2's ``fully_shard`` or DDP's
``replicate``: hooks around every forward and backward, work tensor by tensor at the step's end),
the recorder, gloo over loopback, and the mesh's every rank asking for this machine's cores. The
processes executor's probe (:func:`pipexplore.executors.probe.probe`) runs torch's pipelining
runtime alone, in a pool of ranks the mesh's runs never use: on notebook 07's pp 2 × dp 2 FSDP2 mesh
it left the first prediction 61–67 % short, a run of the script on layers that compute nothing
taking longer than the whole predicted step.

Here the script itself runs, forked as the plan's runs are, on stages that keep their ranks
computing as long as the plan's own actions do (:class:`~pipexplore.executors.probe.BusyLayer`,
:func:`~pipexplore.executors.probe.busy_seconds`), each holding as many parameter tensors as the
plan's stages hold, trained by the plan's optimizer, for the warm-up and measured steps a run of the
plan takes (:func:`~pipexplore.runs.roundtrip.torchrun_result`'s; its median step kept).
Each action's span beyond its layer's seconds is the executor's overhead for its phase; the
dispatch gap is the median's; and the hand-over is the one with which the simulator reproduces the
measured step (:meth:`~pipexplore.predict.costs.Corrections.step_fitted`, the fit a run's learning
makes), so that the waits of ranks sharing cores and the step's data-parallel work are on the
critical path as the run will have them.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from pipexplore.executors.probe import BusyLayer, action_overheads, busy_seconds, busy_table, fitted_transfer
from pipexplore.plan import Plan
from pipexplore.predict.costs import handoff_gaps
from pipexplore.training import OptimizerFactory

__all__ = ["script_probe", "parameter_tensors", "TIMEOUT"]

#: Seconds the probe's run may take, its ranks' start included.
TIMEOUT = 60.0


def _mean(output: torch.Tensor, target: Any) -> torch.Tensor:
    return output.mean()


def script_probe(plan: Plan, *, tensors: int = 2, optimizer: Optional[OptimizerFactory] = None,
                 timeout: float = TIMEOUT) -> tuple[dict[str, float], float, float]:
    """``(overhead, gap, transfer)`` of ``plan``'s executor as :func:`pipexplore.executors.probe.probe`
    returns them, measured by running the exported script's ranks forked here (the module
    docstring) on busy stages of ``tensors`` parameter tensors each, trained by ``optimizer`` (a
    factory; None: the script's default).

    Raises:
        ValueError: a plan the script cannot run (:func:`~pipexplore.runs.roundtrip.torchrun_result`).
        pipexplore.runs.launch.TorchrunError: a rank failed or the run outlasted ``timeout``.
    """
    from pipexplore.executors import pool
    from pipexplore.runs.roundtrip import torchrun_result

    if pool.fork_server(None) is None:  # (under torchrun's agent instead, a probe would take ten seconds)
        raise RuntimeError("the exported script's ranks cannot be forked here")
    stages, chunks = plan.num_stages, plan.chunks
    seconds = busy_seconds(plan)
    layers = nn.Sequential(*[BusyLayer(*seconds, tensors=tensors) for _ in range(stages)])
    busy = Plan(busy_table(stages, chunks, seconds), splits=tuple(range(1, stages)), devices=plan.devices,
                chunks=chunks, checkpoint=plan.checkpoint, schedule=plan.schedule, virtual_stages=plan.virtual_stages,
                executor=plan.executor, batch=chunks, mesh=plan.mesh, data_parallel=plan.data_parallel,
                reshard_after_forward=plan.reshard_after_forward)
    result = torchrun_result(layers, torch.randn(chunks, 1), busy, nodes=1, loss_fn=_mean, optimizer=optimizer,
                             timeout=timeout, forked=True)
    measured = result.timeline
    overhead = action_overheads(measured, busy.schedule, {"forward": seconds[0], "backward": seconds[1]})
    gap, transfer = handoff_gaps(measured)
    gap, transfer = float(gap or 0.0), float(transfer or 0.0)
    return overhead, gap, fitted_transfer(busy, overhead, gap, transfer, measured)


def parameter_tensors(model: nn.Module, stages: int) -> int:
    """The parameter tensors a stage of ``model`` holds on ``stages`` stages (the whole model's, shared
    alike; at least two: a busy stage's own)."""
    return max(2, int(np.ceil(sum(1 for _ in model.parameters()) / max(1, stages))))
