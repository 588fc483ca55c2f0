"""Splits through ``torch.distributed.pipelining.pipeline`` (PyTorch's tracer; pipexplore does not trace
itself, and rewrites only what torch's splitter cannot split: :mod:`~pipexplore.models.trace.fx_workarounds`).

Example::

    pipe = split(model, {"input_ids": ids[:2]}, ["transformer.h.2"])
    skip_routes_of(pipe)                            # values that jump over stages
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any, Optional, Sequence

from torch import fx, nn

from pipexplore.models.hf import cache_off
from pipexplore.models.inputs import call_inputs
from pipexplore.models.trace import markers
from pipexplore.models.trace.candidates import TraceError, candidate_modules
from pipexplore.models.trace.fx_workarounds import inline_constant_no_grad_regions
from pipexplore.schedules import TORCH_CLASSES

__all__ = ["split", "split_marked", "run_generated_code", "skip_routes_of", "SCHEDULE_CLASSES", "MULTI_STAGE"]

#: torch.distributed.pipelining's schedule class for each of our schedules, and the classes that
#: take a list of stages per rank (several stages on one rank; ``_PipelineScheduleRuntime`` runs a
#: CSV schedule file).
SCHEDULE_CLASSES = dict(TORCH_CLASSES)
MULTI_STAGE = {"ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
               "ScheduleLoopedBFS", "ScheduleDualPipeV", "_PipelineScheduleRuntime"}


def split(model: nn.Module, mb_args: Any, split_points: Sequence[str], *,
          mb_kwargs: Optional[dict[str, Any]] = None) -> Any:
    """Split ``model`` into pipeline stages with torch's tracer, each stage beginning at a split point.

    As ``pipeline(model, mb_args, split_spec={fqn: SplitPoint.BEGINNING for each point})``.
    ``mb_args`` is one micro-batch as the model takes it: a tensor, a tuple of positional inputs
    or a dict of keyword inputs; ``mb_kwargs`` adds keyword inputs. The model is changed while
    tracing: give a copy. The returned ``Pipe`` has ``output_spec``: the pytree structure of the
    model's output (e.g. a Hugging Face ``ModelOutput``), to rebuild it from the flat outputs.
    A config's ``use_cache=True`` is off while tracing: the stages never build a KV cache
    (:func:`pipexplore.models.hf.cache_off`; the model's config is put back after). The stages
    run their generated code, not torch's fx interpreter (:func:`run_generated_code`).

    Raises :class:`TraceError` with what failed and what to do when the model cannot be traced,
    when a split point names no submodule, or when a split point does not begin exactly one
    stage (a module not called in forward, or called more than once).

    Example::

        pipe = trace.split(copy.deepcopy(gpt2), {"input_ids": ids[:2]}, ["transformer.h.2"])
        pipe.num_stages   # 2
    """
    return split_marked(model, mb_args, split_points, mb_kwargs=mb_kwargs)[0]


def split_marked(model: nn.Module, mb_args: Any, split_points: Sequence[str], *,
                 mb_kwargs: Optional[dict[str, Any]] = None, marks: Sequence[str] = (),
                 exported: Any = None) -> tuple[Any, Any]:
    """:func:`split`, with a marker (``pipe_split()``) also at the start of each module in
    ``marks`` while exporting, those not in ``split_points`` removed from the graph before it is
    split; or, given ``exported`` (a :class:`~pipexplore.models.trace.markers.MarkedExport` of a
    model of this shape on inputs of this shape), no export at all: its graph split at
    ``split_points``. Returns ``(pipe, the MarkedExport of this export)`` (None where this torch's
    splitter gives no export to keep).

    Raises :class:`TraceError` as :func:`split` does, and
    :class:`~pipexplore.models.trace.markers.MarkersMoved` where the graph's markers are not one
    per marked call in the order of the calls (a marker inside a region export keeps apart, such
    as an autocast block), or ``exported`` has no marker at a split point: split without it then.
    """
    from torch.distributed.pipelining import pipeline

    args, kwargs = call_inputs(mb_args)
    kwargs.update(mb_kwargs or {})
    split_points = list(split_points)
    modules = dict(model.named_modules())
    unknown = [fqn for fqn in split_points if fqn not in modules or not fqn]
    if unknown:
        examples = [name for name, _ in candidate_modules(model)][:6]
        raise TraceError(f"split point(s) {unknown} name no submodule of {type(model).__name__}: a split point is a "
                         f"module's FQN as model.named_modules() gives it, e.g. {examples} "
                         "(trace.candidates lists them all)")
    repeated = sorted({fqn for fqn in split_points if split_points.count(fqn) > 1})
    if repeated:
        raise TraceError(f"split point(s) {repeated} are given more than once: give each split point once")
    if exported is not None and not set(split_points) <= exported.marked:
        raise markers.MarkersMoved(f"{sorted(set(split_points) - exported.marked)} not marked in the kept export")
    order: list[str] = list(exported.order) if exported is not None else []
    captured: dict[str, Any] = {}

    def policy(gm: fx.GraphModule) -> fx.GraphModule:
        codegen = getattr(gm.graph, "_codegen", None)
        captured["output_spec"] = getattr(getattr(codegen, "pytree_info", None), "out_spec", None)
        gm = inline_constant_no_grad_regions(gm)  # (a marker inside such a region comes out with it)
        markers.keep_markers(gm, order, split_points)
        return gm

    noise = io.StringIO()
    logger = logging.getLogger("torch")
    level = logger.level
    marks = list(dict.fromkeys([*split_points, *marks]))
    marked = [] if exported is not None else markers.mark_beginnings(model, marks, order)
    try:
        logger.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise), warnings.catch_warnings(), \
                cache_off(model), markers.exporting(exported, captured, model):  # (cache: hf.cache_off)
            warnings.simplefilter("ignore")
            pipe = pipeline(model, mb_args=tuple(args), mb_kwargs=kwargs or None, split_policy=policy)
    except markers.MarkersMoved:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(
            f"could not trace {type(model).__name__} into one graph to split it: {type(exc).__name__}: {first}\n"
            "Typical causes: data-dependent control flow (an `if` on a tensor's value), graph breaks, or "
            "operators without meta kernels. Mark the stage boundaries yourself with "
            "`torch.distributed.pipelining.pipe_split()` inside forward, remove the data-dependent branch, or "
            "build the stages with the manual API (`PipelineStage(stage_module, ...)`).") from exc
    finally:
        logger.setLevel(level)
        for module, own_forward in marked:
            if own_forward is None:
                del module.forward
            else:
                module.forward = own_forward
    never = [fqn for fqn in split_points if fqn not in order]
    if never:
        raise TraceError(f"split point(s) {never} did not begin a stage: {type(model).__name__}'s forward never "
                         "calls them on this input; choose modules that forward calls (trace.candidates lists them "
                         "in execution order)")
    twice = [fqn for fqn in split_points if order.count(fqn) > 1]
    if twice:
        raise TraceError(f"split point(s) {twice} would begin {max(order.count(f) for f in twice)} stages each: "
                         "forward calls them more than once (a shared module); split at a module that forward "
                         "calls once")
    pipe.output_spec = captured.get("output_spec")  # type: ignore[assignment]  # (torch: Tensor | Module only)
    contiguous_boundaries(pipe.split_gm)
    run_generated_code(pipe.split_gm)
    if exported is None and "program" in captured:
        exported = markers.MarkedExport(captured["program"], tuple(order), frozenset(marks))
    return pipe, exported


def run_generated_code(module: nn.Module) -> int:
    """Make the stages of a traced split run their generated Python code rather than
    ``torch.fx.Interpreter``, node by node, which torch's unflattened modules use by default (the
    same operations: outputs and gradients are bit for bit the same). On small CPU layers the
    interpreter doubled a stage's time: a forward and backward of 4 × (Linear 64→64, GELU) took
    1.58 ms interpreted, 0.78 ms generated, 0.69 ms as the ``nn.Sequential`` itself. Returns how
    many modules were switched (none under a torch without the switch). A module whose graph
    names a value ``self`` (a child called ``self``, as in BERT's attention) keeps the
    interpreter: in the generated code that name would hide the module itself. Exported code holds
    this function's source and runs it (the torchrun script, the pipelining code)."""
    switched = 0
    for submodule in module.modules():
        if getattr(submodule, "_run_with_interpreter", None) is True and \
                all(node.name != "self" for node in submodule.graph.nodes):  # type: ignore[union-attr]
            submodule._run_with_interpreter = False  # type: ignore[assignment]  # (torch: Tensor | Module only)
            switched += 1
    return switched


def contiguous_boundaries(split_gm) -> int:
    """Every value a stage receives or sends laid out contiguously: torch's stages receive into
    buffers of the traced value's strides, and gloo sends and receives contiguous tensors only (a
    transposed or expanded value at a boundary, as BERT's, ViT's, OPT's or T5's, otherwise fails
    with "input tensor has to be contiguous"). Returns how many values were changed."""
    import torch

    changed = 0
    for name, stage in split_gm.named_children():
        graph = getattr(stage, "graph", None)
        if not name.startswith("submod_") or graph is None:
            continue
        before = changed
        for node in graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder" and torch.is_tensor(value) and not value.is_contiguous():
                node.meta["val"] = value.contiguous()
                changed += 1
            if node.op == "output":
                outputs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
                made = []
                for out in outputs:
                    value = out.meta.get("val") if hasattr(out, "meta") else None
                    if torch.is_tensor(value) and not value.is_contiguous():
                        with graph.inserting_before(node):
                            out = graph.call_method("contiguous", (out,))
                        out.meta["val"] = value.contiguous()
                        changed += 1
                    made.append(out)
                node.args = (type(node.args[0])(made) if isinstance(node.args[0], (tuple, list)) else made[0],)
        if changed > before:  # (a stage left as it was keeps its code)
            stage.recompile()
    return changed



def skip_routes_of(pipe: Any) -> list[tuple[int, int]]:
    """``(producing stage, consuming stage)`` for every value that jumps over at least one stage."""
    stage_of = {}
    routes = set()
    for node in pipe.split_gm.graph.nodes:
        if node.op == "call_module" and node.target.startswith("submod_pp_"):
            stage = int(node.target.rsplit("_", 1)[1])
            stage_of[node.name] = stage
            for arg in node.all_input_nodes:
                source = arg
                while source.op == "call_function" and source.all_input_nodes:  # getitem of a stage's tuple
                    source = source.all_input_nodes[0]
                if source.name in stage_of and stage_of[source.name] < stage - 1:
                    routes.add((stage_of[source.name], stage))
    return sorted(routes)
