"""The explorer's two ways in for a run made under ``torchrun``: load a directory (:func:`load_result`)
or export, launch node agents here and load what they recorded (:func:`torchrun_result`) — the
same path a cluster takes (or, for a run on this machine alone, its ranks forked here with the
environment torchrun gives them: :mod:`pipexplore.runs.forked`).

Example::

    result = torchrun_result(model, sample, plan, nodes=2, run=4)       # 2 agents × 2 ranks here
    result = load_result("runs/7", layer_table, plan, samples=64, run=5)
"""
from __future__ import annotations

import pathlib
import shutil
import tempfile
from typing import Any, Callable, Optional

import pandas as pd
import torch

from pipexplore.cancel import check_cancelled
from pipexplore.executors.base import RunResult, result
from pipexplore.executors.distributed import default_timeout
from pipexplore.samples import batch_size
from pipexplore.models.trace import SCHEDULE_CLASSES
from pipexplore.plan import Plan
from pipexplore.runs.launch import HOOKS_MODULE, TorchrunError, launch, printed_losses, write_hooks
from pipexplore.runs.load import RunDirectoryError, plan_of, read_run, run_result
from pipexplore.runs.record import PLAN_FILE
from pipexplore.schedules import is_csv
from pipexplore.splits import shared_parameters
from pipexplore.training import LossFn, OptimizerFactory, Training

__all__ = ["load_result", "torchrun_result", "STARTUP_SECONDS", "holds_traces"]

#: Seconds the node agents may take to start, meet and trace the model, beside the steps' own timeout.
STARTUP_SECONDS = 180.0


def holds_traces(directory: pathlib.Path) -> bool:
    """Whether ``directory`` holds profiler traces (``*.json``, ``*.json.gz``) and no recorded run."""
    if (directory / PLAN_FILE).exists() or any(directory.glob("rank-*.json")):
        return False
    return any(directory.glob("*.json")) or any(directory.glob("*.json.gz"))


def load_result(directory: Any, layer_table: pd.DataFrame, plan: Plan, *, samples: int,
                run: Any = 0) -> tuple[Plan, RunResult]:
    """Read ``directory`` whole (:func:`~pipexplore.runs.load.read_run`) and give the plan it ran
    (rebuilt on ``layer_table`` from ``plan``) and its result. A directory of ``torch.profiler``
    traces (and no recorded run) is read by :mod:`pipexplore.runs.kineto` where it is installed,
    against ``plan``.

    Raises:
        FileNotFoundError: no such directory.
        RunDirectoryError: what :func:`~pipexplore.runs.load.read_run` refuses, or traces with no reader.
    """
    path = pathlib.Path(directory)
    if path.is_dir() and holds_traces(path):
        try:
            from pipexplore.runs import kineto  # type: ignore[attr-defined]
        except ImportError:
            raise RunDirectoryError(f"{path} holds profiler traces (*.json) but no recorded run ({PLAN_FILE}, "
                                    "rank-*.json); this pipexplore has no reader of profiler traces "
                                    "(pipexplore.runs.kineto)") from None
        timeline = kineto.read_traces(path, run=run)
        out = result(plan, timeline, float("nan"), torch.empty((samples, 0)), set(), executor="torchrun")
        out.metrics.update(executor="torchrun", directory=str(path), source="profiler traces")
        return plan, out
    recorded = read_run(path)
    ran = plan_of(recorded, layer_table, plan)
    return ran, run_result(recorded, ran, samples=samples, run=run)


