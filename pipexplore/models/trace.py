"""Models that are not ``nn.Sequential``: candidate split points, their costs, and splits.

Candidate split points at any depth (:func:`candidate_modules`), each profiled where it runs in
the model (:func:`candidates`), and splits through ``torch.distributed.pipelining.pipeline``
(PyTorch's tracer; pipexplore does not trace itself, and rewrites only what torch's splitter
cannot split: :mod:`pipexplore.models.fx_workarounds`)::

    table = trace.candidates(model, {"input_ids": ids})   # one row per block, in execution order
    pipe = trace.split(model, {"input_ids": ids[:2]}, ["transformer.h.2"])
    trace.skip_routes_of(pipe)                            # values that jump over stages
"""
from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from typing import Any, Optional, Sequence

import pandas as pd
import torch
from torch import fx, nn

from pipexplore.loss import synthetic_loss
from pipexplore.microbatch import tensors_in
from pipexplore.models.fx_workarounds import inline_constant_no_grad_regions
from pipexplore.models.hf import cache_off
from pipexplore.models.inputs import call_inputs
from pipexplore.models.stage_inputs import inputs_past_first_stage  # noqa: F401  (its old home)
from pipexplore.schedules import TORCH_CLASSES

#: torch.distributed.pipelining's schedule class for each of our schedules, and the classes that
#: take a list of stages per rank (several stages on one rank; ``_PipelineScheduleRuntime`` runs a
#: CSV schedule file).
SCHEDULE_CLASSES = dict(TORCH_CLASSES)
MULTI_STAGE = {"ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
               "ScheduleLoopedBFS", "ScheduleDualPipeV", "_PipelineScheduleRuntime"}

__all__ = ["TraceError", "GRANULARITIES", "candidate_modules", "candidates", "candidates_in_rows",
           "inputs_past_first_stage", "split", "split_marked", "run_generated_code", "skip_routes_of",
           "SCHEDULE_CLASSES", "MULTI_STAGE"]

#: How fine the candidate split points are: ``blocks`` (the model's repeated blocks, wherever their
#: containers sit) or ``children`` (each block opened one level more).
GRANULARITIES = ("blocks", "children")
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class TraceError(RuntimeError):
    """The model could not be captured as one graph, or split where asked; the message says what to do."""


def _is_block_list(module: nn.Module) -> bool:
    """A container of blocks: a ``ModuleList``, ``ModuleDict`` or ``Sequential`` whose every
    element is itself made of modules (``h.0``, ``layers["0"]``), not of plain layers."""
    return isinstance(module, _CONTAINERS) and len(module) > 0 and all(
        next(child.children(), None) is not None for child in module.children())


def _opens(module: nn.Module, *, top: bool, in_block: bool) -> bool:
    """Whether ``module`` is opened (its children become candidates) rather than being one.

    Containers at the top of the model always open (as before); block lists open anywhere.
    Outside blocks a module opens when a block list sits anywhere below it (``transformer`` of
    ``transformer.h.N``, ``bert.encoder`` of ``bert.encoder.layer.N``). A block opens only when
    block lists among its direct children hold most of its weights (``stages.N`` of
    ``stages.N.blocks.M``), so that blocks keep lesser inner lists (attention heads) closed.
    """
    if isinstance(module, _CONTAINERS) and len(module) > 0 and (top or _is_block_list(module)):
        return True
    if not in_block:
        return any(_is_block_list(m) for m in module.modules())
    lists = [child for child in module.children() if _is_block_list(child)]
    if not lists:
        return False

    def size(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters()) or sum(1 for _ in m.modules())

    return 2 * sum(size(child) for child in lists) > size(module)


