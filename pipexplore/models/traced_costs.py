"""What a traced model's stages cost beyond the model's own modules: what its profile is shifted by.

A model that is not an ``nn.Sequential`` is profiled as it is (:func:`pipexplore.models.trace.candidates`
times each candidate block with hooks inside real passes of the model), but every executor runs
it as the stages torch's tracer builds (:func:`pipexplore.models.trace.split`): torch.export's
aten-level graphs in unflattened modules, with the glue between blocks (a dropout, a reshape)
inside a stage. Those stages are not the modules: one block of the ``TinyTransformer`` of
:mod:`pipexplore.examples` took 0.43 ms forward as the model's module and 0.56 ms as its traced
stage (4 rows, one thread), its backward the same both ways; a first prediction of a traced
model's run came out 20–50 % short for that.

:func:`traced_extra` times each candidate both ways, alone, on the inputs it gets in a pass of
the model (the same harness: a forward, then a backward from ones into the outputs that need a
gradient), and gives the seconds its stage takes beyond its module per phase;
:func:`pipexplore.models.trace.candidates_in_rows` measures them on the micro-batch and adds them
to the profile at each size it profiles (:func:`shift_to_stages`). A difference, not a ratio: a
block of a few microseconds (a position embedding) whose stage also runs the glue after it would
otherwise multiply its noise by 10 or more. Tracing costs a second or two of CPU, so the seconds
are kept for the session per model shape (what its trace at every candidate sees:
:func:`pipexplore.models.traced_pipes.split_key`) and intra-op threads: re-exploring the same
architecture measures nothing again.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch import nn

from pipexplore.microbatch import tensors_in
from pipexplore.models.hf import cache_off
from pipexplore.models.inputs import call_inputs
from pipexplore.models.traced_pipes import split_key

__all__ = ["StageExtra", "traced_extra", "shift_to_stages", "isolated_seconds", "forget_measured"]


class StageExtra(NamedTuple):
    """What :func:`traced_extra` measures: per candidate, the seconds its traced stage takes beyond
    its module, and the first candidate a second stage may begin at to run in processes
    (:func:`pipexplore.models.stage_inputs.first_runnable_split`)."""

    forward: list[float]
    backward: list[float]
    first_split: int


#: What :func:`traced_extra` measured per model shape, once a session.
_MEASURED: dict[tuple, StageExtra] = {}


def forget_measured() -> None:
    """Measure every model shape again (what this session measured is dropped)."""
    _MEASURED.clear()


def _fresh(value: Any) -> Any:
    """An input as a stage receives it: a floating tensor is a new leaf that needs its gradient."""
    if torch.is_tensor(value) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value


def isolated_seconds(module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any], *, repeats: int = 3,
                     warmup: int = 1) -> tuple[float, float]:
    """Median seconds of ``module(*args, **kwargs)`` forward, then of its backward from ones into
    every output that needs a gradient (0 where none does), over ``repeats`` calls after
    ``warmup`` untimed ones (a :class:`~pipexplore.predict.timing.Timer` each: on a GPU, to its
    kernels' end); floating inputs are fresh leaves each call, as a stage gets them."""
    from pipexplore.predict.timing import Timer

    tensors = [*module.parameters(), *tensors_in(list(args)), *tensors_in(kwargs)]
    device = tensors[0].device if tensors else torch.device("cpu")
    timers = {"forward": Timer(device), "backward": Timer(device)}
    differentiable = False
    for step in range(warmup + repeats):
        call_args = [_fresh(a) for a in args]
        call_kwargs = {k: _fresh(v) for k, v in kwargs.items()}

        def forward() -> Any:
            return module(*call_args, **call_kwargs)

        output = timers["forward"](forward) if step >= warmup else forward()
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        differentiable = bool(outputs)

        def backward(outputs: list[torch.Tensor] = outputs) -> None:
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])

        timers["backward"](backward) if step >= warmup else backward()
    return timers["forward"].median, timers["backward"].median if differentiable else 0.0


def _inputs_of(modules: Sequence[nn.Module], run: Any) -> list[Optional[tuple[tuple, dict]]]:
    """The ``(args, kwargs)`` each module is first called with while ``run()`` runs (no gradients)."""
    seen: list[Optional[tuple[tuple, dict]]] = [None] * len(modules)
    handles = []
    for k, module in enumerate(modules):
        def keep(_: nn.Module, args: Any, kwargs: dict[str, Any], k: int = k) -> None:
            if seen[k] is None:
                seen[k] = (tuple(args), dict(kwargs))
        handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _shape_key(model: nn.Module, sample: Any, names: Sequence[str]) -> tuple:
    """The model's shape as its trace at every candidate sees it (:func:`~pipexplore.models.
    traced_pipes.split_key`), and the intra-op threads its stages are timed with."""
    return split_key(model, sample, None, names), torch.get_num_threads()