def torchrun_result(model: torch.nn.Module, sample: Any, plan: Plan, *, nodes: int, target: Any = None,
                    loss_fn: Optional[LossFn] = None, optimizer: Optional[OptimizerFactory] = None,
                    run: Any = 0, warmup: int = 2, repeats: int = 10, timeout: Optional[float] = None,
                    progress: Optional[Callable[[str], None]] = None, keep: Optional[Any] = None,
                    tp_plan: Optional[dict[str, str]] = None, forked: bool = False) -> RunResult:
    """Export ``plan`` as the ``torchrun`` script, run it under ``nodes`` node agents on this
    machine (``plan.num_devices / nodes`` ranks each, gloo on CPUs) with ``--record``, and load the
    run: ``warmup`` steps, then ``repeats`` measured, the median kept (as every executor does; the
    agents' start-up costs seconds and a step milliseconds, so it measures more steps than a local run).

    The model, batch, ``loss_fn`` and ``optimizer`` factory (resolved here, once:
    :meth:`pipexplore.training.Training.of`) travel by value (cloudpickle) in a hooks module written
    to a temporary directory, removed afterwards (``keep``: a directory to record into and keep
    instead). ``timeout``: seconds for the whole run (default: :data:`STARTUP_SECONDS` plus the
    processes executor's default for the steps).
    ``metrics['printed_losses']`` holds each step's loss as the script printed it. A plan with a
    mesh runs all its ranks (``tp_plan``: the tensor-parallel plan it was counted with), each
    replica on the sample. ``forked``: the ranks forked here with torchrun's environment
    (:func:`~pipexplore.runs.forked.launch_forked`; ``nodes`` 1), not started by its agents.

    Raises:
        ValueError: a plan or sample the exported script cannot run (a parameter tied across stages
            beside data or tensor parallelism, before any process starts), or ``nodes`` not
            dividing its ranks.
        pipexplore.runs.launch.TorchrunError: a rank failed (named: rank, its place in a mesh, host, exit
            code) or the run timed out.
        pipexplore.cancel.Cancelled: cancelled; every agent and rank is stopped, nothing is loaded.
    """
    training = Training.of(loss_fn, optimizer, target)
    world = plan.mesh_or_pipeline.size
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or world % nodes:
        raise ValueError(f"nodes must be a whole number that divides the plan's {world} ranks, got {nodes!r}")
    if forked and nodes != 1:
        raise ValueError(f"forked ranks run on this one machine, as one node: nodes must be 1, got {nodes}")
    if not is_csv(plan.schedule) and plan.schedule not in SCHEDULE_CLASSES:
        raise ValueError(f"the torchrun script runs {', '.join(SCHEDULE_CLASSES)} or a CSV schedule; not "
                         f"{plan.schedule!r}")
    if plan.schedule == "1f1b" and plan.chunks < plan.num_stages:
        raise ValueError(f"torch's Schedule1F1B needs at least as many micro-batches as stages: chunks "
                         f"{plan.chunks} < {plan.num_stages} stages")
    if isinstance(model, torch.nn.Sequential) and not torch.is_tensor(sample):
        raise ValueError(f"an nn.Sequential takes one tensor as its input, not a {type(sample).__name__}")
    rows = batch_size(sample)  # a traced model's inputs may be a tensor, a tuple or a dict (the script cuts each)
    if rows % plan.chunks:
        raise ValueError(f"torch pipelining splits the batch evenly: {rows} rows do not divide into "
                         f"{plan.chunks} chunks")
    mesh = plan.mesh
    tied = shared_parameters(plan.layer_table, plan.splits) if mesh is not None and (mesh.dp > 1 or mesh.tp > 1) else {}
    if tied:  # (the script's ranks would refuse it too, once started)
        named = "; ".join(f"{name} (stages {', '.join(map(str, stages))})" for name, stages in tied.items())
        raise ValueError(f"{type(model).__name__} ties {named} across stages (an embedding and its head): their "
                         f"gradients are summed between pipeline ranks, which the script does not do beside tensor "
                         f"or data parallelism; untie them (tie_word_embeddings=False) or plan dp=1 and tp=1")
    from pipexplore.export.code import mesh_options
    from pipexplore.export.torchrun import torchrun_script

    if timeout is None:
        timeout = STARTUP_SECONDS + default_timeout(plan, warmup + repeats - 1)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="pipexplore-torchrun-"))
    record = pathlib.Path(keep) if keep is not None else folder / "run"
    try:
        hooks = write_hooks(folder, model, sample, training.schedule_target(rows), training.loss_fn,
                            training.optimizer)
        assert hooks == HOOKS_MODULE
        script = folder / "train_pipeline.py"
        script.write_text(torchrun_script(plan.layer_table, list(plan.splits), hooks=hooks, chunks=plan.chunks,
                                          schedule=plan.schedule, devices=plan.num_devices, steps=warmup + repeats,
                                          device=plan.device_type, checkpoint=plan.export_checkpoint,
                                          **mesh_options(plan, tp_plan)))
        check_cancelled()
        arguments = ["--record", str(record), "--warmup", str(warmup)]
        try:
            if forked:
                from pipexplore.executors.forkserver import installed_modules
                from pipexplore.runs.forked import launch_forked

                outcome = launch_forked(script, ranks=world, args=arguments, timeout=timeout, steps=warmup + repeats,
                                        progress=progress, preload=installed_modules(model))
            else:
                outcome = launch(script, nodes=nodes, nproc_per_node=world // nodes, timeout=timeout,
                                 args=arguments, steps=warmup + repeats, progress=progress)
        except TorchrunError as failed:
            if plan.mesh is None or failed.rank is None or not 0 <= failed.rank < world:
                raise
            place = plan.mesh.place(failed.rank)  # the rank named by its place in the mesh too
            text = str(failed).replace(f"rank {failed.rank} on host", f"rank {failed.rank} ({place}) on host", 1)
            raise TorchrunError(text, failed.rank, failed.host, failed.exitcode) from None
        check_cancelled()
        recorded = read_run(record)
        ran = plan_of(recorded, plan.layer_table, plan)
        out = run_result(recorded, ran, samples=rows, run=run)
        out.metrics["printed_losses"] = printed_losses(outcome.stdout)
        out.metrics["wall_seconds"] = outcome.seconds
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)
