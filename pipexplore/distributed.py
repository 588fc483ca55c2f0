"""Multi-process steps: one process per rank, running ``torch.distributed.pipelining`` schedules.

The processes are started from the notebook with the ``spawn`` method and meet on a free
loopback port (gloo on CPUs, NCCL on GPUs). Each rank builds its stage(s) with ``PipelineStage``
and runs the torch schedule for the plan; it times each stage's ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` (measured, whatever labels the
schedule uses) on the host clock, which all processes on one machine share, and sends its
events back. A rank that raises or dies fails the run within ``timeout`` with that rank's
traceback; every process is reaped.

Example::

    result = run_processes(model, sample, plan)       # plan.executor == "processes"
    result.timeline                                   # every rank's events, one schema
"""
from __future__ import annotations

import copy
import io
from collections import OrderedDict
import os
import queue as queue_module
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
from torch import nn

from pipexplore.plan import Plan
from pipexplore.timeline import COLUMNS

__all__ = ["run_processes", "DistributedRunError", "SCHEDULE_CLASSES"]

SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                    "zero-bubble": "ScheduleInterleavedZeroBubble"}
MULTI_STAGE = {"ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"}


class DistributedRunError(RuntimeError):
    """A rank failed, died or hung; the message holds its traceback or exit code."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def _timed(stage: Any, spans: list, name: str, phase_of: Callable[..., str]) -> None:
    original = getattr(stage, name)

    def timed(chunk: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = original(chunk, *args, **kwargs)
        if stage.device.type == "cuda":
            torch.cuda.synchronize(stage.device)
        spans.append((stage.stage_index, str(stage.device), chunk, phase_of(*args, **kwargs), start,
                      time.perf_counter()))
        return out

    setattr(stage, name, timed)


def _worker(rank: int, world: int, port: int, job: dict[str, Any], results: Any) -> None:
    """One rank: build its stages, run ``warmup`` + 1 steps, send back the last step's events."""
    import torch.distributed as dist

    try:
        if job.get("crash_rank") == rank:
            raise RuntimeError(f"rank {rank} crashed on purpose (a test of failure handling)")
        if job.get("hang_rank") == rank:
            time.sleep(3600)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        devices = [torch.device(d) for d in job["devices"]]
        device = devices[rank]
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=job["timeout"]))
        from torch.distributed.pipelining import PipelineStage, schedules

        stages, params = [], []
        if job.get("traced") is not None:
            # A traced model: every rank traces the same split and builds its own stages from it.
            from pipexplore.trace import split

            traced = job["traced"]
            pipe = split(traced["model"], traced["mb_args"], traced["split_points"])
            num_stages = pipe.num_stages
            indices = list(range(rank, num_stages, world))
            for s in indices:
                stage = pipe.build_stage(s, device)
                params += list(stage.submod.parameters())
                stages.append(stage)
        else:
            num_stages = len(job["stages"])
            indices = list(range(rank, num_stages, world))
            for s in indices:
                module = job["stages"][s].to(device)
                params += list(module.parameters())
                stages.append(PipelineStage(module, s, num_stages, device))
        spans: list = []
        for stage in stages:
            _timed(stage, spans, "forward_one_chunk", lambda *a, **k: "forward")
            _timed(stage, spans, "backward_one_chunk",
                   lambda *a, full_backward=True, **k: "backward" if full_backward else "input_grad")
            _timed(stage, spans, "backward_weight_one_chunk", lambda *a, **k: "weight_grad")
        name = job["schedule_class"]
        cls = getattr(schedules, name)
        schedule = cls(stages if name in MULTI_STAGE else stages[0], n_microbatches=job["chunks"],
                       loss_fn=job["loss_fn"])
        optimizer = job["optimizer"](params)
        has_first, has_last = 0 in indices, num_stages - 1 in indices
        x = job["sample"].to(device)
        target = job["target"].to(device) if torch.is_tensor(job["target"]) else job["target"]
        losses: list = []
        for step in range(job["warmup"] + 1):
            optimizer.zero_grad(set_to_none=True)
            spans.clear()
            losses = []
            dist.barrier()
            kwargs: dict[str, Any] = {}
            if has_last:
                kwargs.update(target=target, losses=losses)
            if has_first:
                schedule.step(x, **kwargs)
            else:
                schedule.step(**kwargs)
            if job["return_grads"] and step == job["warmup"]:
                grads = {f"{s}.{n}": p.grad.detach().cpu() for s, st in zip(indices, stages)
                         for n, p in st.submod.named_parameters() if p.grad is not None}
            optimizer.step()
        # Plain bytes: tensors sent through the queue would be shared-memory handles that die with this process.
        buffer = io.BytesIO()
        torch.save({"spans": spans, "losses": [float(loss.detach()) for loss in losses],
                    "grads": grads if job["return_grads"] else None}, buffer)
        results.put(("ok", rank, buffer.getvalue()))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_processes(model: nn.Module, sample: torch.Tensor, plan: Plan, *, target: Any = None,
                  loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                  optimizer: Optional[Callable[[Any], torch.optim.Optimizer]] = None, run: Any = 0,
                  warmup: int = 1, timeout: float = 120.0, return_grads: bool = False,
                  _crash_rank: Optional[int] = None, _hang_rank: Optional[int] = None) -> Any:
    """Run ``warmup`` + 1 steps of ``plan`` in one process per device; measure the last.

    Returns a :class:`pipexplore.run.RunResult` whose timeline holds every rank's events
    (``device`` is the rank's device, ``stage`` the pipeline stage). With ``return_grads`` the
    parameter gradients of the measured step are in ``result.metrics['grads']`` (by
    ``'stage.param'``). The model, ``loss_fn`` and ``optimizer`` must be picklable (defined in
    an importable module, not in the notebook), as the processes are spawned.
    """
    import pandas as pd
    import torch.multiprocessing as mp

    from pipexplore.run import _result, synthetic_loss

    if plan.schedule not in SCHEDULE_CLASSES:
        raise ValueError(f"the processes executor runs {', '.join(SCHEDULE_CLASSES)}; not {plan.schedule!r}")
    traced = not isinstance(model, nn.Sequential)
    crossing = [r for r in plan.skip_routes if r.crosses]
    if crossing and not traced:
        raise ValueError("skip routes that cross stages cannot run in separate processes; move the split points "
                         "so that every stash and its pop share a stage, or trace the model")
    if not torch.is_tensor(sample):
        raise TypeError("the processes executor takes one tensor as the sample")
    if plan.schedule == "1f1b" and plan.chunks < plan.num_stages:
        raise ValueError(f"torch's Schedule1F1B needs at least as many micro-batches as stages: chunks "
                         f"{plan.chunks} < {plan.num_stages} stages")
    if sample.size(0) % plan.chunks:
        raise ValueError(f"torch pipelining splits the batch evenly: {sample.size(0)} rows do not divide into "
                         f"{plan.chunks} chunks")
    if traced:  # split by torch's tracer in every rank, at the plan's candidate blocks
        names = [str(n) for n in plan.layer_table["name"]]
        stages = []
        tracing = {"model": copy.deepcopy(model), "mb_args": (sample[: sample.size(0) // plan.chunks],),
                   "split_points": [names[s] for s in plan.splits]}
    else:
        layers = list(copy.deepcopy(model).named_children())  # stages keep the model's layer names
        points = [0, *plan.splits, len(layers)]
        stages = [nn.Sequential(OrderedDict(layers[a:b])) for a, b in zip(points, points[1:])]
        tracing = None
    world = plan.num_devices
    if target is None:  # torch's schedules want a target for the loss; the synthetic loss ignores it
        target = torch.zeros(sample.size(0), 1)
    job = {
        "stages": stages, "devices": list(plan.devices[:world]), "chunks": plan.chunks,
        "schedule_class": SCHEDULE_CLASSES[plan.schedule], "loss_fn": loss_fn or synthetic_loss,
        "optimizer": optimizer or default_optimizer, "sample": sample.detach().cpu(),
        "target": target.detach().cpu() if torch.is_tensor(target) else target, "warmup": warmup,
        "timeout": timeout, "return_grads": return_grads, "crash_rank": _crash_rank, "hang_rank": _hang_rank,
        "traced": tracing,
    }
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_worker, args=(rank, world, port, job, results), daemon=True,
                                 name=f"pipexplore-rank{rank}") for rank in range(world)]
    for process in processes:
        process.start()
    outputs: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world:
            try:
                status, rank, payload = results.get(timeout=0.2)
            except queue_module.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead:
                    raise DistributedRunError(f"{dead[0].name} died with exit code {dead[0].exitcode}") from None
                if time.monotonic() > deadline:
                    waiting = sorted(set(range(world)) - set(outputs))
                    raise DistributedRunError(f"the run timed out after {timeout:.0f} s; rank(s) {waiting} did not "
                                              "finish") from None
                continue
            if status == "error":
                raise DistributedRunError(f"rank {rank} failed:\n{payload}")
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
        results.close()
        results.join_thread()

    rows = [(run, stage, device, chunk, phase, start, end, "measured")
            for payload in outputs.values() for stage, device, chunk, phase, start, end in payload["spans"]]
    frame = pd.DataFrame(rows, columns=COLUMNS)
    if len(frame):
        origin = frame["start"].min()
        frame["start"] -= origin
        frame["end"] -= origin
    frame = frame.sort_values(["start", "stage"]).reset_index(drop=True)
    frame.attrs["peak_memory"] = {}
    losses = [loss for payload in outputs.values() for loss in payload["losses"]]
    result = _result(plan, frame, sum(losses) / len(losses) if losses else float("nan"), sample,
                     set(plan.devices[:world]))
    if return_grads:
        result.metrics["grads"] = {k: v for payload in outputs.values() for k, v in (payload["grads"] or {}).items()}
    result.metrics["losses"] = losses
    return result