def traced_extra(model: nn.Module, sample: Any, names: Sequence[str], *, repeats: int = 3,
                 warmup: int = 1, owned: bool = False) -> StageExtra:
    """Per candidate ``names`` (FQNs in execution order, as :func:`~pipexplore.models.trace.candidates`
    lists them): the seconds its traced stage takes beyond its own module, forward and backward,
    on ``sample`` (one micro-batch as the model takes it; negative where the stage was faster);
    and the first candidate a second stage may begin at for the split to run in processes.
    The model is traced with a stage beginning at every candidate but the first (a copy:
    :func:`~pipexplore.models.traced_pipes.traced_pipe`, whose export of the model the runs' splits
    then use) and
    each stage timed alone beside its module (:func:`isolated_seconds`); a stage also runs the
    glue that follows its block. 0 for a block the pass did not call. Kept for the session per
    model shape (:func:`forget_measured`). ``owned``: the model is a copy the caller gives away
    (the explorer's, on the profile's device): its blocks are timed on it, rather than on one more
    copy (a model that fills half a GPU fits its profile).

    Raises:
        pipexplore.models.trace.TraceError: the model cannot be traced into these stages.
    """
    from pipexplore.models.stage_inputs import first_runnable_split
    from pipexplore.models.traced_pipes import traced_pipe

    key = _shape_key(model, sample, names)
    if key in _MEASURED:
        kept = _MEASURED[key]
        return StageExtra(list(kept.forward), list(kept.backward), kept.first_split)
    args, kwargs = call_inputs(sample)
    own = model if owned else copy.deepcopy(model)  # its blocks run backwards: not the caller's own grads
    if owned:
        own.zero_grad(set_to_none=True)  # the profile's passes left them: the copy traced below need not hold them
    modules = dict(own.named_modules())
    blocks = [modules[name] for name in names]
    with cache_off(own):
        own_inputs = _inputs_of(blocks, lambda: own(*args, **kwargs))
    # (through the session's kept pipes: the model's export made here serves the runs' splits after)
    pipe = traced_pipe(model, sample, list(names[1:]))
    stages = sorted(((int(n.rsplit("_", 1)[1]), m) for n, m in pipe.split_gm.named_children()
                     if n.startswith("submod_")), key=lambda pair: pair[0])
    stage_inputs = _inputs_of([m for _, m in stages], lambda: pipe(*args, **kwargs))
    forward, backward = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, block in enumerate(blocks):
            if own_inputs[k] is None or k >= len(stages) or stage_inputs[k] is None:
                forward.append(0.0)
                backward.append(0.0)
                continue
            mine = isolated_seconds(block, *own_inputs[k], repeats=repeats, warmup=warmup)
            traced = isolated_seconds(stages[k][1], *stage_inputs[k], repeats=repeats, warmup=warmup)
            forward.append(traced[0] - mine[0])
            backward.append(traced[1] - mine[1])
    first_split = first_runnable_split(pipe)
    _MEASURED[key] = StageExtra(list(forward), list(backward), first_split)
    return StageExtra(forward, backward, first_split)


def shift_to_stages(model: nn.Module, tables: Sequence[Any], sample: Any, *, repeats: int = 3,
                    owned: bool = False) -> Optional[str]:
    """Add to each table's ``forward`` and ``backward`` what its candidates' traced stages take
    beyond them (:func:`traced_extra`), measured on ``sample`` (the micro-batch the stages run)
    and the same seconds at every size the tables were profiled at (what a stage adds is mostly
    per call: dispatch of more, smaller aten ops and the glue between blocks; one block of the
    tiny transformer, 0.12 ms more at 16 rows, 0.17–0.27 ms at 4, within this machine's noise),
    never below zero: one trace, not one a size (each is a torch.export of the whole model, ~2 s
    for a 6-block GPT-2 on this CPU). The seconds go to ``table.attrs["stage_extra"]``
    (``{"forward": [...], "backward": [...]}``), the first row a second stage may begin at for the
    split to run in processes to ``table.attrs["first_split"]`` (:class:`StageExtra`). Returns None,
    or why the tables stay the modules' times: the model cannot be traced a stage a candidate, or a
    stage fails alone."""
    try:
        forward, backward, first_split = traced_extra(model, sample, tables[0]["name"].tolist(), repeats=repeats,
                                                      owned=owned)
    except Exception as exc:  # noqa: BLE001 - the profile stands without it, and says why
        lines = str(exc).strip().splitlines() or [""]
        first = lines[0] if len(lines[0]) <= 160 else lines[0][:159] + "…"
        return (f"The profile times {type(model).__name__}'s own modules, not the stages its runs trace "
                f"({type(exc).__name__}: {first}): predictions leave out what those stages take beyond the "
                "modules.")
    for table in tables:
        for phase, extra in (("forward", forward), ("backward", backward)):
            table[phase] = (table[phase] + extra).clip(lower=0.0)
        table.attrs["stage_extra"] = {"forward": forward, "backward": backward}
        table.attrs["first_split"] = first_split
    return None