def candidate_modules(model: nn.Module, granularity: str = "blocks") -> list[tuple[str, nn.Module]]:
    """Modules a pipeline stage can begin at, by FQN, in the model's registration order.

    ``granularity='blocks'``: the model's children, with containers opened wherever they sit —
    ``ModuleList``, ``ModuleDict`` and ``Sequential`` holding blocks inside attributes, nested
    (``transformer.h.0``, ``model.layers.0``, ``layers.0`` of a ``ModuleDict``,
    ``encoder.layer.0``, ``backbone.stages.0.blocks.0``); a container at the top of the model
    opens even when it holds plain layers. ``granularity='children'``: each of those blocks opened
    one level more (``transformer.h.0.attn``, ``transformer.h.0.mlp``, …; a ``ModuleList`` child,
    never called itself, gives its elements).

    Example::

        [name for name, _ in candidate_modules(gpt2)]
        # ['transformer.wte', 'transformer.wpe', 'transformer.drop', 'transformer.h.0', …, 'lm_head']
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(map(repr, GRANULARITIES))}, got {granularity!r}")
    found: list[tuple[str, nn.Module]] = []

    def visit(fqn: str, module: nn.Module, *, top: bool, in_block: bool) -> None:
        if fqn and not _opens(module, top=top, in_block=in_block):
            found.append((fqn, module))
            return
        inner = in_block or _is_block_list(module)
        for name, child in module.named_children():
            visit(f"{fqn}.{name}" if fqn else name, child, top=not fqn, in_block=inner)

    visit("", model, top=True, in_block=False)
    if granularity == "children":
        opened: list[tuple[str, nn.Module]] = []
        for fqn, module in found:
            children = [(f"{fqn}.{name}", child) for name, child in module.named_children()] or [(fqn, module)]
            for name, child in children:  # a ModuleList or ModuleDict is never called itself: its elements are
                lists = isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) > 0
                opened += [(f"{name}.{key}", element) for key, element in child.named_children()] if lists \
                    else [(name, child)]
        found = opened
    return found


def _identity(t: torch.Tensor) -> tuple:
    """The same value seen by two blocks: backward hooks hand the caller a view, not the object."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def candidates(model: nn.Module, sample: Any, *, mb_kwargs: Optional[dict[str, Any]] = None,
               granularity: str = "blocks", loss_fn: Any = None, target: Any = None, repeats: int = 3,
               warmup: int = 1, optimizer: Any = None, time_optimizer: bool = True) -> pd.DataFrame:
    """Profile each candidate split point (:func:`candidate_modules`) as it runs in the model.

    ``sample`` is one mini-batch as the model takes it: a tensor, a tuple of positional inputs or
    a dict of keyword inputs (``input_ids``, ``attention_mask``, ``labels``); ``mb_kwargs`` adds
    keyword inputs. Hooks time every candidate inside real forward and backward passes of the
    whole model (on a GPU, synchronised at each mark), ``warmup`` passes first (untimed:
    allocation, dispatch caches), then ``repeats`` timed ones; ``loss_fn(output, target)``
    receives the output as the model returns it (default: the mean of the squared floating
    outputs). The passes run with a Hugging Face config's ``use_cache`` off, as training does
    (:func:`pipexplore.models.hf.cache_off`).

    Returns one row per candidate in execution order, columns as :func:`pipexplore.profile`
    gives (``name`` is the module's FQN), with ``stash`` and ``pop`` naming values that skip over
    candidates (an output consumed by a later, non-adjacent candidate), and ``shared`` naming
    parameters used by several candidates (tied weights). Times are medians over ``repeats``.
    ``optimizer``: seconds of one step of ``optimizer(parameters)`` (the factory a run uses;
    default SGD, lr 0.01) over the candidate's parameters, timed on copies of them
    (:func:`pipexplore.predict.optimizer_cost.optimizer_seconds`; a tied weight counts in every
    candidate that holds it, as each stage steps its own copy); ``time_optimizer=False`` leaves it
    out (a caller that has it already).

    Example::

        table = trace.candidates(gpt2, {"input_ids": ids, "labels": ids}, loss_fn=lambda out, _: out.loss)
        table[["name", "forward", "backward", "shared"]]
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more passes, got {warmup}")
    args, kwargs = call_inputs(sample)
    kwargs.update(mb_kwargs or {})
    blocks = candidate_modules(model, granularity)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no child modules to split between")
    index = {id(module): k for k, (_, module) in enumerate(blocks)}
    order: list[int] = []
    forward: dict[int, list[float]] = {k: [] for k in range(len(blocks))}
    backward: dict[int, list[float]] = {k: [] for k in range(len(blocks))}
    out_bytes: dict[int, int] = {}
    edges: set[tuple[int, int]] = set()
    producer: dict[tuple, tuple[int, torch.Tensor]] = {}
    started: dict[int, float] = {}
    bwd_start: dict[int, float] = {}
    bwd_end: dict[int, float] = {}
    handles = []
    from pipexplore.predict.timing import synchronize

    device = next(model.parameters(), torch.empty(0)).device

    def now() -> float:  # on a GPU, when the kernels launched so far have run
        synchronize(device)
        return time.perf_counter()

    def pre(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        k = index[id(module)]
        if k not in order:
            order.append(k)
        position = order.index(k)
        for t in tensors_in(args) + tensors_in(kwargs):
            source = producer.get(_identity(t), (None, None))[0]
            if source is not None and order.index(source) < position - 1:  # skips a block in execution order
                edges.add((source, k))
        started[k] = now()

    def post(module: nn.Module, args: Any, output: Any) -> None:
        k = index[id(module)]
        forward[k].append(now() - started[k])
        tensors = tensors_in(output)
        out_bytes[k] = sum(t.numel() * t.element_size() for t in tensors)
        for t in tensors:
            producer[_identity(t)] = (k, t)  # held for the pass: a freed address reused is not this value

    def bwd_pre(module: nn.Module, grad_output: Any) -> None:
        bwd_start[index[id(module)]] = now()

    def bwd_post(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        bwd_end[index[id(module)]] = now()

    for _, module in blocks:
        handles += [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post),
                    module.register_full_backward_pre_hook(bwd_pre), module.register_full_backward_hook(bwd_post)]
    owners: dict[int, list[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for k, (_, module) in enumerate(blocks):
        for param in module.parameters():
            owners.setdefault(id(param), []).append(k)
            params[id(param)] = param

    def accumulated(blocks_of_param: tuple[int, ...]) -> Any:
        def hook(_: torch.Tensor) -> None:  # a block's backward ends at its weights' last accumulation
            # A tied weight accumulates once, after every block using it: that ends the first of them
            # in forward (the embedding, last in backward), not the others (a head, long done).
            block = min(blocks_of_param, key=lambda j: order.index(j) if j in order else len(order))
            bwd_end[block] = max(bwd_end.get(block, 0.0), now())
        return hook

    for pid, ks in owners.items():
        if params[pid].requires_grad:
            handles.append(params[pid].register_post_accumulate_grad_hook(accumulated(tuple(set(ks)))))
    with warnings.catch_warnings(), cache_off(model):  # training never uses a KV cache: hf.cache_off
        try:
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            for timed in [False] * warmup + [True] * repeats:
                producer.clear()
                bwd_start.clear()
                bwd_end.clear()
                output = model(*args, **kwargs)
                loss = (loss_fn or synthetic_loss)(output, target)
                loss.backward()
                model.zero_grad(set_to_none=True)
                if not timed:
                    for times in forward.values():
                        times.clear()
                    continue
                for k in range(len(blocks)):
                    if k in bwd_start:
                        backward[k].append(max(0.0, bwd_end.get(k, bwd_start[k]) - bwd_start[k]))
        finally:
            producer.clear()
            for handle in handles:
                handle.remove()
    if len(order) < len(blocks):
        unused = [blocks[k][0] for k in range(len(blocks)) if k not in order]
        order += [k for k in range(len(blocks)) if k not in order]
        warnings.warn(f"blocks not called in forward: {unused}", stacklevel=2)
    shared = {k: [] for k in range(len(blocks))}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    for pid, ks in owners.items():
        if len(set(ks)) > 1:
            for k in ks:
                shared[k].append(names.get(pid, "?"))
    rows = []
    position = {k: p for p, k in enumerate(order)}
    for k in order:
        name, module = blocks[k]
        routes = sorted((position[src], position[dst]) for src, dst in edges)
        stash = [f"v{src}>{dst}" for src, dst in routes if src == position[k]]
        pop = [f"v{src}>{dst}" for src, dst in routes if dst == position[k]]
        rows.append({
            "name": name, "type": type(module).__name__,
            "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
            "output_bytes": out_bytes.get(k, 0),
            "forward": sorted(forward[k])[len(forward[k]) // 2] if forward[k] else 0.0,
            "backward": sorted(backward[k])[len(backward[k]) // 2] if backward[k] else 0.0,
            "stash": ",".join(stash), "pop": ",".join(pop), "stash_keys": ",".join(stash), "pop_keys": ",".join(pop),
            "shared": ",".join(sorted(set(shared[k]))), "order": position[k],
        })
    table = pd.DataFrame(rows)
    if time_optimizer:  # the update at the end of a step, over each candidate's parameters
        from pipexplore.predict.optimizer_cost import optimizer_seconds

        table["optimizer"] = optimizer_seconds([blocks[k][1] for k in order], optimizer, repeats=repeats)
    return table


def candidates_in_rows(model: nn.Module, sample: Any, *, chunks: int, target: Any = None, as_stages: bool = True,
                       owned: bool = False, **options: Any) -> pd.DataFrame:
    """:func:`candidates` profiled on one micro-batch of ``chunks`` and on the whole ``sample``,
    with each block's costs as a line in the rows ``n`` of a micro-batch (``forward_a``,
    ``forward_b``, … as :func:`pipexplore.profile` gives them), so predictions hold when
    ``chunks`` changes. With ``chunks=1`` the whole sample only (costs proportional to rows).
    ``as_stages``: the times include what the traced stages the runs execute take beyond the
    model's own modules, measured on the micro-batch (:func:`pipexplore.models.traced_costs.
    shift_to_stages`; ``attrs["stage_extra"]``: the seconds and the rows they were measured at);
    ``owned``: ``model`` is a copy the caller gives away, timed on without one more copy.

    Example::

        table = candidates_in_rows(model, {"input_ids": ids}, chunks=4)
    """
    from pipexplore.models.inputs import first_microbatch, sample_rows
    from pipexplore.predict.timing import fit_columns

    whole = candidates(model, sample, target=target, **options)
    batch = sample_rows(sample)
    tables, rows, samples = [whole], [batch], [sample]
    if chunks > 1:
        part = first_microbatch(sample, chunks)
        part_rows = sample_rows(part)
        part_target = target[:part_rows] if torch.is_tensor(target) and target.dim() > 0 else target
        if part_rows < batch:  # (the optimizer's cost has no rows: the whole sample's table has it)
            tables.insert(0, candidates(model, part, target=part_target, **{**options, "time_optimizer": False}))
            rows.insert(0, part_rows)
            samples.insert(0, part)
    if as_stages:
        from pipexplore.models.traced_costs import shift_to_stages

        refused = shift_to_stages(model, tables, samples[0], repeats=options.get("repeats", 3), owned=owned)
        if refused:
            warnings.warn(refused, RuntimeWarning, stacklevel=2)
            whole.attrs["notes"] = [*whole.attrs.get("notes", []), refused]
    table = whole.copy()
    fit_columns(table, tables, rows)
    table.attrs.update(whole.attrs)
    table.attrs.update(rows=tuple(rows), batch=batch)
    if "stage_extra" in whole.attrs:
        table.attrs["stage_extra"] = {**whole.attrs["stage_extra"], "rows": rows[0]}
    return table


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
    split; or, given ``exported`` (a :class:`~pipexplore.models.marked_export.MarkedExport` of a
    model of this shape on inputs of this shape), no export at all: its graph split at
    ``split_points``. Returns ``(pipe, the MarkedExport of this export)`` (None where this torch's
    splitter gives no export to keep).

    Raises :class:`TraceError` as :func:`split` does, and
    :class:`~pipexplore.models.marked_export.MarkersMoved` where the graph's markers are not one
    per marked call in the order of the calls (a marker inside a region export keeps apart, such
    as an autocast block), or ``exported`` has no marker at a split point: split without it then.
    """
    from torch.distributed.pipelining import pipeline

    from pipexplore.models import marked_export

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
        raise marked_export.MarkersMoved(f"{sorted(set(split_points) - exported.marked)} not marked in the kept export")
    order: list[str] = list(exported.order) if exported is not None else []
    captured: dict[str, Any] = {}

    def policy(gm: fx.GraphModule) -> fx.GraphModule:
        codegen = getattr(gm.graph, "_codegen", None)
        captured["output_spec"] = getattr(getattr(codegen, "pytree_info", None), "out_spec", None)
        gm = inline_constant_no_grad_regions(gm)  # (a marker inside such a region comes out with it)
        marked_export.keep_markers(gm, order, split_points)
        return gm

    noise = io.StringIO()
    logger = logging.getLogger("torch")
    level = logger.level
    marks = list(dict.fromkeys([*split_points, *marks]))
    marked = [] if exported is not None else marked_export.mark_beginnings(model, marks, order)
    try:
        logger.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise), warnings.catch_warnings(), \
                cache_off(model), marked_export.exporting(exported, captured, model):  # (cache: hf.cache_off)
            warnings.simplefilter("ignore")
            pipe = pipeline(model, mb_args=tuple(args), mb_kwargs=kwargs or None, split_policy=policy)
    except marked_export.MarkersMoved:
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
    pipe.output_spec = captured.get("output_spec")
    run_generated_code(pipe.split_gm)
    if exported is None and "program" in captured:
        exported = marked_export.MarkedExport(captured["program"], tuple(order), frozenset(marks))
    return pipe, exported


def run_generated_code(module: nn.Module) -> int:
    """Make the stages of a traced split run their generated Python code rather than
    ``torch.fx.Interpreter``, node by node, which torch's unflattened modules use by default (the
    same operations: outputs and gradients are bit for bit the same). On small CPU layers the
    interpreter doubled a stage's time: a forward and backward of 4 × (Linear 64→64, GELU) took
    1.58 ms interpreted, 0.78 ms generated, 0.69 ms as the ``nn.Sequential`` itself. Returns how
    many modules were switched (none under a torch without the switch). A module whose graph
    names a value ``self`` (a child called ``self``, as in BERT's attention) keeps the
    interpreter: in the generated code that name would hide the module itself. Exported code does
    the same with :data:`pipexplore.plan.RUN_GENERATED_CODE`."""
    switched = 0
    for submodule in module.modules():
        if getattr(submodule, "_run_with_interpreter", None) is True and \
                all(node.name != "self" for node in submodule.graph.nodes):
            submodule._run_with_interpreter = False
            switched += 1
    return switched


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
